"""Grouped-query attention for few-token CPU calls, as a Transformers attention implementation.

For a one-token decoding step with no mask, Transformers' SDPA path calls
`torch.nn.functional.scaled_dot_product_attention(..., enable_gqa=True)` with one query row per head. On CPU that
kernel walks the cached keys once per query head with a one-row block. Laying the query heads that share a key/value
head out as rows of one block ("packing") gives the same kernel one pass over the keys per key/value head, at the same
arithmetic (bf16 inputs, float32 accumulation, the same online softmax; equal up to rounding order). Measured here
(`python -m pyramid_hf.cpu_attention`: 2-core Zen 4, bf16, 2 threads, alone), one query token over 150 / 400 / 1000
cached tokens took 154 / 405 / 988 us per layer through Transformers and 29 / 50 / 97 us packed for Qwen2.5-0.5B's
heads (14 query, 2 key/value, 64 wide); 206 / 663 / 1273 against 30 / 68 / 108 us for the 1.5B's (12 / 2, 128 wide).
In a one-token forward of the 1.5B over 300 cached tokens, attention went 13.5 -> 3.9 ms of ~140. Calls of 4-16
tokens with a mask (a pyramid's checks) gain 1.1-2x the same way (up to 7.8x for the 1.5B at 1000 cached tokens); at
192+ packed rows the kernel's blocking turned against it, so wider calls (and prefill) keep Transformers' path.

`PACKED_GQA` is registered with Transformers' public `AttentionInterface` (its masks built as for SDPA), and
`use_packed_gqa(model)` switches a CPU model that runs SDPA with grouped-query heads to it. Anything it does not
cover (other devices, gradients, dropout, masks per head, soft-capping, attention sinks, position biases, no mask on
a several-token call) goes to Transformers' own SDPA function unchanged.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

PACKED_GQA = "sdpa_packed_gqa"
MAX_PACKED_ROWS = 128  # query heads per key/value head x query tokens; measured even at 96-112, 2x slower at 192+
_UNCOVERED_KWARGS = ("softcap", "s_aux", "position_bias")


def packs(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
          **kwargs) -> bool:
    """Whether `packed_gqa_attention` runs this call itself (else it hands it to Transformers' SDPA function)."""
    batch, heads, q_len, _ = query.shape
    kv_heads = key.shape[1]
    if query.device.type != "cpu" or query.requires_grad or dropout or any(kwargs.get(k) is not None
                                                                           for k in _UNCOVERED_KWARGS):
        return False
    if kv_heads >= heads or heads % kv_heads or key.shape[0] != batch:
        return False
    if heads // kv_heads * q_len > MAX_PACKED_ROWS:
        return False
    if attention_mask is None:
        return q_len == 1  # several tokens without a mask mean a causal call: Transformers handles that
    return attention_mask.dim() == 4 and attention_mask.shape[1] == 1 and attention_mask.shape[0] in (1, batch)


def packed_gqa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Transformers' attention-function contract: query (B, H, q, D), key/value (B, H_kv, L, D), a mask in SDPA's
    form (bool, True = attend, or additive float; shared by all heads) -> ((B, q, H, D_v), None)."""
    if not packs(query, key, attention_mask, dropout, **kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    # query head h reads key/value head h // groups: its rows become rows [g * q_len, (g + 1) * q_len) of that head
    packed_query = query.reshape(batch, kv_heads, groups * q_len, dim)
    mask = attention_mask.repeat(1, 1, groups, 1) if attention_mask is not None and groups > 1 else attention_mask
    output = torch.nn.functional.scaled_dot_product_attention(packed_query, key, value, attn_mask=mask, scale=scaling)
    return output.reshape(batch, heads, q_len, value.shape[-1]).transpose(1, 2).contiguous(), None


AttentionInterface.register(PACKED_GQA, packed_gqa_attention)
AttentionMaskInterface.register(PACKED_GQA, sdpa_mask)


def _grouped(config) -> bool:
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return bool(heads) and kv_heads < heads


def use_packed_gqa(model: nn.Module) -> bool:
    """Switch ``model`` (a Transformers model, or any module holding them) to `PACKED_GQA` where it runs SDPA on CPU
    with grouped-query heads; True if anything was switched. The switch can be undone with
    ``set_attn_implementation("sdpa")``; a switched model moved to another device runs Transformers' SDPA there."""
    from transformers import PreTrainedModel

    switched = False
    for module in model.modules():
        config = getattr(module, "config", None)
        if not isinstance(module, PreTrainedModel) or getattr(config, "_attn_implementation", None) != "sdpa":
            continue
        if not _grouped(config) or next(module.parameters()).device.type != "cpu":
            continue
        module.set_attn_implementation(PACKED_GQA)
        switched = True
    return switched


def time_layouts(layouts=((14, 2, 64), (12, 2, 128)), contexts=(150, 400, 1000), tokens=(1, 4, 8, 16),
                 repeats: int = 30) -> list[dict]:
    """Median microseconds of one attention call, Transformers' SDPA path against the packed one, on random bf16
    tensors per (query heads, key/value heads, head width) layout; the two alternate call by call. Tokens > 1 carry a
    causal mask, as a pyramid's checks do."""
    import statistics
    import time

    rows = []
    for heads, kv_heads, dim in layouts:
        module = nn.Module()
        module.num_key_value_groups, module.is_causal = heads // kv_heads, True
        for context in contexts:
            for q_len in tokens:
                query = torch.randn(1, heads, q_len, dim, dtype=torch.bfloat16)
                key, value = (torch.randn(1, kv_heads, context, dim, dtype=torch.bfloat16) for _ in range(2))
                mask = None if q_len == 1 else torch.ones(q_len, context, dtype=torch.bool).tril(context - q_len)[
                    None, None]
                times = {"sdpa_us": [], "packed_us": []}
                for _ in range(repeats + 3):
                    for name, function in (("sdpa_us", sdpa_attention_forward), ("packed_us", packed_gqa_attention)):
                        start = time.perf_counter()
                        function(module, query, key, value, mask)
                        times[name].append(1e6 * (time.perf_counter() - start))
                rows.append({"heads": heads, "kv_heads": kv_heads, "dim": dim, "context": context, "tokens": q_len}
                            | {name: round(statistics.median(t[3:]), 1) for name, t in times.items()})
    return rows


if __name__ == "__main__":  # quick look on this CPU: python -m pyramid_hf.cpu_attention
    print("| heads (q/kv x width) | cached tokens | tokens | Transformers' SDPA us | packed us | ratio |")
    print("|---|---|---|---|---|---|")
    for row in time_layouts():
        print(f"| {row['heads']}/{row['kv_heads']} x {row['dim']} | {row['context']} | {row['tokens']} | "
              f"{row['sdpa_us']} | {row['packed_us']} | {row['sdpa_us'] / row['packed_us']:.2f} |")
