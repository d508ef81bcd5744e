"""`pyramid-sd publish`: a reloadable folder, a measured card that round-trips, clear refusals, the Hub boundary."""

import json

import pytest
import torch
from huggingface_hub import ModelCard
from tiny import VOCAB, tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from pyramid_hf.cli import main
from pyramid_hf.eval_acceptance import KIND
from pyramid_hf.hub import PublishArgs, publish, push_folder
from pyramid_hf.testing import tiny_tokenizer


@pytest.fixture
def model_dir(tmp_path):
    folder = tmp_path / "draft"
    tiny_model("qwen2", seed=5).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def _acceptance_json(tmp_path, mean=2.71):
    path = tmp_path / "acceptance.json"
    config = {"student": "runs/draft", "teacher": "Qwen/Qwen2.5-Coder-0.5B-Instruct", "draft_tokens": 4,
              "dataset": "humaneval", "split": "test", "prompts": 3, "dtype": "bfloat16", "divergence": "js",
              "command": "pyramid-sd eval-acceptance --pair draft:qualifier"}
    result = {"positions": 120, "mean_accepted_tokens": mean, "acceptance_exact_greedy": 0.634,
              "acceptance_exact_sampling": 0.6, "mean_accepted_tokens_sampling": 2.5,
              "acceptance_by_position": [0.7, 0.6, 0.55, 0.5], "fuzzy": [{"tau": 0.1, "acceptance": 0.7,
                                                                          "mean_accepted_tokens": 3.1}],
              "mean_tv": 0.4, "mean_js": 0.2, "latency_ms": {"student_1": 30.0, "teacher_1": 90.0, "teacher_5": 200.0},
              "break_even_accepted_tokens": 3.56, "predicted_speedup_vs_teacher": 0.76}
    path.write_text(json.dumps({"kind": KIND, "config": config, "result": result}))
    return path


def _args(model_dir, out, **kw):
    return PublishArgs(model=str(model_dir), repo_id="someone/tiny-draft", output_dir=str(out), **kw)


def test_folder_reloads_and_generates_identically(model_dir, tmp_path, capsys):
    out = publish(_args(model_dir, tmp_path / "out", base_model="Qwen/Qwen2.5-Coder-0.5B-Instruct",
                        results=[str(_acceptance_json(tmp_path))], license="apache-2.0"))
    assert "dry run: would upload" in capsys.readouterr().out
    original = AutoModelForCausalLM.from_pretrained(model_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.randint(3, VOCAB, (1, 7), generator=torch.Generator().manual_seed(1))
    assert torch.equal(original.generate(ids, do_sample=False, max_new_tokens=12),
                       reloaded.generate(ids, do_sample=False, max_new_tokens=12))
    assert AutoTokenizer.from_pretrained(out).get_vocab() == tiny_tokenizer().get_vocab()
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["pyramid"]["draft_tokens"] == 4 and generation["num_assistant_tokens"] == 4
    assert not list(out.glob("*.bin"))


def test_card_carries_the_measured_numbers_and_round_trips(model_dir, tmp_path):
    out = publish(_args(model_dir, tmp_path / "out", base_model="Qwen/Qwen2.5-Coder-0.5B-Instruct",
                        target="Qwen/Qwen2.5-Coder-1.5B-Instruct", qualifier="Qwen/Qwen2.5-Coder-0.5B-Instruct",
                        results=[str(_acceptance_json(tmp_path, mean=2.71))], license="apache-2.0",
                        datasets=["pyramid-hf/stdlib-prompts"]))
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert "speculative-decoding" in card.data.tags and card.data.license == "apache-2.0"
    assert card.data.datasets == ["pyramid-hf/stdlib-prompts"]
    assert "| exact, greedy | 63.4% | 2.71 |" in card.text
    assert "3.56 tokens per call" in card.text
    assert "Nothing was measured" not in card.text
    assert 'PyramidAssistant(qualifier, draft, PyramidConfig(draft_tokens=4' in card.text


def test_bench_results_go_into_the_card(model_dir, tmp_path):
    from pyramid_hf.bench.report import MethodRecord, write_results

    def record(method, knobs, tokens_per_s):
        return MethodRecord(method=method, label=method, knobs=knobs, tokens_per_s=tokens_per_s,
                            acceptance={"draft->qualifier": None, "qualifier->target": 0.5, "draft->target": None},
                            mean_tokens_per_target_call=2.0, overhead_share=0.02, identical_to_ar=1.0,
                            pass_at_1=0.5, speedup_vs_ar=tokens_per_s / 3.0)

    records = [record("ar", {}, 3.0), record("psd", {"draft_tokens": 4}, 4.5)]
    paths = write_results(tmp_path / "bench", {"preset": "qwen-coder-cpu", "dataset": "humaneval",
                                               "split": "test"}, records)
    out = publish(_args(model_dir, tmp_path / "out", results=[str(paths["json"])]))
    text = (out / "README.md").read_text()
    assert "Benchmark: qwen-coder-cpu on humaneval test" in text and "| psd |" in text and "4.50" in text


def test_without_results_the_card_says_nothing_was_measured(model_dir, tmp_path):
    out = publish(_args(model_dir, tmp_path / "out"))
    assert "Nothing was measured for this card" in ModelCard.load(out / "README.md").text


def test_knob_flags_override_stored_knobs(model_dir, tmp_path):
    from pyramid_hf import PyramidConfig

    first = publish(_args(model_dir, tmp_path / "a"), PyramidConfig(draft_tokens=3, qualifier_tokens=6),
                    {"draft_tokens", "qualifier_tokens"})
    second = publish(_args(first, tmp_path / "b"), PyramidConfig(qualifier_tokens=9), {"qualifier_tokens"})
    knobs = json.loads((second / "generation_config.json").read_text())["pyramid"]
    assert (knobs["draft_tokens"], knobs["qualifier_tokens"]) == (3, 9)


def test_refuses_to_overwrite_without_flag(model_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="not empty; pass --overwrite"):
        publish(_args(model_dir, out))
    assert (out / "keep.txt").exists()
    publish(_args(model_dir, out, overwrite=True))
    assert not (out / "keep.txt").exists() and (out / "README.md").exists()


def test_refuses_pickled_weights(model_dir, tmp_path):
    torch.save({"w": torch.zeros(2)}, model_dir / "pytorch_model.bin")
    with pytest.raises(ValueError, match="refusing pickled weights.*pytorch_model.bin"):
        publish(_args(model_dir, tmp_path / "out"))


@pytest.mark.parametrize("content,match", [
    (None, "does not exist"),
    ("{not json", "not a JSON object"),
    ('{"kind": "pyramid-hf/eval-acceptance", "config": {}}', "'config' must be an object with keys"),
    ('{"methods": [{"method": "nope"}]}', "not a bench results file"),
    ('{"config": {}, "methods": [{"method": "nope"}]}', r"methods\[0\] lacks"),
])
def test_bad_results_files(model_dir, tmp_path, content, match):
    path = tmp_path / "results.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        publish(_args(model_dir, tmp_path / "out", results=[str(path)]))
    assert not (tmp_path / "out").exists()  # nothing written before the inputs are known good


def test_push_offline_is_a_clear_error(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="HF_HUB_OFFLINE=1: cannot push"):
        publish(_args(model_dir, tmp_path / "out", push=True))
    assert (tmp_path / "out" / "README.md").exists()  # the folder is still there to upload later


def test_push_not_logged_in(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    import huggingface_hub.utils._auth as auth

    monkeypatch.setattr(auth, "get_token", lambda: None)
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    with pytest.raises(RuntimeError, match="not logged in"):
        push_folder(tmp_path, "someone/x", private=False)


def test_push_unreachable_hub_does_not_hang_or_print_the_token(tmp_path, monkeypatch, capsys):
    import huggingface_hub

    from pyramid_hf.models import loading

    secret = "hf_" + "x" * 30
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: secret)
    monkeypatch.setattr(loading, "hub_reachable", lambda timeout_s=3.0: False)
    with pytest.raises(RuntimeError, match="cannot reach the Hub") as error:
        push_folder(tmp_path, "someone/x", private=False)
    assert secret not in str(error.value) and secret not in capsys.readouterr().out


def test_cli_publish_dry_run(model_dir, tmp_path, capsys):
    rc = main(["publish", "--model", str(model_dir), "--repo-id", "someone/tiny", "--output-dir", str(tmp_path / "o"),
               "--draft_tokens", "5", "--results", str(_acceptance_json(tmp_path))])
    assert rc == 0 and "dry run" in capsys.readouterr().out
    assert json.loads((tmp_path / "o" / "generation_config.json").read_text())["pyramid"]["draft_tokens"] == 5
    assert main(["publish", "--model", str(model_dir), "--repo-id", "nope", "--output-dir", str(tmp_path / "p")]) == 2


def test_a_reduced_vocabulary_sidecar_is_published_and_named_in_the_card(model_dir, tmp_path):
    from pyramid_hf.models import load_model
    from pyramid_hf.vocab_head import SIDECAR, ReducedVocabHead, save_reduced_vocab

    save_reduced_vocab(model_dir, list(range(0, VOCAB, 2)), source="test")
    out = publish(_args(model_dir, tmp_path / "out"))
    assert (out / SIDECAR).read_text() == (model_dir / SIDECAR).read_text()
    assert f"reduced vocabulary of {len(range(0, VOCAB, 2))} tokens" in ModelCard.load(out / "README.md").text
    assert isinstance(load_model(str(out)).model.get_output_embeddings(), ReducedVocabHead)


def test_a_feature_draft_is_published_reloadable_and_named_in_the_card(tmp_path):
    from pyramid_hf import FeatureDraft
    from pyramid_hf.models import load_model

    qualifier = tiny_model("qwen2", hidden=32, layers=2, seed=5)
    draft = FeatureDraft.from_qualifier(qualifier)
    src = draft.save(tmp_path / "feature")
    tiny_tokenizer().save_pretrained(src)
    out = publish(_args(src, tmp_path / "out"))
    assert "a feature draft (EAGLE-style" in ModelCard.load(out / "README.md").text
    reloaded = load_model(str(out), dtype="float32").model
    f, e = torch.randn(1, 4, 32), torch.randn(1, 4, 32)
    torch.testing.assert_close(reloaded(f, e), draft(f, e))
