"""Int8 weights for the levels that get verified (qualifier, model draft): cheaper small forwards on CPU.

A 0.5B forward of one token on a CPU is bound by reading its weights (~85% of its time is in matmuls whose cost
barely moves between 1 and 13 rows). Int8 weights halve what is read: a forward of the 0.5B qualifier over 1 / 4
rows drops from ~103 / ~109 to ~62 / ~79 ms here. But torch's int8 weight-only kernel (``torch._weight_int8pack_mm``)
does not use the CPU's bf16 matrix units, so at 13 rows it is ~2x slower than bf16 (239 vs 112 ms). `Int8Linear`
therefore keeps both copies and picks per call: int8 for calls of at most ``max_int8_rows`` rows (autoregressive
steps, short drafts), the original weights for wider calls (draft trees, prefill). Memory grows by half the
linears' bf16 size.

Where int8 stops paying depends on the CPU: on a CPU without bf16 matrix units (AVX2 only, e.g. an AMD EPYC seen
here) a bf16 matmul costs k times as much for k rows while the int8 kernel stays ~5x cheaper up to 13 rows
(896 x 4864: bf16 2.0 / 14.0 ms at 1 / 8 rows, int8 0.8 / 2.8 ms). ``max_int8_rows="auto"`` (the default) therefore
measures it, once per weight shape and process: `measure_max_int8_rows` times both kernels at 1, 2, 4, ... 64 rows
(a few seconds for a 0.5B model; on weights read from memory, not cache, as in a whole forward) and keeps int8
up to the widest call at which it is still faster.

Lossless: the quantized model only proposes or filters tokens; the target verifies them with its own, untouched
weights. Top-1 agreement of the int8 0.5B with its bf16 self was 96% on library code (dynamic int8 activations,
torch's other CPU path, kept only 75-90%: Qwen's activation outliers), so per-stage acceptance moves a little.

On CPUs with AVX512-BF16 the int8 calls run on a few-row kernel (`int8_matmul`), which widens the int8 weights to
bf16 in registers and reads them once for all rows of a call; on other x86 CPUs with AVX2 on its float32 twin (on an
AVX2 EPYC the 0.5B's forward over 1 / 5 / 9 tokens: 51 / 123 / 170 ms on torch's int8 kernel, 35 / 56 / 85 on it);
elsewhere on torch's int8 kernel (``torch._weight_int8pack_mm``, a private torch API, called only through
`pyramid_hf.cpu_kernels`). ``python -m pyramid_hf.quantize`` times them on the CPU at hand.
"""

from __future__ import annotations

import torch
from torch import nn

from .cpu_kernels import (
    CALIBRATION_ROWS,
    cold,
    int8_weight_only_matmul,
    skinny_available,
    skinny_bf16_available,
    skinny_linear_int8,
    skinny_linear_int8_f32,
    time_kernels,
)
from .cpu_linear import cold_routed, measure_kernels

MODES = ("none", "int8")
PROBE_ROWS = 1024
# call widths at which int8 is timed against the float path: the general ones plus 3, 5 and 6, the widths of the
# qualifier's calls that check 2, 4 or 5 drafted tokens (a 5-row call would otherwise go by the 8-row decision)
INT8_CALIBRATION_ROWS = tuple(sorted({*CALIBRATION_ROWS, 3, 5, 6}))
_measured_rows: dict[tuple, int] = {}  # (out, in, dtype) -> max_int8_rows, measured once per process


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8: weight ~= weight_int8 * scales[:, None] (scales in bf16, what the kernel of
    `int8_weight_only_matmul` reads)."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12).to(torch.bfloat16)
    weight_int8 = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return weight_int8.contiguous(), scales


def check_quantization_flag(flag: str, value: str | None) -> None:
    """A command-line quantization flag: unset (the default applies) or one of `MODES`."""
    if value is not None and value not in MODES:
        raise ValueError(f"--{flag} must be {' or '.join(MODES)}, got {value!r}")


def int8_matmul(x2d: torch.Tensor, weight_int8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x2d @ (weight_int8 * scales[:, None]).T`` on the int8 kernel `Int8Linear` runs here: a few-row kernel of this
    package where one is built, torch's elsewhere. On CPUs with AVX512-BF16 the bf16 one
    (`pyramid_hf.cpu_kernels.skinny_linear_int8`); where both run (Zen 4, 896 x 4864, one thread) they tie at one row
    (0.35 ms) and the few-row one is faster from two rows on (5 rows: 0.42 against 0.74 ms, bf16 0.70; 8 rows: 0.64 /
    0.94 / 0.75): torch's does not use the bf16 dot products. On other x86 CPUs with AVX2 the float32 one
    (`pyramid_hf.cpu_kernels.skinny_linear_int8_f32`): torch's kernel takes bf16 activations, which such CPUs handle in
    software, and reads the weights again for every row."""
    kernel = int8_kernel()
    if kernel == "few-row bf16":
        return skinny_linear_int8(x2d.to(torch.bfloat16), weight_int8, scales.to(torch.bfloat16)).to(x2d.dtype)
    if kernel == "few-row float32":
        return skinny_linear_int8_f32(x2d.float(), weight_int8, scales).to(x2d.dtype)
    return int8_weight_only_matmul(x2d, weight_int8, scales.to(torch.bfloat16))


def int8_kernel() -> str:
    """The int8 kernel `int8_matmul` runs here, in order of preference: "few-row bf16" (AVX512-BF16), "few-row float32"
    (AVX2), "torch"."""
    if skinny_bf16_available():
        return "few-row bf16"
    return "few-row float32" if skinny_available() else "torch"


def kernel_scales(scales: torch.Tensor) -> torch.Tensor:
    """``scales`` (bf16, from `quantize_rows`) in the dtype `int8_matmul`'s kernel reads here, so no call converts
    them: float32 for the AVX2 few-row kernel (the same values), bf16 for the others."""
    return scales.float() if int8_kernel() == "few-row float32" else scales


def widest_faster(rows, float_ms, int8_ms) -> int:
    """The widest of ``rows`` (ascending) up to which int8 was faster at every width measured; 0 if never."""
    best = 0
    for width, f, q in zip(rows, float_ms, int8_ms, strict=False):
        if q >= f:
            break
        best = width
    return best


def measure_max_int8_rows(weight: torch.Tensor, weight_int8: torch.Tensor, scales: torch.Tensor,
                          rows=INT8_CALIBRATION_ROWS, repeats: int = 5, width_kernels: dict | None = None) -> int:
    """How wide a call may be for int8 weights to beat the float matmul on this machine (0: never); measured once
    per weight shape, dtype and float routing per process. ``width_kernels``: the routing of the float path the
    layer would take otherwise (`pyramid_hf.cpu_linear.RoutedLinear`; default torch's kernel at every width)."""
    # the kernels' relative speed depends on the width of a call, not on how many output rows a weight has: time
    # at most PROBE_ROWS of them (a 151936-token LM head would otherwise take seconds per width in bf16)
    weight, weight_int8, scales = weight[:PROBE_ROWS], weight_int8[:PROBE_ROWS], scales[:PROBE_ROWS]
    width_kernels = dict(sorted((width_kernels or {}).items()))
    key = (*weight.shape, weight.dtype) + ((tuple(width_kernels.items()),) if width_kernels else ())
    if key not in _measured_rows:
        timings = time_kernels({"float": cold_routed(weight, width_kernels),
                                "int8": cold(int8_matmul, weight_int8, scales)},
                               weight.shape[1], weight.dtype, rows, repeats,
                               stop_when=lambda t: t["int8"][-1] >= t["float"][-1])
        _measured_rows[key] = widest_faster(rows, timings["float"], timings["int8"])
    return _measured_rows[key]


class Int8Linear(nn.Module):
    """An ``nn.Linear`` that runs narrow calls (<= ``max_int8_rows`` rows) on int8 weights, wider ones as before;
    ``max_int8_rows="auto"`` measures that width on this machine (`measure_max_int8_rows`)."""

    def __init__(self, linear: nn.Linear, max_int8_rows: int | str = "auto"):
        super().__init__()
        if linear.weight.device.type != "cpu":
            raise ValueError(f"int8 quantization runs on CPU only (torch's int8 weight-only kernel); this layer is "
                             f"on {linear.weight.device.type}: load the qualifier with --qualifier_quantization none "
                             f"(load_trio(..., qualifier_quantization='none'))")
        self.linear = linear
        weight_int8, scales = quantize_rows(linear.weight)
        self.register_buffer("weight_int8", weight_int8, persistent=False)
        self.register_buffer("scales", kernel_scales(scales), persistent=False)
        if max_int8_rows == "auto":
            max_int8_rows = measure_max_int8_rows(linear.weight, weight_int8, self.scales,
                                                  width_kernels=getattr(linear, "width_kernels", None))
        self.max_int8_rows = _check_rows(max_int8_rows)
        if self.max_int8_rows == 0:  # int8 never wins on this machine: free its copy, keep the float path only
            self.weight_int8, self.scales = weight_int8[:0], scales[:0]

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
        y = int8_matmul(x.reshape(rows, x.shape[-1]), self.weight_int8, self.scales)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if self.linear.bias is None else y + self.linear.bias

    def extra_repr(self) -> str:
        return f"int8 for calls of <= {self.max_int8_rows} rows"


def _check_rows(max_int8_rows) -> int:
    if isinstance(max_int8_rows, bool) or not isinstance(max_int8_rows, int) or max_int8_rows < 0:
        raise ValueError(f"max_int8_rows must be a non-negative integer or 'auto', got {max_int8_rows!r}")
    return max_int8_rows


def int8_rows_of(model: nn.Module) -> list[int]:
    """The ``max_int8_rows`` of every int8 layer in ``model``."""
    return [m.max_int8_rows for m in model.modules() if isinstance(m, Int8Linear)]


def quantize_model(model: nn.Module, mode: str = "int8", max_int8_rows: int | str = "auto") -> int:
    """Give every ``nn.Linear`` in ``model`` (its decoder layers and a plain or reduced-vocabulary LM head) int8
    weights for narrow calls, in place. Returns how many layers changed; ``mode="none"`` changes nothing.
    ``max_int8_rows``: the widest call (rows) run on int8 weights, or "auto" to measure it on this machine."""
    if mode not in MODES:
        raise ValueError(f"unknown quantization {mode!r}; choose from {', '.join(MODES)}")
    if max_int8_rows != "auto":
        _check_rows(max_int8_rows)
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


def time_int8_kernels(shapes=((4864, 896), (896, 4864), (8960, 1536), (1536, 8960)), rows=(1, 2, 3, 5, 8, 16, 32),
                      repeats: int = 21) -> list[dict]:
    """Median ms of one call per (out, in) float32 weight shape and width, on weights read from memory: the float path
    `--cpu_linear auto` routes to, torch's int8 kernel, and the int8 kernel `int8_matmul` runs here; they take turns
    call by call (`time_kernels`). The first shapes are the 0.5B qualifier's MLP, the last the 1.5B's."""
    results = []
    for out_features, in_features in shapes:
        weight = torch.randn(out_features, in_features)
        weight_int8, scales = quantize_rows(weight)
        kernels = {"float (routed)": cold_routed(weight, measure_kernels(weight)),
                   "torch int8": cold(int8_weight_only_matmul, weight_int8, scales),
                   "int8_matmul": cold(int8_matmul, weight_int8, kernel_scales(scales))}
        timings = time_kernels(kernels, in_features, torch.float32, rows, repeats)
        results += [{"shape": f"{out_features} x {in_features}", "rows": width}
                    | {name: round(times[i], 3) for name, times in timings.items()} for i, width in enumerate(rows)]
    return results


if __name__ == "__main__":  # quick look on this CPU: python -m pyramid_hf.quantize
    table = time_int8_kernels()
    names = [key for key in table[0] if key not in ("shape", "rows")]
    print("| weight (out x in) | rows | " + " | ".join(f"{name} ms" for name in names) + " |")
    print("|---|---|" + "---|" * len(names))
    for row in table:
        print(f"| {row['shape']} | {row['rows']} | " + " | ".join(str(row[name]) for name in names) + " |")
