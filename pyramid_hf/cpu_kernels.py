"""The only module that calls torch's private CPU kernels and probes, and the timing helpers that choose among them.

- ``torch._weight_int8pack_mm``: int8 weight-only matmul (`pyramid_hf.quantize`).
- ``torch.ops.mkldnn._linear_pointwise``: a float linear on oneDNN, the kernel torch's compiler uses for CPU linears
  (`pyramid_hf.cpu_linear`). Eager float32 ``nn.functional.linear`` goes to MKL's sgemm instead, which on an AMD
  EPYC seen here (AVX2, no AVX512) runs narrow calls far below the CPU's speed: 8960 x 1536 at 1 / 8 rows took
  3.6 / 12.3 ms on MKL and 2.4 / 4.5 ms on oneDNN.
- ``torch.cpu._is_amx_tile_supported`` / ``torch.cpu._is_avx512_bf16_supported``: whether bf16 matmuls run in
  hardware (`native_bf16`).

``tests/test_cpu_kernels.py`` fails loudly if any of them disappears or changes what it computes.
"""

from __future__ import annotations

import time

import torch

CALIBRATION_ROWS = (1, 2, 4, 8, 16, 32, 64)  # call widths (rows) at which kernels are timed against each other


def int8_weight_only_matmul(x2d: torch.Tensor, weight_int8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x2d @ (weight_int8 * scales[:, None]).T`` for x2d (n, k) in bf16/fp32, weight_int8 (out, k), scales (out,)
    bf16; the product is in x2d's dtype. The kernel always runs on bf16 activations: with float32 ones torch's
    kernel is ~10x slower (896 x 4864, 1 row: 2.05 vs 0.20 ms here), slower even than the float32 matmul."""
    return torch._weight_int8pack_mm(x2d.to(torch.bfloat16), weight_int8, scales).to(x2d.dtype)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``nn.functional.linear(x, weight, bias)`` computed by oneDNN (CPU; no autograd)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def onednn_available() -> bool:
    """Whether this torch build has oneDNN and its linear op (ARM and other builds may lack either)."""
    try:
        return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


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


def median_ms(fn, x: torch.Tensor, repeats: int) -> float:
    """Median wall time of ``fn(x)`` in ms over ``repeats`` calls, after one warm-up call."""
    fn(x)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1000


@torch.no_grad()
def time_kernels(kernels: dict, in_features: int, dtype: torch.dtype, rows=CALIBRATION_ROWS, repeats: int = 5,
                 stop_when=None) -> dict[str, list[float]]:
    """Median ms of each of ``kernels`` (name -> fn(x2d)) at each width of ``rows``, interleaved width by width;
    ``stop_when(timings)`` may end the sweep early (the lists then stop at the last width measured)."""
    timings = {name: [] for name in kernels}
    for width in rows:
        x = torch.randn(width, in_features, dtype=dtype)
        for name, fn in kernels.items():
            timings[name].append(median_ms(fn, x, repeats))
        if stop_when is not None and stop_when(timings):
            break
    return timings
