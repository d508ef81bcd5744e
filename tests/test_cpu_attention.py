"""Packed grouped-query attention (`pyramid_hf.cpu_attention`): the same values as Transformers' SDPA path on every
call it takes over, Transformers' path on every call it does not, and lossless decoding on models switched to it."""

import pytest
import torch
from tiny import VOCAB, tiny_model, tiny_trio
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import pyramid_hf.cpu_attention as cpu_attention
from pyramid_hf import PyramidAssistant, PyramidConfig
from pyramid_hf.cpu_attention import PACKED_GQA, packed_gqa_attention, packs, use_packed_gqa


class _Module(torch.nn.Module):
    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def _qkv(batch, heads, kv_heads, q_len, kv_len, dim=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    shape = (batch, heads, q_len, dim), (batch, kv_heads, kv_len, dim), (batch, kv_heads, kv_len, dim)
    return [torch.randn(s, generator=g, dtype=torch.float32).to(dtype) for s in shape]


def _causal(batch, q_len, kv_len, pad=0, additive=False):
    """(batch, 1, q, kv) mask for the last q of kv positions; row 0 of the batch has ``pad`` left-padded positions."""
    allowed = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len).repeat(batch, 1, 1, 1)
    allowed[0, :, :, :pad] = False
    if not additive:
        return allowed
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (14, 2), (12, 2), (8, 1)])
@pytest.mark.parametrize("q_len,mask_kind", [(1, None), (1, "bool"), (5, "bool"), (9, "additive"), (1, "padded"),
                                             (4, "padded")])
def test_packed_attention_equals_transformers_sdpa(heads, kv_heads, q_len, mask_kind):
    batch, kv_len = (2 if mask_kind == "padded" else 1), 23
    query, key, value = _qkv(batch, heads, kv_heads, q_len, kv_len, seed=heads * 100 + q_len)
    mask = None if mask_kind is None else _causal(batch, q_len, kv_len, pad=3 if mask_kind == "padded" else 0,
                                                  additive=mask_kind == "additive")
    module = _Module(heads // kv_heads)
    assert packs(query, key, mask)  # the call below runs the packed path, not the fallback
    got, weights = packed_gqa_attention(module, query, key, value, mask, scaling=0.3)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    assert weights is None and got.shape == expected.shape == (batch, q_len, heads, 16)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_packed_attention_in_bf16_stays_at_bf16_rounding():
    query, key, value = _qkv(1, 14, 2, 1, 300, dim=64, dtype=torch.bfloat16)
    module = _Module(7)
    got, _ = packed_gqa_attention(module, query, key, value, None)
    reference, _ = sdpa_attention_forward(module, query.float(), key.float(), value.float(), None)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference, rtol=0, atol=2e-2)


def test_calls_it_does_not_cover_go_to_transformers(monkeypatch):
    module = _Module(2)
    query, key, value = _qkv(1, 4, 2, 3, 10)
    mask = _causal(1, 3, 10)
    assert not packs(query, key, None)  # several tokens and no mask: a causal call
    assert not packs(query, key, mask.repeat(1, 4, 1, 1))  # a mask per head
    assert not packs(query.requires_grad_(), key, mask)  # training
    assert not packs(query.detach(), key, mask, dropout=0.1)
    assert not packs(query.detach(), key, mask, softcap=30.0)
    assert not packs(*_qkv(1, 4, 4, 3, 10)[:2], mask)  # no grouped heads: nothing to pack
    wide = _qkv(1, 4, 2, cpu_attention.MAX_PACKED_ROWS // 2 + 1, 80)
    assert not packs(wide[0], wide[1], _causal(1, wide[0].shape[2], 80))
    calls = []
    monkeypatch.setattr(cpu_attention, "sdpa_attention_forward", lambda *a, **k: calls.append(a) or ("sdpa", None))
    assert packed_gqa_attention(module, query.detach(), key, value, None)[0] == "sdpa" and len(calls) == 1


def _kv_heads_model(kv_heads):
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=kv_heads, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def test_use_packed_gqa_switches_only_cpu_sdpa_models_with_grouped_heads(tmp_path):
    model = tiny_model("qwen2", 32, 2)
    assert use_packed_gqa(model) and model.config._attn_implementation == PACKED_GQA
    assert model.model.config._attn_implementation == PACKED_GQA
    assert not use_packed_gqa(model)  # already switched
    model.save_pretrained(tmp_path)  # a saved (published) model does not ask its users for pyramid_hf's attention
    assert "packed" not in (tmp_path / "config.json").read_text()
    assert not use_packed_gqa(_kv_heads_model(4))  # one key/value head per query head
    eager = tiny_model("llama", 32, 2)
    eager.set_attn_implementation("eager")
    assert not use_packed_gqa(eager) and eager.config._attn_implementation == "eager"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_switched_models_give_the_same_logits_through_prefill_padding_and_decoding(arch, monkeypatch):
    reference, packed = tiny_model(arch, 64, 3, seed=4), tiny_model(arch, 64, 3, seed=4)
    assert use_packed_gqa(packed)
    ids = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding in row 0
    caches = {"reference": DynamicCache(), "packed": DynamicCache()}
    fallbacks = []
    real = cpu_attention.sdpa_attention_forward
    monkeypatch.setattr(cpu_attention, "sdpa_attention_forward", lambda *a, **k: fallbacks.append(1) or real(*a, **k))
    with torch.no_grad():
        for width in (11, 1, 1, 4, 1):  # a prefill, one-token steps, a 4-token check
            step_ids = ids[:, :width] if width > 1 else ids[:, -1:]
            mask = torch.cat([mask, torch.ones(2, width, dtype=mask.dtype)], 1) if width != 11 else mask
            fallbacks.clear()
            outputs = {name: model(input_ids=step_ids, attention_mask=mask, cache=caches[name], use_cache=True)
                       for name, model in (("reference", reference), ("packed", packed))}
            torch.testing.assert_close(outputs["packed"].logits, outputs["reference"].logits, rtol=1e-5, atol=1e-5)
            if width < 11:
                assert not fallbacks  # every layer of the switched model ran packed
            ids = torch.cat([ids, outputs["packed"].logits[:, -1:].argmax(-1)], 1)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("seed,prompt_len,max_new,l_d,l_q", [(0, 3, 30, 3, 6), (1, 9, 17, 4, 12), (2, 1, 9, 2, 3)])
def test_pyramid_on_packed_models_matches_packed_target_greedy(arch, seed, prompt_len, max_new, l_d, l_q):
    target, qualifier, draft = tiny_trio(arch, seed=seed)
    for model in (target, qualifier, draft):
        assert use_packed_gqa(model)
    ids = torch.randint(3, VOCAB, (1, prompt_len), generator=torch.Generator().manual_seed(seed))
    expected = target.generate(ids, do_sample=False, max_new_tokens=max_new)
    assistant = PyramidAssistant(qualifier, draft, PyramidConfig(draft_tokens=l_d, qualifier_tokens=l_q))
    got = target.generate(ids, assistant_model=assistant, do_sample=False, max_new_tokens=max_new)
    assert torch.equal(got, expected)


def test_time_layouts_times_both_paths_per_layout():
    rows = cpu_attention.time_layouts(layouts=((4, 2, 16),), contexts=(20,), tokens=(1, 3), repeats=2)
    assert [(r["context"], r["tokens"]) for r in rows] == [(20, 1), (20, 3)]
    assert all(r["sdpa_us"] > 0 and r["packed_us"] > 0 for r in rows)


def test_load_model_packs_cpu_attention_unless_torch_kernels_are_asked_for(tmp_path):
    from tiny import save_tiny_folders

    from pyramid_hf.models import load_model

    folder = save_tiny_folders(tmp_path, target=tiny_model("qwen2", 32, 2))["target"]
    plain = load_model(folder, dtype="float32", cpu_linear="torch")
    assert plain.model.config._attn_implementation == "sdpa" and "attention" not in plain.origin
    packed = load_model(folder, dtype="float32", cpu_linear="onednn")
    assert packed.model.config._attn_implementation == PACKED_GQA and "attention packed" in packed.origin
