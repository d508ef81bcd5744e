"""`PyramidAssistant`: what users pass as ``generate(assistant_model=...)``."""

from __future__ import annotations

from transformers.generation import CandidateGenerator

from . import _hf
from .candidate_generator import PROMPT_LOOKUP, build_pyramid_generator
from .config import PyramidConfig
from .feature_draft import FeatureDraft
from .levels import vocab_size_of
from .stats import PyramidStats

_hf.install()

__all__ = ["PROMPT_LOOKUP", "PyramidAssistant"]


class PyramidAssistant:
    """A qualifier model that filters a draft, used as the target's assistant.

    Args:
        qualifier: the middle model (a causal LM sharing the target's tokenizer).
        draft: the bottom level: a causal LM, a `pyramid_hf.FeatureDraft` (one decoder layer over the
            qualifier's hidden states, EAGLE-style), ``"prompt_lookup"`` (free n-gram drafting over the prompt and
            the text so far), any Transformers `CandidateGenerator` instance (e.g. a
            `pyramid_hf.ngram_draft.CorpusNgramDraft`: lookup plus a corpus n-gram table), or None (the qualifier
            drafts alone: plain two-model speculative decoding).
        config: a `PyramidConfig` (defaults: exact rules, l_D=4, l_Q=8).
        lookup_ngram_size: longest n-gram matched by ``"prompt_lookup"``.

    After each ``generate()`` call, ``stats`` holds that call's counts and ``total_stats`` the sum over
    all calls since construction or ``reset_stats()``.

    Transformers' assistant options (``num_assistant_tokens``, ``assistant_confidence_threshold``, their
    "heuristic" schedules) do not apply: the draft always proposes ``config.draft_tokens`` tokens (fewer only at
    an end-of-sequence token or the length limit) and ``config.schedule`` is the only schedule.
    """

    _is_pyramid_assistant = True

    def __init__(self, qualifier, draft=None, config: PyramidConfig | None = None, lookup_ngram_size: int = 2):
        if config is None:
            config = PyramidConfig()
        if not isinstance(config, PyramidConfig):
            raise TypeError(f"config must be a PyramidConfig, got {type(config).__name__}")
        if not hasattr(qualifier, "forward") or not hasattr(qualifier, "config"):
            raise TypeError(f"qualifier must be a causal LM model, got {type(qualifier).__name__}")
        if isinstance(draft, str) and draft != PROMPT_LOOKUP:
            raise ValueError(f"draft must be a model, {PROMPT_LOOKUP!r}, a CandidateGenerator or None; got {draft!r}")
        if isinstance(draft, FeatureDraft):
            draft.check_qualifier(qualifier)
        elif draft is not None and not isinstance(draft, (str, CandidateGenerator)):
            if not hasattr(draft, "forward") or not hasattr(draft, "config"):
                raise TypeError(f"draft must be a model, {PROMPT_LOOKUP!r}, a CandidateGenerator or None; "
                                f"got {type(draft).__name__}")
            if vocab_size_of(draft) != vocab_size_of(qualifier):
                raise ValueError(
                    f"draft and qualifier have different vocabularies ({vocab_size_of(draft)} vs "
                    f"{vocab_size_of(qualifier)} tokens); a pyramid needs one shared tokenizer"
                )
        if isinstance(lookup_ngram_size, bool) or not isinstance(lookup_ngram_size, int) or lookup_ngram_size < 1:
            raise ValueError(f"lookup_ngram_size must be a positive integer, got {lookup_ngram_size!r}")
        self.qualifier = qualifier
        self.draft = draft
        self.config = config
        self.lookup_ngram_size = lookup_ngram_size
        self.stats = PyramidStats()
        self.total_stats = PyramidStats()

    # Transformers reads a few attributes of an assistant before decoding starts.
    @property
    def device(self):
        return self.qualifier.device

    @property
    def draft_kind(self) -> str:
        if self.draft is None:
            return "none"
        if isinstance(self.draft, str):
            return self.draft
        if isinstance(self.draft, FeatureDraft):
            return "feature"
        return "candidate_generator" if isinstance(self.draft, CandidateGenerator) else "model"

    def reset_stats(self) -> None:
        self.stats.reset()
        self.total_stats.reset()

    def check_compatible(self, target) -> None:
        """Raise ValueError when ``target`` cannot be verified against this pyramid."""
        target_vocab = vocab_size_of(target)
        for name, model in (("qualifier", self.qualifier), ("draft", self.draft)):
            if self.draft_kind != "model" and name == "draft":
                continue
            if vocab_size_of(model) != target_vocab:
                raise ValueError(
                    f"the {name} and the target have different vocabularies ({vocab_size_of(model)} vs "
                    f"{target_vocab} tokens); a pyramid needs one shared tokenizer"
                )

    # ------------------------------------------------------------------ called by the decoding loop
    def _begin_call(self) -> PyramidStats:
        return PyramidStats(generate_calls=1)

    def _end_call(self, stats: PyramidStats) -> None:
        self.stats = stats
        self.total_stats.add(stats)

    def build_candidate_generator(self, target, logits_processor, generation_config, stats, attention_mask=None):
        """A fresh `PyramidCandidateGenerator` (fresh caches) for one generate() call."""
        return build_pyramid_generator(self.qualifier, self.draft, self.config, target, logits_processor,
                                       generation_config, stats, attention_mask, self.lookup_ngram_size)

    def __repr__(self) -> str:
        return (f"PyramidAssistant(qualifier={type(self.qualifier).__name__}, draft={self.draft_kind}, "
                f"config={self.config})")
