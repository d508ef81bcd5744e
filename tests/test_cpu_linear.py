"""Float32 linears routed to oneDNN: chosen per measured width, same outputs, and the pyramid stays exactly lossless."""

import copy
import gc
import io
import math

import pytest
import torch
from tiny import VOCAB, save_tiny_folders, tiny_model, tiny_trio
from torch import nn

from pyramid_hf import PyramidAssistant, PyramidConfig
from pyramid_hf.bench.main import BenchArgs
from pyramid_hf.cpu_kernels import (
    CALIBRATION_ROWS,
    SKINNY_MAX_ROWS,
    onednn_available,
    onednn_packs,
    skinny_available,
    skinny_bf16_available,
)
from pyramid_hf.cpu_linear import (
    PROBE_OUT_FEATURES,
    RoutedLinear,
    covering_width,
    fastest_kernels,
    forced_kernels,
    measure_kernels,
    route_linears,
)
from pyramid_hf.quantize import Int8Linear, quantize_model
from pyramid_hf.textgen import GenerateArgs


def _ids(seed, n=6):
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def test_covering_width_and_the_winning_rule():
    assert [covering_width(r) for r in (1, 2, 3, 5, 8, 9, 64, 65, 300)] == [1, 2, 4, 8, 8, 16, 64, 64, 64]
    rows = (1, 2, 4, 8)
    # an AVX2 EPYC: MKL's narrow calls are slow; oneDNN beats it, the few-row kernel beats both
    assert fastest_kernels(rows, {"torch": [3.6, 7.3, 11.9, 12.3], "onednn": [2.4, 4.4, 4.4, 4.5],
                                  "skinny": [2.4, 2.1, 2.6, 3.3]}) == {1: "onednn", 2: "skinny", 4: "skinny", 8: "skinny"}
    # a CPU where torch's default is as good: within 5% is not worth a switch
    assert fastest_kernels(rows, {"torch": [3.0, 3.1, 3.2, 3.4], "onednn": [2.9, 3.0, 3.3, 2.0]}) == {8: "onednn"}
    # a kernel not timed at a width (inf: above the few-row kernel's widest) never wins there
    assert fastest_kernels((16, 32), {"torch": [9.0, 9.0], "onednn": [5.0, 5.0], "skinny": [4.0, math.inf]}) == {
        16: "skinny", 32: "onednn"}
    assert fastest_kernels((), {"torch": []}) == {}


@pytest.mark.parametrize("bias", [True, False])
def test_routed_linear_matches_the_float_layer_and_routes_only_what_it_should(bias, monkeypatch):
    from pyramid_hf import cpu_linear

    torch.manual_seed(0)
    layer, reference = nn.Linear(64, 40, bias=bias), nn.Linear(64, 40, bias=bias)
    reference.load_state_dict(layer.state_dict())
    monkeypatch.setattr(cpu_linear, "measure_kernels", lambda weight, **k: {1: "onednn", 2: "skinny"})
    assert route_linears(nn.Sequential(layer)) == {"layers": 1, "kernels": {"onednn": [1], "skinny": [2]}}
    assert type(layer) is RoutedLinear and set(layer.state_dict()) == set(reference.state_dict())
    assert "onednn at call widths [1], skinny at [2]" in repr(layer)
    used = []
    for name in ("onednn", "skinny"):
        monkeypatch.setitem(cpu_linear.KERNELS, name,
                            lambda *a, name=name: used.append((name, a[0].shape)) or nn.functional.linear(*a))
    with torch.no_grad():
        for shape in ((1, 1, 64), (1, 2, 64), (1, 3, 64), (7, 64)):
            x = torch.randn(*shape)
            torch.testing.assert_close(layer(x), reference(x), rtol=1e-5, atol=1e-5)
        layer(torch.randn(2, 64, dtype=torch.float64).float())
        assert layer(torch.randn(0, 64)).shape == (0, 40)  # an empty call: torch's own kernel
    assert used == [("onednn", (1, 1, 64)), ("skinny", (1, 2, 64)), ("skinny", (2, 64))]  # widths 1 and 2 only
    x = torch.randn(1, 64, requires_grad=True)
    layer(x).sum().backward()  # with gradients on: torch's own, differentiable path
    assert len(used) == 3 and x.grad is not None


def test_route_linears_modes_and_what_it_leaves_alone(monkeypatch):
    from pyramid_hf import cpu_linear

    with pytest.raises(ValueError, match="unknown cpu_linear 'mkl'; choose from auto, skinny, onednn, torch"):
        route_linears(tiny_model("llama", 32, 2), "mkl")
    assert route_linears(tiny_model("llama", 32, 2), "torch") == {"layers": 0, "kernels": {}}
    bf16_routes = route_linears(tiny_model("llama", 32, 2).to(torch.bfloat16), "onednn")["kernels"]
    # bf16: oneDNN on prepacked weights, where oneDNN can pack bf16 here (not on AVX2-only CPUs: torch's kernel stays)
    assert bf16_routes == ({"packed": list(CALIBRATION_ROWS)} if onednn_packs(torch.bfloat16) else {})
    assert route_linears(tiny_model("llama", 32, 2).to(torch.float16), "onednn")["layers"] == 0  # not float16
    model = tiny_model("llama", 32, 2)
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert route_linears(model, "onednn") == {"layers": linears, "kernels": {"onednn": list(CALIBRATION_ROWS)}}
    model = tiny_model("llama", 32, 2)
    assert route_linears(model, "skinny") == {"layers": linears,
                                              "kernels": {"onednn": [32, 64], "skinny": [1, 2, 4, 8, 16]}}
    assert forced_kernels("skinny") == {1: "skinny", 2: "skinny", 4: "skinny", 8: "skinny", 16: "skinny",
                                        32: "onednn", 64: "onednn"}
    monkeypatch.setattr(cpu_linear, "measure_kernels", lambda weight, **k: {})  # never faster here
    untouched = tiny_model("llama", 32, 2)
    assert route_linears(untouched, "auto")["layers"] == 0
    assert not any(isinstance(m, RoutedLinear) for m in untouched.modules())
    with pytest.raises(ValueError, match="unknown cpu_linear 'fast'"):
        GenerateArgs(prompt="x", cpu_linear="fast")
    with pytest.raises(ValueError, match="unknown cpu_linear 'fast'"):
        BenchArgs(out="x", cpu_linear="fast")


def test_widths_are_measured_once_per_shape(monkeypatch):
    from pyramid_hf import cpu_linear

    monkeypatch.setattr(cpu_linear, "_measured", {})
    chosen = measure_kernels(torch.randn(48, 32), rows=(1, 2, 32), repeats=1)
    assert set(chosen) <= {1, 2, 32} and set(chosen.values()) <= {"onednn", "skinny"}
    assert chosen.get(32) != "skinny"  # never timed above its widest (16 rows), so never chosen there
    assert cpu_linear._measured == {(48, 32, torch.float32): chosen}
    cpu_linear._measured[(48, 32, torch.float32)] = {4: "onednn"}  # a second layer of that shape reads it
    assert measure_kernels(torch.randn(48, 32)) == {4: "onednn"}
    measure_kernels(torch.randn(PROBE_OUT_FEATURES + 10, 8), rows=(1,), repeats=1)
    assert (PROBE_OUT_FEATURES, 8, torch.float32) in cpu_linear._measured  # only PROBE_OUT_FEATURES rows timed
    chosen_bf16 = measure_kernels(torch.randn(48, 32).bfloat16(), rows=(1, 2, 32), repeats=1)
    offered = {"skinny"} if skinny_bf16_available() else set()
    offered |= {"packed"} if onednn_available() else set()  # not plain oneDNN: torch's own bf16 kernel is that
    assert set(chosen_bf16.values()) <= offered
    assert chosen_bf16.get(32) != "skinny"  # never timed above its widest


def test_bf16_layers_on_prepacked_onednn_weights_follow_weight_updates(monkeypatch):
    """bf16 routes to oneDNN run on weights packed once per layer (outside the state dict); an in-place update or a
    dtype move of the weights packs them again, so a stale copy is never read."""
    from pyramid_hf import cpu_linear

    if not onednn_available() or not onednn_packs(torch.bfloat16):
        assert forced_kernels("onednn", torch.bfloat16) == {}
        return
    assert forced_kernels("onednn", torch.bfloat16) == dict.fromkeys(CALIBRATION_ROWS, "packed")
    monkeypatch.setattr(cpu_linear, "skinny_bf16_available", lambda: True)  # bf16 layers are routable
    plain = tiny_model("qwen2", 64, 2, seed=4).to(torch.bfloat16)
    routed = tiny_model("qwen2", 64, 2, seed=4).to(torch.bfloat16)
    assert route_linears(routed, "onednn")["kernels"] == {"packed": list(CALIBRATION_ROWS)}
    assert set(routed.state_dict()) == set(plain.state_dict())
    ids = _ids(9)
    with torch.no_grad():
        torch.testing.assert_close(routed(ids).logits.float(), plain(ids).logits.float(), rtol=0.05, atol=0.05)
        layer = routed.model.layers[0].mlp.down_proj
        x = torch.randn(3, layer.in_features).bfloat16()
        before = layer(x)
        layer.weight.mul_(-1)  # as an optimizer step would: in place
        torch.testing.assert_close(layer(x), -before)
        copied = copy.deepcopy(layer)  # the packed copy is opaque: copies and saves leave it behind
        torch.testing.assert_close(copied(x), layer(x))
        saved = io.BytesIO()
        torch.save(layer, saved)
        torch.testing.assert_close(torch.load(io.BytesIO(saved.getvalue()), weights_only=False)(x), layer(x))
        layer.float()
        torch.testing.assert_close(layer(x.float()), nn.functional.linear(x.float(), layer.weight))


def test_bf16_layers_stay_on_torch_where_onednn_cannot_pack_bf16(monkeypatch):
    """oneDNN packs bf16 weights only on CPUs with AVX512 or AVX-NE-CONVERT (elsewhere it raises): there no route, forced
    or measured, names the packed kernel, and bf16 layers still compute their linear."""
    from pyramid_hf import cpu_linear

    monkeypatch.setattr(cpu_linear, "onednn_packs", lambda dtype: False)
    monkeypatch.setattr(cpu_linear, "_measured", {})
    monkeypatch.setattr(cpu_linear, "onednn_pack", lambda *a, **k: pytest.fail("packed on a CPU that cannot"))
    assert forced_kernels("onednn", torch.bfloat16) == {}
    assert "packed" not in measure_kernels(torch.randn(48, 32).bfloat16(), rows=(1, 2), repeats=1).values()
    plain = tiny_model("qwen2", 64, 2, seed=4).to(torch.bfloat16)
    routed = tiny_model("qwen2", 64, 2, seed=4).to(torch.bfloat16)
    assert "packed" not in route_linears(routed, "onednn")["kernels"]
    with torch.no_grad():
        torch.testing.assert_close(routed(_ids(9)).logits.float(), plain(_ids(9)).logits.float(), rtol=0.05,
                                   atol=0.05)


def test_prepacked_copies_are_offered_only_while_they_fit_in_memory(monkeypatch):
    """Prepacked bf16 weights cost as much memory again: `route_linears` offers them only while the copies promised
    so far fit in half of the memory available (an 8B target on a 24 GB CPU would not); a freed model gives its
    promise back."""
    from pyramid_hf import cpu_linear

    offered = []
    monkeypatch.setattr(cpu_linear, "measure_kernels", lambda weight, offer_packed=True: offered.append(offer_packed)
                        or {})
    monkeypatch.setattr(cpu_linear, "onednn_available", lambda: True)
    monkeypatch.setattr(cpu_linear, "_packed_reserved", [0])
    model = tiny_model("llama", 32, 2).to(torch.bfloat16)
    size = sum(m.weight.numel() * 2 for m in model.modules() if isinstance(m, nn.Linear))
    monkeypatch.setattr(cpu_linear, "available_memory_bytes", lambda: 3 * size)
    route_linears(model, "auto")  # needs `size`, may use 1.5x it: offered, and promised
    assert offered and all(offered) and cpu_linear._packed_reserved == [size]
    offered.clear()
    route_linears(tiny_model("llama", 32, 2).to(torch.bfloat16), "auto")  # 2x size > 1.5x: not offered
    assert offered and not any(offered) and cpu_linear._packed_reserved == [size]
    del model
    gc.collect()
    assert cpu_linear._packed_reserved == [0]
    offered.clear()
    route_linears(tiny_model("llama", 32, 2).to(torch.bfloat16), "auto")  # room again once the first is gone
    assert offered and all(offered)


def test_bf16_layers_route_to_the_few_row_kernel_where_it_runs_and_stay_close_to_torch(monkeypatch):
    """bf16 models route only to the few-row AVX512-BF16 kernel (torch already runs bf16 on oneDNN), and only where
    it can be built; a routed model's logits stay within bf16 rounding of the plain model's."""
    from pyramid_hf import cpu_linear

    monkeypatch.setattr(cpu_linear, "_measured", {})
    plain = tiny_model("qwen2", 64, 2, seed=3).to(torch.bfloat16)
    routed = tiny_model("qwen2", 64, 2, seed=3).to(torch.bfloat16)
    if not skinny_bf16_available():
        with pytest.raises(RuntimeError, match="few-row kernel for bfloat16"):
            route_linears(routed, "skinny")
        assert "skinny" not in route_linears(routed, "auto")["kernels"]
        return
    report = route_linears(routed, "skinny")
    assert report["kernels"]["skinny"] == [w for w in CALIBRATION_ROWS if w <= SKINNY_MAX_ROWS]
    assert report["kernels"].get("packed", []) == ([w for w in CALIBRATION_ROWS if w > SKINNY_MAX_ROWS]
                                                   if onednn_available() else [])
    ids = _ids(7)
    with torch.no_grad():
        torch.testing.assert_close(routed(ids).logits.float(), plain(ids).logits.float(), rtol=0.05, atol=0.05)
        hidden = torch.randn(1, 5, 64).bfloat16()
        up_proj = routed.model.layers[0].mlp.up_proj
        alone = torch.cat([up_proj(hidden[:, i : i + 1]) for i in range(5)], dim=1)
        assert torch.equal(up_proj(hidden), alone)  # a verified block's rows equal one-token steps, bit for bit


def test_int8_layers_time_themselves_against_the_routed_float_path(monkeypatch):
    from pyramid_hf import quantize

    seen = []
    monkeypatch.setattr(quantize, "measure_max_int8_rows",
                        lambda *a, width_kernels=None, **k: seen.append(width_kernels) or 4)
    model = tiny_model("llama", 32, 2)
    route_linears(model, "onednn")
    quantize_model(model, "int8")
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert layers and all(isinstance(m.linear, RoutedLinear) for m in layers)
    assert seen and all(kernels == forced_kernels("onednn") for kernels in seen)


@pytest.mark.parametrize("mode", ["onednn", "skinny"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("draft_kind", ["model", "ngram_lookup"])
@pytest.mark.parametrize("seed,max_new,l_d,l_q", [(0, 1, 1, 1), (1, 21, 3, 5), (2, 40, 4, 8)])
def test_pyramid_on_routed_models_matches_routed_target_greedy(mode, arch, draft_kind, seed, max_new, l_d, l_q):
    """All three models routed to oneDNN at every width, or to the few-row kernel up to 16 rows (fp32): PSD exact
    reproduces the target's greedy tokens."""
    if mode == "skinny" and not skinny_available():
        with pytest.raises(RuntimeError, match="cpu_linear='skinny' needs the few-row kernel"):
            route_linears(tiny_model(arch, 32, 2), mode)
        return
    target, qualifier, draft = tiny_trio(arch, seed=60 + seed, init=0.5)
    before = target(_ids(seed)).logits
    for model in (target, qualifier, draft):
        assert route_linears(model, mode)["layers"] > 0
    with torch.no_grad():
        torch.testing.assert_close(target(_ids(seed)).logits, before, rtol=1e-4, atol=1e-4)
    draft = draft if draft_kind == "model" else "prompt_lookup"
    expected = target.generate(_ids(seed), do_sample=False, max_new_tokens=max_new)
    assistant = PyramidAssistant(qualifier, draft, PyramidConfig(draft_tokens=l_d, qualifier_tokens=l_q))
    got = target.generate(_ids(seed), assistant_model=assistant, do_sample=False, max_new_tokens=max_new)
    assert torch.equal(got, expected), f"{got.tolist()} != {expected.tolist()}"


def test_load_trio_routes_float32_models_and_picks_the_dtype(tmp_path, monkeypatch, caplog):
    from pyramid_hf import cpu_kernels, cpu_linear
    from pyramid_hf.trio import default_dtype, load_trio

    monkeypatch.setenv("PYRAMID_HF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_linear, "measure_kernels", lambda weight, **k: {1: "skinny", 2: "skinny", 4: "onednn", 8: "onednn"})
    target, qualifier, draft = tiny_trio("qwen2", seed=8)
    folders = save_tiny_folders(tmp_path, target=target, qualifier=qualifier, draft=draft)
    with caplog.at_level("INFO", logger="pyramid_hf"):
        trio = load_trio(None, **folders, dtype="float32")
    for role in ("target", "qualifier", "draft"):
        model = getattr(trio, role)
        assert any(isinstance(m, RoutedLinear) for m in model.modules()), role
        assert ("float32 linears: oneDNN at call widths [4, 8]; the few-row kernel at call widths [1, 2]"
                in trio.origins[role])
    assert any("float32 linears: oneDNN" in r.getMessage() for r in caplog.records)
    plain = load_trio(None, **folders, dtype="float32", cpu_linear="torch")
    assert not any(isinstance(m, RoutedLinear) for m in plain.target.modules())
    ids = _ids(3)
    expected = plain.target.generate(ids, do_sample=False, max_new_tokens=20)
    got = trio.target.generate(ids, do_sample=False, max_new_tokens=20, assistant_model=PyramidAssistant(
        trio.qualifier, trio.draft, PyramidConfig(draft_tokens=3, qualifier_tokens=4)))
    assert torch.equal(got, expected)
    for native, dtype in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(cpu_kernels, "native_bf16", lambda device, native=native: native)
        assert default_dtype() == str(dtype).removeprefix("torch.")
        assert next(load_trio(None, **folders).target.parameters()).dtype == dtype


def test_a_reduced_vocab_head_is_routed_too_and_stays_routed_under_int8():
    from pyramid_hf.vocab_head import ReducedVocabHead, apply_reduced_vocab

    model = tiny_model("qwen2", 32, 2, seed=3)
    first = route_linears(model, "onednn")["layers"]
    ids = _ids(4)
    with torch.no_grad():
        full = model(ids).logits
    apply_reduced_vocab(model, torch.arange(0, VOCAB, 2))
    head = model.get_output_embeddings()
    assert isinstance(head, ReducedVocabHead) and not head.width_kernels
    assert route_linears(model, "onednn") == {"layers": 1, "kernels": {"onednn": list(CALIBRATION_ROWS)}}  # the head
    assert head.width_kernels == forced_kernels("onednn") and first > 1
    with torch.no_grad():
        reduced = model(ids).logits
    torch.testing.assert_close(reduced[..., ::2], full[..., ::2], rtol=1e-4, atol=1e-4)
    assert torch.isinf(reduced[..., 1::2]).all()
    quantize_model(model, "int8", max_int8_rows=2)
    assert isinstance(head.kept_linear, Int8Linear) and isinstance(head.kept_linear.linear, RoutedLinear)
    assert route_linears(model, "onednn")["layers"] == 0  # everything is routed already


def test_builds_without_onednn_keep_torchs_kernel(monkeypatch):
    from pyramid_hf import cpu_linear
    from pyramid_hf.feature_train import FeatureDraftArguments

    monkeypatch.setattr(cpu_linear, "_measured", {})
    monkeypatch.setattr(cpu_linear, "onednn_available", lambda: False)
    model = tiny_model("llama", 32, 2)
    assert set(route_linears(model, "auto")["kernels"]) <= {"skinny"}  # the few-row kernel alone, where it won
    with pytest.raises(RuntimeError, match="cpu_linear='onednn' needs a torch build with oneDNN"):
        route_linears(model, "onednn")
    monkeypatch.setattr(cpu_linear, "skinny_available", lambda: False)  # neither: torch's kernel everywhere
    monkeypatch.setattr(cpu_linear, "_measured", {})
    assert route_linears(tiny_model("llama", 32, 2), "auto") == {"layers": 0, "kernels": {}}
    with pytest.raises(RuntimeError, match="cpu_linear='skinny' needs the few-row kernel for float32, which could not be built"):
        route_linears(tiny_model("llama", 32, 2), "skinny")
    monkeypatch.undo()
    monkeypatch.setattr(cpu_linear, "_measured", {})
    monkeypatch.setattr(cpu_linear, "skinny_available", lambda: False)

    def broken(*args):
        raise RuntimeError("mkldnn not supported on this platform")

    monkeypatch.setattr(cpu_linear, "onednn_linear", broken)
    assert measure_kernels(torch.randn(48, 32), rows=(1,), repeats=1) == {}
    with pytest.raises(ValueError, match="unknown cpu_linear 'fast'"):
        FeatureDraftArguments(cpu_linear="fast")


def test_models_list_says_what_this_machine_makes_the_defaults(monkeypatch, capsys):
    from pyramid_hf import cpu_kernels
    from pyramid_hf.cli import main
    from pyramid_hf.trio import hardware_summary

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cpu_kernels, "native_bf16", lambda device: False)
    monkeypatch.setattr(cpu_kernels, "onednn_available", lambda: True)
    monkeypatch.setattr(cpu_kernels, "skinny_available", lambda: True)
    line = hardware_summary()
    assert "bf16 matmuls on the CPU emulated" in line and "default --dtype float32" in line
    assert "times torch's kernel against oneDNN and the few-row AVX2 kernel" in line
    monkeypatch.setattr(cpu_kernels, "native_bf16", lambda device: True)
    monkeypatch.setattr(cpu_kernels, "skinny_bf16_available", lambda: True)
    line = hardware_summary()
    assert "in hardware -> default --dtype bfloat16" in line
    assert ("bfloat16 CPU linears: --cpu_linear auto times torch's kernel against oneDNN on prepacked weights and "
            "the few-row bf16 kernel" in line)
    monkeypatch.setattr(cpu_kernels, "onednn_available", lambda: False)
    assert "bfloat16 CPU linears: --cpu_linear auto times torch's kernel against the few-row bf16 kernel" in (
        hardware_summary())
    monkeypatch.setattr(cpu_kernels, "skinny_bf16_available", lambda: False)
    assert "bfloat16 CPU linears: torch's kernel (no other kernel for this dtype here)" in hardware_summary()
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert "this machine:" in out and "qwen-coder-cpu" in out.split("this machine:")[0]


def test_load_trio_takes_a_preset_name_and_names_the_presets_on_a_typo():
    from pyramid_hf.trio import load_trio

    with pytest.raises(ValueError, match="unknown preset 'qwen-coder-cpx'; available: .*qwen-coder-cpu"):
        load_trio("qwen-coder-cpx")
