"""Tiny random models and a matching tokenizer, built in process (no downloads): for tests, the demo and examples.

All models share one vocabulary of ``VOCAB`` ids, so any two of them can be a draft/qualifier/target pyramid.
``tiny_tokenizer()`` is a real ``PreTrainedTokenizerFast`` over exactly those ids (word level: characters and a
few code words), so writers that save a tokenizer, chat-less prompting and decoding all work as with real models.
"""

from __future__ import annotations

import string

VOCAB = 97
PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
_WORDS = ["def", "return", "if", "else", "for", "in", "while", "import", "class", "print", "self", "None",
          "True", "False", "and", "or", "not", "pass", "range", "len"]


def _vocab() -> dict[str, int]:
    symbols = ["<pad>", "<eos>", "<unk>"] + _WORDS + list(string.ascii_lowercase + string.digits + "()[]{}:,.=+-*/<>'\"_#")
    symbols = list(dict.fromkeys(symbols))
    symbols += [f"<extra_{i}>" for i in range(VOCAB - len(symbols))]
    assert len(symbols) == VOCAB, len(symbols)
    return {s: i for i, s in enumerate(symbols)}


def tiny_tokenizer():
    """A fast tokenizer with ``VOCAB`` ids: words and single characters, split on whitespace and punctuation."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab=_vocab(), unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                     pre_tokenizers.Punctuation()])
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>", model_max_length=1024)


def tiny_model(arch: str = "llama", hidden: int = 64, layers: int = 3, seed: int = 0, vocab: int = VOCAB,
               init: float = 0.02, eos=None, tie_word_embeddings: bool = False):
    """A random Llama or Qwen2 causal LM (fp32, eval mode), seeded; ``eos=None`` never stops early."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if arch not in ("llama", "qwen2"):
        raise ValueError(f"unknown tiny architecture {arch!r}: llama or qwen2")
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  bos_token_id=PAD_ID, pad_token_id=PAD_ID, eos_token_id=eos, initializer_range=init,
                  tie_word_embeddings=tie_word_embeddings)
    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    model = model_class(config_class(**common))
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = PAD_ID
    return model.eval()


def tiny_trio(arch: str = "llama", seed: int = 0, **kw):
    """(target, qualifier, draft): hidden 64/32/16, layers 3/2/2, one shared vocabulary."""
    return (tiny_model(arch, 64, 3, seed, **kw), tiny_model(arch, 32, 2, seed + 1, **kw),
            tiny_model(arch, 16, 2, seed + 2, **kw))


def save_tiny_folders(root, **models) -> dict:
    """Save each model with the tiny tokenizer as ``root/<name>`` (a local model folder); returns name -> path str."""
    from pathlib import Path

    folders = {}
    for name, model in models.items():
        folder = Path(root) / name
        model.save_pretrained(folder)
        tiny_tokenizer().save_pretrained(folder)
        folders[name] = str(folder)
    return folders
