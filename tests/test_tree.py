"""Draft trees: one qualifier pass over several drafts gives each draft's own logits, the kept path's cache equals
a plain pass over it, and a pyramid that verifies trees stays token-for-token equal to the target alone."""

import pytest
import torch
from scipy.stats import chisquare
from tiny import VOCAB, tiny_model

from pyramid_hf import PyramidAssistant, PyramidConfig
from pyramid_hf._hf import keep_cache_positions, tree_attention_mask
from pyramid_hf.acceptance import CHILD_RULES
from pyramid_hf.cpu_attention import PACKED_GQA
from pyramid_hf.levels import ModelLevel
from pyramid_hf.ngram_draft import CorpusNgramDraft, NgramTable, lookup_branches
from pyramid_hf.stats import PyramidStats
from pyramid_hf.tree import DraftTree, sample_tree

BRANCHES = [[5, 6, 7], [5, 8], [9, 10, 11, 12], [5, 6, 13], [5, 6]]


def test_tree_merges_shared_prefixes_and_keeps_branch_order():
    tree = DraftTree.from_branches(BRANCHES + [[], [9, 10]])
    assert tree.ids == (5, 6, 7, 8, 9, 10, 11, 12, 13)
    assert tree.parents == (-1, 0, 1, 0, -1, 4, 5, 6, 1)
    assert tree.branches == ((0, 1, 2), (0, 3), (4, 5, 6, 7), (0, 1, 8))  # [5, 6] and [9, 10] are prefixes
    assert tree.depths() == [1, 2, 3, 2, 1, 2, 3, 4, 3]
    mask = tree.ancestor_mask()
    assert mask[2].nonzero().view(-1).tolist() == [0, 1, 2]
    assert mask[8].nonzero().view(-1).tolist() == [0, 1, 8]
    assert mask[7].nonzero().view(-1).tolist() == [4, 5, 6, 7]
    assert DraftTree.from_branches([[3, 4], [3, 4, 5]]).branches == ((0, 1, 2),)  # a longer branch replaces


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("attention", ["sdpa", PACKED_GQA, "eager"])
@pytest.mark.parametrize("padded", [False, True])
def test_one_tree_pass_equals_a_pass_per_branch_and_the_kept_path_equals_a_plain_pass(arch, attention, padded):
    model = tiny_model(arch, seed=3)
    model.config._attn_implementation = attention
    seq = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(1, 40, dtype=torch.long)
    if padded:
        mask[0, :2] = 0  # a left-padded prompt
    mask_or_none = mask if padded else None
    level = ModelLevel(model, "qualifier", PyramidStats(), keep_hidden=True)
    level.next_token_logits(seq[:, :7], 1, mask_or_none)  # part of the sequence cached already
    tree = DraftTree.from_branches(BRANCHES)
    logits = level.tree_logits(seq, tree, mask_or_none)
    assert logits.shape == (1 + len(tree), VOCAB)
    for b, nodes in enumerate(tree.branches):
        reference = ModelLevel(model, "target", PyramidStats())
        full = torch.cat([seq, tree.branch_ids(b)[None]], dim=1)
        expected = reference.next_token_logits(full, len(nodes) + 1, mask_or_none)
        torch.testing.assert_close(logits[[0] + [1 + i for i in nodes]], expected, atol=1e-5, rtol=1e-5)

    path = list(tree.branches[2][:3])  # keep 9, 10, 11 of the third branch
    level.commit_tree_path(path)
    assert level.cached_ids.tolist() == [seq[0].tolist() + [9, 10, 11]]
    after = torch.cat([seq, torch.tensor([[9, 10, 11, 40, 41]])], dim=1)
    fresh = ModelLevel(model, "draft", PyramidStats(), keep_hidden=True)
    torch.testing.assert_close(level.next_token_logits(after, 2, mask_or_none),
                               fresh.next_token_logits(after, 2, mask_or_none), atol=1e-5, rtol=1e-5)
    real = mask[0, : after.shape[1]].bool()  # padding positions' states are whatever attention makes of no keys
    torch.testing.assert_close(level.hidden[:, real], fresh.hidden[:, real], atol=1e-5, rtol=1e-5)
    assert level.cache.get_seq_length() == after.shape[1]


def test_an_uncommitted_tree_is_dropped_and_a_cache_that_cannot_move_is_refed():
    model = tiny_model("llama", seed=4)
    seq = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    level = ModelLevel(model, "qualifier", PyramidStats())
    level.tree_logits(seq, DraftTree.from_branches(BRANCHES))
    nxt = torch.cat([seq, torch.tensor([[5, 6]])], dim=1)
    expected = ModelLevel(model, "target", PyramidStats()).next_token_logits(nxt, 3)
    torch.testing.assert_close(level.next_token_logits(nxt, 3), expected, atol=1e-5, rtol=1e-5)
    assert level.cache.get_seq_length() == nxt.shape[1] and level.pending_nodes == 0

    level.tree_logits(nxt, DraftTree.from_branches([[1, 2], [3]]))
    assert not keep_cache_positions(object(), nxt.shape[1], [nxt.shape[1]], 3)  # not a layered dynamic cache
    assert not keep_cache_positions(level.cache, nxt.shape[1], [nxt.shape[1]], 99)  # wrong length: untouched
    assert level.cache.get_seq_length() == nxt.shape[1] + 3
    with pytest.raises(RuntimeError, match="no draft tree"):
        ModelLevel(model, "target", PyramidStats()).commit_tree_path([0])


def test_tree_mask_forms_and_refusal():
    allowed = torch.tensor([[True, False], [True, True]])
    sdpa, eager = tiny_model("llama", seed=0), tiny_model("llama", seed=0)
    sdpa.config._attn_implementation, eager.config._attn_implementation = "sdpa", "eager"
    assert tree_attention_mask(sdpa, allowed, "cpu").dtype == torch.bool
    sdpa.set_attn_implementation(PACKED_GQA)
    assert tree_attention_mask(sdpa, allowed, "cpu").dtype == torch.bool
    additive = tree_attention_mask(eager, allowed, "cpu")
    assert additive.shape == (1, 1, 2, 2) and additive[0, 0, 1, 1] == 0 and additive[0, 0, 0, 1] < -1e30
    eager.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="draft_branches=1"):
        tree_attention_mask(eager, allowed, "cpu")


def test_lookup_branches_and_draft_branches():
    ids = [1, 2, 3, 9, 9, 2, 3, 7, 8, 4, 3, 5, 2, 3]
    assert lookup_branches(ids, 3, 2, 8) == [(2, [7, 8]), (2, [9, 9]), (1, [5, 2])]
    table = NgramTable.build([[2, 3, 6, 6, 6]] * 2, orders=(2, 1))
    draft = CorpusNgramDraft(table, num_output_tokens=2, eos_token_id=8)
    assert draft.propose_branches(ids, 2, 4) == [[7, 8], [6, 6], [9, 9], [5, 2]]
    assert draft.propose_branches(ids, 2, 2) == [[7, 8], [6, 6]]
    assert draft.propose(ids) == [7, 8]
    assert draft.propose_branches([40, 41], 2, 4) == [[]]


def _table_from(qualifier):
    rows = [qualifier.generate(torch.randint(1, VOCAB, (1, 4), generator=torch.Generator().manual_seed(100 + i)),
                               do_sample=False, max_new_tokens=30)[0].tolist() for i in range(4)]
    return NgramTable.build(rows)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("seed,max_new,l_d,l_q,branches", [(0, 40, 3, 6, 4), (1, 33, 4, 8, 8), (2, 17, 2, 3, 2)])
def test_pyramid_with_draft_trees_is_exact(arch, seed, max_new, l_d, l_q, branches, llama_trio, qwen_trio):
    target, qualifier, _ = llama_trio if arch == "llama" else qwen_trio
    prompt = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(seed))
    expected = target.generate(prompt, do_sample=False, max_new_tokens=max_new)
    assistant = PyramidAssistant(qualifier, CorpusNgramDraft(_table_from(qualifier)),
                                 PyramidConfig(draft_tokens=l_d, qualifier_tokens=l_q, draft_branches=branches))
    got = target.generate(prompt, assistant_model=assistant, do_sample=False, max_new_tokens=max_new)
    assert torch.equal(got, expected)
    stats = assistant.stats
    assert stats.tree_rounds > 0 and stats.tree_nodes > stats.tree_rounds  # trees were really checked
    assert 0 < stats.draft_accepted


def test_trees_win_rounds_a_single_draft_loses(llama_trio):
    target, qualifier, _ = llama_trio
    table = _table_from(qualifier)
    prompt = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(5))
    totals = {}
    for branches in (1, 6):
        assistant = PyramidAssistant(qualifier, CorpusNgramDraft(table),
                                     PyramidConfig(draft_tokens=4, qualifier_tokens=8, draft_branches=branches))
        target.generate(prompt, assistant_model=assistant, do_sample=False, max_new_tokens=60)
        totals[branches] = assistant.stats
    assert totals[1].tree_rounds == 0
    assert totals[6].tree_other_branch_won > 0  # another branch beat the first guess at least once
    assert totals[6].mean_tokens_per_qualifier_call >= totals[1].mean_tokens_per_qualifier_call


def test_draft_branches_is_validated():
    with pytest.raises(ValueError, match="draft_branches"):
        PyramidConfig(draft_branches=0)


def _walk_samples(tree, probs_by_node, rule, draws=20000, tau=0.0):
    torch.manual_seed(7)
    firsts, seconds = [], []
    for _ in range(draws):
        path, token, rows = sample_tree(tree, lambda node: probs_by_node[node], CHILD_RULES[rule], tau=tau,
                                        divergence="js")
        emitted = [tree.ids[i] for i in path] + [int(token)]
        assert rows.shape[0] == len(emitted)
        firsts.append(emitted[0])
        if path and tree.ids[path[0]] == 2:  # descended into the child 2 (node 0): what came after it
            seconds.append(emitted[1])
    return torch.tensor(firsts), torch.tensor(seconds)


def _chi2_p(samples, probs):
    observed = torch.bincount(samples, minlength=probs.shape[0]).double()
    keep = probs > 0
    assert observed[~keep].sum() == 0, "a token of probability 0 was emitted"
    return chisquare(observed[keep].numpy(), (probs[keep] / probs[keep].sum() * samples.shape[0]).numpy()).pvalue


# children of the root: 2, 3, 4 (three branches); after 2 the tree proposes 5 and 1
TREE = DraftTree.from_branches([[2, 5], [3], [4, 0], [2, 1]])
NODE_PROBS = {-1: torch.tensor([0.05, 0.1, 0.3, 0.25, 0.0, 0.3], dtype=torch.float64),
              0: torch.tensor([0.2, 0.1, 0.1, 0.1, 0.1, 0.4], dtype=torch.float64)}
NODE_PROBS.update({n: torch.full((6,), 1 / 6, dtype=torch.float64) for n in range(1, len(TREE))})


@pytest.mark.parametrize("rule", ["exact", "assisted"])
def test_tree_sampling_emits_the_verifiers_distribution(rule):
    firsts, seconds = _walk_samples(TREE, NODE_PROBS, rule)
    assert _chi2_p(firsts, NODE_PROBS[-1]) > 1e-3
    assert _chi2_p(seconds, NODE_PROBS[0]) > 1e-3  # after descending into 2: the distribution after node 0
    assert seconds.shape[0] > 0.25 * firsts.shape[0]


def test_tree_sampling_check_catches_a_planted_bug(monkeypatch):
    """Accept each child with the verifier's own probability instead of the residual's: over-emits children."""
    def buggy(child_ids, verifier_probs, *, tau=0.0, divergence="js"):
        for j, token in enumerate(child_ids.tolist()):
            if float(torch.rand(())) < verifier_probs[token]:
                return j, child_ids[j]
        return None, torch.multinomial(verifier_probs, 1)[0]

    monkeypatch.setitem(CHILD_RULES, "exact", buggy)
    firsts, _ = _walk_samples(TREE, NODE_PROBS, "exact", draws=5000)
    assert _chi2_p(firsts, NODE_PROBS[-1]) < 1e-3


def test_fuzzy_children_take_the_first_close_child():
    probs = torch.tensor([0.02, 0.9, 0.08])
    assert CHILD_RULES["fuzzy"](torch.tensor([2, 1]), probs, tau=0.2)[0] == 1  # JS(p, point mass on 1) ~0.05
    j, token = CHILD_RULES["fuzzy"](torch.tensor([2, 0]), probs, tau=0.2)
    assert j is None and 0 <= int(token) < 3
