"""Int8 weights for the qualifier and draft: close to the float layers, and the pyramid stays exactly lossless."""


import pytest
import torch
from test_sampling import _pvalues, _samples, _target_joint, sharp_trio  # noqa: F401 (fixture)
from tiny import VOCAB, save_tiny_folders, tiny_model, tiny_trio
from torch import nn

from pyramid_hf import PyramidAssistant, PyramidConfig
from pyramid_hf.bench.main import BenchArgs
from pyramid_hf.quantize import (
    INT8_CALIBRATION_ROWS,
    Int8Linear,
    int8_rows_of,
    measure_max_int8_rows,
    quantize_model,
    quantize_rows,
    widest_faster,
)
from pyramid_hf.textgen import GenerateArgs
from pyramid_hf.vocab_head import ReducedVocabHead, apply_reduced_vocab


@pytest.mark.parametrize("bias", [True, False])
def test_int8_linear_is_close_when_narrow_and_the_float_layer_when_wide(bias):
    torch.manual_seed(0)
    linear = nn.Linear(64, 40, bias=bias)
    layer = Int8Linear(linear, max_int8_rows=2)
    assert layer.weight is linear.weight and layer.bias is linear.bias
    with torch.no_grad():
        narrow = torch.randn(1, 2, 64)
        got, want = layer(narrow), linear(narrow)
        assert got.shape == want.shape and not torch.equal(got, want)  # int8 really ran
        assert (got - want).abs().max() < 0.02 * want.abs().max()
        wide = torch.randn(1, 3, 64)
        assert torch.equal(layer(wide), linear(wide))
    assert torch.equal(layer(narrow), linear(narrow))  # with gradients on: the float weights, differentiable


def test_quantize_model_counts_layers_and_refuses_bad_input():
    model = tiny_model("llama", 32, 2, seed=1)
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert quantize_model(tiny_model("llama", 32, 2, seed=1), "none") == 0
    assert quantize_model(model, "int8") == linears
    assert not any(type(m) is nn.Linear and not isinstance(p, Int8Linear)
                   for p in model.modules() for m in p.children())
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(model, "int8")
    with pytest.raises(ValueError, match="unknown quantization 'int4'; choose from none, int8"):
        quantize_model(tiny_model("llama", 32, 2), "int4")
    with pytest.raises(ValueError, match="max_int8_rows must be a non-negative integer or 'auto', got -1"):
        quantize_model(tiny_model("llama", 32, 2), "int8", max_int8_rows=-1)
    with pytest.raises(ValueError, match="max_int8_rows must be a non-negative integer or 'auto', got 'fast'"):
        quantize_model(tiny_model("llama", 32, 2), "int8", max_int8_rows="fast")
    with pytest.raises(ValueError, match="needs bfloat16 or float32 weights"):
        quantize_model(tiny_model("llama", 32, 2).half(), "int8")
    with pytest.raises(ValueError, match="CPU only .* on meta: load the qualifier with --qualifier_quantization none"):
        Int8Linear(nn.Linear(8, 8, device="meta"))
    with pytest.raises(ValueError, match="--qualifier_quantization must be none or int8, got 'int4'"):
        GenerateArgs(prompt="x", qualifier_quantization="int4")
    with pytest.raises(ValueError, match="--qualifier_quantization must be none or int8"):
        BenchArgs(out="x", qualifier_quantization="fp8")


def _ids(seed, n=6):
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("draft_kind", ["model", "ngram_lookup"])
@pytest.mark.parametrize("seed,max_new,l_d,l_q", [(0, 1, 1, 1), (1, 21, 3, 5), (2, 40, 4, 8)])
def test_pyramid_with_int8_levels_matches_target_greedy(arch, draft_kind, seed, max_new, l_d, l_q):
    """Every qualifier and draft call runs on int8 weights (max_int8_rows above any call's width)."""
    target, qualifier, draft = tiny_trio(arch, seed=40 + seed, init=0.5)
    if seed == 2:
        apply_reduced_vocab(qualifier, torch.arange(0, VOCAB, 2))  # and a quantized reduced head
    float_logits = qualifier(_ids(seed)).logits
    assert quantize_model(qualifier, "int8", max_int8_rows=64) > 0
    quantize_model(draft, "int8", max_int8_rows=64)
    with torch.no_grad():
        assert not torch.equal(qualifier(_ids(seed)).logits, float_logits)
    draft = draft if draft_kind == "model" else "prompt_lookup"
    expected = target.generate(_ids(seed), do_sample=False, max_new_tokens=max_new)
    assistant = PyramidAssistant(qualifier, draft, PyramidConfig(draft_tokens=l_d, qualifier_tokens=l_q))
    got = target.generate(_ids(seed), assistant_model=assistant, do_sample=False, max_new_tokens=max_new)
    assert torch.equal(got, expected), f"{got.tolist()} != {expected.tolist()}"
    assert max_new == 1 or assistant.total_stats.forward_calls["qualifier"] > 0  # one token: the target alone


def test_sampling_with_an_int8_qualifier_matches_the_target_distribution(sharp_trio):  # noqa: F811
    target, qualifier, draft = sharp_trio
    qualifier = tiny_model("llama", 16, 1, 5, vocab=8, init=0.5)
    quantize_model(qualifier, "int8", max_int8_rows=64)
    assistant = PyramidAssistant(qualifier, draft, PyramidConfig(draft_tokens=2, qualifier_tokens=2))
    pvals = _pvalues(_samples(target, assistant), _target_joint(target))
    assert min(pvals) > 1e-3, pvals


def test_load_trio_quantizes_the_qualifier_on_request(tmp_path, monkeypatch, caplog):
    from pyramid_hf import quantize
    from pyramid_hf.trio import load_trio

    monkeypatch.setenv("PYRAMID_HF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(quantize, "measure_max_int8_rows", lambda *a, **k: 8)  # what a real CPU may measure
    target, qualifier, _ = tiny_trio("qwen2", seed=7)
    folders = save_tiny_folders(tmp_path, target=target, qualifier=qualifier)
    kwargs = dict(folders, draft="prompt_lookup", dtype="float32", qualifier_vocab_size=24)
    plain = load_trio(None, **kwargs)
    assert not any(isinstance(m, Int8Linear) for m in plain.qualifier.modules())
    trio = load_trio(None, qualifier_quantization="int8", **kwargs)
    head = trio.qualifier.get_output_embeddings()
    assert isinstance(head, ReducedVocabHead) and isinstance(head.kept_linear, Int8Linear)
    assert "int8 weights for calls of <= 8 tokens" in trio.origins["qualifier"]
    assert not any(isinstance(m, Int8Linear) for m in trio.target.modules())
    monkeypatch.setattr(quantize, "measure_max_int8_rows", lambda *a, **k: 0)  # int8 never faster on this CPU
    with caplog.at_level("INFO", logger="pyramid_hf"):
        slow = load_trio(None, qualifier_quantization="int8", **kwargs)
    assert "int8 weights" not in slow.origins["qualifier"]
    assert any("int8 weights were not faster" in r.getMessage() for r in caplog.records)
    ids = _ids(9)
    expected = trio.target.generate(ids, do_sample=False, max_new_tokens=24)
    got = trio.target.generate(ids, do_sample=False, max_new_tokens=24, assistant_model=PyramidAssistant(
        trio.qualifier, trio.draft, PyramidConfig(draft_tokens=3, qualifier_tokens=4)))
    assert torch.equal(got, expected)


def test_widest_faster_keeps_int8_up_to_the_first_width_where_it_loses():
    rows = (1, 2, 4, 8, 16)
    # an AMX CPU (bf16 matrix units): int8 wins narrow calls only
    assert widest_faster(rows, [100, 102, 105, 110, 118], [60, 70, 79, 150, 240]) == 4
    # an AVX2-only CPU (bf16 emulated, cost ~ rows): int8 wins everywhere measured
    assert widest_faster(rows, [2.0, 3.7, 7.1, 14.0, 27.9], [0.8, 0.9, 1.4, 2.8, 5.4]) == 16
    assert widest_faster(rows, [1, 1, 1], [2, 0.5, 0.5]) == 0  # slower at one row: never, even if faster later
    assert widest_faster(rows[:2], [5, 5], [1, 1]) == 2  # calibration stopped early: the widest measured


def test_auto_width_is_measured_once_per_shape_and_used_by_the_layer(monkeypatch):
    from pyramid_hf import quantize

    monkeypatch.setattr(quantize, "_measured_rows", {})
    weight = torch.randn(64, 48, dtype=torch.bfloat16)
    weight_int8, scales = quantize_rows(weight)
    width = measure_max_int8_rows(weight, weight_int8, scales, repeats=1)
    assert width == 0 or width in INT8_CALIBRATION_ROWS
    assert quantize._measured_rows == {(64, 48, torch.bfloat16): width}
    quantize._measured_rows[(64, 48, torch.bfloat16)] = 3  # a second layer of that shape reads the measurement
    linear = nn.Linear(48, 64, bias=False).to(torch.bfloat16)
    layer = Int8Linear(linear)
    assert layer.max_int8_rows == 3 and int8_rows_of(nn.Sequential(layer)) == [3]
    with torch.no_grad():
        narrow, wide = torch.randn(3, 48, dtype=torch.bfloat16), torch.randn(4, 48, dtype=torch.bfloat16)
        assert not torch.equal(layer(narrow), linear(narrow)) and torch.equal(layer(wide), linear(wide))
    big = torch.randn(5000, 48)  # only the first PROBE_ROWS rows are timed: keyed by the probe's shape
    measure_max_int8_rows(big, *quantize_rows(big), rows=(1,), repeats=1)
    assert (quantize.PROBE_ROWS, 48, torch.float32) in quantize._measured_rows


def test_training_dtype_auto_and_the_emulated_bf16_warning(monkeypatch, caplog):
    from types import SimpleNamespace

    from pyramid_hf import cpu_kernels, feature_train
    from pyramid_hf.trio import _warn_emulated_bf16

    args = SimpleNamespace(device=torch.device("cpu"))
    for native, expected in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(cpu_kernels, "native_bf16", lambda device, native=native: native)
        assert feature_train.qualifier_dtype("auto", args) == expected
        assert feature_train.qualifier_dtype("float16", args) == "float16"
        caplog.clear()
        with caplog.at_level("WARNING", logger="pyramid_hf"):
            _warn_emulated_bf16(tiny_model("llama", 32, 2).to(torch.bfloat16))
            _warn_emulated_bf16(tiny_model("llama", 32, 2))  # float32: nothing to say
        warned = [r.getMessage() for r in caplog.records]
        assert len(warned) == (0 if native else 1)
        assert all("bf16 on a CPU without bf16 matrix units" in m for m in warned)


@pytest.mark.parametrize("built", ["bf16", "f32", "none"])
def test_int8_layers_run_the_few_row_kernel_where_it_is_built(monkeypatch, built):
    """`quantize.int8_matmul` (what `Int8Linear` calls): the package's few-row bf16 int8 kernel where it is built (CPUs
    with AVX512-BF16), else its float32 one (AVX2), else torch's int8 kernel; always in the caller's dtype. (All give
    the same values on these inputs, so the test watches which one is called and on what.)"""
    from pyramid_hf import quantize

    called = []

    def recording(kernel, out_dtype=None):
        def matmul(x, weight_int8, scales):
            called.append((kernel, x.dtype))
            return (x.float() @ (weight_int8.float() * scales.float()[:, None]).T).to(out_dtype or x.dtype)
        return matmul

    monkeypatch.setattr(quantize, "skinny_bf16_available", lambda: built == "bf16")
    monkeypatch.setattr(quantize, "skinny_available", lambda: built in ("bf16", "f32"))
    monkeypatch.setattr(quantize, "skinny_linear_int8", recording("few-row bf16", torch.bfloat16))
    monkeypatch.setattr(quantize, "skinny_linear_int8_f32", recording("few-row f32", torch.float32))
    monkeypatch.setattr(quantize, "int8_weight_only_matmul", recording("torch"))
    weight_int8, scales = quantize_rows(torch.randn(48, 64))
    layer = Int8Linear(nn.Linear(64, 48, bias=False), max_int8_rows=8)
    for dtype in (torch.bfloat16, torch.float32):
        assert quantize.int8_matmul(torch.randn(5, 64).to(dtype), weight_int8, scales).dtype == dtype
    with torch.no_grad():
        layer(torch.randn(3, 64))
    assert called == {"bf16": [("few-row bf16", torch.bfloat16)] * 3,
                      "f32": [("few-row f32", torch.float32)] * 3,
                      "none": [("torch", torch.bfloat16), ("torch", torch.float32), ("torch", torch.float32)]}[built]


def test_time_int8_kernels_times_every_kernel_at_every_width():
    from pyramid_hf.quantize import time_int8_kernels

    table = time_int8_kernels(shapes=((24, 40), (8, 16)), rows=(1, 3), repeats=1)
    assert [(row["shape"], row["rows"]) for row in table] == [("24 x 40", 1), ("24 x 40", 3), ("8 x 16", 1),
                                                              ("8 x 16", 3)]
    assert all(row[name] > 0 for row in table for name in ("float (routed)", "torch int8", "int8_matmul"))
