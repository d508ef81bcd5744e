"""`pyramid-sd eval-acceptance`: the pure measurements, a model against itself, and the command end to end."""

import json

import pytest
import torch
from tiny import VOCAB, tiny_model

from pyramid_hf.cli import main
from pyramid_hf.eval_acceptance import (
    EvalAcceptanceArgs,
    break_even,
    expected_tokens_per_call,
    load_report,
    measure,
    simulate_blocks,
)
from pyramid_hf.testing import tiny_tokenizer


def test_simulate_blocks():
    assert simulate_blocks([True] * 10, 4)[0] == [5, 5]  # 4 kept + the verifier's token, twice
    assert simulate_blocks([False] * 3, 4)[0] == [1, 1, 1]
    emitted, reached, kept = simulate_blocks([True, False, True, True, True, True, True], 2)
    assert emitted == [2, 3, 3]  # t=0: keep 1, reject; t=2: keep 2 (cap); t=5: keep 2
    assert reached == [3, 3] and kept == [3, 2]
    assert simulate_blocks([], 4)[0] == []


def test_expected_tokens_per_call():
    assert expected_tokens_per_call(torch.zeros(5), 4) == 1.0
    assert expected_tokens_per_call(torch.ones(1), 4) == 2.0
    assert expected_tokens_per_call(torch.full((100,), 0.5), 2) == pytest.approx(1.75, abs=0.01)


def test_break_even():
    latency = {"student_1": 35.0, "teacher_1": 90.0, "teacher_5": 160.0}
    assert break_even(latency, 4) == pytest.approx((4 * 35 + 160) / 90)
    assert break_even({}, 4) is None


def _args(tmp_path, **kw):
    return EvalAcceptanceArgs(**{"out": str(tmp_path), "preset": None, "student": "s", "teacher": "t",
                                 "progress": False, "latency_repeats": 1, **kw})


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, VOCAB, (1, n), generator=g) for n in (5, 9, 3)]


def test_a_model_against_itself_is_accepted_everywhere(tmp_path):
    model = tiny_model("llama", seed=1)
    result = measure(model, model, _prompts(), _args(tmp_path, max_new_tokens=12, draft_tokens=4, taus="0,0.1"))
    assert result["positions"] == 36
    assert result["acceptance_exact_greedy"] == 1.0
    assert result["acceptance_exact_sampling"] == pytest.approx(1.0, abs=1e-5)
    assert all(row["acceptance"] == 1.0 for row in result["fuzzy"])
    assert result["acceptance_by_position"] == [1.0] * 4
    # 12 positions per prompt, l = 4: calls keep 4, 4, 2 and each adds the verifier's token
    assert result["mean_accepted_tokens"] == pytest.approx(13 / 3)
    assert result["mean_tv"] == pytest.approx(0.0, abs=1e-5)
    assert result["break_even_accepted_tokens"] > 0


def test_a_different_model_is_not(tmp_path):
    result = measure(tiny_model("llama", seed=1), tiny_model("llama", seed=2), _prompts(),
                     _args(tmp_path, max_new_tokens=12, latency_repeats=0))
    assert result["acceptance_exact_greedy"] < 1.0 and result["mean_tv"] > 0.01
    assert 1.0 <= result["mean_accepted_tokens"] < 5.0
    assert result["latency_ms"] == {} and result["break_even_accepted_tokens"] is None
    taus = [row["tau"] for row in result["fuzzy"]]
    accepted = [row["acceptance"] for row in result["fuzzy"]]
    assert taus == sorted(taus) and accepted == sorted(accepted)  # a larger tau never accepts less


def _save_pair(tmp_path):
    """A tiny student and teacher as local folders under ``tmp_path``; returns the report folder to use."""
    for name, seed in (("student", 1), ("teacher", 2)):
        tiny_model("qwen2", seed=seed).save_pretrained(tmp_path / name)
        tiny_tokenizer().save_pretrained(tmp_path / name)
    return tmp_path / "acc"


def test_command_end_to_end(tmp_path):
    out = _save_pair(tmp_path)
    rc = main(["eval-acceptance", "--preset", "", "--student", str(tmp_path / "student"), "--teacher",
               str(tmp_path / "teacher"), "--limit", "2", "--max-new-tokens", "8", "--draft-tokens", "3",
               "--latency_repeats", "1", "--dtype", "float32", "--out", str(out)])
    assert rc == 0
    config, result = load_report(out / "acceptance.json")
    assert config["draft_tokens"] == 3 and config["prompts"] == 2 and config["split"] == "test"
    assert config["command"].startswith("pyramid-sd eval-acceptance")
    assert result["positions"] == 16
    text = (out / "acceptance.md").read_text()
    assert "| exact, greedy |" in text and "Break-even" in text


@pytest.mark.parametrize("kw,match", [
    ({"pair": "draft:target", "student": None, "teacher": None}, "--pair must be one of"),
    ({"teacher": None}, "go together"),
    ({"draft_tokens": 0}, "must be positive"),
    ({"divergence": "hellinger"}, "--divergence must be one of"),
    ({"taus": "0.1,0.9"}, "outside the range"),
    ({"taus": "a"}, "comma-separated numbers"),
    ({"dataset": "mbpp"}, "unknown dataset"),
    ({"student_quantization": "int4"}, "--student_quantization must be none or int8"),
    ({"teacher_quantization": "fp8"}, "--teacher_quantization must be none or int8"),
])
def test_bad_arguments(tmp_path, kw, match):
    base = {"out": str(tmp_path), "preset": "qwen-coder-cpu", "student": "s", "teacher": "t"}
    with pytest.raises(ValueError, match=match):
        EvalAcceptanceArgs(**{**base, **kw})


def test_load_report_rejects_other_files(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"config": {}, "methods": []}))
    with pytest.raises(ValueError, match="not an eval-acceptance report"):
        load_report(path)


def test_a_path_model_changes_the_text_not_the_rule(tmp_path):
    student, teacher, writer = (tiny_model("llama", seed=s, init=0.3) for s in (1, 2, 3))
    args = _args(tmp_path, max_new_tokens=12, latency_repeats=0)
    own = measure(student, teacher, _prompts(), args)
    assert measure(student, teacher, _prompts(), args, path_model=teacher) == own  # the teacher's path by default
    other = measure(student, teacher, _prompts(), args, path_model=writer)
    assert other["mean_tv"] != pytest.approx(own["mean_tv"])  # another text was scored
    assert measure(teacher, teacher, _prompts(), args, path_model=writer)["acceptance_exact_greedy"] == 1.0


def test_the_qualifier_side_follows_the_preset_quantization_unless_told(tmp_path):
    from types import SimpleNamespace

    from pyramid_hf.eval_acceptance import pair_quantization

    preset = SimpleNamespace(qualifier_quantization="int8")
    pair = {"student": "qualifier", "teacher": "target", "preset": preset}
    assert pair_quantization(_args(tmp_path), pair) == {"student": "int8", "teacher": "none"}
    assert pair_quantization(_args(tmp_path), pair | {"student": "draft", "teacher": "qualifier"}) == {
        "student": "none", "teacher": "int8"}
    assert pair_quantization(_args(tmp_path, student_quantization="none"), pair)["student"] == "none"
    assert pair_quantization(_args(tmp_path, teacher_quantization="int8"), {}) == {"student": "none",
                                                                                 "teacher": "int8"}


def test_a_quantized_student_end_to_end(tmp_path, monkeypatch):
    from pyramid_hf import quantize

    monkeypatch.setattr(quantize, "measure_max_int8_rows", lambda *a, **k: 8)  # what a real CPU may measure
    out = _save_pair(tmp_path)
    rc = main(["eval-acceptance", "--preset", "", "--student", str(tmp_path / "student"), "--teacher",
               str(tmp_path / "teacher"), "--limit", "1", "--max-new-tokens", "6", "--latency_repeats", "0",
               "--dtype", "float32", "--student_quantization", "int8", "--out", str(out)])
    assert rc == 0
    config, result = load_report(out / "acceptance.json")
    assert "int8 weights for calls of <= 8 tokens" in config["origins"]["student"]
    assert "int8" not in config["origins"]["teacher"]
    assert result["positions"] == 6


def test_greedy_paths_are_reused_only_for_the_same_writer_and_give_the_same_report(tmp_path):
    from pyramid_hf.greedy_paths import GreedyPaths

    student, teacher = tiny_model("llama", seed=1), tiny_model("llama", seed=2)
    args = _args(tmp_path, max_new_tokens=10, draft_tokens=3, latency_repeats=0)  # timings differ run to run
    file = tmp_path / "paths.jsonl"
    writer = {"model": "t", "dtype": "float32", "quantization": "none", "max_new_tokens": 10}
    fresh = measure(student, teacher, _prompts(), args, paths=GreedyPaths(file, writer))
    assert len(file.read_text().splitlines()) == 3
    reread = GreedyPaths(file, writer)
    teacher.generate = lambda *a, **k: pytest.fail("a stored path was generated again")
    assert measure(student, teacher, _prompts(), args, paths=reread) == fresh
    assert (reread.reused, reread.written) == (3, 0)
    other = GreedyPaths(file, writer | {"max_new_tokens": 6})  # another writer's paths are never used
    assert other.paths == {}
    del teacher.generate
    measure(student, teacher, _prompts(), _args(tmp_path, max_new_tokens=6, draft_tokens=3), paths=other)
    assert other.written == 3 and len(file.read_text().splitlines()) == 6
    assert len(GreedyPaths(file, writer).paths) == 3  # both writers' records live side by side


@pytest.mark.parametrize("line,match", [("{not json", "is not JSON"), ('{"ids": [1]}', "not a greedy-path record"),
                                        ('{"writer": {}, "prompt_ids": [1, 2], "ids": [1, 3, 4]}',
                                         "does not start with its prompt")])
def test_a_damaged_paths_file_is_named_not_used(tmp_path, line, match):
    from pyramid_hf.greedy_paths import GreedyPaths

    file = tmp_path / "paths.jsonl"
    file.write_text(line + "\n")
    with pytest.raises(ValueError, match=match):
        GreedyPaths(file, {})


def test_command_reuses_its_paths_file(tmp_path, caplog):
    out = _save_pair(tmp_path)
    command = ["eval-acceptance", "--preset", "", "--student", str(tmp_path / "student"), "--teacher",
               str(tmp_path / "teacher"), "--limit", "2", "--max-new-tokens", "8", "--latency_repeats", "0",
               "--dtype", "float32", "--paths_file", str(tmp_path / "paths.jsonl")]
    assert main(command + ["--out", str(out / "1")]) == 0
    with caplog.at_level("INFO", logger="pyramid_hf"):
        assert main(command + ["--out", str(out / "2")]) == 0
    assert "greedy paths: 2 read from" in caplog.text and "0 generated" in caplog.text
    assert load_report(out / "1" / "acceptance.json")[1] == load_report(out / "2" / "acceptance.json")[1]
