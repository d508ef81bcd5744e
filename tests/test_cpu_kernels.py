"""Guards for the private torch CPU kernels and probes that `pyramid_hf.cpu_kernels` wraps: each test fails loudly if
torch drops one or changes what it computes."""

import math
import platform
import shutil
from pathlib import Path

import pytest
import torch

from pyramid_hf import cpu_kernels
from pyramid_hf.cpu_kernels import (
    CALIBRATION_ROWS,
    SKINNY_MAX_ROWS,
    cold,
    int8_weight_only_matmul,
    native_bf16,
    onednn_available,
    onednn_linear,
    onednn_pack,
    onednn_packs,
    skinny_available,
    skinny_bf16_available,
    skinny_linear,
    skinny_linear_bf16,
    skinny_linear_int8,
    skinny_linear_int8_f32,
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_private_onednn_weight_packing_still_gives_the_same_linear(dtype):
    """Guard for ``torch.ops.mkldnn._reorder_linear_weight``: weights packed once give the product of the plain ones."""
    if not onednn_available():  # no oneDNN in this torch build: the packed route is never offered (test_cpu_linear)
        assert platform.machine().lower() not in ("x86_64", "amd64"), "x86 torch builds ship oneDNN"
        return
    g = torch.Generator().manual_seed(11)
    weight, bias = torch.randn(40, 64, generator=g).to(dtype), torch.randn(40, generator=g).to(dtype)
    if not onednn_packs(dtype):  # bf16 packing needs AVX512 or AVX-NE-CONVERT: the probe must say so, not crash
        assert dtype == torch.bfloat16 and not torch.cpu._is_avx512_bf16_supported()
        with pytest.raises(RuntimeError):
            onednn_pack(weight)
        return
    packed = onednn_pack(weight)
    assert packed.layout == torch._mkldnn and packed.shape == weight.shape
    for rows in (1, 3, 16, 40):
        x = torch.randn(rows, 64, generator=g).to(dtype)
        expected = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
        tol = 1e-5 if dtype == torch.float32 else 2**-8
        torch.testing.assert_close(onednn_linear(x, packed, bias).double(), expected, rtol=tol, atol=tol * 8)


def test_onednn_packs_bf16_exactly_where_the_cpu_flags_allow_it():
    """``onednn_packs`` probes oneDNN's weight packing once per dtype: float32 wherever oneDNN runs; bf16 only on CPUs
    with AVX512 BW/VL/DQ or AVX-NE-CONVERT (what oneDNN asks for; an AVX2-only EPYC raised), so routing never offers a
    packed route that would raise inside a forward."""
    assert onednn_packs(torch.float32) == onednn_available()
    cpuinfo = Path("/proc/cpuinfo")
    if onednn_available() and cpuinfo.is_file():
        flags = set(next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "").split())
        expected = {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags
        assert onednn_packs(torch.bfloat16) == expected


def test_time_kernels_interleaves_widths_and_stops_when_told():
    calls = []
    kernels = {"a": lambda x: calls.append(("a", x.shape[0])), "b": lambda x: calls.append(("b", x.shape[0]))}
    timings = time_kernels(kernels, 8, torch.float32, rows=(1, 2, 4), repeats=1)
    assert [len(v) for v in timings.values()] == [3, 3] and all(t >= 0 for v in timings.values() for t in v)
    assert [c for c in calls if c[0] == "a"] == [("a", 1)] * 2 + [("a", 2)] * 2 + [("a", 4)] * 2  # warm-up + 1
    calls.clear()
    time_kernels(kernels, 8, torch.float32, rows=(1,), repeats=3)  # warm-ups, then the kernels take turns
    assert [name for name, _ in calls] == ["a", "b"] + ["a", "b"] * 3
    calls.clear()
    stopped = time_kernels(kernels, 8, torch.float32, rows=CALIBRATION_ROWS, repeats=1,
                           stop_when=lambda t: len(t["a"]) == 2)
    assert [len(v) for v in stopped.values()] == [2, 2] and max(width for _, width in calls) == 2


def _can_build_skinny() -> bool:
    return (platform.machine().lower() in ("x86_64", "amd64") and shutil.which("c++") is not None
            and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))


@pytest.mark.parametrize("in_features,out_features", [(64, 40), (37, 11), (1536, 13), (8, 4)])
@pytest.mark.parametrize("bias", [True, False])
def test_the_few_row_kernel_builds_where_it_can_and_computes_a_float32_linear(in_features, out_features, bias):
    """``pyramid_hf/csrc/skinny_linear.cpp`` through torch's extension builder: built on x86 CPUs with AVX2 and a
    compiler (as CI's), the same product as ``nn.functional.linear`` for every width up to past its widest, tails of
    the input (not a multiple of 8) and output (not a multiple of 4) included, 2D / 3D / strided inputs."""
    assert skinny_available() == _can_build_skinny()
    if not _can_build_skinny():
        return
    g = torch.Generator().manual_seed(in_features + out_features)
    weight = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    for rows in (*range(1, SKINNY_MAX_ROWS + 2), 40):
        x = torch.randn(rows, in_features, generator=g)
        got = skinny_linear(x, weight, b)
        expected = torch.nn.functional.linear(x.double(), weight.double(), None if b is None else b.double())
        assert got.shape == (rows, out_features) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5 * math.sqrt(in_features))
    x3 = torch.randn(2, 5, in_features, generator=g)
    for view in (x3, x3[:, -1:], x3[:, ::2], x3.transpose(0, 1)):
        torch.testing.assert_close(skinny_linear(view, weight, b), torch.nn.functional.linear(view, weight, b),
                                   rtol=1e-5, atol=1e-4)


def test_the_few_row_kernel_gives_each_row_the_same_bits_whatever_the_call_width():
    """Each output row is summed in one fixed order: a row computed alone equals, bit for bit, the same row inside a
    call of 2 to 17 rows (what makes a verification call agree with one-token decoding)."""
    if not _can_build_skinny():
        assert not skinny_available()
        return
    g = torch.Generator().manual_seed(5)
    weight, bias = torch.randn(45, 203, generator=g), torch.randn(45, generator=g)
    x = torch.randn(17, 203, generator=g)
    alone = torch.cat([skinny_linear(x[i : i + 1], weight, bias) for i in range(17)])
    for rows in range(2, 18):
        assert torch.equal(skinny_linear(x[:rows], weight, bias), alone[:rows]), rows


def test_the_few_row_kernel_rejects_what_it_cannot_compute_and_falls_back_when_unbuildable(monkeypatch):
    if _can_build_skinny():
        weight = torch.randn(8, 16)
        with pytest.raises(RuntimeError, match="float32 only"):
            skinny_linear(torch.randn(2, 16).bfloat16(), weight.bfloat16(), None)
        with pytest.raises(RuntimeError, match=r"x's last dim \(15\) must equal weight's in_features \(16\)"):
            skinny_linear(torch.randn(2, 15), weight, None)
        with pytest.raises(RuntimeError, match="bias must be float32 of 8 values"):
            skinny_linear(torch.randn(2, 16), weight, torch.randn(7))
    cpu_kernels._skinny_extension.cache_clear()
    try:
        monkeypatch.setenv("CXX", "no-such-compiler-here")
        assert not skinny_available()  # no compiler: oneDNN / torch kernels serve, nothing crashes
        cpu_kernels._skinny_extension.cache_clear()
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
        assert not skinny_available()  # no AVX2
    finally:
        monkeypatch.undo()
        cpu_kernels._skinny_extension.cache_clear()


@pytest.mark.parametrize("in_features,out_features", [(64, 40), (37, 11), (896, 13), (8, 4), (5, 9), (96, 48)])
def test_the_few_row_float32_int8_kernel_computes_x_times_the_dequantized_weight(in_features, out_features):
    """``skinny_linear_int8_f32`` (in skinny_linear.cpp, AVX2): float32 x times int8 weights with per-row scales, to
    float32 rounding of the exact product, for every width up to past the widest register tile, with input tails (not
    a multiple of 8, also under 8) and output tails (not a multiple of 4); 2D / 3D / strided inputs; each row's bits do
    not depend on the call's width; and it rejects what it cannot compute."""
    if not _can_build_skinny():
        assert not skinny_available()
        return
    g = torch.Generator().manual_seed(in_features * 7 + out_features)
    weight_int8, scales = quantize_rows(torch.randn(out_features, in_features, generator=g))
    dequantized = weight_int8.double() * scales.double()[:, None]
    x = torch.randn(17, in_features, generator=g)
    alone = torch.cat([skinny_linear_int8_f32(x[i : i + 1], weight_int8, scales) for i in range(17)])
    for rows in range(1, 18):
        got = skinny_linear_int8_f32(x[:rows], weight_int8, scales)
        assert got.shape == (rows, out_features) and got.dtype == torch.float32
        assert torch.equal(got, alone[:rows]), rows
        torch.testing.assert_close(got.double(), x[:rows].double() @ dequantized.T, rtol=1e-5,
                                   atol=1e-6 * math.sqrt(in_features))
    x3 = torch.randn(2, 5, in_features, generator=g)
    for view in (x3, x3[:, -1:], x3[:, ::2], x3.transpose(0, 1)):
        torch.testing.assert_close(skinny_linear_int8_f32(view, weight_int8, scales).double(),
                                   view.double() @ dequantized.T, rtol=1e-5, atol=1e-6 * math.sqrt(in_features))
    with pytest.raises(RuntimeError, match="x must be float32"):
        skinny_linear_int8_f32(x.bfloat16(), weight_int8, scales)
    with pytest.raises(RuntimeError, match="weight must be a 2-d int8 CPU tensor"):
        skinny_linear_int8_f32(x, weight_int8.float(), scales)
    with pytest.raises(RuntimeError, match=f"scales must be floating point of {out_features} values"):
        skinny_linear_int8_f32(x, weight_int8, scales[:-1])
    with pytest.raises(RuntimeError, match=rf"x's last dim \({in_features + 1}\) must equal"):
        skinny_linear_int8_f32(torch.randn(2, in_features + 1), weight_int8, scales)


def _can_build_skinny_bf16() -> bool:
    return (platform.machine().lower() in ("x86_64", "amd64") and shutil.which("c++") is not None
            and torch.cpu._is_avx512_bf16_supported())


@pytest.mark.parametrize("in_features,out_features", [(64, 40), (37, 11), (1536, 13), (8, 4)])
@pytest.mark.parametrize("bias", [True, False])
def test_the_few_row_bf16_kernel_builds_where_it_can_and_computes_a_bf16_linear(in_features, out_features, bias):
    """``pyramid_hf/csrc/skinny_linear_bf16.cpp``: built on x86 CPUs with AVX512-BF16 and a compiler, the bf16 linear
    to within one bf16 rounding of the exact result, for every width up to past the widest, input tails (not a
    multiple of 32) and output tails (not a multiple of 4) included, 2D / 3D / strided inputs."""
    assert skinny_bf16_available() == _can_build_skinny_bf16()
    if not _can_build_skinny_bf16():
        return
    g = torch.Generator().manual_seed(in_features * out_features)
    weight = torch.randn(out_features, in_features, generator=g).bfloat16()
    b = torch.randn(out_features, generator=g).bfloat16() if bias else None
    for rows in (*range(1, SKINNY_MAX_ROWS + 2), 40):
        x = torch.randn(rows, in_features, generator=g).bfloat16()
        got = skinny_linear_bf16(x, weight, b)
        exact = torch.nn.functional.linear(x.double(), weight.double(), None if b is None else b.double())
        assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=1e-5 * math.sqrt(in_features))
    x3 = torch.randn(2, 5, in_features, generator=g).bfloat16()
    for view in (x3, x3[:, -1:], x3[:, ::2], x3.transpose(0, 1)):
        torch.testing.assert_close(skinny_linear_bf16(view, weight, b).double(),
                                   torch.nn.functional.linear(view.double(), weight.double(),
                                                              None if b is None else b.double()),
                                   rtol=2**-8, atol=1e-5 * math.sqrt(in_features))


def test_the_few_row_bf16_kernel_gives_each_row_the_same_bits_whatever_the_call_width():
    if not _can_build_skinny_bf16():
        assert not skinny_bf16_available()
        return
    g = torch.Generator().manual_seed(6)
    weight, bias = torch.randn(45, 203, generator=g).bfloat16(), torch.randn(45, generator=g).bfloat16()
    x = torch.randn(17, 203, generator=g).bfloat16()
    alone = torch.cat([skinny_linear_bf16(x[i : i + 1], weight, bias) for i in range(17)])
    for rows in range(2, 18):
        assert torch.equal(skinny_linear_bf16(x[:rows], weight, bias), alone[:rows]), rows


def test_the_few_row_bf16_kernel_rejects_what_it_cannot_compute_and_falls_back_when_unbuildable(monkeypatch):
    if _can_build_skinny_bf16():
        weight = torch.randn(8, 16).bfloat16()
        with pytest.raises(RuntimeError, match="x must be bfloat16"):
            skinny_linear_bf16(torch.randn(2, 16), weight, None)
        with pytest.raises(RuntimeError, match="weight must be a 2-d bfloat16 CPU tensor"):
            skinny_linear_bf16(torch.randn(2, 16).bfloat16(), weight.float(), None)
        with pytest.raises(RuntimeError, match=r"x's last dim \(15\) must equal the weight's in_features \(16\)"):
            skinny_linear_bf16(torch.randn(2, 15).bfloat16(), weight, None)
        with pytest.raises(RuntimeError, match="bias must be bfloat16 of 8 values"):
            skinny_linear_bf16(torch.randn(2, 16).bfloat16(), weight, torch.randn(8))
    cpu_kernels._skinny_bf16_extension.cache_clear()
    try:
        monkeypatch.setenv("CXX", "no-such-compiler-here")
        assert not skinny_bf16_available()  # no compiler: torch's kernels serve, nothing crashes
        cpu_kernels._skinny_bf16_extension.cache_clear()
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
        assert not skinny_bf16_available()  # no AVX512-BF16
    finally:
        monkeypatch.undo()
        cpu_kernels._skinny_bf16_extension.cache_clear()


@pytest.mark.parametrize("in_features,out_features", [(64, 40), (37, 11), (896, 13), (8, 4), (49, 5), (96, 48)])
def test_the_few_row_int8_kernel_computes_x_times_the_dequantized_weight(in_features, out_features):
    """``skinny_linear_int8`` (in skinny_linear_bf16.cpp): bf16 x times int8 weights with per-row scales, to within one
    bf16 rounding of the exact product, for every width up to past the widest register tile, with input tails (not a
    multiple of 32, also under 16 and between 16 and 32) and output tails; each row's bits do not depend on the call's
    width; and what it computes is what torch's int8 kernel computes."""
    if not _can_build_skinny_bf16():
        assert not skinny_bf16_available()
        return
    g = torch.Generator().manual_seed(in_features + out_features)
    weight_int8, scales = quantize_rows(torch.randn(out_features, in_features, generator=g))
    dequantized = weight_int8.double() * scales.double()[:, None]
    x = torch.randn(17, in_features, generator=g).bfloat16()
    alone = torch.cat([skinny_linear_int8(x[i : i + 1], weight_int8, scales) for i in range(17)])
    for rows in range(1, 18):
        got = skinny_linear_int8(x[:rows], weight_int8, scales)
        assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
        assert torch.equal(got, alone[:rows]), rows
        exact = x[:rows].double() @ dequantized.T
        torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=1e-5 * math.sqrt(in_features))
    if in_features % 32 == 0 and out_features % 8 == 0:  # torch's kernel reads blocks (other shapes crash it)
        torch.testing.assert_close(alone.double(), int8_weight_only_matmul(x, weight_int8, scales).double(),
                                   rtol=2**-7, atol=1e-4 * math.sqrt(in_features))
    with pytest.raises(RuntimeError, match="weight must be a 2-d int8 CPU tensor"):
        skinny_linear_int8(x, weight_int8.float(), scales)
    with pytest.raises(RuntimeError, match=f"scales must be bfloat16 of {out_features} values"):
        skinny_linear_int8(x, weight_int8, scales.float())


def test_cold_timing_cycles_through_copies_that_outsize_the_cache(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "cache_bytes", lambda: 4096)
    weight, scales = torch.randn(16, 16), torch.randn(16)  # 1024 + 64 bytes: 2 x 4096 needs 8 sets
    seen = []
    fn = cold(lambda x, w, s: seen.append((w.data_ptr(), s.data_ptr())) or x @ w.T * s, weight, scales)
    x = torch.randn(3, 16)
    for _ in range(16):
        torch.testing.assert_close(fn(x), x @ weight.T * scales)
    assert len(set(seen)) == 8 and seen[:8] == seen[8:]  # eight distinct copies, in turn
    monkeypatch.setattr(cpu_kernels, "COLD_BYTES_CAP", 2048)
    few = []
    fn = cold(lambda x, w: few.append(w.data_ptr()), weight)
    for _ in range(4):
        fn(x)
    assert len(set(few)) == 2  # the memory cap wins over the cache size


def test_cache_bytes_reads_the_last_level_cache():
    assert 2**16 <= cpu_kernels.cache_bytes() <= 2**33


def test_time_kernels_skips_a_kernel_above_its_widest():
    timings = time_kernels({"a": lambda x: x, "b": lambda x: x}, 8, torch.float32, rows=(1, 2, 4), repeats=1,
                           max_rows={"b": 2})
    assert all(math.isfinite(t) for t in timings["a"]) and timings["b"][2] == math.inf
    assert all(math.isfinite(t) for t in timings["b"][:2])


def test_kernel_builds_are_named_by_the_shared_header_and_ship_with_it(tmp_path, monkeypatch):
    import ast
    import fnmatch
    import re

    csrc = Path(cpu_kernels.__file__).parent / "csrc"
    for source in (cpu_kernels.SKINNY_SOURCE, cpu_kernels.SKINNY_BF16_SOURCE):
        assert '#include "weight_tiles.h"' in source.read_text()
    assert [h.name for h in cpu_kernels.KERNEL_HEADERS] == ["weight_tiles.h"]
    # torch's build cache keys on the sources alone: an edited header must change the build's name
    before = cpu_kernels._build_name("k")
    header = tmp_path / "weight_tiles.h"
    header.write_text(cpu_kernels.KERNEL_HEADERS[0].read_text() + "// edited\n")
    monkeypatch.setattr(cpu_kernels, "KERNEL_HEADERS", (header,))
    assert cpu_kernels._build_name("k") != before and cpu_kernels._build_name("k").startswith("k_")
    # a wheel (non-editable install) carries every file the kernels compile
    pyproject = (csrc.parents[1] / "pyproject.toml").read_text()  # (tomllib needs Python 3.11)
    globs = ast.literal_eval(re.search(r"\[tool\.setuptools\.package-data\]\npyramid_hf = (\[.*\])", pyproject)[1])
    for path in csrc.iterdir():
        assert any(fnmatch.fnmatch(f"csrc/{path.name}", g) for g in globs), path.name
