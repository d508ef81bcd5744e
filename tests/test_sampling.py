"""Lossless modes under sampling: the distribution of generated tokens is the target's.

The target's exact distribution over the first three new tokens (with temperature, top-k and top-p
applied) is computed by enumeration; pyramid samples are compared with a chi-square test per
position marginal and on the joint of the first two tokens. The same check must reject a planted
bug (resampling from the verifier instead of the residual).
"""

import itertools

import pytest
import torch
from scipy.stats import chisquare
from tiny import tiny_model
from transformers.generation import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import pyramid_hf.acceptance as acceptance
from pyramid_hf import PyramidAssistant, PyramidConfig
from pyramid_hf.ngram_draft import CorpusNgramDraft, NgramTable

V = 8
NEW = 3
SAMPLES = 1500
PROMPT = torch.tensor([[1, 2, 3]])
SAMPLING = dict(do_sample=True, temperature=0.8, top_k=6, top_p=0.95)


@pytest.fixture(scope="module")
def sharp_trio():
    # a larger init makes next-token distributions peaked and the three models disagree (TV ~0.4-0.5)
    return (tiny_model("llama", 32, 2, 0, vocab=V, init=0.5), tiny_model("llama", 16, 1, 1, vocab=V, init=0.5),
            tiny_model("llama", 16, 1, 2, vocab=V, init=0.5))


def _target_joint(target):
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.8), TopKLogitsWarper(6), TopPLogitsWarper(0.95)])
    joint = torch.zeros((V,) * NEW, dtype=torch.float64)
    with torch.no_grad():
        for seq in itertools.product(range(V), repeat=NEW):
            ids = torch.cat([PROMPT, torch.tensor([seq])], dim=1)
            logits = target(ids).logits[0, PROMPT.shape[1] - 1 : -1]
            p = 1.0
            for i, tok in enumerate(seq):
                row = processors(ids[:, : PROMPT.shape[1] + i], logits[i : i + 1])
                p *= row.softmax(-1)[0, tok].item()
            joint[seq] = p
    return joint


def _samples(target, assistant):
    torch.manual_seed(1234)
    out = [target.generate(PROMPT, assistant_model=assistant, max_new_tokens=NEW, **SAMPLING)[0, -NEW:].tolist()
           for _ in range(SAMPLES)]
    return torch.tensor(out)


def _pvalues(samples, joint):
    pvals = []
    margins = [joint.sum(dim=tuple(d for d in range(NEW) if d != i)) for i in range(NEW)]
    cells = [(samples[:, i], margins[i], V) for i in range(NEW)]
    cells.append((samples[:, 0] * V + samples[:, 1], joint.sum(2).flatten(), V * V))
    for values, probs, n in cells:
        observed = torch.bincount(values, minlength=n).double()
        keep = probs > 0
        assert observed[~keep].sum() == 0, "a token the target can never emit was generated"
        expected = probs[keep] / probs[keep].sum() * SAMPLES
        pvals.append(chisquare(observed[keep].numpy(), expected.numpy()).pvalue)
    return pvals


def _ngram_draft():
    """A corpus n-gram draft over V tokens whose table holds the prompt's continuation 1,2,3 -> 4,5 and noise."""
    g = torch.Generator().manual_seed(0)
    rows = [[1, 2, 3, 4, 5, 6]] * 3 + torch.randint(0, V, (20, 12), generator=g).tolist()
    return CorpusNgramDraft(NgramTable.build(rows), num_output_tokens=2)


@pytest.mark.parametrize("rule,draft", [("exact", "model"), ("assisted", "model"), ("exact", "prompt_lookup"),
                                        ("exact", "ngram"), ("exact", None), ("exact", "ngram_tree"),
                                        ("assisted", "ngram_tree")])
def test_sampling_matches_target_distribution(sharp_trio, rule, draft):
    target, qualifier, draft_model = sharp_trio
    branches = 3 if draft == "ngram_tree" else 1
    draft = _ngram_draft() if draft in ("ngram", "ngram_tree") else draft
    assistant = PyramidAssistant(qualifier, draft_model if draft == "model" else draft,
                                 PyramidConfig(draft_tokens=2, qualifier_tokens=2, qualifier_rule=rule,
                                               draft_branches=branches))
    pvals = _pvalues(_samples(target, assistant), _target_joint(target))
    assert min(pvals) > 1e-3, pvals
    assert assistant.total_stats.qualifier_accepted > 0 and assistant.total_stats.target_calls > SAMPLES
    if branches > 1:  # the draft trees were really walked, and not only along their first branch
        assert assistant.total_stats.tree_rounds > SAMPLES // 2 and assistant.total_stats.tree_other_branch_won > 0


def test_planted_residual_bug_is_caught(sharp_trio, monkeypatch):
    """Resample from the verifier itself instead of norm(max(0, p - q)): the same check must fail."""
    target, qualifier, draft_model = sharp_trio

    def buggy_exact(candidate_ids, proposer_probs, verifier_probs, *, do_sample, tau=0.0, divergence="js"):
        k = candidate_ids.shape[0]
        idx = torch.arange(k)
        ratio = verifier_probs[idx, candidate_ids] / proposer_probs[idx, candidate_ids]
        n = acceptance._first_false(torch.rand(k) <= ratio)
        return n, acceptance._sample(verifier_probs[n])  # BUG: should be the residual when n < k

    monkeypatch.setitem(acceptance.RULES, "exact", buggy_exact)
    assistant = PyramidAssistant(qualifier, draft_model, PyramidConfig(draft_tokens=2, qualifier_tokens=2))
    pvals = _pvalues(_samples(target, assistant), _target_joint(target))
    assert min(pvals) < 1e-3, pvals
