"""Float32 linears on oneDNN where it beats torch's default CPU kernel, measured per weight shape and call width.

Eager float32 ``nn.Linear`` on CPU runs MKL's sgemm. On an AMD EPYC seen here (AVX2, no AVX512) MKL runs narrow
calls far below the CPU's speed, while oneDNN, the library torch's compiler uses for CPU linears, does not. The
Qwen2.5-Coder-1.5B target in float32, a forward over 1 / 8 / 13 new tokens after a 200-token prompt:
390 / 1207 / 1319 ms with MKL, 299 / 519 / 635 ms on oneDNN, its 200-token prefill 6.3 -> 4.3 s. Verifying a block
of 8 then costs 1.7 one-token forwards instead of 3.1, which is what speculative decoding lives on.

Which kernel wins depends on the CPU (MKL is tuned for Intel's), so ``cpu_linear="auto"`` times both, once per
weight shape and process, at 1, 2, 4 ... 64 rows (at most ``PROBE_OUT_FEATURES`` output rows: a 151936-token head
would take seconds), and a `RoutedLinear` sends a call to oneDNN when oneDNN was faster at the measured width that
covers it; a reduced-vocabulary LM head (`pyramid_hf.vocab_head`) is routed the same way. Only float32 weights on
CPU, only without gradients: training and other dtypes run as before.

Exactness: oneDNN computes the same float32 product with another summation order (logits of the 1.5B differ by
<1e-4, the same size as MKL's own differences between a 1-row and an 8-row call). Every method in a run, target-only
decoding included, uses the same routed target, so speculative decoding stays token for token what the target
decodes alone (``tests/test_cpu_linear.py``).
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from .cpu_kernels import CALIBRATION_ROWS, onednn_available, onednn_linear, time_kernels

logger = logging.getLogger("pyramid_hf")

MODES = ("auto", "onednn", "torch")
PROBE_OUT_FEATURES = 8192  # enough output rows to read more than a CPU's cache holds, as a real layer does
MIN_GAIN = 0.95  # oneDNN must take at most 95% of the default kernel's time at a width to be used there
_measured: dict[tuple, frozenset] = {}  # (out, in) -> widths where oneDNN won, measured once per process
CPU_LINEAR_HELP = ("float32 linears on CPU: auto (oneDNN at the call widths where it measured faster than torch's "
                   "default kernel here), onednn (always), torch (never)")
DTYPE_HELP = ("model dtype: bfloat16, float32, float16; default: bfloat16 where the hardware multiplies it (GPUs, CPUs "
              "with AMX / AVX512-BF16), float32 elsewhere")


def check_cpu_linear(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown cpu_linear {mode!r}; choose from {', '.join(MODES)}")
    return mode


def covering_width(rows: int, widths=CALIBRATION_ROWS) -> int:
    """The narrowest measured width that holds a call of ``rows`` rows (the widest one for wider calls)."""
    return next((width for width in widths if width >= rows), widths[-1])


def onednn_wins(rows, torch_ms, onednn_ms) -> frozenset:
    """The widths of ``rows`` at which oneDNN took at most ``MIN_GAIN`` of the default kernel's time."""
    return frozenset(width for width, t, o in zip(rows, torch_ms, onednn_ms, strict=True) if o <= MIN_GAIN * t)


def routed_linear(x: torch.Tensor, weight: torch.Tensor, bias, onednn_widths: frozenset) -> torch.Tensor:
    """``nn.functional.linear``, on oneDNN when the call's covering width is one of ``onednn_widths``."""
    if (torch.is_grad_enabled() or x.dtype != torch.float32 or x.device.type != "cpu" or x.numel() == 0
            or covering_width(x.numel() // x.shape[-1]) not in onednn_widths):
        return nn.functional.linear(x, weight, bias)
    return onednn_linear(x, weight, bias)


def measure_onednn_widths(weight: torch.Tensor, rows=CALIBRATION_ROWS, repeats: int = 5) -> frozenset:
    """The call widths at which oneDNN beats torch's default kernel for ``weight`` on this machine."""
    weight = weight.detach()[:PROBE_OUT_FEATURES]
    key = tuple(weight.shape)
    if key not in _measured:
        try:
            timings = time_kernels({"torch": lambda v: nn.functional.linear(v, weight),
                                    "onednn": lambda v: onednn_linear(v, weight, None)},
                                   weight.shape[1], torch.float32, rows, repeats)
            _measured[key] = onednn_wins(rows, timings["torch"], timings["onednn"])
        except RuntimeError as error:  # a build whose oneDNN cannot run this op: keep torch's kernel
            logger.info("oneDNN linear unavailable for %s weights (%s): torch's kernel kept", key, error)
            _measured[key] = frozenset()
    return _measured[key]


class RoutedLinear(nn.Linear):
    """An ``nn.Linear`` (same parameters, same state-dict keys) whose no-grad float32 CPU calls run on oneDNN at the
    widths in ``onednn_widths``. Made in place by `route_linears`."""

    onednn_widths: frozenset = frozenset()

    @property
    def float_linear(self):
        """``fn(x, weight, bias)`` routed like this layer: the float path `pyramid_hf.quantize.Int8Linear` times."""
        return functools.partial(routed_linear, onednn_widths=self.onednn_widths)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return routed_linear(x, self.weight, self.bias, self.onednn_widths)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, onednn at widths {sorted(self.onednn_widths)}"


def as_routed(linear: nn.Linear, onednn_widths: frozenset) -> RoutedLinear:
    """``linear`` itself, made a `RoutedLinear` (same object, parameters and hooks: only forward changes)."""
    linear.__class__ = RoutedLinear
    linear.onednn_widths = frozenset(onednn_widths)
    return linear


def route_linears(model: nn.Module, mode: str = "auto") -> dict:
    """Route ``model``'s float32 CPU ``nn.Linear`` layers (and a reduced-vocabulary LM head) to oneDNN, in place:
    ``"auto"`` at the call widths where it measured faster here, ``"onednn"`` always, ``"torch"`` never; layers
    already routed are left as they are. Returns ``{"layers": n, "widths": [...]}``: how many layers route at least
    one width, and the union of those widths."""
    from .vocab_head import ReducedVocabHead

    if check_cpu_linear(mode) == "torch":
        return {"layers": 0, "widths": []}
    if not onednn_available():
        if mode == "auto":
            return {"layers": 0, "widths": []}
        raise RuntimeError("cpu_linear='onednn' needs a torch build with oneDNN (torch.backends.mkldnn); this one "
                           "has none: use cpu_linear='auto' or 'torch'")
    layers, widths = 0, set()
    for module in list(model.modules()):
        if type(module) is nn.Linear and module.weight.dtype == torch.float32 and module.weight.device.type == "cpu":
            chosen = frozenset(CALIBRATION_ROWS) if mode == "onednn" else measure_onednn_widths(module.weight)
            if chosen:
                as_routed(module, chosen)
        elif (isinstance(module, ReducedVocabHead) and module.kept_linear is None and not module.onednn_widths
              and module.kept_weight.dtype == torch.float32 and module.kept_weight.device.type == "cpu"):
            chosen = frozenset(CALIBRATION_ROWS) if mode == "onednn" else measure_onednn_widths(module.kept_weight)
            module.onednn_widths = chosen
        else:
            continue
        if chosen:
            layers += 1
            widths |= chosen
    return {"layers": layers, "widths": sorted(widths)}
