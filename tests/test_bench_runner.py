"""The benchmark runner on a tiny in-process trio: every method runs, lossless ones reproduce AR, numbers add up."""

import pytest
import torch
from tiny import tiny_trio

from pyramid_hf.bench.meter import ForwardMeter
from pyramid_hf.bench.methods import Method, default_grid, method_kwargs
from pyramid_hf.bench.runner import GenerationSettings, Prompt, Runner, StopInNewText, cut_at_stop
from pyramid_hf.bench.summary import analytic_speedup, first_difference, summarize
from pyramid_hf.trio import Trio


@pytest.fixture(scope="module")
def trio():
    target, qualifier, draft = tiny_trio("llama", seed=3, init=0.5)
    return Trio(target, qualifier, draft, None)


def _prompts(n):
    return [Prompt(i, "", torch.randint(1, 97, (1, 6), generator=torch.Generator().manual_seed(i))) for i in range(n)]


def test_every_method_runs_and_lossless_ones_match_ar(trio):
    runner = Runner(trio, GenerationSettings(max_new_tokens=12), progress=False)
    grid = default_grid(trio, {"draft_tokens": 2, "qualifier_tokens": 4}, sd_tokens=(2, 3), lookup_tokens=(2,))
    methods = runner.tune(grid, _prompts(1))
    families = [m.method for m in methods]
    assert families.count("sd_qualifier") == 1 and families.count("sd_draft") == 1  # tuned to one each
    assert families.count("psd_f") == 3  # every tau kept
    prompts = _prompts(3)
    runs = runner.run(methods, prompts)
    ar = summarize(methods[0], runs["ar"], None, greedy=True)
    assert ar["mean_tokens_per_target_call"] == pytest.approx(1.0)
    assert analytic_speedup(ar, ar) == pytest.approx(1.0)
    for method in methods:
        assert [r.prompt_index for r in runs[method.label]] == [0, 1, 2]
        assert all(r.new_tokens == 12 for r in runs[method.label])
        s = summarize(method, runs[method.label], runs["ar"], greedy=True)
        assert 0.0 <= s["overhead_share"] < 1.0
        assert s["forward_calls"]["target"] >= 3
        if method.lossless and method.method != "ar":
            assert s["identical_to_ar"] == 1.0, method.label  # fp32: exact
            assert s["first_diff_positions"] == [None, None, None]
        if method.method.startswith("psd"):
            assert s["forward_calls"]["draft"] > 0 and s["acceptance"]["qualifier->target"] is not None


def test_acceptance_of_two_model_sd_counts_assistant_forwards(trio):
    runner = Runner(trio, GenerationSettings(max_new_tokens=10), progress=False)
    method = Method.make("sd_qualifier", num_tokens=3)
    runs = runner.run([method], _prompts(2))
    s = summarize(method, runs[method.label], None, greedy=True)
    proposed = sum(r.forward_calls["qualifier"] for r in runs[method.label])
    accepted = sum(r.new_tokens - r.forward_calls["target"] for r in runs[method.label])
    assert s["acceptance"]["qualifier->target"] == pytest.approx(accepted / proposed)


def test_meter_refuses_one_model_in_two_roles(trio):
    with pytest.raises(ValueError, match="same model object"):
        ForwardMeter({"target": trio.target, "qualifier": trio.target})


def test_meter_counts_nested_calls(trio):
    meter = ForwardMeter({"target": trio.target})
    with meter:
        trio.target(torch.tensor([[1, 2, 3]]))
        trio.target(torch.tensor([[1, 2]]))
    trio.target(torch.tensor([[1]]))  # hooks removed on exit
    assert meter.calls == {"target": 2} and meter.seconds["target"] > 0


def test_method_validation_and_labels(trio):
    with pytest.raises(ValueError, match="unknown method"):
        Method.make("beam")
    m = Method.make("psd_f", tau_target=0.2, tau_qualifier=0.1, draft_tokens=2, qualifier_tokens=4)
    assert m.label == "psd_f draft_tokens=2 qualifier_tokens=4 tau_qualifier=0.1 tau_target=0.2"
    assert not m.lossless and m.pyramid_config().mode == "psd_f"
    assert Method.make("psd_a", tau_target=0.0).lossless
    assert not Method.make("psd_a", tau_target=0.3).lossless
    no_draft = Trio(trio.target, trio.qualifier, "prompt_lookup", None)
    with pytest.raises(ValueError, match="sd_draft needs"):
        method_kwargs(Method.make("sd_draft", num_tokens=2), no_draft, {})


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 5, 3], [1, 2, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


class _CharTokenizer:
    """Decodes id i to chr(ord('a') + i % 26), except ids 0 -> newline and 1 -> '#'."""

    pad_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join("\n" if i == 0 else "#" if i == 1 else chr(ord("a") + i % 26) for i in ids)


def test_stop_in_new_text_sees_a_stop_string_inside_a_block_and_cut_keeps_through_it():
    tok = _CharTokenizer()
    crit = StopInNewText(tok, ("\n#",), prompt_length=2)
    # prompt "\n#" itself must not count; a block "cd\n#ef" added at once must
    assert not crit(torch.tensor([[0, 1, 2, 3]]), None).item()
    assert crit(torch.tensor([[0, 1, 2, 3, 0, 1, 4, 5]]), None).item()
    assert cut_at_stop(tok, [2, 3, 0, 1, 4, 5], ("\n#",)) == [2, 3, 0, 1]
    assert cut_at_stop(tok, [2, 3, 4], ("\n#",)) == [2, 3, 4]
    assert cut_at_stop(tok, [0, 1], ("\n#", "zz")) == [0, 1]
    assert cut_at_stop(tok, [], ("\n#",)) == []


def test_two_model_sd_is_cut_at_a_stop_string_inside_its_block(trio):
    """The cut is what AR produces: SD's overshoot is dropped, its generated tokens still counted for acceptance."""
    tok = _CharTokenizer()
    prompt = _prompts(1)[0]
    plain = Runner(Trio(trio.target, trio.qualifier, trio.draft, tok), GenerationSettings(max_new_tokens=24), progress=False)
    ar_ids = plain.run_one(Method.make("ar"), prompt).new_ids
    stop = tok.decode(ar_ids[8:10])  # a two-character string that AR completes at its 10th token
    first = next(i for i in range(2, len(ar_ids) + 1) if stop in tok.decode(ar_ids[:i]))
    settings = GenerationSettings(max_new_tokens=24, stop_strings=(stop,))
    runner = Runner(Trio(trio.target, trio.qualifier, trio.draft, tok), settings, progress=False)
    for method in (Method.make("ar"), Method.make("sd_qualifier", num_tokens=5),
                   Method.make("psd", draft_tokens=2, qualifier_tokens=5)):
        run = runner.run_one(method, prompt)
        assert run.new_ids == ar_ids[:first], method.label
        assert first <= run.generated_tokens < first + 7, method.label


def test_grids_parse_trees_adaptive_blocks_and_confidence_cut_sd(trio):
    from pyramid_hf.bench.main import _psd_settings, _sd_settings

    assert _psd_settings("3:4,3:4:4,3:12:4:0.5,3:12:1:0.5:0.3") == ((3, 4), (3, 4, 4), (3, 12, 4, 0.5),
                                                                    (3, 12, 1, 0.5, 0.3))
    assert _sd_settings("4,12:0.5") == (4, (12, 0.5))
    for bad in ("3", "3:4:x", "3:4:4:0.5:1:2", "3:4:4:0.5:x"):
        with pytest.raises(ValueError, match="psd_grid"):
            _psd_settings(bad)
    for bad in ("0", "4:1.5", "x"):
        with pytest.raises(ValueError, match="sd_tokens"):
            _sd_settings(bad)
    knobs = {"draft_tokens": 2, "qualifier_tokens": 4, "draft_branches": 3, "block_confidence": 0.4}
    grid = default_grid(trio, knobs, sd_tokens=(2, (8, 0.5)),
                        psd_grid=((2, 4), (2, 4, 1, 0.0), (3, 9, 2, 0.6), (3, 9, 1, 0.6, 0.3)))
    assert [m.knob_dict for m in grid["psd"]] == [
        {"draft_tokens": 2, "qualifier_tokens": 4, "draft_branches": 3, "block_confidence": 0.4},  # preset's
        {"draft_tokens": 2, "qualifier_tokens": 4},  # explicitly off
        {"draft_tokens": 3, "qualifier_tokens": 9, "draft_branches": 2, "block_confidence": 0.6},
        {"draft_tokens": 3, "qualifier_tokens": 9, "block_confidence": 0.6, "draft_confidence": 0.3}]
    config = grid["psd"][2].pyramid_config()
    assert (config.draft_branches, config.block_confidence, config.qualifier_tokens) == (2, 0.6, 9)
    assert grid["psd"][3].pyramid_config().draft_confidence == 0.3
    assert grid["sd_qualifier"][1].knob_dict == {"num_tokens": 8, "confidence": 0.5}
    kwargs = method_kwargs(grid["sd_qualifier"][1], trio, {})
    assert kwargs["assistant_model"].generation_config.assistant_confidence_threshold == 0.5
    method_kwargs(grid["sd_qualifier"][0], trio, {})
    assert trio.qualifier.generation_config.assistant_confidence_threshold == 0.0
