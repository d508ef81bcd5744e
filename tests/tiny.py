"""Tiny random models built in process (fp32, seeded): one shared vocabulary, three sizes, two architectures."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

VOCAB = 97


def tiny_model(arch: str, hidden: int, layers: int, seed: int, vocab: int = VOCAB, init: float = 0.02, eos=None):
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  bos_token_id=0, pad_token_id=0, eos_token_id=eos, initializer_range=init)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = 0
    return model.eval()


def tiny_trio(arch: str = "llama", seed: int = 0, **kw):
    """(target, qualifier, draft): hidden 64/32/16, layers 3/2/2."""
    return (tiny_model(arch, 64, 3, seed, **kw), tiny_model(arch, 32, 2, seed + 1, **kw),
            tiny_model(arch, 16, 2, seed + 2, **kw))
