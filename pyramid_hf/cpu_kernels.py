"""The only module that calls torch's private CPU kernels and probes, and the timing helpers that choose among them.

- ``torch._weight_int8pack_mm``: int8 weight-only matmul (`pyramid_hf.quantize`).
- ``torch.ops.mkldnn._linear_pointwise``: a float linear on oneDNN, the kernel torch's compiler uses for CPU linears
  (`pyramid_hf.cpu_linear`), on plain weights or on weights reordered once by ``torch.ops.mkldnn._reorder_linear_weight``
  (`onednn_pack`). Eager float32 ``nn.functional.linear`` goes to MKL's sgemm instead, which on an AMD
  EPYC seen here (AVX2, no AVX512) runs narrow calls far below the CPU's speed: 8960 x 1536 at 1 / 8 rows took
  3.6 / 12.3 ms on MKL and 2.4 / 4.5 ms on oneDNN.
- ``torch.utils.cpp_extension.load``: compiles ``pyramid_hf/csrc/skinny_linear.cpp`` once per machine, a float32
  linear for calls of few rows on AVX2 CPUs (`skinny_linear`); where it cannot be built (no compiler, no AVX2) the
  other kernels serve, and its twin over int8 weights on float32 activations (`skinny_linear_int8_f32`); and
  ``pyramid_hf/csrc/skinny_linear_bf16.cpp``, a bf16 linear for calls of few rows on CPUs with
  AVX512-BF16 (`skinny_linear_bf16`), where a one-token call reads the weights faster than torch's bf16 kernel, and
  its twin over int8 weights (`skinny_linear_int8`), which unlike torch's int8 kernel uses the bf16 dot products.
  Both include ``csrc/weight_tiles.h`` (how threads split the output features).
- ``torch.cpu._is_amx_tile_supported`` / ``torch.cpu._is_avx512_bf16_supported``: whether bf16 matmuls run in
  hardware (`native_bf16`).

``tests/test_cpu_kernels.py`` fails loudly if any of them disappears or changes what it computes.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import math
import os
import platform
import shutil
import time
from pathlib import Path

import torch

logger = logging.getLogger("pyramid_hf")

CALIBRATION_ROWS = (1, 2, 4, 8, 16, 32, 64)  # call widths (rows) at which kernels are timed against each other
SKINNY_MAX_ROWS = 16  # widest call the few-row kernel is timed (and used) at
SKINNY_SOURCE = Path(__file__).parent / "csrc" / "skinny_linear.cpp"
SKINNY_BF16_SOURCE = Path(__file__).parent / "csrc" / "skinny_linear_bf16.cpp"
KERNEL_HEADERS = (Path(__file__).parent / "csrc" / "weight_tiles.h",)  # included by both sources
COLD_BYTES_CAP = 512 * 2**20  # most memory the cold-cache timing copies may take


def int8_weight_only_matmul(x2d: torch.Tensor, weight_int8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x2d @ (weight_int8 * scales[:, None]).T`` for x2d (n, k) in bf16/fp32, weight_int8 (out, k), scales (out,)
    bf16; the product is in x2d's dtype. The kernel always runs on bf16 activations: with float32 ones torch's
    kernel is ~10x slower (896 x 4864, 1 row: 2.05 vs 0.20 ms here), slower even than the float32 matmul."""
    return torch._weight_int8pack_mm(x2d.to(torch.bfloat16), weight_int8, scales).to(x2d.dtype)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``nn.functional.linear(x, weight, bias)`` computed by oneDNN (CPU; no autograd)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def onednn_pack(weight: torch.Tensor, rows: int = 16) -> torch.Tensor:
    """``weight`` reordered once into oneDNN's blocked layout for calls of about ``rows`` rows (an opaque mkldnn
    tensor that only `onednn_linear` reads): torch's eager linear reorders the plain weights on every call."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)


def onednn_available() -> bool:
    """Whether this torch build has oneDNN and its linear op (ARM and other builds may lack either)."""
    try:
        return (bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")
                and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN can pack ``dtype`` weights here (`onednn_pack`): its bf16 packing needs AVX512 (BW, VL, DQ) or
    AVX-NE-CONVERT and raises on other CPUs (an AVX2-only AMD EPYC seen here), so the packed route is offered only
    where a probe on a tiny weight succeeds."""
    if not onednn_available():
        return False
    try:
        onednn_pack(torch.zeros(8, 16, dtype=dtype))
    except RuntimeError as error:
        logger.info("oneDNN cannot pack %s weights on this CPU (%s): the packed route is not offered", dtype,
                    str(error).strip().splitlines()[0])
        return False
    return True


def _build_name(name: str) -> str:
    """``name`` with a digest of the shared headers: torch's build cache keys on the sources' text alone, so an
    edited header gets a build of its own instead of an old one."""
    digest = hashlib.sha256(b"".join(header.read_bytes() for header in KERNEL_HEADERS)).hexdigest()[:10]
    return f"{name}_{digest}"


def _compile(name: str, source: Path, flags: list[str], what: str):
    """``source`` compiled and loaded as extension ``name`` (torch caches the build per machine: ~30 s once), or
    None, with a log line saying why, where it cannot be built."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        logger.warning("%s not built: no C++ compiler (%s) on PATH; the library kernels serve", what, compiler)
        return None
    if shutil.which("ninja") is None:  # torch's builder runs ninja: the pip package's copy, outside an active venv
        try:
            import ninja

            os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
        except ImportError:
            pass
    try:
        from torch.utils.cpp_extension import load

        logger.info("loading the %s (%s; compiled on first use, ~30 s, then cached by torch)", what, source.name)
        return load(name=_build_name(name), sources=[str(source)], extra_cflags=["-O3", *flags, "-fopenmp"],
                    extra_include_paths=[str(source.parent)], verbose=False)
    except Exception as error:  # noqa: BLE001 - any build failure: fall back, never crash decoding
        logger.warning("%s not built (%s: %s); the library kernels serve", what, type(error).__name__,
                       str(error).strip().splitlines()[-1:] or "")
        return None


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


@functools.cache
def _skinny_extension():
    """The compiled few-row float32 kernel, or None where it cannot run (no AVX2, no compiler)."""
    if not _x86():
        return None
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        logger.info("few-row float32 kernel not used: this CPU has no AVX2")
        return None
    return _compile("pyramid_hf_skinny_linear_v3", SKINNY_SOURCE, ["-mavx2", "-mfma"], "few-row float32 CPU kernel")


@functools.cache
def _skinny_bf16_extension():
    """The compiled few-row bf16 kernel, or None where it cannot run (no AVX512-BF16, no compiler)."""
    if not _x86() or not torch.cpu._is_avx512_bf16_supported():
        return None
    return _compile("pyramid_hf_skinny_linear_bf16_v1", SKINNY_BF16_SOURCE,
                    ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"], "few-row bf16 CPU kernel")


def skinny_available() -> bool:
    """Whether `skinny_linear` runs here (x86 CPU with AVX2, a C++ compiler; built on first call)."""
    return _skinny_extension() is not None


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``nn.functional.linear(x, weight, bias)`` in float32 by the few-row kernel (CPU, no autograd): each output
    row is computed in the same order whatever the number of rows in the call."""
    return _skinny_extension().skinny_linear(x, weight, bias)


def skinny_linear_int8_f32(x: torch.Tensor, weight_int8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x @ (weight_int8 * scales[:, None]).T`` for float32 ``x`` by the few-row AVX2 kernel (int8 weights widened to
    float32 in registers, float32 sums scaled once; CPU, no autograd), reading the weights once for all rows of a
    call; each row is the same whatever the number of rows. Where `skinny_available`."""
    return _skinny_extension().skinny_linear_int8_f32(x, weight_int8, scales)


def skinny_bf16_available() -> bool:
    """Whether `skinny_linear_bf16` runs here (x86 CPU with AVX512-BF16, a C++ compiler; built on first call)."""
    return _skinny_bf16_extension() is not None


def skinny_linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``nn.functional.linear(x, weight, bias)`` for bf16 ``x`` and ``weight`` by the few-row kernel (float32
    sums rounded once to bf16; CPU, no autograd); each output row is the same whatever the number of rows."""
    return _skinny_bf16_extension().skinny_linear_bf16(x, weight, bias)


def skinny_linear_int8(x: torch.Tensor, weight_int8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x @ (weight_int8 * scales[:, None]).T`` for bf16 ``x`` by the few-row kernel (int8 weights widened to bf16 in
    registers, float32 sums scaled and rounded once to bf16; CPU, no autograd): what `int8_weight_only_matmul`
    computes, reading the weights once for all rows of a call. Where `skinny_bf16_available`."""
    return _skinny_bf16_extension().skinny_linear_int8_bf16(x, weight_int8, scales)


def native_bf16(device="cpu") -> bool:
    """Whether ``device`` multiplies bf16 matrices in hardware: CUDA with bf16 support, or a CPU with AMX or
    AVX512-BF16. Elsewhere (e.g. AVX2-only CPUs) bf16 matmuls are emulated: a forward over k tokens costs about k
    one-token forwards (0.5B here: 98 ms for 1 token, 557 ms for 8), so wide calls run faster in float32."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return True  # other accelerators: trust their bf16
    return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())


def cache_bytes() -> int:
    """The CPU's last-level cache in bytes (Linux sysfs; 32 MiB where unknown)."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
            sizes.append(int(text[:-1]) * {"K": 2**10, "M": 2**20, "G": 2**30}[text[-1]] if text[-1] in "KMG"
                         else int(text))
        except (OSError, ValueError, KeyError):
            continue
    return max(sizes, default=32 * 2**20)


def available_memory_bytes() -> int | None:
    """Memory the system can still give this process (Linux ``MemAvailable``), or None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cold(fn, *tensors):
    """``fn(x, *tensors)`` as ``fn(x)`` cycling through enough copies of ``tensors`` (twice the last-level cache,
    at most `COLD_BYTES_CAP`) that each call reads them from memory, as a layer inside a whole model does. Timed on
    one warm copy, a small layer's weights stay in cache and every kernel looks faster than it is in decoding."""
    size = max(1, sum(t.numel() * t.element_size() for t in tensors))
    copies = max(1, min(math.ceil(2 * cache_bytes() / size), COLD_BYTES_CAP // size))
    sets = itertools.cycle([tensors] + [tuple(t.clone() for t in tensors) for _ in range(copies - 1)])
    return lambda x: fn(x, *next(sets))


@torch.no_grad()
def time_kernels(kernels: dict, in_features: int, dtype: torch.dtype, rows=CALIBRATION_ROWS, repeats: int = 5,
                 stop_when=None, max_rows: dict | None = None) -> dict[str, list[float]]:
    """Median ms of each of ``kernels`` (name -> fn(x2d)) at each width of ``rows``; at each width the kernels take
    turns call by call (after one warm-up call each), so a change in the machine's speed while they are timed (another
    process, a clock step) moves all of them alike instead of deciding which one looks faster. ``max_rows`` (name ->
    rows) skips a kernel above its widest (its time there is ``inf``); ``stop_when(timings)`` may end the sweep early
    (the lists then stop at the last width measured)."""
    max_rows = max_rows or {}
    timings = {name: [] for name in kernels}
    for width in rows:
        x = torch.randn(width, in_features, dtype=dtype)
        timed = {name: fn for name, fn in kernels.items() if width <= max_rows.get(name, width)}
        for fn in timed.values():
            fn(x)
        times = {name: [] for name in timed}
        for _ in range(repeats):
            for name, fn in timed.items():
                start = time.perf_counter()
                fn(x)
                times[name].append(time.perf_counter() - start)
        for name in kernels:
            timings[name].append(sorted(times[name])[repeats // 2] * 1000 if name in times else math.inf)
        if stop_when is not None and stop_when(timings):
            break
    return timings
