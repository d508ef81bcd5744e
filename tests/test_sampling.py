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
from transformers.generation import (
    CandidateGenerator,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

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


class _BranchingDraft(CandidateGenerator):
    """Deterministic drafts (point masses) in several branches that depend on the text so far: a draft tree every
    round, whose branches share first tokens sometimes and are right or wrong in every combination."""

    def propose_branches(self, ids, num_tokens, max_branches):
        last = ids[-1]
        branches = [[(last + 1) % V, (last + 2) % V], [(last + 1) % V, (3 * last) % V], [(5 * last + 2) % V],
                    [(last + 4) % V, last]]
        return [b[:num_tokens] for b in branches[:max_branches]]

    def get_candidates(self, input_ids, **kwargs):
        first = self.propose_branches(input_ids[0].tolist(), 2, 1)[0]
        return torch.cat([input_ids, torch.tensor([first], dtype=input_ids.dtype)], dim=1), None

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        return


def _ngram_draft():
    """A corpus n-gram draft over V tokens whose table holds the prompt's continuation 1,2,3 -> 4,5 and noise."""
    g = torch.Generator().manual_seed(0)
    rows = [[1, 2, 3, 4, 5, 6]] * 3 + torch.randint(0, V, (20, 12), generator=g).tolist()
    return CorpusNgramDraft(NgramTable.build(rows), num_output_tokens=2)


@pytest.mark.parametrize("rule,draft", [("exact", "model"), ("assisted", "model"), ("exact", "prompt_lookup"),
                                        ("exact", "ngram"), ("exact", None), ("exact", "tree"), ("assisted", "tree"),
                                        ("exact", "model_adaptive"), ("exact", "model_cut")])
def test_sampling_matches_target_distribution(sharp_trio, rule, draft):
    target, qualifier, draft_model = sharp_trio
    branches = 4 if draft == "tree" else 1
    # adaptive blocks: up to 6 qualifier tokens, cut where the qualifier's own confidence falls below 0.5
    blocks = dict(qualifier_tokens=6, block_confidence=0.5) if draft == "model_adaptive" else dict(qualifier_tokens=2)
    cut = draft == "model_cut"
    if cut:  # the draft stops after a sampled token it gave probability < 0.5
        blocks["draft_confidence"] = 0.5
    makers = {"model": lambda: draft_model, "model_adaptive": lambda: draft_model, "model_cut": lambda: draft_model,
              "ngram": _ngram_draft,
              "tree": _BranchingDraft}
    draft = makers[draft]() if draft in makers else draft  # "prompt_lookup" and None are drafts as they are
    assistant = PyramidAssistant(qualifier, draft,
                                 PyramidConfig(draft_tokens=2, qualifier_rule=rule, draft_branches=branches, **blocks))
    pvals = _pvalues(_samples(target, assistant), _target_joint(target))
    assert min(pvals) > 1e-3, pvals
    assert assistant.total_stats.qualifier_accepted > 0 and assistant.total_stats.target_calls > SAMPLES
    if cut:  # proposals were really cut short, not all l_D long
        assert assistant.total_stats.draft_proposed < 2 * assistant.total_stats.inner_rounds
    if isinstance(draft, _BranchingDraft):  # the draft trees were really walked, and not only along their first branch
        assert assistant.total_stats.tree_rounds > SAMPLES and assistant.total_stats.tree_other_branch_won > 0


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


def test_planted_tree_bug_is_caught(sharp_trio, monkeypatch):
    """Descend into the first child the verifier gives any probability: the same check must fail."""
    target, qualifier, _ = sharp_trio

    def greedy_children(child_ids, verifier_probs, *, tau=0.0, divergence="js"):
        for j, token in enumerate(child_ids.tolist()):
            if verifier_probs[token] > 0:
                return j, child_ids[j]
        return None, acceptance._sample(verifier_probs)

    monkeypatch.setitem(acceptance.CHILD_RULES, "exact", greedy_children)
    assistant = PyramidAssistant(qualifier, _BranchingDraft(),
                                 PyramidConfig(draft_tokens=2, qualifier_tokens=2, draft_branches=4))
    pvals = _pvalues(_samples(target, assistant), _target_joint(target))
    assert min(pvals) < 1e-3, pvals
