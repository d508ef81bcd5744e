"""eval-acceptance for a `FeatureDraft`: the inner stage walked along the qualifier's greedy path.

A model draft's distribution at a position does not depend on where a verification block starts, so
`pyramid_hf.eval_acceptance` scores every position once and simulates blocks afterwards. A feature draft's does:
the first token of a block reads the qualifier's real hidden states, later ones its own predictions. This walk
runs the draft exactly as the pyramid's inner stage does under greedy verification (a block of up to ``l`` drafts,
cut at the first disagreement, the qualifier's own token after it) and reports the same numbers.
"""

from __future__ import annotations

import statistics
import time

import torch

from .acceptance import DIVERGENCES, tv_distance
from .feature_draft import FeatureDraftLevel
from .stats import PyramidStats


class _PathStates:
    """Stands in for the qualifier level: its real hidden states for the first ``available`` path positions."""

    def __init__(self, model, hidden: torch.Tensor):
        self.model = model
        self.hidden = hidden
        self.available = 0

    def hidden_for(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.hidden[:, : min(self.available, input_ids.shape[1])]


@torch.no_grad()
def walk(draft, teacher, path_ids: torch.Tensor, start: int, draft_tokens: int, divergence: str) -> dict:
    """Blocks along ``path_ids`` (1, L), a greedy continuation (the teacher's, or the target's that the pyramid
    decodes) of a prompt of ``start`` tokens; a draft is kept when its argmax is the teacher's."""
    device = next(teacher.parameters()).device
    out = teacher(input_ids=path_ids.to(device), output_hidden_states=True)
    teacher_probs = out.logits[0].float().softmax(-1).cpu()  # row p predicts position p + 1
    states = _PathStates(teacher, draft.select_features(out.hidden_states))
    level = FeatureDraftLevel(draft, states, PyramidStats())
    length = path_ids.shape[1]
    emitted, reached, kept = [], [0] * draft_tokens, [0] * draft_tokens
    divs, tvs, jss, seconds = [], [], [], []
    t = start + 1  # the qualifier's prefill wrote position `start` itself
    while t < length:
        states.available = t - 1  # it has read everything but the token it wrote last
        n = 0
        while n < draft_tokens and t + n < length:
            began = time.perf_counter()
            draft_probs = level.next_token_logits(path_ids[:, : t + n]).softmax(-1).cpu()  # (1, V)
            seconds.append(time.perf_counter() - began)
            teacher_row = teacher_probs[t + n - 1 : t + n]
            divs.append(float(DIVERGENCES[divergence](teacher_row, draft_probs)))
            tvs.append(float(tv_distance(teacher_row, draft_probs)))
            jss.append(float(DIVERGENCES["js"](teacher_row, draft_probs)))
            reached[n] += 1
            if int(draft_probs.argmax()) != int(teacher_row.argmax()):  # the path's token, on the teacher's path
                break
            kept[n] += 1
            n += 1
        emitted.append(n + 1)
        t += n + 1
    return {"emitted": emitted, "reached": reached, "kept": kept, "div": divs, "tv": tvs, "js": jss,
            "seconds": seconds}


def summarize_walks(walks: list[dict], draft_tokens: int, taus: list[float]) -> dict:
    """The report's numbers (`pyramid_hf.eval_acceptance.summarize_pair`'s keys) from walked blocks."""
    def pool(key):
        return [x for w in walks for x in w[key]]

    reached = [sum(w["reached"][j] for w in walks) for j in range(draft_tokens)]
    kept = [sum(w["kept"][j] for w in walks) for j in range(draft_tokens)]
    emitted, tv, js, divs, seconds = pool("emitted"), pool("tv"), pool("js"), pool("div"), pool("seconds")
    return {
        "positions": sum(reached),
        "mean_accepted_tokens": statistics.fmean(emitted) if emitted else None,
        "acceptance_exact_greedy": sum(kept) / sum(reached) if sum(reached) else None,
        "acceptance_exact_sampling": 1.0 - statistics.fmean(tv) if tv else None,
        "mean_accepted_tokens_sampling": None,  # a walk follows greedy verification only
        "acceptance_by_position": [k / r if r else None for k, r in zip(kept, reached, strict=True)],
        "fuzzy": [{"tau": tau, "acceptance": statistics.fmean(d <= tau for d in divs) if divs else None,
                   "mean_accepted_tokens": None} for tau in taus],
        "mean_tv": statistics.fmean(tv) if tv else None,
        "mean_js": statistics.fmean(js) if js else None,
        "student_ms_per_token": 1000 * statistics.median(seconds) if seconds else None,
        "scored_on": "positions the draft reached in walked blocks (block-position dependent)",
    }
