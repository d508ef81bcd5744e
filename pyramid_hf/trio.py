"""Three models of one family, loaded from a preset and/or explicit sources (Hub id, local folder, GGUF file)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from .assistant import PROMPT_LOOKUP
from .ngram_draft import NGRAM

logger = logging.getLogger("pyramid_hf")

NO_DRAFT = "none"
FREE_DRAFTS = (PROMPT_LOOKUP, NGRAM)


@dataclass
class Trio:
    """Loaded models: ``draft`` is a model, ``"prompt_lookup"``, a `CorpusNgramDraft` or None (the qualifier alone)."""

    target: object
    qualifier: object
    draft: object
    tokenizer: object
    origins: dict = field(default_factory=dict)

    @property
    def has_model_draft(self) -> bool:
        """A draft model that can also draft alone (for two-model SD); a feature draft needs the qualifier."""
        from .feature_draft import FeatureDraft

        return self.draft is not None and hasattr(self.draft, "forward") and not isinstance(self.draft, FeatureDraft)

    def roles(self) -> dict:
        """role -> model, for the models that run forwards."""
        out = {"target": self.target, "qualifier": self.qualifier}
        if hasattr(self.draft, "forward"):
            out["draft"] = self.draft
        return out


def _source_of(spec) -> str:
    return spec if isinstance(spec, str) else spec.source


def load_trio(preset=None, *, target: str | None = None, qualifier: str | None = None, draft: str | None = None,
              dtype=None, device_map=None, need_draft: bool = True,
              qualifier_vocab_size: int | None = None, qualifier_quantization: str | None = None,
              cpu_linear: str = "auto") -> Trio:
    """Load the target, qualifier and draft named by ``preset`` (a `Preset` or a preset's name), each overridable by a
    source string.

    ``draft`` may also be ``"prompt_lookup"`` (free n-gram drafting over the text so far), ``"ngram"`` (that plus
    a standard-library n-gram table, built once per tokenizer and cached) or ``"none"``. ``need_draft=False`` skips
    loading a model draft (e.g. for methods that never use it). ``qualifier_vocab_size`` (default: the preset's;
    0 = the full head) gives the qualifier an LM head over that many tokens, the most frequent in the standard
    library's code (`pyramid_hf.vocab_head.reduce_loaded_vocab`): cheaper per token and still lossless, since
    the target verifies a proper distribution. ``qualifier_quantization`` (default: the preset's; ``"none"`` or
    ``"int8"``) gives the qualifier int8 weights for its narrow calls (`pyramid_hf.quantize`; CPU only, lossless).
    ``dtype`` (default `default_dtype`: bfloat16 where the device multiplies it in hardware, else float32).
    ``cpu_linear`` (``"auto"``, ``"skinny"``, ``"onednn"``, ``"torch"``) routes CPU linears of all three models
    (float32: to oneDNN or the few-row AVX2 kernel; bf16: to oneDNN on weights packed once or the few-row
    AVX512-BF16 kernel) where that measured faster than torch's default (`pyramid_hf.cpu_linear`).
    """
    from .cpu_linear import route_linears
    from .models import get_preset, load_model

    if isinstance(preset, str):
        preset = get_preset(preset)  # unknown names: ValueError listing the presets
    sources = {
        "target": target or (preset and _source_of(preset.target)),
        "qualifier": qualifier or (preset and _source_of(preset.qualifier)),
        "draft": draft or (preset and _source_of(preset.draft)),
    }
    missing = [role for role in ("target", "qualifier") if not sources[role]]
    if missing:
        raise ValueError(f"no {' or '.join(missing)} given: pass --preset or --{missing[0]}")
    if dtype is None:
        dtype = default_dtype(device_map)
        logger.info("dtype: %s (%s)", dtype, "bf16 matmuls run in hardware here" if dtype == "bfloat16" else
                    "no bf16 matrix units here (no AMX / AVX512-BF16): bf16 would be emulated")
    loaded = {}
    for role in ("target", "qualifier", "draft"):
        source = sources[role]
        if role == "draft" and (not source or source in FREE_DRAFTS + (NO_DRAFT,) or not need_draft):
            continue
        loaded[role] = load_model(source, dtype=dtype, device_map=device_map, cpu_linear=cpu_linear)
        logger.info("%s: %s", role, loaded[role].origin)
    _warn_emulated_bf16(loaded["target"].model)
    draft_source = sources["draft"]
    tokenizer = loaded["target"].tokenizer
    if qualifier_vocab_size is None:
        qualifier_vocab_size = getattr(preset, "qualifier_vocab_size", None) or 0
    if qualifier_vocab_size:
        _reduce_qualifier(loaded["qualifier"], tokenizer, qualifier_vocab_size)
        route_linears(loaded["qualifier"].model, cpu_linear)  # the new head
    quantize_loaded("qualifier", loaded["qualifier"],
                    qualifier_quantization or getattr(preset, "qualifier_quantization", "none"))
    if "draft" in loaded:
        draft_obj = loaded["draft"].model
    elif draft_source == NGRAM:
        draft_obj = ngram_draft(tokenizer, loaded["target"].model, **getattr(preset, "ngram_options", {}))
    else:
        draft_obj = PROMPT_LOOKUP if draft_source == PROMPT_LOOKUP else None
    _check_same_tokenizer(tokenizer, {role: lm.tokenizer for role, lm in loaded.items() if role != "target"})
    return Trio(loaded["target"].model, loaded["qualifier"].model, draft_obj, tokenizer,
                {role: lm.origin for role, lm in loaded.items()} | ({"draft": draft_source} if "draft" not in loaded
                                                                   else {}))


def default_dtype(device_map=None) -> str:
    """bfloat16 where the models' device multiplies bf16 in hardware (GPUs, CPUs with AMX / AVX512-BF16), float32
    elsewhere: on an AVX2-only CPU float32 ran the pyramid 3x and target-only decoding 1.7x faster end to end."""
    import torch

    from .cpu_kernels import native_bf16

    on_gpu = device_map not in (None, "cpu") and torch.cuda.is_available()
    return "bfloat16" if native_bf16("cuda" if on_gpu else "cpu") else "float32"


def hardware_summary() -> str:
    """One line on what this machine makes the defaults: the dtype, and which CPU linear kernels it has for it."""
    import torch

    from .cpu_kernels import onednn_available, skinny_available, skinny_bf16_available

    gpu = torch.cuda.is_available()
    dtype = default_dtype("auto" if gpu else None)
    units = "in hardware" if dtype == "bfloat16" else "emulated (no AMX / AVX512-BF16)"
    candidates = {"bfloat16": (("oneDNN on prepacked weights", onednn_available),
                               ("the few-row bf16 kernel", skinny_bf16_available)),
                  "float32": (("oneDNN", onednn_available), ("the few-row AVX2 kernel", skinny_available))}[dtype]
    others = [name for name, available in candidates if available()]
    linears = (f"--cpu_linear auto times torch's kernel against {' and '.join(others)} per weight shape at load"
               if others else "torch's kernel (no other kernel for this dtype here)")
    return (f"this machine: bf16 matmuls on the {'GPU' if gpu else 'CPU'} {units} -> default --dtype {dtype}; "
            f"{dtype} CPU linears: {linears}")


def _warn_emulated_bf16(target) -> None:
    import torch

    from .cpu_kernels import native_bf16

    weight = next(target.parameters())
    if weight.dtype == torch.bfloat16 and not native_bf16(weight.device):
        logger.warning("target: bf16 on a %s without bf16 matrix units (no AMX / AVX512-BF16): its bf16 matmuls are "
                       "emulated, a forward over k tokens costs about k one-token forwards, so prompts and verified "
                       "blocks are slow; --dtype float32 ran AR 1.7x and the pyramid 3x faster end to end on such a "
                       "CPU (README, 'Measured here')", weight.device.type.upper())


def _reduce_qualifier(qualifier, tokenizer, size: int) -> None:
    from .models import cache_root
    from .vocab_head import ReducedVocabHead, reduce_loaded_vocab

    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"qualifier_vocab_size must be a non-negative integer (0 = full head), got {size!r}")
    if isinstance(qualifier.model.get_output_embeddings(), ReducedVocabHead):
        logger.info("qualifier: already has a reduced-vocabulary head; qualifier_vocab_size=%d not applied", size)
        return
    facts = reduce_loaded_vocab(qualifier.model, tokenizer, size, cache_root())
    qualifier.origin += f" (LM head over {facts['size']} tokens, {facts['coverage']:.2%} of standard-library code)"
    logger.info("qualifier: LM head over the %d most frequent tokens (kept ids: %s)", facts["size"], facts["sidecar"])


def quantize_loaded(role: str, loaded, mode: str) -> None:
    """`pyramid_hf.quantize.quantize_model` on a loaded model, with its origin and the log saying what int8 covers."""
    from .quantize import int8_rows_of, quantize_model

    changed = quantize_model(loaded.model, mode)
    if changed:
        rows = int8_rows_of(loaded.model)
        if max(rows) == 0:
            logger.info("%s: int8 weights were not faster than %s at any call width on this CPU: it keeps its "
                        "own weights", role, next(loaded.model.parameters()).dtype)
            return
        used = [r for r in rows if r]  # layers where int8 never won keep only their float path
        span = f"{min(used)}-{max(used)}" if min(used) != max(used) else str(used[0])
        loaded.origin += (f" (int8 weights for calls of <= {span} tokens in {len(used)} of {changed} layers, "
                          f"measured on this CPU)")
        logger.info("%s: int8 weights for calls of <= %s tokens (%d of %d layers; the widths where int8 beat "
                    "%s here)", role, span, len(used), changed, next(loaded.model.parameters()).dtype)


def ngram_draft(tokenizer, target, **options):
    """The ``"ngram"`` draft for ``tokenizer``: its standard-library table is built once and cached.
    ``options``: `CorpusNgramDraft` keyword arguments (min_count, min_share, min_ngram, ...)."""
    from .models import cache_root
    from .ngram_draft import CorpusNgramDraft, stdlib_ngram_table

    if tokenizer is None:
        raise ValueError("the ngram draft needs the target's tokenizer (to tokenize its corpus)")
    eos = target.generation_config.eos_token_id if target.generation_config.eos_token_id is not None \
        else tokenizer.eos_token_id
    return CorpusNgramDraft(stdlib_ngram_table(tokenizer, cache_root()), eos_token_id=eos, **options)


def _check_same_tokenizer(target_tokenizer, others: dict) -> None:
    """A pyramid needs one tokenizer: same vocabulary (token -> id) and the same special tokens."""
    if target_tokenizer is None:
        return
    target_vocab = target_tokenizer.get_vocab()
    for role, tokenizer in others.items():
        if tokenizer is None:
            continue
        if tokenizer.get_vocab() != target_vocab:
            raise ValueError(f"the {role}'s tokenizer differs from the target's ({len(tokenizer.get_vocab())} vs "
                             f"{len(target_vocab)} tokens, or different ids); a pyramid needs one shared tokenizer")
        if tokenizer.eos_token_id != target_tokenizer.eos_token_id:
            raise ValueError(f"the {role}'s tokenizer has eos id {tokenizer.eos_token_id}, the target's "
                             f"{target_tokenizer.eos_token_id}; a pyramid needs one shared tokenizer")
