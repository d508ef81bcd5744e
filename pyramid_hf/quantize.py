"""Int8 weights for the levels that get verified (qualifier, model draft): cheaper small forwards on CPU.

A 0.5B forward of one token on a CPU is bound by reading its weights (~85% of its time is in matmuls whose cost
barely moves between 1 and 13 rows). Int8 weights halve what is read: a forward of the 0.5B qualifier over 1 / 4
rows drops from ~103 / ~109 to ~62 / ~79 ms here. But torch's int8 weight-only kernel (``torch._weight_int8pack_mm``)
does not use the CPU's bf16 matrix units, so at 13 rows it is ~2x slower than bf16 (239 vs 112 ms). `Int8Linear`
therefore keeps both copies and picks per call: int8 for calls of at most ``max_int8_rows`` rows (autoregressive
steps, short drafts), the original weights for wider calls (draft trees, prefill). Memory grows by half the
linears' bf16 size.

Lossless: the quantized model only proposes or filters tokens; the target verifies them with its own, untouched
weights. Top-1 agreement of the int8 0.5B with its bf16 self was 96% on library code (dynamic int8 activations,
torch's other CPU path, kept only 75-90%: Qwen's activation outliers), so per-stage acceptance moves a little.

``torch._weight_int8pack_mm`` is a private torch op: this module is the only one that calls it, and
``tests/test_quantize.py`` fails loudly if it disappears or changes meaning.
"""

from __future__ import annotations

import torch
from torch import nn

MODES = ("none", "int8")
DEFAULT_MAX_INT8_ROWS = 4  # where int8 stops paying on a 2-core AMX CPU (whole 0.5B forwards, see above)


def int8_weight_only_matmul(x2d: torch.Tensor, weight_int8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x2d @ (weight_int8 * scales[:, None]).T`` for x2d (n, k) in bf16/fp32, weight_int8 (out, k), scales (out,)."""
    return torch._weight_int8pack_mm(x2d, weight_int8, scales)


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8: weight ~= weight_int8 * scales[:, None]."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    weight_int8 = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return weight_int8.contiguous(), scales.to(weight.dtype)


class Int8Linear(nn.Module):
    """An ``nn.Linear`` that runs narrow calls (<= ``max_int8_rows`` rows) on int8 weights, wider ones as before."""

    def __init__(self, linear: nn.Linear, max_int8_rows: int = DEFAULT_MAX_INT8_ROWS):
        super().__init__()
        if linear.weight.device.type != "cpu":
            raise ValueError(f"int8 quantization runs on CPU only (torch's int8 weight-only kernel); this layer is "
                             f"on {linear.weight.device.type}: load the qualifier with --qualifier_quantization none "
                             f"(load_trio(..., qualifier_quantization='none'))")
        self.linear = linear
        weight_int8, scales = quantize_rows(linear.weight)
        self.register_buffer("weight_int8", weight_int8, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.max_int8_rows = max_int8_rows

    @property
    def weight(self) -> torch.Tensor:  # the original weights: for code that inspects dtype, device or shape
        return self.linear.weight

    @property
    def bias(self):
        return self.linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows > self.max_int8_rows or torch.is_grad_enabled():
            return self.linear(x)
        y = int8_weight_only_matmul(x.reshape(rows, x.shape[-1]), self.weight_int8, self.scales)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if self.linear.bias is None else y + self.linear.bias

    def extra_repr(self) -> str:
        return f"int8 for calls of <= {self.max_int8_rows} rows"


def quantize_model(model: nn.Module, mode: str = "int8", max_int8_rows: int = DEFAULT_MAX_INT8_ROWS) -> int:
    """Give every ``nn.Linear`` in ``model`` (its decoder layers and a plain or reduced-vocabulary LM head) int8
    weights for narrow calls, in place. Returns how many layers changed; ``mode="none"`` changes nothing."""
    if mode not in MODES:
        raise ValueError(f"unknown quantization {mode!r}; choose from {', '.join(MODES)}")
    if isinstance(max_int8_rows, bool) or not isinstance(max_int8_rows, int) or max_int8_rows < 1:
        raise ValueError(f"max_int8_rows must be a positive integer, got {max_int8_rows!r}")
    if mode == "none":
        return 0
    if any(isinstance(m, Int8Linear) for m in model.modules()):
        raise ValueError("the model is already quantized")
    if any(p.dtype not in (torch.bfloat16, torch.float32) for p in model.parameters()):
        raise ValueError("int8 quantization needs bfloat16 or float32 weights")
    from .vocab_head import ReducedVocabHead

    changed = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Int8Linear(child, max_int8_rows))
                changed += 1
        if isinstance(module, ReducedVocabHead):
            module.quantize(max_int8_rows)
            changed += 1
    return changed
