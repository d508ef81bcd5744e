"""`pyramid-sd`: the command line.

    pyramid-sd demo --max-new-tokens 64

`demo` builds a tiny random trio in process (no downloads), runs target-only greedy decoding and
the pyramid side by side, checks that the lossless pyramid reproduced the target's tokens, and
prints the per-stage stats. Real models, `generate` and `bench` are tracked in issue 3.
"""

from __future__ import annotations

import argparse
import json
import sys

from transformers import HfArgumentParser

from .config import PyramidConfig


def _tiny_trio(vocab: int, seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    def make(hidden, layers, offset):
        torch.manual_seed(seed + offset)
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=2048, bos_token_id=0, pad_token_id=0, eos_token_id=None)
        model = LlamaForCausalLM(cfg).eval()
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        return model

    return make(64, 3, 0), make(32, 2, 1), make(16, 2, 2)


def demo(argv: list[str]) -> int:
    import torch

    from .assistant import PyramidAssistant

    parser = HfArgumentParser(PyramidConfig, prog="pyramid-sd demo")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random models and prompt")
    parser.add_argument("--draft", choices=["model", "prompt_lookup", "none"], default="model",
                        help="the bottom level of the pyramid")
    (config, args) = parser.parse_args_into_dataclasses(args=argv)
    target, qualifier, draft_model = _tiny_trio(vocab=97, seed=args.seed)
    draft = {"model": draft_model, "prompt_lookup": "prompt_lookup", "none": None}[args.draft]
    prompt = torch.randint(1, 97, (1, 8), generator=torch.Generator().manual_seed(args.seed))
    expected = target.generate(prompt, do_sample=False, max_new_tokens=args.max_new_tokens)
    assistant = PyramidAssistant(qualifier, draft, config)
    out = target.generate(prompt, assistant_model=assistant, do_sample=False, max_new_tokens=args.max_new_tokens)
    identical = bool(torch.equal(out, expected))
    print(f"mode={config.mode} lossless={config.lossless} identical_to_target_greedy={identical}")
    print(assistant.stats.summary())
    print(json.dumps({"config": config.to_dict(), "stats": assistant.stats.to_dict()}, default=str))
    return 0 if identical or not config.lossless else 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="pyramid-sd", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["demo"], help="what to run")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    ns = parser.parse_args(argv[:1])
    return {"demo": demo}[ns.command](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
