"""Training a `FeatureDraft` against its qualifier, with Transformers' `Trainer` (so `accelerate launch` scales it).

The qualifier reads a block of text once (no gradient) and gives its last hidden state ``f_t`` at every position
and, through its LM head, its next-token distribution. The draft learns, at every position at once, to predict
``f_{t+1}`` from ``(f_t, x_{t+1})``: a KL term pulls the draft's distribution (the qualifier's head on the predicted
feature) toward the qualifier's, and a smooth-L1 term pulls the predicted feature toward the real one. With
``unroll_steps`` = k > 1 the draft also learns from its own predictions, as it drafts: pass s feeds the
features predicted in pass s - 1 (the real one at the first position) and is scored against the same targets.
The loss runs over the qualifier's reduced vocabulary when ``vocab_size`` is set (the head the pyramid uses).
The qualifier's forward is most of a step's cost; with ``cache_features`` its hidden states are kept per block
after their first read (`pyramid_hf.feature_store`), so later epochs over the same text cost only the draft's passes,
and with ``feature_cache_dir`` later runs over the same text too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from .cpu_linear import check_cpu_linear
from .feature_draft import FeatureDraft
from .feature_store import FeatureStore

logger = logging.getLogger("pyramid_hf")


@dataclass
class FeatureDraftArguments:
    """What to train (``TrainingArguments`` says how: steps, lr, batch size, output_dir, bf16, ...)."""

    qualifier: str = field(default="Qwen/Qwen2.5-Coder-0.5B-Instruct",
                           metadata={"help": "the model whose hidden states the draft reads (Hub id, folder, GGUF)"})
    qualifier_dtype: str = field(default="auto", metadata={
        "help": "the frozen qualifier's dtype; auto: bfloat16 where the hardware multiplies bf16 natively (GPU, CPU "
                "with AMX / AVX512-BF16), float32 elsewhere (an AVX2-only CPU emulates bf16: 4.5x slower steps)"})
    cpu_linear: str = field(default="auto", metadata={"help": "the frozen qualifier's float32 linears on CPU: auto "
                                                              "(oneDNN where measured faster), onednn, torch"})
    init_from: str | None = field(default=None, metadata={"help": "continue from a saved feature-draft folder"})
    init_layer: int = field(default=-1, metadata={"help": "qualifier decoder layer copied into a new draft"})
    feature_layers: list[int] = field(default_factory=lambda: [-1], metadata={
        "help": "which of the qualifier's hidden states a new draft reads (indices into output_hidden_states: 0 the "
                "embeddings, -1 the final post-norm state); several, e.g. 2 12 -1, are fused by a learnt linear "
                "map (EAGLE-3's low, middle and high layers)"})
    texts: str = field(default="stdlib-code", metadata={"help": "training text: 'stdlib-code' (offline: the Python "
                                                                "standard library's modules), a local folder of "
                                                                "*.py / *.txt files, a JSONL file of a model's own "
                                                                "completions (pyramid-sd write-completions), or a "
                                                                "Hub dataset"})
    text_column: str = field(default="text", metadata={"help": "column of a Hub dataset holding the text"})
    text_split: str = field(default="train", metadata={"help": "split of a Hub dataset"})
    max_texts: int | None = field(default=None, metadata={"help": "use at most this many texts"})
    block_size: int = field(default=256, metadata={"help": "tokens per training sequence"})
    vocab_size: int | None = field(default=32768, metadata={"help": "score over the qualifier's N most frequent "
                                                                    "tokens (its reduced head); None: full vocabulary"})
    feature_loss_weight: float = field(default=0.1, metadata={"help": "weight of the smooth-L1 feature term"})
    unroll_steps: int = field(default=2, metadata={"help": "passes per step; pass s > 1 reads pass s-1's features"})
    cache_features: bool = field(default=False, metadata={
        "help": "keep the frozen qualifier's hidden states of every block after its first read, so later epochs "
                "skip the qualifier's forward (memory: blocks x block_size x hidden size x 2 or 4 bytes, on CPU)"})
    feature_cache_dir: str | None = field(default=None, metadata={
        "help": "keep those states in memory-mapped files under this folder instead of memory (implies "
                "cache_features), one subfolder per qualifier, feature layers and text: later runs over the same "
                "text (a continued draft, another schedule) start at the cached speed"})

    def __post_init__(self):
        check_cpu_linear(self.cpu_linear)
        if self.block_size < 2:
            raise ValueError(f"block_size must be at least 2, got {self.block_size}")
        if self.unroll_steps < 1:
            raise ValueError(f"unroll_steps must be at least 1, got {self.unroll_steps}")
        if self.feature_loss_weight < 0:
            raise ValueError(f"feature_loss_weight must be >= 0, got {self.feature_loss_weight}")
        if self.vocab_size is not None and self.vocab_size < 2:
            raise ValueError(f"vocab_size must be at least 2 (or None for the full vocabulary), got {self.vocab_size}")
        if self.feature_cache_dir:
            self.cache_features = True


class FeatureDistillation(nn.Module):
    """The module `Trainer` optimises: the draft (trainable) plus a frozen qualifier that is not part of its state,
    so checkpoints hold only the draft."""

    def __init__(self, draft: FeatureDraft, qualifier, head_weight: torch.Tensor, feature_loss_weight: float = 0.1,
                 unroll_steps: int = 2, feature_store: FeatureStore | None = None):
        super().__init__()
        self.draft = draft
        object.__setattr__(self, "qualifier", qualifier.eval().requires_grad_(False))  # not a submodule
        self.register_buffer("head_weight", head_weight.detach().clone(), persistent=False)  # (K, H)
        self.feature_loss_weight = feature_loss_weight
        self.unroll_steps = unroll_steps
        self.feature_store = feature_store  # block index -> (selected states (T, k * H), final state (T, H))

    @torch.no_grad()
    def _qualifier_features(self, input_ids, attention_mask):
        device = self.head_weight.device
        if next(self.qualifier.parameters()).device != device:
            self.qualifier.to(device)
        out = self.qualifier(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                             logits_to_keep=1)
        # what the draft reads (B, T, k * H) and what it predicts: the final state (B, T, H), after the final norm
        return self.draft.select_features(out.hidden_states), out.hidden_states[-1]

    @torch.no_grad()
    def _qualifier_states(self, input_ids, attention_mask, block_index=None):
        """The qualifier's states (those the draft reads, and the final ones) and its input embeddings of
        ``input_ids``; with a feature store and the blocks' dataset indices, read from the store where every block of
        the batch was read before."""
        embeds = self.qualifier.get_input_embeddings()(input_ids)
        if self.feature_store is None or block_index is None:
            return self._qualifier_features(input_ids, attention_mask), embeds
        keys = [int(i) for i in block_index]
        stored = self.feature_store.get(keys)
        if stored is not None:
            return tuple(states.to(input_ids.device) for states in stored), embeds
        selected, final = self._qualifier_features(input_ids, attention_mask)
        self.feature_store.put(keys, selected, final)
        return (selected, final), embeds

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                block_index: torch.Tensor | None = None, **_):
        (selected, final), embeds = self._qualifier_states(input_ids, attention_mask, block_index)
        dtype = self.draft.fc.weight.dtype
        features, embeds = self.draft.fuse_features(selected.to(dtype)), embeds.to(dtype)
        target_features = final[:, 1:].to(dtype)  # f_{j+1}, j = 0 .. T-2
        head = self.head_weight
        device_type = head.device.type
        if not (torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == head.dtype):
            head = head.to(dtype)  # under autocast in the head's dtype, the matmuls take it as it is: no cast a pass
        with torch.no_grad():
            teacher_probs, teacher_neg_entropy = teacher_distribution(F.linear(target_features, head))
        mask = None if attention_mask is None else attention_mask[:, 1:].to(torch.float32)
        inputs = features[:, :-1]
        total, parts = 0.0, {}
        for step in range(self.unroll_steps):
            predicted = self.draft(inputs, embeds[:, 1:], attention_mask=attention_mask[:, :-1]
                                   if attention_mask is not None else None)
            kl = kl_to_teacher(F.linear(predicted, head), teacher_probs, teacher_neg_entropy)  # (B, T-1)
            l1 = F.smooth_l1_loss(predicted.float(), target_features.float(), reduction="none").mean(-1)
            per_pos = kl + self.feature_loss_weight * l1
            loss = per_pos.mean() if mask is None else (per_pos * mask).sum() / mask.sum().clamp(min=1)
            total = total + loss / self.unroll_steps
            parts[f"kl_{step + 1}"] = float(kl.detach().mean())
            inputs = torch.cat([features[:, :1], predicted[:, :-1]], dim=1)  # next pass reads its own predictions
        self.last_parts = parts
        return {"loss": total}


_KL_ROWS = 64  # rows per chunk: a (64, 32768) float32 chunk is 8 MB, reused from the heap instead of fresh pages


def _row_chunks(count: int) -> list[slice]:
    return [slice(start, start + _KL_ROWS) for start in range(0, count, _KL_ROWS)]


def teacher_distribution(teacher_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., V) logits -> float32 probabilities (..., V) and sum_v p log p (...), computed in row chunks."""
    flat = teacher_logits.reshape(-1, teacher_logits.shape[-1])
    probs = torch.empty(flat.shape, dtype=torch.float32, device=flat.device)
    neg_entropy = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device)
    for rows in _row_chunks(flat.shape[0]):
        logp = torch.log_softmax(flat[rows].float(), dim=-1)
        probs[rows] = logp.exp()
        neg_entropy[rows] = (probs[rows] * logp).sum(-1)
    return probs.view(teacher_logits.shape), neg_entropy.view(teacher_logits.shape[:-1])


def kl_to_teacher(draft_logits: torch.Tensor, teacher_probs: torch.Tensor,
                  teacher_neg_entropy: torch.Tensor) -> torch.Tensor:
    """KL(teacher || softmax(draft_logits)) per row (...,), differentiable in ``draft_logits`` (..., V).

    Equal to ``sum p (log p - log_softmax(z))``, but as ``sum p log p - p.z + logsumexp(z)`` with the gradient
    ``softmax(z) - p`` written directly, in row chunks: the unfused form allocates and walks about ten (N, V) float32
    tensors per pass (on a 2-core CPU a fifth of a training step went to the kernel zeroing their fresh pages)."""
    return _KLToTeacher.apply(draft_logits, teacher_probs, teacher_neg_entropy)


class _KLToTeacher(torch.autograd.Function):
    @staticmethod
    def forward(ctx, draft_logits, teacher_probs, teacher_neg_entropy):
        vocab = draft_logits.shape[-1]
        logits, probs = draft_logits.reshape(-1, vocab), teacher_probs.reshape(-1, vocab)
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        dot = torch.empty_like(lse)
        for rows in _row_chunks(logits.shape[0]):
            chunk = logits[rows].float()
            lse[rows] = torch.logsumexp(chunk, dim=-1)
            dot[rows] = (probs[rows] * chunk).sum(-1)
        ctx.save_for_backward(draft_logits, teacher_probs, lse)
        return (teacher_neg_entropy.reshape(-1).float() - dot + lse).view(draft_logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad_kl):
        draft_logits, teacher_probs, lse = ctx.saved_tensors
        vocab = draft_logits.shape[-1]
        logits, probs = draft_logits.reshape(-1, vocab), teacher_probs.reshape(-1, vocab)
        grad_rows = grad_kl.reshape(-1, 1).float()
        grad = torch.empty_like(logits)
        for rows in _row_chunks(logits.shape[0]):
            softmax = (logits[rows].float() - lse[rows, None]).exp_()
            grad[rows] = softmax.sub_(probs[rows]).mul_(grad_rows[rows])
        return grad.view(draft_logits.shape), None, None


def text_blocks(tokenizer, texts: list[str], block_size: int) -> list[list[int]]:
    """Tokenize ``texts``, join them with EOS and cut the stream into ``block_size`` blocks (the tail is dropped)."""
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    for encoded in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        stream += encoded + ([eos] if eos is not None else [])
    return [stream[i : i + block_size] for i in range(0, len(stream) - block_size + 1, block_size)]


def load_texts(args: FeatureDraftArguments) -> list[str]:
    from .prompts import stdlib_code_files

    if args.texts == "stdlib-code":
        return stdlib_code_files(limit=args.max_texts)
    folder = Path(args.texts).expanduser()
    if folder.suffix == ".jsonl":
        from .completions import read_completions

        if not folder.is_file():
            raise FileNotFoundError(f"completions file not found: {folder} (write it with pyramid-sd write-completions)")
        return [r["text"] for r in read_completions(folder)][: args.max_texts]
    if folder.is_dir():
        files = sorted(p for p in folder.rglob("*") if p.suffix in (".py", ".txt") and p.is_file())
        if not files:
            raise ValueError(f"{folder} holds no *.py or *.txt files to train on")
        return [p.read_text(errors="replace") for p in files[: args.max_texts]]
    from datasets import load_dataset

    data = load_dataset(args.texts, split=args.text_split)
    if args.text_column not in data.column_names:
        raise ValueError(f"dataset {args.texts!r} has no column {args.text_column!r}: {data.column_names}")
    column = data[args.text_column]
    return list(column if args.max_texts is None else column[: args.max_texts])


def build_module(args: FeatureDraftArguments, qualifier, tokenizer) -> FeatureDistillation:
    """The draft (new or continued) and the scoring head (reduced to ``vocab_size`` tokens when set)."""
    from .models import cache_root
    from .vocab_head import ReducedVocabHead, reduce_loaded_vocab

    if args.init_from:
        draft = FeatureDraft.load(args.init_from, dtype=torch.float32)
        draft.check_qualifier(qualifier)
        if list(args.feature_layers) not in ([-1], list(draft.feature_layers)):
            raise ValueError(f"feature_layers {list(args.feature_layers)} differ from the draft's in {args.init_from} "
                             f"({list(draft.feature_layers)}): a continued draft keeps the states it was built for")
        draft.meta["steps_before"] = int(draft.meta.get("steps") or 0)  # saved folders count all steps
    else:
        draft = FeatureDraft.from_qualifier(qualifier, init_layer=args.init_layer,
                                            feature_layers=args.feature_layers).float()
    draft.train()
    head = qualifier.get_output_embeddings()
    if args.vocab_size and args.vocab_size < head.weight.shape[0] and not isinstance(head, ReducedVocabHead):
        reduce_loaded_vocab(qualifier, tokenizer, args.vocab_size, cache_root())
        head = qualifier.get_output_embeddings()
    return FeatureDistillation(draft, qualifier, head.weight, args.feature_loss_weight, args.unroll_steps)


def _save_draft(module: FeatureDistillation, folder: Path, args: FeatureDraftArguments, step: int, tokenizer) -> Path:
    """A loadable feature-draft folder (bf16) of the module's current draft; training state is left as it is."""
    import copy

    steps = int(module.draft.meta.get("steps_before", 0)) + step  # a continued draft counts its earlier runs
    copy.deepcopy(module.draft).to(torch.bfloat16).save(
        folder, qualifier=args.qualifier, texts=args.texts, steps=steps, block_size=args.block_size,
        unroll_steps=args.unroll_steps, vocab_size=args.vocab_size)
    tokenizer.save_pretrained(folder)
    return folder


def qualifier_dtype(name: str, training_args) -> str:
    """``name``, with "auto" resolved for the device training runs on (see `pyramid_hf.cpu_kernels.native_bf16`)."""
    from .cpu_kernels import native_bf16

    if name != "auto":
        return name
    device = getattr(training_args, "device", "cpu")
    resolved = "bfloat16" if native_bf16(device) else "float32"
    logger.info("qualifier dtype auto -> %s (%s %s bf16 matrix units)", resolved, torch.device(device).type,
                "has" if resolved == "bfloat16" else "has no")
    return resolved


def train(args: FeatureDraftArguments, training_args, *, qualifier=None, tokenizer=None) -> Path:
    """Train and save ``output_dir/final`` (a feature-draft folder); resumes from the last checkpoint if any."""
    from datasets import Dataset
    from transformers import Trainer, TrainerCallback

    from .distill import last_checkpoint
    from .models import load_model

    if qualifier is None:
        loaded = load_model(args.qualifier, dtype=qualifier_dtype(args.qualifier_dtype, training_args),
                            reduced_vocab=False, cpu_linear=args.cpu_linear)
        qualifier, tokenizer = loaded.model, loaded.tokenizer
        logger.info("qualifier: %s", loaded.origin)
    if tokenizer is None:
        raise ValueError("training a feature draft needs the qualifier's tokenizer")
    module = build_module(args, qualifier, tokenizer)
    blocks = text_blocks(tokenizer, load_texts(args), args.block_size)
    if not blocks:
        raise ValueError(f"no {args.block_size}-token block in the training text {args.texts!r}")
    logger.info("feature draft: %d blocks of %d tokens from %s", len(blocks), args.block_size, args.texts)
    if args.cache_features:
        module.feature_store = FeatureStore.for_draft(module.draft, qualifier, blocks, args.feature_cache_dir)
    training_args.remove_unused_columns = False

    class SaveDraftFolders(TrainerCallback):  # every checkpoint also as a loadable draft folder, for the curve
        def on_save(self, _args, state, control, **kwargs):
            if state.is_world_process_zero:
                step = int(state.global_step)
                _save_draft(module, Path(training_args.output_dir) / f"checkpoint-{step}" / "draft", args, step,
                            tokenizer)

    dataset = Dataset.from_dict({"input_ids": blocks, "block_index": list(range(len(blocks)))})
    trainer = Trainer(model=module, args=training_args, train_dataset=dataset,
                      callbacks=[SaveDraftFolders()])
    trainer.train(resume_from_checkpoint=last_checkpoint(training_args.output_dir))
    final = _save_draft(module, Path(training_args.output_dir) / "final", args, int(trainer.state.global_step),
                        tokenizer)
    logger.info("feature draft saved to %s", final)
    return final
