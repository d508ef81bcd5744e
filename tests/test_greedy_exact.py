"""Lossless modes under greedy decoding: token for token equal to target-only greedy (fp32)."""

import pytest
import torch
from tiny import VOCAB, tiny_model, tiny_trio
from transformers import StoppingCriteria, StoppingCriteriaList

from pyramid_hf import PyramidAssistant, PyramidConfig


def _prompt(seed, length):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (1, length), generator=g)


def _check(target, assistant, ids, **kw):
    expected = target.generate(ids, do_sample=False, **kw)
    got = target.generate(ids, assistant_model=assistant, do_sample=False, **kw)
    assert torch.equal(got, expected), f"pyramid {got.tolist()} != target {expected.tolist()}"
    return got


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("draft_kind", ["model", "prompt_lookup", None])
@pytest.mark.parametrize("qualifier_rule", ["exact", "assisted"])
@pytest.mark.parametrize("seed,prompt_len,max_new,l_d,l_q", [
    (0, 1, 1, 1, 1), (1, 5, 2, 3, 5), (2, 9, 7, 4, 8), (3, 3, 33, 2, 3), (4, 12, 20, 5, 4), (5, 6, 13, 3, 16),
])
def test_matches_target_greedy(arch, draft_kind, qualifier_rule, seed, prompt_len, max_new, l_d, l_q,
                               llama_trio, qwen_trio):
    target, qualifier, draft = llama_trio if arch == "llama" else qwen_trio
    draft = draft if draft_kind == "model" else draft_kind
    cfg = PyramidConfig(draft_tokens=l_d, qualifier_tokens=l_q, qualifier_rule=qualifier_rule)
    assistant = PyramidAssistant(qualifier, draft, cfg)
    out = _check(target, assistant, _prompt(seed, prompt_len), max_new_tokens=max_new)
    assert out.shape[1] == prompt_len + max_new  # no EOS configured: max_new_tokens exactly
    assert assistant.stats.new_tokens == max_new


def test_long_generation_with_many_rejections_stays_exact(llama_trio):
    """Caches of all three models are cropped after every rejection: 300 tokens must still match."""
    target, qualifier, draft = llama_trio
    assistant = PyramidAssistant(qualifier, draft, PyramidConfig(draft_tokens=3, qualifier_tokens=6))
    _check(target, assistant, _prompt(7, 4), max_new_tokens=300)
    assert assistant.stats.target_calls > 50  # random models disagree: many rejections were exercised


def test_agreeing_levels_accept_everything(llama_trio):
    """Qualifier and draft equal to the target: every proposal is kept, l_Q + 1 tokens per target call."""
    target, _, _ = llama_trio
    assistant = PyramidAssistant(target, target, PyramidConfig(draft_tokens=2, qualifier_tokens=4))
    _check(target, assistant, _prompt(3, 5), max_new_tokens=25)
    s = assistant.stats
    assert s.draft_acceptance_rate == 1.0 and s.qualifier_acceptance_rate == 1.0
    assert s.outer_accepted_hist[4] == 5 and s.target_calls == 5  # 5 calls x (4 + 1 bonus) = 25
    assert s.forward_calls["target"] == 5


def test_heuristic_schedule_is_exact_and_grows(llama_trio):
    target, qualifier, draft = llama_trio
    assistant = PyramidAssistant(qualifier, draft, PyramidConfig(draft_tokens=2, qualifier_tokens=3,
                                                                 schedule="heuristic"))
    _check(target, assistant, _prompt(11, 6), max_new_tokens=40)
    agreeing = PyramidAssistant(target, target, PyramidConfig(draft_tokens=1, qualifier_tokens=2,
                                                              schedule="heuristic"))
    _check(target, agreeing, _prompt(11, 6), max_new_tokens=40)
    assert agreeing.stats.target_calls < 40 / 3  # l_Q grew beyond its initial 2


def test_eos_inside_a_draft_stops_exactly():
    eos = None
    target, qualifier, draft = tiny_trio("llama", seed=20)
    ids = _prompt(5, 4)
    plain = target.generate(ids, do_sample=False, max_new_tokens=30)
    eos = int(plain[0, ids.shape[1] + 9])  # the 10th greedy token becomes EOS
    for m in (target, qualifier, draft):
        m.generation_config.eos_token_id = eos
    assistant = PyramidAssistant(qualifier, target, PyramidConfig(draft_tokens=4, qualifier_tokens=8))
    out = _check(target, assistant, ids, max_new_tokens=30)
    assert int(out[0, -1]) == eos and out.shape[1] <= ids.shape[1] + 10


class StopAfterToken(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_custom_stopping_criteria_honoured_exactly(llama_trio):
    target, qualifier, _ = llama_trio
    ids = _prompt(9, 5)
    plain = target.generate(ids, do_sample=False, max_new_tokens=30)
    stop = int(plain[0, ids.shape[1] + 6])
    assistant = PyramidAssistant(target, target, PyramidConfig(draft_tokens=4, qualifier_tokens=8))
    criteria = StoppingCriteriaList([StopAfterToken(stop)])
    out = _check(target, assistant, ids, max_new_tokens=30, stopping_criteria=criteria)
    assert int(out[0, -1]) == stop and out.shape[1] < ids.shape[1] + 30


def test_mixed_dtypes_are_still_exact(llama_trio):
    """A bf16 qualifier and draft only change proposals: the fp32 target's verification keeps it exact."""
    target, _, _ = llama_trio
    qualifier = tiny_model("llama", 32, 2, 1).to(torch.bfloat16)
    draft = tiny_model("llama", 16, 2, 2).to(torch.bfloat16)
    assistant = PyramidAssistant(qualifier, draft, PyramidConfig(draft_tokens=3, qualifier_tokens=6))
    _check(target, assistant, _prompt(2, 6), max_new_tokens=30)


def test_scores_match_plain_generate(llama_trio):
    target, qualifier, draft = llama_trio
    ids = _prompt(4, 5)
    kw = dict(do_sample=False, max_new_tokens=12, return_dict_in_generate=True, output_scores=True)
    plain = target.generate(ids, **kw)
    got = target.generate(ids, assistant_model=PyramidAssistant(qualifier, draft), **kw)
    assert torch.equal(got.sequences, plain.sequences)
    assert len(got.scores) == len(plain.scores) == 12
    for a, b in zip(got.scores, plain.scores, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_fuzzy_target_with_tau_zero_is_greedy_target(llama_trio):
    """tau=0 accepts only identical distributions: different models -> every token is the target's own."""
    target, qualifier, draft = llama_trio
    cfg = PyramidConfig(target_rule="fuzzy", tau_target=0.0, draft_tokens=2, qualifier_tokens=4)
    assistant = PyramidAssistant(qualifier, draft, cfg)
    _check(target, assistant, _prompt(1, 5), max_new_tokens=15)
    assert assistant.stats.qualifier_accepted == 0


def test_fuzzy_max_tau_accepts_everything(llama_trio):
    import math

    target, qualifier, draft = llama_trio
    cfg = PyramidConfig(qualifier_rule="fuzzy", target_rule="fuzzy", tau_qualifier=math.log(2),
                        tau_target=math.log(2), draft_tokens=2, qualifier_tokens=4)
    assistant = PyramidAssistant(qualifier, draft, cfg)
    target.generate(_prompt(1, 5), assistant_model=assistant, do_sample=False, max_new_tokens=20)
    assert assistant.stats.qualifier_acceptance_rate == 1.0
    assert assistant.stats.draft_acceptance_rate == 1.0


def test_total_stats_accumulate_and_reset(llama_trio):
    target, qualifier, draft = llama_trio
    assistant = PyramidAssistant(qualifier, draft)
    for _ in range(2):
        target.generate(_prompt(0, 4), assistant_model=assistant, do_sample=False, max_new_tokens=5)
    assert assistant.stats.new_tokens == 5 and assistant.total_stats.new_tokens == 10
    assert assistant.total_stats.generate_calls == 2
    assistant.reset_stats()
    assert assistant.total_stats.new_tokens == 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("draft_kind", ["model", None])
@pytest.mark.parametrize("confidence", [0.2, 0.6, 0.95])
def test_adaptive_blocks_stay_exact_and_cut_blocks(arch, draft_kind, confidence, llama_trio, qwen_trio):
    target, qualifier, draft = llama_trio if arch == "llama" else qwen_trio
    draft = draft if draft_kind == "model" else None
    ids = _prompt(11, 5)
    sizes = {}
    for threshold in (0.0, confidence):
        assistant = PyramidAssistant(qualifier, draft, PyramidConfig(draft_tokens=2, qualifier_tokens=12,
                                                                     block_confidence=threshold))
        _check(target, assistant, ids, max_new_tokens=40)
        sizes[threshold] = assistant.stats.qualifier_proposed / assistant.stats.target_calls
    assert sizes[confidence] < sizes[0.0]  # blocks were cut before l_Q


def test_block_confidence_is_validated():
    for bad in (1.0, -0.1, True, "0.5"):
        with pytest.raises(ValueError, match="block_confidence"):
            PyramidConfig(block_confidence=bad)
        with pytest.raises(ValueError, match="draft_confidence"):
            PyramidConfig(draft_confidence=bad)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("confidence", [0.3, 0.9])
def test_draft_confidence_stays_exact_and_cuts_proposals(arch, confidence, llama_trio, qwen_trio):
    target, qualifier, draft = llama_trio if arch == "llama" else qwen_trio
    ids = _prompt(12, 6)
    per_round = {}
    for threshold in (0.0, confidence):
        assistant = PyramidAssistant(qualifier, draft, PyramidConfig(draft_tokens=4, qualifier_tokens=8,
                                                                     draft_confidence=threshold))
        _check(target, assistant, ids, max_new_tokens=40)
        per_round[threshold] = assistant.stats.draft_proposed / assistant.stats.inner_rounds
    assert per_round[confidence] < per_round[0.0]  # the unsure draft stopped early


@pytest.mark.parametrize("draft_kind", ["prompt_lookup", None])
def test_draft_confidence_without_a_model_draft_is_refused(draft_kind, llama_trio):
    target, qualifier, _ = llama_trio
    assistant = PyramidAssistant(qualifier, draft_kind, PyramidConfig(draft_tokens=2, draft_confidence=0.5))
    with pytest.raises(ValueError, match="draft_confidence=0.5 cuts a model draft's proposals"):
        target.generate(input_ids=_prompt(3, 5), max_new_tokens=8, do_sample=False, assistant_model=assistant)
