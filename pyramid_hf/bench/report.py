"""The bench's outputs: ``results.json`` (machine-readable), ``results.md`` (the table), ``speed_quality.png``."""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from .methods import ALL_METHODS, SD_METHODS

STAGES = ("draft->qualifier", "qualifier->target", "draft->target")


@dataclass
class MethodRecord:
    """One method/config of a bench run: every key the issue asks for, plus the raw counts behind them."""

    method: str
    label: str
    knobs: dict
    tokens_per_s: float
    acceptance: dict
    mean_tokens_per_target_call: float
    overhead_share: float
    identical_to_ar: float | None
    pass_at_1: float | None
    speedup_vs_ar: float | None = None
    speedup_vs_best_sd: float | None = None
    analytic_speedup: float | None = None
    decode_tokens_per_s: float | None = None
    decode_speedup_vs_ar: float | None = None
    prefill_s: float = 0.0
    n_prompts: int = 0
    new_tokens: int = 0
    generated_tokens: int = 0
    wall_s: float = 0.0
    forward_calls: dict = field(default_factory=dict)
    forward_time_s: dict = field(default_factory=dict)
    first_diff_positions: list = field(default_factory=list)
    per_prompt: list = field(default_factory=list)

    def __post_init__(self):
        if self.method not in ALL_METHODS:
            raise ValueError(f"unknown method {self.method!r} in a bench record; expected one of {list(ALL_METHODS)}")
        missing = [s for s in STAGES if s not in self.acceptance]
        if missing:
            raise ValueError(f"record {self.label!r}: acceptance lacks stages {missing}")

    @property
    def ms_per_forward(self) -> dict:
        return {role: 1000 * self.forward_time_s[role] / n for role, n in self.forward_calls.items() if n}


# keys every record in results.json must carry (the fields without a default, and the speedups)
_REQUIRED = [f.name for f in fields(MethodRecord) if f.default is MISSING and f.default_factory is MISSING] + [
    "speedup_vs_ar", "speedup_vs_best_sd", "analytic_speedup"]


def make_records(summaries: list[dict]) -> list[MethodRecord]:
    names = {f.name for f in fields(MethodRecord)}
    return [MethodRecord(**{k: v for k, v in s.items() if k in names}) for s in summaries]


def fill_relative_speedups(records: list[MethodRecord]) -> None:
    """Speedups vs AR and vs the fastest two-model SD record (by median tokens/s), in place."""
    ar = next((r for r in records if r.method == "ar"), None)
    if ar is None:
        raise ValueError("a bench report needs an ar record: every speedup is measured against it")
    sd = [r for r in records if r.method in SD_METHODS]
    best_sd = max(sd, key=lambda r: r.tokens_per_s) if sd else None
    for r in records:
        r.speedup_vs_ar = r.tokens_per_s / ar.tokens_per_s if ar.tokens_per_s else None
        r.speedup_vs_best_sd = r.tokens_per_s / best_sd.tokens_per_s if best_sd and best_sd.tokens_per_s else None
        if r.decode_tokens_per_s is not None and ar.decode_tokens_per_s:
            r.decode_speedup_vs_ar = r.decode_tokens_per_s / ar.decode_tokens_per_s


def best_sd_label(records: list[MethodRecord]) -> str | None:
    sd = [r for r in records if r.method in SD_METHODS]
    return max(sd, key=lambda r: r.tokens_per_s).label if sd else None


def _fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:{spec}}{suffix}"


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _identical(record: MethodRecord) -> str:
    if record.identical_to_ar is None:
        return "-"
    diffs = [d for d in record.first_diff_positions if d is not None]
    return _pct(record.identical_to_ar) + (f" (first diff at {min(diffs)})" if diffs else "")


def markdown_table(config: dict, records: list[MethodRecord]) -> str:
    models = config.get("models", {})
    lines = [
        f"# pyramid-sd bench: {config.get('preset') or 'custom trio'} on {config.get('dataset')} "
        f"({config.get('split')}, {len(config.get('reported_on', []))} prompts)",
        "",
        "Models: " + ", ".join(f"{role} = {origin}" for role, origin in models.items()),
        f"Decoding: {'greedy' if config.get('greedy', True) else 'sampling'}, dtype {config.get('dtype')}, "
        f"max_new_tokens {config.get('max_new_tokens')}, torch threads {config.get('torch_threads', '?')}; "
        f"knobs tuned on dev tasks {config.get('tuned_on', [])}. Best two-model SD: {best_sd_label(records) or '-'}.",
        "",
        "| method | knobs | tok/s | x AR | x best SD | analytic x AR | acc D->Q | acc Q->T | acc D->T "
        "| tokens/target call | ms/forward T/Q/D | overhead | decode tok/s (x AR) | identical to AR | pass@1 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        knobs = ", ".join(f"{k}={v}" for k, v in r.knobs.items()) or "-"
        ms = r.ms_per_forward
        costs = "/".join(_fmt(ms.get(role), ".0f") for role in ("target", "qualifier", "draft"))
        lines.append(
            f"| {r.method} | {knobs} | {_fmt(r.tokens_per_s)} | {_fmt(r.speedup_vs_ar)} | "
            f"{_fmt(r.speedup_vs_best_sd)} | {_fmt(r.analytic_speedup)} | {_pct(r.acceptance['draft->qualifier'])} | "
            f"{_pct(r.acceptance['qualifier->target'])} | {_pct(r.acceptance['draft->target'])} | "
            f"{_fmt(r.mean_tokens_per_target_call)} | {costs} | {_pct(r.overhead_share)} | "
            f"{_fmt(r.decode_tokens_per_s)} ({_fmt(r.decode_speedup_vs_ar)}) | {_identical(r)} | "
            f"{_pct(r.pass_at_1)} |")
    lines += ["", "tok/s: median over prompts. x AR / x best SD: ratio of medians, measured interleaved in one "
              "process. analytic: speedup predicted from the measured tokens per target call and per-model forward "
              "costs with zero framework overhead. overhead: wall time outside model forwards. decode tok/s: tokens per "
              "second once each model's first forward (the prompt's prefill) is done. identical to AR: "
              "share of prompts with AR's exact tokens (bf16 can flip near-tie argmaxes; exactness is proven by the "
              "fp32 tests). Completions end at the first stop string anywhere in the new text: two-model SD "
              "stops after the block that holds it, and the tokens past it are cut, not counted (their time is)."]
    return "\n".join(lines) + "\n"


_SHORT_KNOBS = {"num_tokens": "l", "draft_tokens": "lD", "qualifier_tokens": "lQ", "tau_target": "tT",
                "tau_qualifier": "tQ"}


def short_label(record: MethodRecord) -> str:
    """A compact label for plots: ``psd_f lD=2 lQ=4 tT=0.3 tQ=0.2``."""
    order = list(_SHORT_KNOBS)
    names = sorted(record.knobs, key=lambda k: order.index(k) if k in order else len(order))
    return " ".join([record.method] + [f"{_SHORT_KNOBS.get(k, k)}={record.knobs[k]}" for k in names])


def plot_speed_quality(records: list[MethodRecord], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {m: plt.cm.tab10(i) for i, m in enumerate(ALL_METHODS)}
    unmeasured = []
    same_height: dict[float, int] = {}  # points at one pass@1 value get their labels stacked, not overlaid
    for r in records:
        if r.pass_at_1 is None:
            unmeasured.append(r.label)
            continue
        rank = same_height[r.pass_at_1] = same_height.get(r.pass_at_1, -1) + 1
        ax.scatter(r.tokens_per_s, 100 * r.pass_at_1, color=colors[r.method], s=40,
                   label=r.method if r.method not in ax.get_legend_handles_labels()[1] else None)
        ax.annotate(short_label(r), (r.tokens_per_s, 100 * r.pass_at_1), fontsize=7, color=colors[r.method],
                    xytext=(5, 6 - 10 * rank), textcoords="offset points",
                    arrowprops={"arrowstyle": "-", "color": colors[r.method], "lw": 0.5} if rank else None)
    ax.set_xlabel("tokens/s (median over prompts)")
    ax.set_ylabel("pass@1 (%)")
    ax.set_title(title + (f"\n(no pass@1 for: {', '.join(unmeasured)})" if unmeasured else ""), fontsize=9)
    ax.grid(alpha=0.3)
    ax.margins(x=0.25, y=0.15)  # room for the labels inside the axes
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def write_results(out: Path, config: dict, records: list[MethodRecord]) -> dict[str, Path]:
    """Write results.json, results.md and speed_quality.png into ``out``; returns their paths by kind."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "markdown": out / "results.md", "plot": out / "speed_quality.png"}
    payload = {"config": config, "methods": [asdict(r) for r in records]}
    paths["json"].write_text(json.dumps(payload, indent=2, default=str) + "\n")
    paths["markdown"].write_text(markdown_table(config, records))
    title = f"pyramid-sd bench: {config.get('preset') or 'custom trio'}, {config.get('dataset')} {config.get('split')}"
    plot_speed_quality(records, paths["plot"], title)
    return paths


def load_results(path: str | Path) -> tuple[dict, list[MethodRecord]]:
    """Read a results.json back, validating its shape; errors name the file and what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"bench results file not found: {path}")
    try:
        payload = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("config"), dict) \
            or not isinstance(payload.get("methods"), list):
        raise ValueError(f'{path} is not a bench results file: expected {{"config": {{...}}, "methods": [...]}}')
    records = []
    for i, item in enumerate(payload["methods"]):
        missing = [k for k in _REQUIRED if not isinstance(item, dict) or k not in item]
        if missing:
            raise ValueError(f"{path}: methods[{i}] lacks {missing}")
        names = {f.name for f in fields(MethodRecord)}
        try:
            records.append(MethodRecord(**{k: v for k, v in item.items() if k in names}))
        except (TypeError, ValueError) as error:
            raise ValueError(f"{path}: methods[{i}]: {error}") from None
    return payload["config"], records
