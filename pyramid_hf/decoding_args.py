"""The flags `pyramid-sd generate` and `pyramid-sd bench` share: which models run (a preset's, overridden one by
one), how they run, and how tokens are chosen."""

from __future__ import annotations

from dataclasses import dataclass, field

from .cpu_linear import CPU_LINEAR_HELP, DTYPE_HELP, check_cpu_linear
from .quantize import check_quantization_flag


@dataclass(kw_only=True)
class DecodingArgs:
    target: str | None = field(default=None, metadata={"help": "override the preset's target (Hub id, folder, GGUF)"})
    qualifier: str | None = field(default=None, metadata={"help": "override the preset's qualifier"})
    draft: str | None = field(default=None, metadata={
        "help": "override the draft: a model, prompt_lookup, ngram (lookup + a standard-library n-gram table) or none"})
    qualifier_vocab_size: int | None = field(default=None, metadata={
        "help": "LM head of the qualifier over this many most frequent tokens (lossless, cheaper); 0 = full head; "
                "default: the preset's"})
    qualifier_quantization: str | None = field(default=None, metadata={
        "help": "none, or int8: int8 weights for the qualifier's calls of <= 4 tokens (CPU; lossless, the target "
                "verifies); default: the preset's"})
    dtype: str | None = field(default=None, metadata={"help": DTYPE_HELP})
    cpu_linear: str = field(default="auto", metadata={"help": CPU_LINEAR_HELP})
    do_sample: bool = field(default=False, metadata={"help": "sample instead of greedy decoding"})
    temperature: float = field(default=0.7, metadata={"help": "sampling temperature (with --do_sample)"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling (with --do_sample)"})
    top_k: int = field(default=0, metadata={"help": "top-k sampling, 0 = off (with --do_sample)"})

    def __post_init__(self):
        check_cpu_linear(self.cpu_linear)
        check_quantization_flag("qualifier_quantization", self.qualifier_quantization)
