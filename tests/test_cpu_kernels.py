"""Guards for the private torch CPU kernels and probes that `pyramid_hf.cpu_kernels` wraps: each test fails loudly if
torch drops one or changes what it computes."""

from pathlib import Path

import pytest
import torch

from pyramid_hf.cpu_kernels import (
    CALIBRATION_ROWS,
    int8_weight_only_matmul,
    native_bf16,
    onednn_available,
    onednn_linear,
    time_kernels,
)
from pyramid_hf.quantize import quantize_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_private_int8_kernel_still_computes_x_times_the_dequantized_weight(dtype):
    """Guard for ``torch._weight_int8pack_mm``: fails loudly if torch drops it or changes what it computes."""
    assert callable(getattr(torch, "_weight_int8pack_mm", None)), "torch._weight_int8pack_mm is gone"
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 64, generator=g).to(dtype)
    x = torch.randn(3, 64, generator=g).to(dtype)
    weight_int8, scales = quantize_rows(weight)
    assert weight_int8.dtype == torch.int8 and scales.shape == (48,) and scales.dtype == torch.bfloat16
    expected = x.bfloat16().float() @ (weight_int8.float() * scales.float()[:, None]).T  # on bf16 activations
    got = int8_weight_only_matmul(x, weight_int8, scales)
    assert got.shape == (3, 48) and got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)



def test_native_bf16_reads_the_cpu_flags_through_torch_private_probes():
    """Guard for ``torch.cpu._is_amx_tile_supported`` / ``_is_avx512_bf16_supported``: they must exist, answer a
    bool, and agree with what the kernel reports in /proc/cpuinfo."""
    for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        assert callable(getattr(torch.cpu, probe, None)), f"torch.cpu.{probe} is gone"
        assert isinstance(getattr(torch.cpu, probe)(), bool)
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        flags = set(next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "").split())
        assert native_bf16("cpu") == bool({"amx_tile", "avx512_bf16"} & flags)
    if not torch.cuda.is_available():
        assert native_bf16("cuda") is False



@pytest.mark.parametrize("shape", [(1, 64), (5, 64), (2, 3, 64)])
@pytest.mark.parametrize("bias", [True, False])
def test_private_onednn_linear_still_computes_a_float32_linear(shape, bias):
    """Guard for ``torch.ops.mkldnn._linear_pointwise``: same product as ``nn.functional.linear`` for 2D and 3D
    inputs, with and without bias."""
    assert hasattr(torch.ops.mkldnn, "_linear_pointwise"), "torch.ops.mkldnn._linear_pointwise is gone"
    assert onednn_available() == torch.backends.mkldnn.is_available()
    g = torch.Generator().manual_seed(1)
    weight, x = torch.randn(40, 64, generator=g), torch.randn(*shape, generator=g)
    b = torch.randn(40, generator=g) if bias else None
    got = onednn_linear(x, weight, b)
    assert got.shape == (*shape[:-1], 40) and got.dtype == torch.float32
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, b), rtol=1e-5, atol=1e-5)
    if len(shape) == 3:  # views, as an LM head sees with logits_to_keep: strided, not contiguous
        for view in (x[:, -1:], x[:, ::2], x.transpose(0, 1)):
            assert not view.is_contiguous() or view.shape[1] == 1
            torch.testing.assert_close(onednn_linear(view, weight, b), torch.nn.functional.linear(view, weight, b),
                                       rtol=1e-5, atol=1e-5)


def test_time_kernels_interleaves_widths_and_stops_when_told():
    calls = []
    kernels = {"a": lambda x: calls.append(("a", x.shape[0])), "b": lambda x: calls.append(("b", x.shape[0]))}
    timings = time_kernels(kernels, 8, torch.float32, rows=(1, 2, 4), repeats=1)
    assert [len(v) for v in timings.values()] == [3, 3] and all(t >= 0 for v in timings.values() for t in v)
    assert [c for c in calls if c[0] == "a"] == [("a", 1)] * 2 + [("a", 2)] * 2 + [("a", 4)] * 2  # warm-up + 1
    calls.clear()
    stopped = time_kernels(kernels, 8, torch.float32, rows=CALIBRATION_ROWS, repeats=1,
                           stop_when=lambda t: len(t["a"]) == 2)
    assert [len(v) for v in stopped.values()] == [2, 2] and max(width for _, width in calls) == 2
