"""Turns the runs of one method into the numbers a benchmark reports."""

from __future__ import annotations

import statistics

from .methods import Method
from .runner import RunResult


def first_difference(ids: list, reference: list) -> int | None:
    """Position of the first token where ``ids`` and ``reference`` differ (None when identical)."""
    for i, (a, b) in enumerate(zip(ids, reference, strict=False)):
        if a != b:
            return i
    return None if len(ids) == len(reference) else min(len(ids), len(reference))


def _sum_dicts(dicts: list[dict]) -> dict:
    out: dict = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def acceptance(method: Method, runs: list[RunResult]) -> dict:
    """Share of proposed tokens the next level kept, per stage (None where the stage is absent or unobserved).

    Pyramid methods count exactly. For Transformers' two-model SD every assistant forward proposes one token,
    so proposals = assistant forwards; prompt lookup's proposal count is not observable from outside.
    """
    stages = {"draft->qualifier": None, "qualifier->target": None, "draft->target": None}
    if method.method.startswith("psd"):
        total = _sum_dicts([{k: r.pyramid_stats[k] for k in ("draft_proposed", "draft_accepted",
                                                              "qualifier_proposed", "qualifier_accepted")}
                            for r in runs])
        if total["draft_proposed"]:
            stages["draft->qualifier"] = total["draft_accepted"] / total["draft_proposed"]
        if total["qualifier_proposed"]:
            stages["qualifier->target"] = total["qualifier_accepted"] / total["qualifier_proposed"]
        return stages
    if method.method in ("sd_qualifier", "sd_draft"):
        role = "qualifier" if method.method == "sd_qualifier" else "draft"
        proposed = sum(r.forward_calls[role] for r in runs)
        accepted = sum(r.generated_tokens - r.forward_calls["target"] for r in runs)
        key = "qualifier->target" if role == "qualifier" else "draft->target"
        stages[key] = max(0, accepted) / proposed if proposed else None
    return stages


def summarize(method: Method, runs: list[RunResult], ar_runs: list[RunResult] | None, greedy: bool) -> dict:
    """Aggregate numbers of one method (speedups relative to other methods are filled in later)."""
    new_tokens = sum(r.new_tokens for r in runs)
    generated_tokens = sum(r.generated_tokens for r in runs)  # incl. any block past a stop string
    wall = sum(r.wall_s for r in runs)
    calls = _sum_dicts([r.forward_calls for r in runs])
    seconds = _sum_dicts([r.forward_time_s for r in runs])
    model_time = sum(seconds.values())
    checked = [r.check for r in runs if r.check is not None]
    identical, first_diffs = None, []
    if greedy and method.lossless and ar_runs is not None and method.method != "ar":
        reference = {r.prompt_index: r.new_ids for r in ar_runs}
        first_diffs = [first_difference(r.new_ids, reference[r.prompt_index]) for r in runs]
        identical = sum(d is None for d in first_diffs) / len(runs) if runs else None
    return {
        "method": method.method,
        "label": method.label,
        "knobs": method.knob_dict,
        "n_prompts": len(runs),
        "new_tokens": new_tokens,
        "generated_tokens": generated_tokens,
        "wall_s": wall,
        "tokens_per_s": statistics.median(r.tokens_per_s for r in runs) if runs else 0.0,
        "decode_tokens_per_s": statistics.median(r.decode_tokens_per_s for r in runs) if runs else 0.0,
        "prefill_s": sum(r.prefill_s for r in runs),
        "acceptance": acceptance(method, runs),
        "mean_tokens_per_target_call": generated_tokens / calls["target"] if calls.get("target") else 0.0,
        "forward_calls": calls,
        "forward_time_s": seconds,
        "overhead_share": max(0.0, wall - model_time) / wall if wall > 0 else 0.0,
        "identical_to_ar": identical,
        "first_diff_positions": first_diffs,
        "pass_at_1": sum(c.passed for c in checked) / len(checked) if checked else None,
        "per_prompt": [
            {"task": r.prompt_index, "new_tokens": r.new_tokens, "generated_tokens": r.generated_tokens, "wall_s": r.wall_s, "tokens_per_s": r.tokens_per_s,
             "prefill_s": r.prefill_s, "decode_tokens_per_s": r.decode_tokens_per_s,
             "target_calls": r.forward_calls.get("target", 0),
             "passed": None if r.check is None else r.check.passed}
            for r in runs
        ],
    }


def analytic_speedup(summary: dict, ar_summary: dict) -> float | None:
    """Speedup over AR predicted from measured per-model costs and the measured tokens per target call.

    ``E * t_T / (t_T' + n_Q t_Q + n_D t_D)`` with E = tokens per target call, t_T = AR's target time per
    token, and per target call: the target's verification forward t_T' and the n_Q qualifier and n_D draft
    forwards at their measured mean costs. It is the speedup with zero framework overhead; the gap to the
    measured speedup is the loop's own cost.
    """
    ar_tokens = ar_summary["new_tokens"]
    target_calls = summary["forward_calls"].get("target", 0)
    if not ar_tokens or not target_calls:
        return None
    ar_target_s_per_token = ar_summary["forward_time_s"]["target"] / ar_tokens
    model_s_per_call = sum(summary["forward_time_s"].values()) / target_calls
    return summary["mean_tokens_per_target_call"] * ar_target_s_per_token / model_s_per_call
