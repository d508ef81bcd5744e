"""Acceptance rules and divergences: short pure tensor functions in one registry.

Every rule has the same signature and answers one question for one verification pass:
given ``k`` proposed tokens, how many does the verifier keep, and which token comes next?

    rule(candidate_ids, proposer_probs, verifier_probs, *, do_sample, tau, divergence)
        candidate_ids   (k,)       proposed token ids
        proposer_probs  (k, V)     processed distributions the proposals were drawn from,
                                   or None for a proposer without logits (n-gram lookup):
                                   it is then treated as a point mass on each proposal
        verifier_probs  (k + 1, V) verifier's processed distributions; row i predicts
                                   position i, row k is the bonus position
        -> (n_accepted: int, next_token: 0-d LongTensor)

All randomness comes from torch's global generator, so ``torch.manual_seed`` makes a run
repeatable exactly as it does for plain ``generate()``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

# ---------------------------------------------------------------------------- divergences
# Each takes p (verifier) and q (proposer), both (..., V), and returns (...,) in nats.


def _xlogy_ratio(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    # sum_v p log(p / q), with 0 log 0 = 0 and p > 0, q = 0 -> inf
    return (torch.xlogy(p, p) - torch.xlogy(p, q)).sum(-1)


def kl_divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) in nats, in [0, inf]."""
    return _xlogy_ratio(p, q).clamp(min=0.0)


def js_divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence in nats, in [0, ln 2]."""
    m = 0.5 * (p + q)
    return (0.5 * _xlogy_ratio(p, m) + 0.5 * _xlogy_ratio(q, m)).clamp(0.0, math.log(2.0))


def tv_distance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Total variation distance, in [0, 1]. Acceptance of exact SD is 1 - E[TV]."""
    return (0.5 * (p - q).abs().sum(-1)).clamp(0.0, 1.0)


DIVERGENCES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "js": js_divergence,
    "kl": kl_divergence,
    "tv": tv_distance,
}

# largest meaningful tau per divergence (the divergence's upper bound)
DIVERGENCE_RANGES: dict[str, tuple[float, float]] = {
    "js": (0.0, math.log(2.0)),
    "kl": (0.0, math.inf),
    "tv": (0.0, 1.0),
}


# ---------------------------------------------------------------------------- helpers


def _sample(probs: torch.Tensor) -> torch.Tensor:
    # probs (V,) -> 0-d token id
    return torch.multinomial(probs, num_samples=1).squeeze(0)


def _point_masses(candidate_ids: torch.Tensor, vocab_size: int, like: torch.Tensor) -> torch.Tensor:
    # (k,) -> (k, V) one-hot rows: the distribution of a deterministic proposer
    q = torch.zeros(candidate_ids.shape[0], vocab_size, dtype=like.dtype, device=like.device)
    return q.scatter_(1, candidate_ids[:, None], 1.0)


def _first_false(accepted: torch.Tensor) -> int:
    # accepted (k,) bool -> length of the all-True prefix
    return int(accepted.to(torch.int64).cumprod(0).sum().item())


def _pick(probs_row: torch.Tensor, do_sample: bool) -> torch.Tensor:
    return _sample(probs_row) if do_sample else probs_row.argmax(-1)


# ---------------------------------------------------------------------------- rules


def exact_rule(candidate_ids, proposer_probs, verifier_probs, *, do_sample, tau=0.0, divergence="js"):
    """Lossless: greedy match, or speculative sampling with residual resampling."""
    k = candidate_ids.shape[0]
    if not do_sample:
        verifier_ids = verifier_probs.argmax(-1)  # (k + 1,)
        n = _first_false(candidate_ids == verifier_ids[:k])
        return n, verifier_ids[n]
    if proposer_probs is None:
        proposer_probs = _point_masses(candidate_ids, verifier_probs.shape[-1], verifier_probs)
    idx = torch.arange(k, device=candidate_ids.device)
    p_x = verifier_probs[idx, candidate_ids]  # (k,)
    q_x = proposer_probs[idx, candidate_ids]  # (k,)
    u = torch.rand(k, device=verifier_probs.device, dtype=verifier_probs.dtype)
    n = _first_false(u * q_x <= p_x)  # accept with prob min(1, p/q); p >= q: always accept
    if n == k:  # every proposal kept: bonus token from the verifier
        return n, _sample(verifier_probs[k])
    residual = (verifier_probs[n] - proposer_probs[n]).clamp(min=0.0)  # norm(max(0, p - q))
    if residual.sum() <= 0:  # p == q everywhere; unreachable for a true rejection, guards rounding
        residual = verifier_probs[n]
    return n, _sample(residual / residual.sum())


def assisted_rule(candidate_ids, proposer_probs, verifier_probs, *, do_sample, tau=0.0, divergence="js"):
    """Strict match (PSD_A inner stage): keep proposals equal to the verifier's own picks.

    The verifier picks (argmax, or a sample) at every position; the prefix where they equal the
    proposals is kept and the verifier's own pick follows. Emitted tokens are the verifier's.
    """
    k = candidate_ids.shape[0]
    if do_sample:
        verifier_ids = torch.multinomial(verifier_probs, num_samples=1).squeeze(1)  # (k + 1,)
    else:
        verifier_ids = verifier_probs.argmax(-1)
    n = _first_false(candidate_ids == verifier_ids[:k])
    return n, verifier_ids[n]


def fuzzy_rule(candidate_ids, proposer_probs, verifier_probs, *, do_sample, tau, divergence="js"):
    """Fuzzy SD: keep position t iff Div(P_verifier, P_proposer) <= tau; NOT lossless for tau > 0.

    On the first rejection the verifier's own distribution gives the next token.
    """
    k = candidate_ids.shape[0]
    if proposer_probs is None:
        proposer_probs = _point_masses(candidate_ids, verifier_probs.shape[-1], verifier_probs)
    div = DIVERGENCES[divergence](verifier_probs[:k], proposer_probs)  # (k,)
    n = _first_false(div <= tau)
    return n, _pick(verifier_probs[n], do_sample)


# ---------------------------------------------------------------------------- tree rules (sampling)
# At one node of a draft tree (`pyramid_hf.tree`): which child, if any, to descend into, and the token emitted here.
#     child_rule(child_ids, verifier_probs, *, tau, divergence) -> (child index or None, token: 0-d LongTensor)
#         child_ids (m,) distinct tokens the draft proposed after this node, in proposal order (point masses)
#         verifier_probs (V,) the verifier's processed distribution at this node
# Each emits a token distributed exactly as verifier_probs (exact, assisted); fuzzy, as in the chain rule, does not.


def exact_children(child_ids, verifier_probs, *, tau=0.0, divergence="js"):
    """Recursive rejection (SpecInfer-style) for point-mass proposals: accept child c with the probability the
    residual gives it; on rejection remove c from the residual and try the next; none left: sample the residual."""
    residual = verifier_probs.clone()
    for j, token in enumerate(child_ids.tolist()):
        total = residual.sum()
        if total <= 0:
            break
        if float(torch.rand((), device=residual.device, dtype=residual.dtype)) * total < residual[token]:
            return j, child_ids[j]
        residual[token] = 0.0
    if residual.sum() <= 0:  # rounding only: every remaining token was proposed and rejected
        residual = verifier_probs
    return None, _sample(residual / residual.sum())


def assisted_children(child_ids, verifier_probs, *, tau=0.0, divergence="js"):
    """Strict match: the verifier samples its own token; descend into the child that equals it, if any."""
    token = _sample(verifier_probs)
    hits = (child_ids == token).nonzero()
    return (int(hits[0, 0]) if hits.numel() else None), token


def fuzzy_children(child_ids, verifier_probs, *, tau, divergence="js"):
    """Fuzzy: the first child whose point mass lies within tau of the verifier's distribution; else a sample."""
    if child_ids.numel():
        points = _point_masses(child_ids, verifier_probs.shape[-1], verifier_probs)
        close = (DIVERGENCES[divergence](verifier_probs[None], points) <= tau).nonzero()
        if close.numel():
            j = int(close[0, 0])
            return j, child_ids[j]
    return None, _sample(verifier_probs)


CHILD_RULES = {"exact": exact_children, "assisted": assisted_children, "fuzzy": fuzzy_children}


RULES = {
    "exact": exact_rule,
    "assisted": assisted_rule,
    "fuzzy": fuzzy_rule,
}
LOSSLESS_RULES = frozenset({"exact", "assisted"})
TARGET_RULES = frozenset({"exact", "fuzzy"})


def get_rule(name: str):
    try:
        return RULES[name]
    except KeyError:
        raise ValueError(f"unknown acceptance rule {name!r}; choose one of {sorted(RULES)}") from None
