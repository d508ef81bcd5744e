"""One-command rebuilds of the drafts this project trains itself (the presets whose draft is a local folder).

    pyramid-sd models build qwen-coder-cpu-feature            # ~10 h on 2 CPU cores; resumable
    pyramid-sd models build qwen-coder-cpu-feature --dry_run  # print the plan

A plan is the list of documented commands of recipes/README.md (fetch, train, write completions, train again,
measure, publish into the preset's cache folder), run one after another in the current directory, where the recipes'
``runs/...`` folders land. A step whose output already exists is skipped and training resumes from its last
checkpoint, so an interrupted build continues where it stopped. Each step's wall time goes to
``runs/build-NAME.json``, the proof that the recipe fits its time budget.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .offline import cache_root
from .presets import PRESETS

logger = logging.getLogger("pyramid_hf")

ROOT = Path(__file__).resolve().parents[2]  # the repository: recipes/ and training/ live there
QUALIFIER = PRESETS["qwen-coder-cpu"].qualifier.hub_id  # the trio both plans train drafts for
TARGET = PRESETS["qwen-coder-cpu"].target.hub_id
CPU = ("accelerate", "launch", "--config_file", "recipes/accelerate_configs/cpu.yaml")


@dataclass(frozen=True)
class BuildStep:
    """One documented command; ``output`` exists once it has finished (None: the command resumes by itself and is a
    quick no-op when done). ``{cache}`` in either stands for the model cache (`$PYRAMID_HF_CACHE`)."""

    name: str
    argv: tuple[str, ...]
    output: str | None = None


def _publish(model: str, results: str, out: str, recipe: str) -> BuildStep:
    """Always run (seconds): the folder may hold a draft an earlier version of the plan published."""
    return BuildStep("publish into the preset's cache folder", (
        "pyramid-sd", "publish", "--model", model, "--repo-id", f"ORG/{out.split('/')[0]}-draft",
        "--output-dir", "{cache}/" + out, "--results", results, "--base_model", QUALIFIER, "--teacher", QUALIFIER,
        "--target", TARGET, "--qualifier", QUALIFIER, "--recipe", recipe, "--license", "apache-2.0", "--overwrite",
    ))


def _eval(student: str, out: str, limit: int = 10) -> BuildStep:
    return BuildStep("measure acceptance on HumanEval test prompts", (
        "pyramid-sd", "eval-acceptance", "--preset", "", "--student", student, "--teacher", QUALIFIER, "--limit",
        str(limit), "--max_new_tokens", "64", "--draft_tokens", "4", "--out", out), out + "/acceptance.json")


def _completions(name: str, out: str, *extra: str) -> BuildStep:
    """The 0.5B's greedy completions (resumes by itself: lines already written are kept)."""
    return BuildStep(name, ("pyramid-sd", "write-completions", "--model", QUALIFIER, *extra, "--max_new_tokens", "128",
                            "--out", out))


def _feature_run(name: str, recipe: str, output_dir: str, *overrides: str) -> BuildStep:
    """A feature-draft recipe as written (``output_dir``: the recipe's own)."""
    return BuildStep(name, (*CPU, "training/train_feature_draft.py", "--config", recipe, *overrides),
                     f"{output_dir}/final/feature_draft.json")


def _continued(name: str, recipe: str, init_from: str, output_dir: str, seed: int, *overrides: str) -> BuildStep:
    """``recipe`` run again from ``init_from``'s final draft into ``output_dir``, on a fresh short schedule."""
    return _feature_run(name, recipe, output_dir, "--init_from", f"{init_from}/final", "--learning_rate", "3e-4",
                        "--warmup_steps", "10", "--seed", str(seed), *overrides, "--output_dir", output_dir)


_FEATURE = "runs/qwen-coder-cpu-feature"
_FUSED = "recipes/qwen-coder-cpu-distilled/feature_draft_fused_layers.yaml"
_SITE_PACKAGES_2 = "recipes/qwen-coder-cpu-distilled/feature_draft_site_packages_2.yaml"
_SITE_PACKAGES_3 = "recipes/qwen-coder-cpu-distilled/feature_draft_site_packages_3.yaml"
_DISTILLED = "runs/qwen-coder-cpu-distilled"

PLANS: dict[str, list[BuildStep]] = {
    # The chain of recipes/README.md that made the best draft (2.42 tokens per 0.5B call at l=4): the three-state
    # draft on the 0.5B's completions of every standard-library prompt, continued with three unrolled passes, then on
    # its completions of three samples of third-party-package prompts. ~10 h on a 2-core Zen 4 (the times in the names).
    "qwen-coder-cpu-feature": [
        BuildStep("fetch the offline models", ("pyramid-sd", "models", "fetch", "qwen-coder-cpu")),
        _completions("the 0.5B's completions of every standard-library prompt (~57 min)",
                     "runs/completions/qwen-coder-0.5b-stdlib-all.jsonl", "--prompts", "stdlib-code"),
        _feature_run("the three-state draft, 300 steps (~28 min)", _FUSED, f"{_FEATURE}/draft-fused-layers"),
        _continued("300 steps more (~28 min)", _FUSED, f"{_FEATURE}/draft-fused-layers",
                   f"{_FEATURE}/draft-fused-layers-2", 1),
        _continued("900 steps more, three unrolled passes, the 0.5B's states stored (~65 min)", _FUSED,
                   f"{_FEATURE}/draft-fused-layers-2", f"{_FEATURE}/draft-fused-long", 2, "--max_steps", "900",
                   "--unroll_steps", "3", "--feature_cache_dir", "runs/feature-cache", "--save_steps", "100"),
        _continued("1200 steps more on the stored states (~55 min)", _FUSED, f"{_FEATURE}/draft-fused-long",
                   f"{_FEATURE}/draft-fused-long2", 3, "--max_steps", "1200", "--unroll_steps", "3",
                   "--feature_cache_dir", "runs/feature-cache", "--save_steps", "150"),
        _completions("the 0.5B's completions of 3500 third-party-package prompts (~85 min)",
                     "runs/completions/qwen-coder-0.5b-site-packages-3500.jsonl", "--prompts", "site-packages-code",
                     "--limit", "3500"),
        _feature_run("600 steps on that text (~47 min)", "recipes/qwen-coder-cpu-distilled/feature_draft_site_packages.yaml",
                     f"{_FEATURE}/draft-site-packages"),
        _completions("the 0.5B's completions of another 3500 (~85 min)",
                     "runs/completions/qwen-coder-0.5b-site-packages-seed1-3500.jsonl", "--prompts",
                     "site-packages-code", "--limit", "3500", "--seed", "1"),
        _feature_run("600 steps on that text (~50 min)", _SITE_PACKAGES_2, f"{_FEATURE}/draft-site-packages-2"),
        _completions("the 0.5B's completions of a third 3500 (~65 min)",
                     "runs/completions/qwen-coder-0.5b-site-packages-seed2-3500.jsonl", "--prompts",
                     "site-packages-code", "--limit", "3500", "--seed", "2"),
        _feature_run("600 steps on that text (~50 min)", _SITE_PACKAGES_3, f"{_FEATURE}/draft-site-packages-3"),
        _eval(f"{_FEATURE}/draft-site-packages-3/final", f"{_FEATURE}/acceptance-site-packages-3", limit=30),
        _publish(f"{_FEATURE}/draft-site-packages-3/final", f"{_FEATURE}/acceptance-site-packages-3/acceptance.json",
                 "qwen-coder-cpu-feature/draft", _SITE_PACKAGES_3),
    ],
    "qwen-coder-cpu-distilled": [
        BuildStep("fetch the offline models", ("pyramid-sd", "models", "fetch", "qwen-coder-cpu")),
        BuildStep("the 6-layer cut learns the 0.5B's own completions (sequence-level KD, ~17 min)", (
            *CPU, "training/distill.py", "--config", "recipes/qwen-coder-cpu-distilled/draft_to_qualifier_seqkd.yaml",
            "--max_steps", "40", "--save_steps", "20",
        ), f"{_DISTILLED}/draft-seqkd/final/config.json"),
        BuildStep("a 16k-token head over the standard library's most frequent tokens", (
            "pyramid-sd", "reduce-vocab", "--model", f"{_DISTILLED}/draft-seqkd/final", "--vocab_size", "16384",
            "--out", f"{_DISTILLED}/draft-16k"), f"{_DISTILLED}/draft-16k/reduced_vocab.json"),
        _eval(f"{_DISTILLED}/draft-16k", f"{_DISTILLED}/acceptance"),
        _publish(f"{_DISTILLED}/draft-16k", f"{_DISTILLED}/acceptance/acceptance.json",
                 "qwen-coder-cpu-distilled/draft", "recipes/qwen-coder-cpu-distilled/draft_to_qualifier_seqkd.yaml"),
    ],
}


def get_plan(name: str) -> list[BuildStep]:
    if name not in PLANS:
        raise ValueError(f"no build plan for {name!r}; buildable presets: {', '.join(PLANS)}")
    return PLANS[name]


def _fill(text: str) -> str:
    return text.replace("{cache}", str(cache_root()))


def command_line(step: BuildStep) -> list[str]:
    """The step's argv as run: ``{cache}`` filled in, `pyramid-sd` and `accelerate` from this Python, the recipes'
    and scripts' paths from the repository when they are not under the current directory."""
    argv = [_fill(a) for a in step.argv]
    for i, arg in enumerate(argv):
        if arg.startswith(("recipes/", "training/")) and not Path(arg).exists():
            argv[i] = str(ROOT / arg)
    if argv[0] == "pyramid-sd":
        return [sys.executable, "-m", "pyramid_hf.cli", *argv[1:]]
    if argv[:2] == ["accelerate", "launch"]:
        return [sys.executable, "-m", "accelerate.commands.launch", *argv[2:]]
    return argv


def is_done(step: BuildStep) -> bool:
    return step.output is not None and Path(_fill(step.output)).exists()


def run_plan(name: str, steps: list[BuildStep], *, dry_run: bool = False, force: bool = False,
             record: str | Path | None = None) -> list[dict]:
    """Run ``steps`` in order (skipping finished ones unless ``force``); returns one record per step with its wall
    time and writes them to ``record`` (JSON) after every step. A failing step stops the build with its name."""
    records: list[dict] = []
    for number, step in enumerate(steps, 1):
        argv = command_line(step)
        header = f"[{number}/{len(steps)}] {step.name}"
        if is_done(step) and not force:
            logger.info("%s: done (%s exists)", header, _fill(step.output))
            records.append({"step": step.name, "status": "skipped"})
            continue
        shown = " ".join(_fill(a) if a else '""' for a in step.argv)
        if dry_run:
            print(f"{header}\n    {shown}")
            continue
        logger.info("%s\n    $ %s", header, shown)
        start = time.perf_counter()
        code = subprocess.run(argv, env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
        seconds = round(time.perf_counter() - start, 1)
        records.append({"step": step.name, "command": shown, "seconds": seconds, "status": "ok" if code == 0 else
                        f"exit {code}"})
        if record is not None:
            Path(record).parent.mkdir(parents=True, exist_ok=True)
            Path(record).write_text(json.dumps({"preset": name, "steps": records}, indent=2) + "\n")
        if code != 0:
            raise RuntimeError(f"build of {name} stopped at step {number} ({step.name}): `{shown}` exited with {code};"
                               " run the same build again to resume")
        if step.output is not None and not is_done(step):
            raise RuntimeError(f"build of {name}: step {number} ({step.name}) finished but did not write "
                               f"{_fill(step.output)}")
    ran = sum(r.get("seconds", 0) for r in records)
    if not dry_run:
        logger.info("build of %s finished: %.1f min in the steps that ran", name, ran / 60)
    return records
