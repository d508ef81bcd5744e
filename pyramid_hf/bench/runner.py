"""Runs decoding methods side by side on the same prompts, interleaved, after warm-up.

Each (prompt, method) run is timed as a whole (wall clock) and per model (forward hooks). Methods are
rotated per prompt so that slow drifts of the machine (thermal, other load) spread over all of them.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm
from transformers import StoppingCriteria, StoppingCriteriaList

from .meter import ForwardMeter
from .methods import Method, Trio, method_kwargs

logger = logging.getLogger("pyramid_hf")


@dataclass
class Prompt:
    index: int  # task index in its dataset
    text: str
    input_ids: torch.LongTensor  # (1, L)
    task: object = None  # a humaneval.Task when the prompt has unit tests


@dataclass
class RunResult:
    label: str
    prompt_index: int
    new_ids: list
    text: str
    wall_s: float
    forward_calls: dict
    forward_time_s: dict
    pyramid_stats: dict | None = None
    check: object = None  # humaneval.CheckResult once checked
    prefill_s: float = 0.0  # the models' first forwards (prompt prefill), inside wall_s
    generated_tokens: int | None = None  # what generate() returned, before the cut at a stop string

    def __post_init__(self):
        if self.generated_tokens is None:
            self.generated_tokens = len(self.new_ids)

    @property
    def new_tokens(self) -> int:
        return len(self.new_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second after the prompt's prefill (long prompts on slow hardware are mostly prefill)."""
        decode_s = self.wall_s - self.prefill_s
        return self.new_tokens / decode_s if decode_s > 0 else 0.0


@dataclass
class GenerationSettings:
    """What every method shares: length, sampling and stop strings."""

    max_new_tokens: int = 128
    do_sample: bool = False
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    stop_strings: tuple = ()
    seed: int = 0

    def generate_kwargs(self, tokenizer, prompt_length: int = 0) -> dict:
        kwargs = {"max_new_tokens": self.max_new_tokens, "do_sample": self.do_sample}
        if self.do_sample:
            kwargs.update(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
        if self.stop_strings:
            # as a stopping criterion, not `stop_strings=`: Transformers' assisted generation copies the target's
            # generation config into the assistant's generate(), which then fails for want of a tokenizer
            if tokenizer is None:
                raise ValueError("stop strings need the trio's tokenizer")
            kwargs["stopping_criteria"] = StoppingCriteriaList(
                [StopInNewText(tokenizer, self.stop_strings, prompt_length)])
        if tokenizer is not None and tokenizer.pad_token_id is not None:
            kwargs["pad_token_id"] = tokenizer.pad_token_id
        return kwargs


class StopInNewText(StoppingCriteria):
    """Stops once any stop string occurs ANYWHERE in the text generated after the prompt.

    Transformers' ``StopStringCriteria`` only looks at the end of the sequence, which token-by-token decoding
    always reaches, but two-model SD adds whole blocks and so runs past a stop string inside a block. Looking at
    the whole new text makes every method stop in the round that produced the stop string; the runner then cuts
    the completion after it (``cut_at_stop``), so every method is timed and scored on the same completion.
    """

    def __init__(self, tokenizer, stop_strings, prompt_length: int):
        self.tokenizer, self.stop_strings, self.prompt_length = tokenizer, tuple(stop_strings), prompt_length

    def __call__(self, input_ids, scores, **kwargs):
        done = [has_stop(self.tokenizer, row[self.prompt_length:].tolist(), self.stop_strings) for row in input_ids]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def has_stop(tokenizer, ids: list, stop_strings: tuple) -> bool:
    text = tokenizer.decode(ids, skip_special_tokens=True)
    return any(s in text for s in stop_strings)


def cut_at_stop(tokenizer, ids: list, stop_strings: tuple) -> list:
    """The shortest prefix of ``ids`` whose text contains a stop string (all of ``ids`` when none does).

    Containing a stop string is monotone in the prefix length, so a binary search finds the cut.
    """
    if not stop_strings or not ids or not has_stop(tokenizer, ids, stop_strings):
        return ids
    lo, hi = 1, len(ids)  # the answer lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if has_stop(tokenizer, ids[:mid], stop_strings):
            hi = mid
        else:
            lo = mid + 1
    return ids[:lo]


@dataclass
class Runner:
    trio: Trio
    settings: GenerationSettings = field(default_factory=GenerationSettings)
    progress: bool = True

    def __post_init__(self):
        self.assistants: dict = {}
        self.meter = ForwardMeter(self.trio.roles())

    @torch.no_grad()
    def run_one(self, method: Method, prompt: Prompt, max_new_tokens: int | None = None) -> RunResult:
        input_ids = prompt.input_ids.to(self.trio.target.device)
        kwargs = self.settings.generate_kwargs(self.trio.tokenizer, input_ids.shape[1])
        if max_new_tokens is not None:
            kwargs["max_new_tokens"] = max_new_tokens
        kwargs.update(method_kwargs(method, self.trio, self.assistants))
        torch.manual_seed(self.settings.seed + prompt.index)
        self.meter.reset()
        with self.meter:
            start = time.perf_counter()
            out = self.trio.target.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
            wall = time.perf_counter() - start
        generated_ids = out[0, input_ids.shape[1]:].tolist()
        new_ids = cut_at_stop(self.trio.tokenizer, generated_ids, self.settings.stop_strings)
        calls, seconds = self.meter.snapshot()
        assistant = kwargs.get("assistant_model")
        stats = assistant.stats.to_dict() if getattr(assistant, "_is_pyramid_assistant", False) else None
        text = self.trio.tokenizer.decode(new_ids, skip_special_tokens=True) if self.trio.tokenizer else ""
        return RunResult(method.label, prompt.index, new_ids, text, wall, calls, seconds, stats,
                         prefill_s=self.meter.prefill_seconds(), generated_tokens=len(generated_ids))

    def warm_up(self, methods: list[Method], prompt: Prompt, tokens: int = 16) -> None:
        """One short untimed run of every method: first-call costs (allocations, kernels) stay out of the numbers."""
        for method in tqdm(methods, desc="warm-up", disable=not self.progress, leave=False):
            self.run_one(method, prompt, max_new_tokens=tokens)

    def run(self, methods: list[Method], prompts: list[Prompt], desc: str = "bench") -> dict[str, list[RunResult]]:
        """Every method on every prompt; the method order rotates from one prompt to the next."""
        labels = [m.label for m in methods]
        if len(set(labels)) != len(labels):
            raise ValueError(f"duplicate methods in {labels}")
        results = {m.label: [] for m in methods}
        bar = tqdm(total=len(prompts) * len(methods), desc=desc, disable=not self.progress)
        for i, prompt in enumerate(prompts):
            shift = i % len(methods)
            for method in methods[shift:] + methods[:shift]:
                bar.set_postfix_str(f"task {prompt.index} {method.label}")
                results[method.label].append(self.run_one(method, prompt))
                bar.update()
        bar.close()
        for runs in results.values():
            runs.sort(key=lambda r: r.prompt_index)
        return results

    def tune(self, grid: dict[str, list[Method]], prompts: list[Prompt]) -> list[Method]:
        """The methods to report: each family's fastest setting (median tokens/s) on ``prompts``.

        Tune on dev prompts only. psd_f keeps every tau: each is its own point on the speed/quality curve.
        """
        tuned = {family: ms for family, ms in grid.items() if len(ms) > 1 and family != "psd_f"}
        if tuned and prompts:
            runs = self.run([m for ms in tuned.values() for m in ms], prompts, desc="tune")
            for family, ms in tuned.items():
                speed = {m: median_tokens_per_s(runs[m.label]) for m in ms}
                tuned[family] = [max(ms, key=speed.get)]
                logger.info("tuned %s: %s (%s)", family, tuned[family][0].label,
                            ", ".join(f"{m.label}: {s:.2f} tok/s" for m, s in speed.items()))
        return [m for family, ms in grid.items() for m in tuned.get(family, ms)]


def median_tokens_per_s(runs: list[RunResult]) -> float:
    return statistics.median(r.tokens_per_s for r in runs) if runs else 0.0
