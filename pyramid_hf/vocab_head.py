"""Draft heads over a reduced vocabulary: the LM head computes logits for K frequent tokens only.

A cut draft spends most of its time in the LM head (Qwen2.5's 151,936 x 896 matrix is larger than six of its
decoder layers together). `ReducedVocabHead` keeps the rows of the K tokens most frequent on the training text,
computes K logits, and writes them back into a full-vocabulary row whose other entries are ``-inf``. The draft's
distribution is then a proper distribution over the full vocabulary that is zero outside the kept set, so exact
verification stays lossless: the verifier only ever sees proposals the draft could make, with their true
probabilities (speculative sampling's residual ``max(0, p - q)`` covers the tokens the draft cannot propose).

    kept_ids = select_vocab(token_counts(tokenizer, texts, vocab_size), 16384, always_keep=tokenizer.all_special_ids)
    apply_reduced_vocab(draft_model, kept_ids)       # in memory
    save_reduced_vocab(folder, kept_ids, source=...)  # a sidecar next to the unchanged full checkpoint

The checkpoint keeps its full head, so plain ``from_pretrained`` still loads it; `pyramid_hf.models.load_model`
applies the sidecar (``reduced_vocab.json``) when it finds one. Save the folder, not a model whose head was swapped
in memory: its ``save_pretrained`` would write ``lm_head.kept_weight``, which plain Transformers cannot load.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from .cpu_linear import routed_linear
from .levels import text_config

logger = logging.getLogger("pyramid_hf")

SIDECAR = "reduced_vocab.json"


def token_counts(tokenizer, texts, vocab_size: int, batch_size: int = 256) -> torch.Tensor:
    """(vocab_size,) int64: how often each token id occurs when ``texts`` are tokenized (no special tokens)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    texts = list(texts)
    for start in range(0, len(texts), batch_size):
        encoded = tokenizer(texts[start : start + batch_size], add_special_tokens=False)["input_ids"]
        ids = torch.tensor([i for row in encoded for i in row], dtype=torch.int64)
        if ids.numel() and int(ids.max()) >= vocab_size:
            raise ValueError(f"tokenizer produced id {int(ids.max())}, outside the model's vocabulary of {vocab_size}")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def select_vocab(counts: torch.Tensor, size: int, always_keep=()) -> torch.Tensor:
    """Sorted ids of the ``size`` most frequent tokens, ``always_keep`` (EOS, specials) included in the count."""
    vocab_size = counts.shape[0]
    always = sorted({int(i) for i in always_keep if i is not None})
    bad = [i for i in always if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"always_keep ids {bad} are outside the vocabulary of {vocab_size}")
    if not len(always) < size <= vocab_size:
        raise ValueError(f"reduced vocabulary size must be in ({len(always)}, {vocab_size}] (more than the "
                         f"{len(always)} ids always kept, at most the full vocabulary), got {size}")
    ranked = counts.to(torch.float64).clone()
    ranked[always] = float("inf")
    kept = torch.topk(ranked, size, sorted=False).indices  # ties broken by id order is not needed: kept is a set
    return kept.sort().values


def coverage(counts: torch.Tensor, kept_ids: torch.Tensor) -> float:
    """Share of token occurrences in ``counts`` that fall inside ``kept_ids``."""
    total = int(counts.sum())
    return float(counts[kept_ids].sum()) / total if total else 0.0


class ReducedVocabHead(nn.Module):
    """Computes logits for ``kept_ids`` only and returns full-vocabulary logits, ``-inf`` elsewhere."""

    def __init__(self, full_head: nn.Linear, kept_ids: torch.Tensor):
        super().__init__()
        weight = full_head.weight
        kept_ids = torch.as_tensor(kept_ids, dtype=torch.long)
        if kept_ids.ndim != 1 or kept_ids.numel() == 0 or int(kept_ids.max()) >= weight.shape[0] or int(kept_ids.min()) < 0:
            raise ValueError(f"kept_ids must be a non-empty 1-D list of ids in [0, {weight.shape[0]})")
        if torch.unique(kept_ids).numel() != kept_ids.numel():
            raise ValueError("kept_ids has repeated ids")
        self.full_vocab_size = weight.shape[0]
        self.register_buffer("kept_ids", kept_ids.to(weight.device), persistent=False)
        self.kept_weight = nn.Parameter(weight.detach()[self.kept_ids].clone(), requires_grad=weight.requires_grad)
        bias = getattr(full_head, "bias", None)
        self.kept_bias = None if bias is None else nn.Parameter(bias.detach()[self.kept_ids].clone())
        self.kept_linear = None  # set by `quantize`
        self.width_kernels = {}  # call width -> float32 / bf16 CPU kernel, set by `cpu_linear.route_linears`

    def quantize(self, max_int8_rows: int | str = "auto") -> None:
        """Int8 kept rows for narrow calls (`pyramid_hf.quantize.Int8Linear`); the float rows serve wider ones."""
        from .cpu_linear import as_routed
        from .quantize import Int8Linear

        linear = nn.Linear(*self.kept_weight.shape[::-1], bias=self.kept_bias is not None, device="meta")
        linear.weight, linear.bias = self.kept_weight, self.kept_bias
        if self.width_kernels:
            as_routed(linear, self.width_kernels)
        self.kept_linear = Int8Linear(linear, max_int8_rows)

    @property
    def weight(self) -> torch.Tensor:  # what code asking for an LM head's weight (dtype, device) expects
        return self.kept_weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.kept_linear is not None:
            kept_logits = self.kept_linear(hidden_states)
        else:
            kept_logits = routed_linear(hidden_states, self.kept_weight, self.kept_bias, self.width_kernels, self)
        logits = kept_logits.new_full((*kept_logits.shape[:-1], self.full_vocab_size), float("-inf"))
        return logits.index_copy_(-1, self.kept_ids, kept_logits)

    def extra_repr(self) -> str:
        return f"kept={self.kept_ids.numel()} of {self.full_vocab_size}"


def apply_reduced_vocab(model, kept_ids) -> nn.Module:
    """Swap ``model``'s LM head for a `ReducedVocabHead` over ``kept_ids`` (in place; returns the model)."""
    head = model.get_output_embeddings()
    if isinstance(head, ReducedVocabHead):
        raise ValueError("the model already has a reduced-vocabulary head")
    if not isinstance(head, nn.Linear):
        raise ValueError(f"cannot reduce an LM head of type {type(head).__name__}; expected nn.Linear")
    new_head = ReducedVocabHead(head, kept_ids)
    for config in {id(c): c for c in (model.config, text_config(model.config))}.values():
        config.tie_word_embeddings = False  # the kept rows are a copy: never re-tie them to the embeddings
    model.set_output_embeddings(new_head)
    return model


def save_reduced_vocab(folder, kept_ids, *, source: str, coverage_share: float | None = None) -> Path:
    path = Path(folder) / SIDECAR
    payload = {"size": int(len(kept_ids)), "source": source, "coverage": coverage_share,
               "kept_ids": [int(i) for i in kept_ids]}
    path.write_text(json.dumps(payload) + "\n")
    return path


def load_reduced_vocab(folder) -> torch.Tensor | None:
    """The kept ids stored in ``folder``'s sidecar, or None when it has none."""
    path = Path(folder) / SIDECAR
    if not path.is_file():
        return None
    try:
        payload = json.loads(path.read_text())
        kept_ids = torch.tensor(payload["kept_ids"], dtype=torch.long)
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path} is not a valid reduced-vocabulary file: {error}") from None
    if kept_ids.numel() != payload.get("size", kept_ids.numel()):
        raise ValueError(f"{path}: size {payload.get('size')} does not match its {kept_ids.numel()} kept ids")
    return kept_ids


def reduce_vocab_texts(source: str, limit: int | None = None) -> list[str]:
    """Texts whose token counts choose the kept vocabulary: for ``stdlib-code`` the standard-library modules the
    prompts come from, whole (code bodies are what a drafter proposes), for a Hub dataset its prompt column."""
    from .prompts import load_prompts, stdlib_code_files

    if source == "stdlib-code":
        return stdlib_code_files(limit=limit)
    return list(load_prompts(source, limit=limit)["prompt"])


def _always_kept_ids(folder: Path, tokenizer, config) -> list[int]:
    """Special tokens and every EOS / pad id the model's configs name: a draft must be able to stop."""
    from transformers import GenerationConfig

    configs = [config]
    if (folder / "generation_config.json").is_file():
        configs.append(GenerationConfig.from_pretrained(folder))
    return _special_ids(tokenizer, configs)


def _special_ids(tokenizer, configs) -> list[int]:
    ids = set(tokenizer.all_special_ids)
    for config in configs:
        for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
            value = getattr(config, name, None)
            ids.update(value if isinstance(value, (list, tuple)) else [] if value is None else [value])
    return sorted(int(i) for i in ids)


def reduce_loaded_vocab(model, tokenizer, size: int, cache_dir, texts: str = "stdlib-code") -> dict:
    """Give a loaded model an LM head over the ``size`` tokens most frequent in ``texts`` (in place).

    The kept ids are counted once per tokenizer and size and cached as a sidecar under ``cache_dir/vocab``.
    Returns the sidecar's facts (size, coverage, where it is cached).
    """
    from .prompts import corpus_cache_key

    vocab_size = int(text_config(model.config).vocab_size)
    key = f"{texts.replace('/', '--')}-{corpus_cache_key(tokenizer)}-v{vocab_size}-k{size}"
    folder = Path(cache_dir) / "vocab" / key
    try:
        kept_ids = load_reduced_vocab(folder)
    except ValueError as error:  # a half-written or foreign cache file: count again, never use it
        logger.warning("recounting the reduced vocabulary: %s", error)
        kept_ids = None
    if kept_ids is None:
        corpus = reduce_vocab_texts(texts)
        counts = token_counts(tokenizer, corpus, vocab_size)
        kept_ids = select_vocab(counts, size, always_keep=_special_ids(tokenizer, [model.config,
                                                                                    model.generation_config]))
        folder.mkdir(parents=True, exist_ok=True)
        save_reduced_vocab(folder, kept_ids, source=f"{texts} ({len(corpus)} texts, {int(counts.sum())} tokens)",
                           coverage_share=coverage(counts, kept_ids))
    apply_reduced_vocab(model, kept_ids)
    payload = json.loads((folder / SIDECAR).read_text())
    return {"size": int(kept_ids.numel()), "coverage": payload.get("coverage"), "sidecar": str(folder / SIDECAR)}


def reduce_vocab_folder(model_dir, out, *, size: int, texts: str = "stdlib-code", limit: int | None = None) -> dict:
    """Write ``out``: the model folder's files unchanged plus a sidecar choosing ``size`` kept tokens."""
    from transformers import AutoConfig, AutoTokenizer

    from .hub import copy_model_files

    src, out = Path(model_dir).expanduser(), Path(out).expanduser()
    if not (src / "config.json").is_file():
        raise ValueError(f"{src} is not a model folder (no config.json)")
    tokenizer = AutoTokenizer.from_pretrained(src)
    config = text_config(AutoConfig.from_pretrained(src))
    vocab_size = int(config.vocab_size)
    corpus = reduce_vocab_texts(texts, limit)
    if not corpus:
        raise ValueError(f"no texts to count tokens on from {texts!r}")
    counts = token_counts(tokenizer, corpus, vocab_size)
    kept_ids = select_vocab(counts, size, always_keep=_always_kept_ids(src, tokenizer, config))
    share = coverage(counts, kept_ids)
    if out.resolve() != src.resolve():
        out.mkdir(parents=True, exist_ok=True)
        copy_model_files(src, out)
    save_reduced_vocab(out, kept_ids, source=f"{texts} ({len(corpus)} texts, {int(counts.sum())} tokens)",
                       coverage_share=share)
    return {"out": out, "size": size, "vocab_size": vocab_size, "coverage": share, "texts": len(corpus),
            "tokens": int(counts.sum())}
