"""How well a student (draft or qualifier) agrees with its teacher (qualifier or target), measured offline.

For each held-out prompt the teacher writes its greedy continuation; one forward pass of each model over
prompt + continuation gives both distributions at every position of the teacher's path. Along that path:

- exact acceptance (greedy): the student's argmax equals the teacher's token; simulated verification with
  ``draft_tokens`` = l gives ``mean_accepted_tokens``: tokens emitted per verifier call, the verifier's own
  token included (1.00 = the student never helps), exactly what greedy speculative decoding would see;
- exact acceptance (sampling): 1 - TV(teacher, student), the acceptance probability of speculative sampling;
- fuzzy acceptance: Div(teacher, student) <= tau, for each tau of a grid;
- mean TV and JS divergence, per-position acceptance within a block.

Latencies of one student token, one teacher token and a teacher pass over l + 1 tokens give the break-even
``(l * t_student + t_teacher(l + 1)) / t_teacher(1)``: the student pays off only above it.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .acceptance import DIVERGENCE_RANGES, DIVERGENCES, tv_distance
from .cpu_linear import CPU_LINEAR_HELP, DTYPE_HELP, check_cpu_linear
from .quantize import check_quantization_flag

logger = logging.getLogger("pyramid_hf")

KIND = "pyramid-hf/eval-acceptance"
PAIRS = ("draft:qualifier", "qualifier:target")


@dataclass
class EvalAcceptanceArgs:
    out: str = field(metadata={"help": "output folder for acceptance.json and acceptance.md"})
    preset: str | None = field(default="qwen-coder-cpu", metadata={"help": "a named trio; empty for --student/--teacher"})
    pair: str = field(default="qualifier:target", metadata={"help": f"student:teacher roles of the preset: {PAIRS}"})
    student: str | None = field(default=None, metadata={"help": "student model (Hub id, folder, GGUF); overrides --pair"})
    teacher: str | None = field(default=None, metadata={"help": "teacher model (Hub id, folder, GGUF); overrides --pair"})
    dataset: str = field(default="humaneval", metadata={"help": "prompt set (humaneval)"})
    split: str = field(default="test", metadata={"help": "humaneval tasks: dev (0-81), test (82-163), all"})
    limit: int | None = field(default=10, metadata={"help": "first N prompts of the split"})
    draft_tokens: int = field(default=4, metadata={"help": "l: student tokens per verifier call in the simulation"})
    max_new_tokens: int = field(default=64, metadata={"help": "length of the teacher's continuation per prompt"})
    divergence: str = field(default="js", metadata={"help": "divergence of the fuzzy rule: js, kl or tv"})
    taus: str = field(default="0.05,0.1,0.2,0.3", metadata={"help": "fuzzy thresholds to report, comma-separated"})
    path_model: str | None = field(default=None, metadata={
        "help": "model whose greedy continuation of each prompt is walked (default: the teacher's own); pass the "
                "target to score a draft:qualifier pair on the text it meets inside the pyramid"})
    dtype: str | None = field(default=None, metadata={"help": DTYPE_HELP})
    cpu_linear: str = field(default="auto", metadata={"help": CPU_LINEAR_HELP})
    student_quantization: str | None = field(default=None, metadata={
        "help": "none or int8 (int8 weights for narrow calls, as the pyramid runs its qualifier); default: the "
                "preset's qualifier_quantization when the student is the preset's qualifier, else none"})
    teacher_quantization: str | None = field(default=None, metadata={
        "help": "none or int8, as --student_quantization, for the teacher"})
    paths_file: str | None = field(default=None, metadata={
        "help": "JSONL file of the greedy continuations walked: reused where it holds one by the same writer (model, "
                "dtype, quantization, --max_new_tokens), else generated and appended; the generation is most of an "
                "eval's time, so scoring a run's checkpoints on one file costs it once"})
    latency_repeats: int = field(default=5, metadata={"help": "timed repeats per latency (median); 0 skips timing"})
    progress: bool = field(default=True, metadata={"help": "show a progress bar"})

    def __post_init__(self):
        check_cpu_linear(self.cpu_linear)
        check_quantization_flag("student_quantization", self.student_quantization)
        check_quantization_flag("teacher_quantization", self.teacher_quantization)
        if not (self.student and self.teacher) and self.pair not in PAIRS:
            raise ValueError(f"--pair must be one of {PAIRS}, got {self.pair!r}")
        if bool(self.student) != bool(self.teacher):
            raise ValueError("--student and --teacher go together")
        if not (self.student or self.preset):
            raise ValueError("pass --preset (with --pair) or --student and --teacher")
        if self.draft_tokens < 1 or self.max_new_tokens < 1 or (self.limit is not None and self.limit < 1):
            raise ValueError("--draft_tokens, --max_new_tokens and --limit must be positive")
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"--divergence must be one of {sorted(DIVERGENCES)}, got {self.divergence!r}")
        if self.dataset != "humaneval":
            raise ValueError(f"unknown dataset {self.dataset!r}; available: humaneval")
        try:
            self.tau_list = [float(t) for t in self.taus.split(",") if t.strip()]
        except ValueError:
            raise ValueError(f"--taus must be comma-separated numbers, got {self.taus!r}") from None
        low, high = DIVERGENCE_RANGES[self.divergence]
        bad = [t for t in self.tau_list if not low <= t <= high]
        if bad:
            raise ValueError(f"--taus {bad} outside the range of {self.divergence!r}: [{low}, {high}]")


# ---------------------------------------------------------------------------- pure measurements


def simulate_blocks(accepted: list[bool], draft_tokens: int) -> tuple[list[int], list[int], list[int]]:
    """Walk the teacher's path in verifier calls of ``draft_tokens`` proposals.

    ``accepted[t]``: whether the student's proposal at position t would be kept. Returns the tokens emitted per
    call (kept proposals + the verifier's own token), and per block position j how often it was reached and kept.
    """
    emitted, reached, kept = [], [0] * draft_tokens, [0] * draft_tokens
    t = 0
    while t < len(accepted):
        n = 0
        while n < draft_tokens and t + n < len(accepted):
            reached[n] += 1
            if not accepted[t + n]:
                break
            kept[n] += 1
            n += 1
        emitted.append(n + 1)
        t += n + 1
    return emitted, reached, kept


def expected_tokens_per_call(accept_probs: torch.Tensor, draft_tokens: int) -> float:
    """Mean over start positions of E[tokens per call] = sum_j prod_{i<j} a_i, for per-position acceptance a."""
    n = accept_probs.shape[0]
    if n == 0:
        return 1.0
    totals = []
    for start in range(n):
        window = accept_probs[start : start + draft_tokens]
        totals.append(1.0 + float(torch.cumprod(window, 0).sum()))
    return sum(totals) / n


def pair_measurements(student_probs: torch.Tensor, teacher_probs: torch.Tensor, divergence: str) -> dict:
    """Per-position agreement of (n, V) student and teacher distributions along the teacher's greedy path."""
    teacher_ids = teacher_probs.argmax(-1)
    greedy_ok = (student_probs.argmax(-1) == teacher_ids).tolist()
    div = DIVERGENCES[divergence](teacher_probs, student_probs)
    tv = tv_distance(teacher_probs, student_probs)
    js = DIVERGENCES["js"](teacher_probs, student_probs)
    return {"greedy_ok": greedy_ok, "div": div.tolist(), "tv": tv.tolist(), "js": js.tolist()}


def summarize_pair(per_prompt: list[dict], draft_tokens: int, taus: list[float]) -> dict:
    """Pool per-prompt measurements into the report's numbers."""
    greedy = [ok for m in per_prompt for ok in m["greedy_ok"]]
    emitted, reached, kept = [], [0] * draft_tokens, [0] * draft_tokens
    sampled = []
    fuzzy = {tau: [] for tau in taus}
    for m in per_prompt:
        e, r, k = simulate_blocks(m["greedy_ok"], draft_tokens)
        emitted += e
        reached = [a + b for a, b in zip(reached, r, strict=True)]
        kept = [a + b for a, b in zip(kept, k, strict=True)]
        sampled.append(expected_tokens_per_call(1.0 - torch.tensor(m["tv"]), draft_tokens))
        for tau in taus:
            fuzzy[tau] += simulate_blocks([d <= tau for d in m["div"]], draft_tokens)[0]
    tv = [x for m in per_prompt for x in m["tv"]]
    js = [x for m in per_prompt for x in m["js"]]
    divs = [x for m in per_prompt for x in m["div"]]
    return {
        "positions": len(greedy),
        "mean_accepted_tokens": statistics.fmean(emitted) if emitted else None,
        "acceptance_exact_greedy": statistics.fmean(greedy) if greedy else None,
        "acceptance_exact_sampling": 1.0 - statistics.fmean(tv) if tv else None,
        "mean_accepted_tokens_sampling": statistics.fmean(sampled) if sampled else None,
        "acceptance_by_position": [k / r if r else None for k, r in zip(kept, reached, strict=True)],
        "fuzzy": [{"tau": tau,
                   "acceptance": statistics.fmean(d <= tau for d in divs) if divs else None,
                   "mean_accepted_tokens": statistics.fmean(fuzzy[tau]) if fuzzy[tau] else None}
                  for tau in taus],
        "mean_tv": statistics.fmean(tv) if tv else None,
        "mean_js": statistics.fmean(js) if js else None,
    }


def break_even(latency_ms: dict, draft_tokens: int) -> float | None:
    """Tokens per verifier call above which the student beats the teacher decoding alone."""
    if not latency_ms:
        return None
    cost = draft_tokens * latency_ms["student_1"] + latency_ms[f"teacher_{draft_tokens + 1}"]
    return cost / latency_ms["teacher_1"]


# ---------------------------------------------------------------------------- models


@torch.no_grad()
def _probs_along(model, ids: torch.Tensor, start: int) -> torch.Tensor:
    """(n, V) float32 next-token distributions predicting positions start .. L-1 of ids (1, L)."""
    device = next(model.parameters()).device
    logits = model(input_ids=ids.to(device)).logits[0, start - 1 : -1]
    return logits.float().softmax(-1).cpu()


@torch.no_grad()
def _latency_ms(model, ids: torch.Tensor, n: int, repeats: int) -> float:
    from transformers import DynamicCache

    device = next(model.parameters()).device
    ids = ids.to(device)
    cache = DynamicCache(config=model.config)
    model(input_ids=ids[:, :-n], cache=cache, use_cache=True, logits_to_keep=1)
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        start = time.perf_counter()
        model(input_ids=ids[:, -n:], cache=cache, use_cache=True, logits_to_keep=n)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        cache.crop(-n)
    return statistics.median(times[1:]) * 1000


def measure(student, teacher, prompts: list[torch.Tensor], args: EvalAcceptanceArgs, path_model=None,
            paths=None) -> dict:
    """Everything the report holds, for prompts given as (1, L) id tensors, along ``path_model``'s greedy
    continuations (default: the teacher's), read from ``paths`` (a `GreedyPaths`) where it holds them.
    Acceptance compares the student's argmax with the teacher's.

    A `FeatureDraft` student is walked block by block (`pyramid_hf.feature_eval`): its distribution depends on
    where a block starts."""
    from tqdm.auto import tqdm

    from .feature_draft import FeatureDraft
    from .feature_eval import summarize_walks, walk

    feature = isinstance(student, FeatureDraft)
    per_prompt = []
    for ids in tqdm(prompts, desc="eval-acceptance", disable=not args.progress):
        writer = teacher if path_model is None else path_model
        device = next(writer.parameters()).device

        def generate(ids=ids, writer=writer, device=device):
            return writer.generate(ids.to(device), do_sample=False, max_new_tokens=args.max_new_tokens,
                                   attention_mask=torch.ones_like(ids, device=device)).cpu()

        full = generate() if paths is None else paths.continuation(ids, generate)
        device = next(teacher.parameters()).device
        if full.shape[1] == ids.shape[1]:
            continue
        if feature:
            per_prompt.append(walk(student, teacher, full, ids.shape[1], args.draft_tokens, args.divergence))
            continue
        teacher_probs = _probs_along(teacher, full, ids.shape[1])
        student_probs = _probs_along(student, full, ids.shape[1])
        per_prompt.append(pair_measurements(student_probs, teacher_probs, args.divergence))
    if feature:
        result = summarize_walks(per_prompt, args.draft_tokens, args.tau_list)
    else:
        result = summarize_pair(per_prompt, args.draft_tokens, args.tau_list)
    latency = {}
    if args.latency_repeats and prompts:
        ids = prompts[0] if prompts[0].shape[1] > args.draft_tokens + 2 else torch.arange(1, 64)[None]
        k1 = args.draft_tokens + 1
        student_1 = result.get("student_ms_per_token") if feature else _latency_ms(student, ids, 1,
                                                                                   args.latency_repeats)
        latency = {"student_1": student_1,
                   "teacher_1": _latency_ms(teacher, ids, 1, args.latency_repeats),
                   f"teacher_{k1}": _latency_ms(teacher, ids, k1, args.latency_repeats)}
        if latency["student_1"] is None:
            latency = {}
    result["latency_ms"] = latency
    result["break_even_accepted_tokens"] = break_even(latency, args.draft_tokens)
    if latency and result["mean_accepted_tokens"] is not None:
        result["predicted_speedup_vs_teacher"] = result["mean_accepted_tokens"] / result["break_even_accepted_tokens"]
    return result


# ---------------------------------------------------------------------------- report


def markdown(config: dict, result: dict) -> str:
    def f(x, spec=".2f"):
        return "-" if x is None else format(x, spec)

    lines = [f"# eval-acceptance: {config['student']} -> {config['teacher']}", "",
             f"{config['dataset']} {config['split']}, {config['prompts']} prompts, {result['positions']} positions "
             f"along {'the teacher' if not config.get('path_model') else config['path_model']}'s greedy path; l = {config['draft_tokens']}, dtype {config['dtype']}.", "",
             "| rule | acceptance | mean accepted tokens per verifier call |", "|---|---|---|",
             f"| exact, greedy | {f(result['acceptance_exact_greedy'], '.1%')} | {f(result['mean_accepted_tokens'])} |",
             f"| exact, sampling (1 - TV) | {f(result['acceptance_exact_sampling'], '.1%')} | "
             f"{f(result['mean_accepted_tokens_sampling'])} |"]
    lines += [f"| fuzzy {config['divergence']} <= {row['tau']} | {f(row['acceptance'], '.1%')} | "
              f"{f(row['mean_accepted_tokens'])} |" for row in result["fuzzy"]]
    by_pos = ", ".join(f(a, ".0%") for a in result["acceptance_by_position"])
    lines += ["", f"Per-position acceptance in a block (greedy): {by_pos}. Mean TV {f(result['mean_tv'], '.3f')}, "
              f"mean JS {f(result['mean_js'], '.3f')} nats."]
    if result.get("latency_ms"):
        lat = ", ".join(f"{k} {v:.1f} ms" for k, v in result["latency_ms"].items())
        lines += ["", f"Latency: {lat}. Break-even: {f(result['break_even_accepted_tokens'])} tokens per call "
                  f"(the student helps only above it); predicted speedup over the teacher alone "
                  f"{f(result.get('predicted_speedup_vs_teacher'))}x."]
    return "\n".join(lines) + "\n"


def write_report(out: str | Path, config: dict, result: dict) -> dict[str, Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "acceptance.json", "markdown": out / "acceptance.md"}
    paths["json"].write_text(json.dumps({"kind": KIND, "config": config, "result": result}, indent=2) + "\n")
    paths["markdown"].write_text(markdown(config, result))
    return paths


def load_report(path: str | Path) -> tuple[dict, dict]:
    """(config, result) of an acceptance.json; ValueError naming what is wrong with a malformed one."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"results file {path} does not exist") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(data, dict) or data.get("kind") != KIND:
        raise ValueError(f"{path} is not an eval-acceptance report (expected \"kind\": {KIND!r})")
    for key, sub in (("config", ("student", "teacher", "draft_tokens")), ("result", ("mean_accepted_tokens",))):
        if not isinstance(data.get(key), dict) or any(k not in data[key] for k in sub):
            raise ValueError(f"{path}: {key!r} must be an object with keys {list(sub)}")
    return data["config"], data["result"]


# ---------------------------------------------------------------------------- command


def pair_quantization(args: EvalAcceptanceArgs, roles: dict) -> dict[str, str]:
    """``{"student": mode, "teacher": mode}``: the flags where given, else the preset's ``qualifier_quantization`` for
    the side that is its qualifier (what decoding runs), else "none"."""
    preset_mode = getattr(roles.get("preset"), "qualifier_quantization", "none")
    return {side: getattr(args, f"{side}_quantization") or (preset_mode if roles.get(side) == "qualifier" else "none")
            for side in ("student", "teacher")}


def run_eval_acceptance(args: EvalAcceptanceArgs, command: str | None = None) -> dict[str, Path]:
    """Measure and write OUT/acceptance.json + .md; ``command`` (the command line) is recorded."""
    from .bench.humaneval import load_tasks
    from .models import get_preset, load_model
    from .trio import _check_same_tokenizer, default_dtype, quantize_loaded

    roles = {}
    if args.student:
        student_source, teacher_source = args.student, args.teacher
    else:
        preset = get_preset(args.preset)
        student_role, teacher_role = args.pair.split(":")
        specs = {"draft": preset.draft, "qualifier": preset.qualifier, "target": preset.target}
        if isinstance(specs[student_role], str):
            raise ValueError(f"preset {preset.name!r} has no model {student_role} ({specs[student_role]}); "
                             "pick another --pair or pass --student")
        student_source, teacher_source = specs[student_role].source, specs[teacher_role].source
        roles = {"student": student_role, "teacher": teacher_role, "preset": preset}
    args.dtype = args.dtype or default_dtype()
    student = load_model(student_source, dtype=args.dtype, cpu_linear=args.cpu_linear)
    teacher = load_model(teacher_source, dtype=args.dtype, reduced_vocab=False, cpu_linear=args.cpu_linear)
    quantization = pair_quantization(args, roles)
    for side, loaded in (("student", student), ("teacher", teacher)):
        quantize_loaded(side, loaded, quantization[side])
    logger.info("student: %s; teacher: %s", student.origin, teacher.origin)
    path = None
    if args.path_model:
        path = load_model(args.path_model, dtype=args.dtype, reduced_vocab=False, cpu_linear=args.cpu_linear)
        logger.info("path: greedy continuations of %s", path.origin)
    _check_same_tokenizer(teacher.tokenizer, {"student": student.tokenizer} | ({"path_model": path.tokenizer}
                                                                                if path else {}))
    if hasattr(student.model, "check_qualifier"):  # a feature draft reads the teacher's hidden states
        student.model.check_qualifier(teacher.model)
    tasks = load_tasks(args.split, args.limit)
    prompts = [teacher.tokenizer(t.prompt, return_tensors="pt").input_ids for t in tasks]
    paths = None
    if args.paths_file:
        from .greedy_paths import GreedyPaths

        paths = GreedyPaths(args.paths_file, {"model": args.path_model or teacher_source, "dtype": args.dtype,
                                              "quantization": "none" if path else quantization["teacher"],
                                              "max_new_tokens": args.max_new_tokens})
    result = measure(student.model.eval(), teacher.model.eval(), prompts, args,
                     path_model=path.model.eval() if path else None, paths=paths)
    if paths is not None:
        logger.info("greedy paths: %d read from %s, %d generated and appended", paths.reused, paths.file,
                    paths.written)
    config = asdict(args) | {"student": student_source, "teacher": teacher_source, "prompts": len(prompts),
                             "origins": {"student": student.origin, "teacher": teacher.origin},
                             "torch_threads": torch.get_num_threads(), "command": command}
    return write_report(args.out, config, result)
