"""`pyramid-sd generate`: stream one completion from a trio and print the per-stage stats."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

from .config import PyramidConfig
from .decoding_args import DecodingArgs

logger = logging.getLogger("pyramid_hf")

METHODS = ("ar", "sd", "psd")


@dataclass
class GenerateArgs(DecodingArgs):
    prompt: str = field(metadata={"help": "the prompt text (raw completion; add --chat for instruct models' template)"})
    preset: str | None = field(default="qwen-coder-cpu", metadata={"help": "a named trio (`pyramid-sd models list`)"})
    method: str = field(default="psd", metadata={"help": "ar (target alone), sd (qualifier drafts), psd (pyramid)"})
    sd_tokens: int = field(default=5, metadata={"help": "draft length for --method sd"})
    chat: bool = field(default=False, metadata={"help": "wrap the prompt in the tokenizer's chat template"})
    max_new_tokens: int = field(default=128, metadata={"help": "tokens to generate"})
    seed: int = field(default=0, metadata={"help": "random seed"})
    json_stats: bool = field(default=False, metadata={"help": "also print the stats as one JSON line"})

    def __post_init__(self):
        super().__post_init__()
        if self.method not in METHODS:
            raise ValueError(f"--method must be one of {METHODS}, got {self.method!r}")
        if self.max_new_tokens < 1 or self.sd_tokens < 1:
            raise ValueError("--max_new_tokens and --sd_tokens must be positive")


def _config_from_preset(config: PyramidConfig, explicit: set, preset) -> PyramidConfig:
    """The preset's tuned knobs, except those given on the command line."""
    if preset is None:
        return config
    values = config.to_dict() | {k: v for k, v in preset.knobs.items() if k not in explicit}
    return PyramidConfig(**{k: v for k, v in values.items() if k in PyramidConfig.__dataclass_fields__})


def run_generate(args: GenerateArgs, config: PyramidConfig, explicit_knobs: set, out=print) -> dict:
    import torch
    from transformers import TextStreamer

    from .assistant import PyramidAssistant
    from .models import get_preset
    from .trio import load_trio

    torch.manual_seed(args.seed)
    preset = get_preset(args.preset) if args.preset else None
    trio = load_trio(preset, target=args.target, qualifier=args.qualifier, draft=args.draft, dtype=args.dtype,
                     qualifier_vocab_size=args.qualifier_vocab_size,
                     qualifier_quantization=args.qualifier_quantization,
                     need_draft=args.method == "psd", cpu_linear=args.cpu_linear)
    config = _config_from_preset(config, explicit_knobs, preset)
    tok = trio.tokenizer
    text = args.prompt
    if args.chat:
        text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    input_ids = tok(text, return_tensors="pt").input_ids.to(trio.target.device)
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, attention_mask=torch.ones_like(input_ids),
                  streamer=TextStreamer(tok, skip_prompt=True), pad_token_id=tok.pad_token_id)
    if args.do_sample:
        kwargs.update(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    assistant = None
    if args.method == "sd":
        gen = trio.qualifier.generation_config
        gen.num_assistant_tokens, gen.num_assistant_tokens_schedule = args.sd_tokens, "constant"
        gen.assistant_confidence_threshold = 0.0
        kwargs["assistant_model"] = trio.qualifier
    elif args.method == "psd":
        assistant = PyramidAssistant(trio.qualifier, trio.draft, config)
        kwargs["assistant_model"] = assistant
    start = time.perf_counter()
    with torch.no_grad():
        output_ids = trio.target.generate(input_ids, **kwargs)
    wall = time.perf_counter() - start
    new_tokens = output_ids.shape[1] - input_ids.shape[1]
    result = {"method": args.method, "new_tokens": new_tokens, "wall_s": wall, "tokens_per_s": new_tokens / wall,
              "models": trio.origins, "new_ids": output_ids[0, input_ids.shape[1]:].tolist()}
    out("")
    if assistant is not None:
        result |= {"mode": config.mode, "config": config.to_dict(), "stats": assistant.stats.to_dict()}
        out(f"[{config.mode}] {assistant.stats.summary()}")
    else:
        out(f"[{args.method}] {new_tokens} tokens in {wall:.2f}s ({new_tokens / wall:.1f} tok/s)")
    if args.json_stats:
        out(json.dumps(result, default=str))
    return result
