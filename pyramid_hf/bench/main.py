"""`pyramid-sd bench`: every method on the same HumanEval prompts, interleaved, with a JSON/Markdown/PNG report."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..decoding_args import DecodingArgs
from .methods import ALL_METHODS, default_grid
from .runner import GenerationSettings, Prompt, Runner
from .summary import analytic_speedup, summarize

logger = logging.getLogger("pyramid_hf")


def _ints(text: str, name: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"--{name} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"--{name} needs positive integers, got {text!r}")
    return values


def _sd_settings(text: str) -> tuple:
    """k or k:confidence items: a draft length, optionally with Transformers' assistant_confidence_threshold."""
    settings = []
    for item in (i for i in text.split(",") if i.strip()):
        k, _, confidence = item.partition(":")
        try:
            setting = (int(k), float(confidence or 0.0))
        except ValueError:
            setting = (0, 0.0)
        if setting[0] < 1 or not 0.0 <= setting[1] < 1.0:
            raise ValueError(f"--sd_tokens items must look like 4 or 8:0.4 (length >= 1, confidence in [0, 1)), "
                             f"got {item!r}")
        settings.append(setting if setting[1] else setting[0])
    if not settings:
        raise ValueError("--sd_tokens is empty")
    return tuple(settings)


def _pairs(text: str, name: str, cast) -> tuple[tuple, ...]:
    try:
        pairs = tuple(tuple(cast(v) for v in item.split(":")) for item in text.split(",") if item.strip())
    except ValueError:
        raise ValueError(f"--{name} must look like a:b,c:d, got {text!r}") from None
    if not pairs or any(len(p) != 2 for p in pairs):
        raise ValueError(f"--{name} must look like a:b,c:d, got {text!r}")
    return pairs


def _psd_settings(text: str) -> tuple[tuple, ...]:
    """l_D:l_Q[:branches[:block_confidence[:draft_confidence]]] items, comma-separated."""
    settings = []
    for item in (i for i in text.split(",") if i.strip()):
        fields = item.split(":")
        try:
            setting = tuple(int(v) for v in fields[:3]) + tuple(float(v) for v in fields[3:])
        except ValueError:
            setting = ()
        if not 2 <= len(setting) <= 5 or len(fields) > 5:
            raise ValueError(f"--psd_grid items must look like l_D:l_Q, l_D:l_Q:branches, "
                             f"l_D:l_Q:branches:block_confidence or l_D:l_Q:branches:block_confidence:draft_confidence,"
                             f" got {item!r}")
        settings.append(setting)
    if not settings:
        raise ValueError("--psd_grid is empty")
    return tuple(settings)


@dataclass
class BenchArgs(DecodingArgs):
    out: str = field(metadata={"help": "output folder for results.json, results.md and speed_quality.png"})
    preset: str = field(default="qwen-coder-cpu", metadata={"help": "a named trio (see `pyramid-sd models list`)"})
    dataset: str = field(default="humaneval", metadata={"help": "prompt set (humaneval)"})
    split: str = field(default="test", metadata={"help": "humaneval tasks to report on: dev (0-81), test (82-163), all"})
    limit: int | None = field(default=10, metadata={"help": "first N prompts of the split"})
    tune_limit: int = field(default=2, metadata={"help": "dev prompts for the draft-length sweep (0: no sweep)"})
    methods: str = field(default=",".join(ALL_METHODS), metadata={"help": "comma-separated methods to run"})
    max_new_tokens: int = field(default=128, metadata={"help": "tokens per completion"})
    seed: int = field(default=0, metadata={"help": "seed (per prompt: seed + task index)"})
    stop_strings: bool = field(default=True, metadata={"help": "stop at HumanEval's end-of-function markers"})
    sd_tokens: str = field(default="3,5,8,8:0.4", metadata={
        "help": "draft lengths swept for two-model SD; k:c also cuts a draft at a token the assistant gives "
                "probability < c (Transformers' assistant_confidence_threshold)"})
    lookup_tokens: str = field(default="4,10", metadata={"help": "draft lengths swept for prompt lookup"})
    psd_grid: str | None = field(default=None, metadata={
        "help": "settings swept for psd and psd_a: l_D:l_Q, or l_D:l_Q:branches (draft trees), or "
                "l_D:l_Q:branches:block_confidence (adaptive l_Q), or "
                "l_D:l_Q:branches:block_confidence:draft_confidence (a model draft cut where unsure); default: the "
                "preset's"})
    tau_grid: str = field(default="0.1:0.05,0.2:0.1,0.3:0.2", metadata={"help": "tau_T:tau_Q pairs for psd_f"})
    check_timeout_s: float = field(default=10.0, metadata={"help": "time limit of each unit-test run"})
    progress: bool = field(default=True, metadata={"help": "show progress bars"})

    def __post_init__(self):
        super().__post_init__()
        unknown = sorted(set(self.method_list) - set(ALL_METHODS))
        if unknown:
            raise ValueError(f"unknown methods {unknown}; choose from {list(ALL_METHODS)}")
        if "ar" not in self.method_list:
            raise ValueError("--methods must include ar: every speedup is measured against it")
        if self.dataset != "humaneval":
            raise ValueError(f"unknown dataset {self.dataset!r}; available: humaneval")
        if self.max_new_tokens < 1 or self.tune_limit < 0 or (self.limit is not None and self.limit < 1):
            raise ValueError("--max_new_tokens and --limit must be positive, --tune_limit non-negative")
        self.sd_token_grid = _sd_settings(self.sd_tokens)
        self.lookup_token_grid = _ints(self.lookup_tokens, "lookup_tokens")
        self.psd_pairs = _psd_settings(self.psd_grid) if self.psd_grid else None
        self.tau_pairs = _pairs(self.tau_grid, "tau_grid", float)

    @property
    def method_list(self) -> list[str]:
        return [m.strip() for m in self.methods.split(",") if m.strip()]


def make_prompts(tasks, tokenizer) -> list[Prompt]:
    return [Prompt(t.index, t.prompt, tokenizer(t.prompt, return_tensors="pt").input_ids, t) for t in tasks]


def bench_trio(trio, args: BenchArgs, knobs: dict, test_tasks, dev_tasks) -> tuple[list[dict], dict]:
    """Tune on ``dev_tasks``, run on ``test_tasks``; returns the method summaries and the run config."""
    from .humaneval import STOP_STRINGS, check_completion, truncate_completion

    settings = GenerationSettings(args.max_new_tokens, args.do_sample, args.temperature, args.top_p, args.top_k,
                                  tuple(STOP_STRINGS) if args.stop_strings else (), args.seed)
    runner = Runner(trio, settings, progress=args.progress)
    grid = default_grid(trio, knobs, args.sd_token_grid, args.lookup_token_grid, args.psd_pairs, args.tau_pairs)
    grid = {family: ms for family, ms in grid.items() if family in args.method_list}
    test_prompts = make_prompts(test_tasks, trio.tokenizer)
    dev_prompts = make_prompts(dev_tasks, trio.tokenizer)
    all_candidates = [m for ms in grid.values() for m in ms]
    runner.warm_up(all_candidates, (dev_prompts or test_prompts)[0])
    methods = runner.tune(grid, dev_prompts)
    runs = runner.run(methods, test_prompts)
    for method_runs in runs.values():
        for run in method_runs:
            task = next(p.task for p in test_prompts if p.index == run.prompt_index)
            run.check = check_completion(task, truncate_completion(run.text), timeout_s=args.check_timeout_s)
    greedy = not args.do_sample
    ar_method = next(m for m in methods if m.method == "ar")
    summaries = [summarize(m, runs[m.label], runs[ar_method.label], greedy) for m in methods]
    ar_summary = summaries[methods.index(ar_method)]
    for s in summaries:
        s["analytic_speedup"] = analytic_speedup(s, ar_summary)
    config = {k: v for k, v in asdict(args).items()} | {
        "models": trio.origins, "preset_knobs": knobs, "tuned_on": [t.index for t in dev_tasks],
        "reported_on": [t.index for t in test_tasks], "greedy": greedy,
    }
    return summaries, config


def run_bench(args: BenchArgs, command: str | None = None) -> dict[str, Path]:
    """Run the benchmark; ``command`` (the command line that ran it) is recorded in results.json."""
    import torch

    from ..models import get_preset
    from ..trio import load_trio
    from .humaneval import load_tasks
    from .report import fill_relative_speedups, make_records, write_results

    preset = get_preset(args.preset) if args.preset else None
    need_draft = bool({"psd", "psd_a", "psd_f", "sd_draft"} & set(args.method_list))
    trio = load_trio(preset, target=args.target, qualifier=args.qualifier, draft=args.draft,
                     dtype=args.dtype, qualifier_vocab_size=args.qualifier_vocab_size,
                     qualifier_quantization=args.qualifier_quantization, need_draft=need_draft,
                     cpu_linear=args.cpu_linear)
    args.dtype = str(next(trio.target.parameters()).dtype).removeprefix("torch.")  # recorded as resolved
    test_tasks = load_tasks(args.split, args.limit)
    dev_tasks = load_tasks("dev", args.tune_limit) if args.tune_limit else []
    if args.split != "test" and dev_tasks:
        logger.warning("reporting on split %r, which overlaps the dev tasks used for tuning", args.split)
    knobs = dict(preset.knobs) if preset else {}
    summaries, config = bench_trio(trio, args, knobs, test_tasks, dev_tasks)
    config["torch_threads"] = torch.get_num_threads()
    config["command"] = command
    records = make_records(summaries)
    fill_relative_speedups(records)
    return write_results(Path(args.out), config, records)
