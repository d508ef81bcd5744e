"""Float32 and bf16 CPU linears on the fastest of their kernels, measured per weight shape and call width.

Eager float32 ``nn.Linear`` on CPU runs MKL's sgemm. On an AMD EPYC seen here (AVX2, no AVX512) MKL runs narrow
calls far below the CPU's speed, while oneDNN, the library torch's compiler uses for CPU linears, does not. The
Qwen2.5-Coder-1.5B target in float32, a forward over 1 / 8 / 13 new tokens after a 200-token prompt:
390 / 1207 / 1319 ms with MKL, 299 / 519 / 635 ms on oneDNN, its 200-token prefill 6.3 -> 4.3 s. Both libraries
are still tuned for wide calls; the few-row kernel (`pyramid_hf.cpu_kernels.skinny_linear`, AVX2, built once per
machine) reads each weight once for all rows of a call of up to 16 rows, and took the same target's 1 / 2 / 4 / 9 /
13-token forwards from 297 / 424 / 484 / 542 / 641 ms on oneDNN to 251 / 274 / 316 / 411 / 511. A block of 8
verified costs 1.6 one-token forwards instead of 1.8 (MKL: 3.1), which is what speculative decoding lives on.

Which kernel wins depends on the CPU, so ``cpu_linear="auto"`` times them, once per weight shape and process, at
1, 2, 4 ... 64 rows, on weights read from memory rather than cache (`pyramid_hf.cpu_kernels.cold`) and on at most
``PROBE_OUT_FEATURES`` output rows (a 151936-token head would take seconds); a `RoutedLinear` sends a call to the
kernel that won at the measured width that covers it, if it beat torch's by 5%. A reduced-vocabulary LM head
(`pyramid_hf.vocab_head`) is routed the same way. Only without gradients: training runs as before.

bf16 weights have three kernels: torch's (oneDNN, on AMX tiles where the CPU has them, reordering the plain weights
on every call), oneDNN on weights packed once per layer (`packed_weight`: as much memory again, offered only while it
fits in `PACKED_MEMORY_SHARE` of the memory available), and the few-row bf16 kernel
(`pyramid_hf.cpu_kernels.skinny_linear_bf16`, AVX512-BF16). On a 2-core AMX Xeon seen here torch's reads a one-row
call's weights at ~13 GB/s, the few-row kernel at ~21 (8960 x 1536: 2.2 -> 1.3 ms), while from 4 rows on AMX wins,
faster on packed weights; the 1.5B target's forward over 1 / 4 / 9 / 13 new tokens went 230 / 236 / 232 / 236 ms ->
192 / 195 / 198 / 196.

Exactness: the kernels compute the same float32 product in other summation orders (logits of the 1.5B differ by
<1e-4, the same size as MKL's own differences between a 1-row and an 8-row call). Every method in a run, target-only
decoding included, uses the same routed target, so speculative decoding stays token for token what the target
decodes alone (``tests/test_cpu_linear.py``).
"""

from __future__ import annotations

import logging
import weakref

import torch
from torch import nn

from .cpu_kernels import (
    CALIBRATION_ROWS,
    SKINNY_MAX_ROWS,
    available_memory_bytes,
    cold,
    onednn_available,
    onednn_linear,
    onednn_pack,
    onednn_packs,
    skinny_available,
    skinny_bf16_available,
    skinny_linear,
    skinny_linear_bf16,
    time_kernels,
)

logger = logging.getLogger("pyramid_hf")

MODES = ("auto", "skinny", "onednn", "torch")
ROUTED_DTYPES = (torch.float32, torch.bfloat16)


def few_row_linear(x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """The few-row kernel for the weights' dtype: AVX2 float32 or AVX512-BF16 bf16 (`pyramid_hf.cpu_kernels`)."""
    return (skinny_linear_bf16 if weight.dtype == torch.bfloat16 else skinny_linear)(x, weight, bias)


def few_row_available(dtype: torch.dtype) -> bool:
    return skinny_bf16_available() if dtype == torch.bfloat16 else skinny_available()


class PackCache:
    """A layer's prepacked weights, ``(key, packed)``. Copies and pickles as empty (oneDNN's opaque tensors can be
    neither), so a deep-copied or saved layer packs its own weights again on first use."""

    def __init__(self):
        self.entry = None

    def __deepcopy__(self, memo):
        return PackCache()

    def __reduce__(self):
        return (PackCache, ())


def packed_weight(owner: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """``weight`` in oneDNN's blocked layout (`pyramid_hf.cpu_kernels.onednn_pack`), packed on first use and cached on
    ``owner`` outside its state dict; packed again whenever the weights change (an in-place update bumps their
    version, ``.to()`` replaces them), so a stale copy is never read. It costs as much memory as the weights."""
    key = (weight.data_ptr(), weight._version, weight.dtype, tuple(weight.shape))
    cache = owner.__dict__.setdefault("_packed_weight", PackCache())
    if cache.entry is None or cache.entry[0] != key:
        cache.entry = None  # free the old copy before making the new one
        cache.entry = (key, onednn_pack(weight, SKINNY_MAX_ROWS))
    return cache.entry[1]


KERNELS = {"onednn": onednn_linear, "skinny": few_row_linear}  # the alternatives to torch's default kernel (and
# "packed": oneDNN on the prepacked weights, which `run_kernel` is given)
KERNEL_NAMES = {"onednn": "oneDNN", "skinny": "the few-row kernel",
                "packed": "oneDNN on prepacked weights"}  # as logs and reports name them
PROBE_OUT_FEATURES = 8192  # output rows timed: the kernels' relative speed depends on the call width, not on this
MIN_GAIN = 0.95  # another kernel must take at most 95% of torch's time at a width to be used there
_measured: dict[tuple, dict] = {}  # (out, in, dtype, packed offered) -> {width: kernel}, measured once per process
PACKED_MEMORY_SHARE = 0.5  # prepacked copies may take at most this share of the memory available when routing
_packed_reserved = [0]  # bytes of prepacked copies promised to routed layers so far (they are made on first use)
CPU_LINEAR_HELP = ("float32 and bf16 linears on CPU: auto (per call width, the fastest of torch's kernel, oneDNN "
                   "(bf16: on weights packed once, while the copies fit in memory) and the few-row kernel (float32 "
                   "on AVX2, bf16 on AVX512-BF16), measured here), skinny (the few-row kernel up to 16 rows, oneDNN "
                   "above), onednn (always), torch (never another; models also keep Transformers' SDPA attention "
                   "instead of packing grouped-query heads for few-token calls)")
DTYPE_HELP = ("model dtype: bfloat16, float32, float16; default: bfloat16 where the hardware multiplies it (GPUs, CPUs "
              "with AMX / AVX512-BF16), float32 elsewhere")


def check_cpu_linear(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown cpu_linear {mode!r}; choose from {', '.join(MODES)}")
    return mode


def covering_width(rows: int, widths=CALIBRATION_ROWS) -> int:
    """The narrowest measured width that holds a call of ``rows`` rows (the widest one for wider calls)."""
    return next((width for width in widths if width >= rows), widths[-1])


def fastest_kernels(rows, timings: dict) -> dict:
    """``{width: kernel}`` for the widths of ``rows`` where the fastest of ``timings``' kernels (name -> ms per
    width; ``inf`` where not timed) is not ``"torch"`` and took at most ``MIN_GAIN`` of torch's time."""
    chosen = {}
    for i, width in enumerate(rows):
        name = min(timings, key=lambda k: timings[k][i])
        if name != "torch" and timings[name][i] <= MIN_GAIN * timings["torch"][i]:
            chosen[width] = name
    return chosen


def routed_linear(x: torch.Tensor, weight: torch.Tensor, bias, width_kernels: dict,
                  owner: nn.Module | None = None) -> torch.Tensor:
    """``nn.functional.linear`` on the kernel ``width_kernels`` names for the call's covering width (torch's
    default where it names none, under autograd, and for other dtypes and devices); ``owner``: the module that
    caches prepacked weights (needed where a width names ``"packed"``)."""
    if (torch.is_grad_enabled() or x.dtype not in ROUTED_DTYPES or x.dtype != weight.dtype or x.device.type != "cpu"
            or x.numel() == 0):
        return nn.functional.linear(x, weight, bias)
    kernel = width_kernels.get(covering_width(x.numel() // x.shape[-1]))
    return run_kernel(kernel, x, weight, bias, packed_weight(owner, weight) if kernel == "packed" else None)


def run_kernel(kernel: str | None, x: torch.Tensor, weight: torch.Tensor, bias, packed=None) -> torch.Tensor:
    """``nn.functional.linear(x, weight, bias)`` on ``kernel`` (None: torch's; ``"packed"``: oneDNN on ``packed``,
    ``weight`` prepacked)."""
    if kernel == "packed":
        return onednn_linear(x, packed, bias)
    return (KERNELS[kernel] if kernel else nn.functional.linear)(x, weight, bias)


def forced_kernels(mode: str, dtype: torch.dtype = torch.float32) -> dict:
    """The routing of a mode that does not measure: ``"onednn"`` everywhere, ``"skinny"`` up to its widest (and
    oneDNN above it); bf16, which torch already runs on oneDNN, goes to oneDNN on prepacked weights instead."""
    if not onednn_available():
        wide = None
    elif dtype == torch.float32:
        wide = "onednn"
    else:  # bf16 needs oneDNN's packing, which some CPUs lack (`cpu_kernels.onednn_packs`)
        wide = "packed" if onednn_packs(dtype) else None
    if mode == "onednn":
        return dict.fromkeys(CALIBRATION_ROWS, wide) if wide else {}
    return {w: "skinny" if w <= SKINNY_MAX_ROWS else wide for w in CALIBRATION_ROWS if w <= SKINNY_MAX_ROWS or wide}


def measure_kernels(weight: torch.Tensor, rows=CALIBRATION_ROWS, repeats: int = 5, offer_packed: bool = True) -> dict:
    """``{width: kernel}``: where oneDNN (float32; bf16 on prepacked weights unless not ``offer_packed``) or the
    few-row kernel beats torch's default for ``weight`` (float32 or bf16) on this machine."""
    weight = weight.detach()[:PROBE_OUT_FEATURES]
    offer_packed = offer_packed and weight.dtype == torch.bfloat16 and onednn_available() and onednn_packs(weight.dtype)
    key = (*weight.shape, weight.dtype) + (("packed",) if offer_packed else ())
    if key not in _measured:
        kernels = {"torch": cold(nn.functional.linear, weight)}
        if onednn_available() and weight.dtype == torch.float32:
            kernels["onednn"] = cold(lambda v, w: onednn_linear(v, w, None), weight)
        if offer_packed:
            kernels["packed"] = cold(lambda v, p: onednn_linear(v, p, None), onednn_pack(weight, SKINNY_MAX_ROWS))
        if few_row_available(weight.dtype):
            kernels["skinny"] = cold(lambda v, w: few_row_linear(v, w, None), weight)
        try:
            timings = time_kernels(kernels, weight.shape[1], weight.dtype, rows, repeats,
                                   max_rows={"skinny": SKINNY_MAX_ROWS})
            _measured[key] = fastest_kernels(rows, timings)
        except RuntimeError as error:  # a build whose oneDNN cannot run this op: keep torch's kernel
            logger.info("another kernel unavailable for %s weights (%s): torch's kernel kept", key, error)
            _measured[key] = {}
    return _measured[key]


def cold_routed(weight: torch.Tensor, width_kernels: dict):
    """``fn(x)``: ``x @ weight.T`` routed by ``width_kernels`` as `routed_linear` does, on copies of ``weight`` (and of
    its prepacked form, where a width names ``"packed"``) read from memory, not cache (`cpu_kernels.cold`): what a
    routed layer costs inside a whole forward."""
    tensors = [weight.detach()]
    if "packed" in width_kernels.values():
        tensors.append(onednn_pack(weight, SKINNY_MAX_ROWS))

    def run(x, weight_copy, packed_copy=None):
        return run_kernel(width_kernels.get(covering_width(x.numel() // x.shape[-1])), x, weight_copy, None,
                          packed_copy)

    return cold(run, *tensors)


class RoutedLinear(nn.Linear):
    """An ``nn.Linear`` (same parameters, same state-dict keys) whose no-grad float32 / bf16 CPU calls run on the kernel
    ``width_kernels`` names for their width (`routed_linear`). Made in place by `route_linears`."""

    width_kernels: dict = {}

    def cold_float_linear(self, weight: torch.Tensor):
        """`cold_routed` for this layer's routing: the float path `pyramid_hf.quantize.Int8Linear` times int8
        against, on ``weight`` (a slice of this layer's)."""
        return cold_routed(weight, self.width_kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return routed_linear(x, self.weight, self.bias, self.width_kernels, self)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {describe_routes(self.width_kernels)}"


def describe_routes(width_kernels: dict) -> str:
    """e.g. ``"skinny at call widths [1, 2, 4, 8, 16], onednn at [32, 64]"``."""
    by_kernel = {}
    for width, kernel in sorted(width_kernels.items()):
        by_kernel.setdefault(kernel, []).append(width)
    return ", ".join(f"{kernel} at {'call widths ' if i == 0 else ''}{widths}"
                     for i, (kernel, widths) in enumerate(by_kernel.items())) or "torch's kernel at every width"


def as_routed(linear: nn.Linear, width_kernels: dict) -> RoutedLinear:
    """``linear`` itself, made a `RoutedLinear` (same object, parameters and hooks: only forward changes)."""
    linear.__class__ = RoutedLinear
    linear.width_kernels = dict(sorted(width_kernels.items()))
    return linear


def _routable(weight: torch.Tensor) -> bool:
    """Float32 and bf16 CPU weights that some kernel here may run faster than torch's."""
    return weight.device.type == "cpu" and weight.dtype in ROUTED_DTYPES and (
        onednn_available() or few_row_available(weight.dtype))


def _packing_fits(model: nn.Module) -> bool:
    """Whether prepacked copies of ``model``'s bf16 linear weights (as many bytes again) fit in `PACKED_MEMORY_SHARE`
    of the memory available, after the copies promised to models routed before; if so they are promised, until
    ``model`` is freed."""
    weights = {m.weight.data_ptr(): m.weight for m in model.modules()
               if isinstance(m, nn.Linear) and m.weight.dtype == torch.bfloat16 and m.weight.device.type == "cpu"}
    needed = sum(w.numel() * w.element_size() for w in weights.values())
    if not needed or not onednn_available():
        return True
    available = available_memory_bytes()
    if available is not None and _packed_reserved[0] + needed > PACKED_MEMORY_SHARE * available:
        logger.info("bf16 linears: no prepacked oneDNN copies (%.1f GB more would exceed %d%% of the %.1f GB "
                    "available)", needed / 1e9, PACKED_MEMORY_SHARE * 100, available / 1e9)
        return False
    _packed_reserved[0] += needed
    weakref.finalize(model, _release_packing, _packed_reserved, needed)
    return True


def _release_packing(reserved: list, size: int) -> None:
    reserved[0] -= size


def route_linears(model: nn.Module, mode: str = "auto") -> dict:
    """Route ``model``'s float32 / bf16 CPU ``nn.Linear`` layers (and a reduced-vocabulary LM head), in place:
    ``"auto"`` to the kernel that measured fastest here per call width, ``"skinny"`` to the few-row kernel up to 16
    rows and (float32) oneDNN above, ``"onednn"`` (float32) always to oneDNN, ``"torch"`` never; layers already
    routed are left as they are. bf16 layers route only where the few-row bf16 kernel runs (AVX512-BF16).
    Returns ``{"layers": n, "kernels": {kernel: [widths]}}``: how many layers route at least one width, and the
    union of widths per kernel."""
    from .vocab_head import ReducedVocabHead

    if check_cpu_linear(mode) == "torch":
        return {"layers": 0, "kernels": {}}
    if mode == "onednn" and not onednn_available():
        raise RuntimeError("cpu_linear='onednn' needs a torch build with oneDNN (torch.backends.mkldnn); this one "
                           "has none: use cpu_linear='auto' or 'torch'")
    if mode == "skinny":
        dtypes = {p.dtype for p in model.parameters() if p.device.type == "cpu"} & set(ROUTED_DTYPES)
        missing = [str(d).removeprefix("torch.") for d in sorted(dtypes, key=str) if not few_row_available(d)]
        if missing:
            raise RuntimeError(f"cpu_linear='skinny' needs the few-row kernel for {', '.join(missing)}, which could "
                               "not be built here (float32 needs an x86 CPU with AVX2, bfloat16 one with AVX512-BF16, "
                               "both a C++ compiler; the log says what failed): use cpu_linear='auto' or 'torch'")
    offer_packed = mode == "auto" and _packing_fits(model)  # forced modes route as told
    layers, kernels = 0, {}
    for module in list(model.modules()):
        if type(module) is nn.Linear and _routable(module.weight):
            weight = module.weight
            chosen = (forced_kernels(mode, weight.dtype) if mode != "auto"
                      else measure_kernels(weight, offer_packed=offer_packed))
            if chosen:
                as_routed(module, chosen)
        elif (isinstance(module, ReducedVocabHead) and module.kept_linear is None and not module.width_kernels
              and _routable(module.kept_weight)):
            weight = module.kept_weight
            chosen = (forced_kernels(mode, weight.dtype) if mode != "auto"
                      else measure_kernels(weight, offer_packed=offer_packed))
            module.width_kernels = dict(sorted(chosen.items()))
        else:
            continue
        if chosen:
            layers += 1
            for width, kernel in chosen.items():
                kernels.setdefault(kernel, set()).add(width)
    return {"layers": layers, "kernels": {k: sorted(v) for k, v in sorted(kernels.items())}}
