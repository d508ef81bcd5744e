"""Unit tests of the rules and divergences on hand-made distributions."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pyramid_hf.acceptance import DIVERGENCES, RULES, js_divergence, kl_divergence, tv_distance

P = torch.tensor([0.5, 0.5, 0.0])
Q = torch.tensor([0.0, 0.5, 0.5])


def test_divergences_on_hand_made_distributions():
    assert tv_distance(P, Q).item() == pytest.approx(0.5)
    # JS: m = (.25, .5, .25); each side 0.5 log 2 -> 0.5 ln 2 overall
    assert js_divergence(P, Q).item() == pytest.approx(0.5 * math.log(2))
    assert kl_divergence(P, Q).item() == math.inf  # p > 0 where q = 0
    a, b = torch.tensor([0.75, 0.25]), torch.tensor([0.5, 0.5])
    assert kl_divergence(a, b).item() == pytest.approx(0.75 * math.log(1.5) + 0.25 * math.log(0.5))
    disjoint = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    assert js_divergence(*disjoint).item() == pytest.approx(math.log(2))
    assert tv_distance(*disjoint).item() == pytest.approx(1.0)
    for div in DIVERGENCES.values():
        assert div(a, a).item() == 0.0


def _fuzzy(tau, cand, proposer, verifier, divergence="js"):
    return RULES["fuzzy"](cand, proposer, verifier, do_sample=False, tau=tau, divergence=divergence)


def test_fuzzy_tau_zero_accepts_only_identical():
    verifier = torch.tensor([[0.6, 0.4], [0.3, 0.7], [0.5, 0.5]])
    same = verifier[:2].clone()
    n, _ = _fuzzy(0.0, torch.tensor([0, 1]), same, verifier)
    assert n == 2
    nudged = same.clone()
    nudged[1] = torch.tensor([0.31, 0.69])
    n, nxt = _fuzzy(0.0, torch.tensor([0, 1]), nudged, verifier)
    assert n == 1 and int(nxt) == 1  # rejected at position 1: the verifier's argmax there


def _dist(values):
    t = torch.tensor(values, dtype=torch.float64) + 1e-3
    return t / t.sum()


dists = st.lists(st.floats(0, 1), min_size=4, max_size=4).map(_dist)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(dists, dists), min_size=1, max_size=5), st.floats(0, 0.69), st.floats(0, 0.69),
       st.sampled_from(sorted(DIVERGENCES)))
def test_larger_tau_never_accepts_fewer(rows, tau_a, tau_b, divergence):
    lo, hi = sorted((tau_a, tau_b))
    proposer = torch.stack([r[0] for r in rows])
    verifier = torch.cat([torch.stack([r[1] for r in rows]), _dist([1, 1, 1, 1])[None]])
    cand = proposer.argmax(-1)
    n_lo, _ = _fuzzy(lo, cand, proposer, verifier, divergence)
    n_hi, _ = _fuzzy(hi, cand, proposer, verifier, divergence)
    assert n_hi >= n_lo


def test_exact_greedy_keeps_matching_prefix_and_bonus():
    verifier = torch.eye(4)[[2, 3, 1, 0]]  # argmax 2, 3, 1, then bonus 0
    n, nxt = RULES["exact"](torch.tensor([2, 3, 1]), None, verifier, do_sample=False)
    assert (n, int(nxt)) == (3, 0)
    n, nxt = RULES["exact"](torch.tensor([2, 0, 1]), None, verifier, do_sample=False)
    assert (n, int(nxt)) == (1, 3)


def test_exact_sampling_single_position_is_lossless():
    """One proposal x ~ q, verified against p: the emitted token must be distributed as p."""
    torch.manual_seed(0)
    p = torch.tensor([0.1, 0.6, 0.3])
    q = torch.tensor([0.5, 0.2, 0.3])
    counts = torch.zeros(3)
    trials = 20000
    xs = torch.multinomial(q, trials, replacement=True)
    verifier = torch.stack([p, p])
    for x in xs:
        n, nxt = RULES["exact"](x.view(1), q[None], verifier, do_sample=True)
        counts[int(x) if n == 1 else int(nxt)] += 1
    torch.testing.assert_close(counts / trials, p, atol=0.015, rtol=0)


def test_exact_sampling_without_proposer_probs_never_re_emits_rejected_token():
    torch.manual_seed(0)
    p = torch.tensor([0.2, 0.8])
    for _ in range(200):
        n, nxt = RULES["exact"](torch.tensor([0]), None, torch.stack([p, p]), do_sample=True)
        if n == 0:
            assert int(nxt) == 1  # point-mass residual: p with the rejected token removed
