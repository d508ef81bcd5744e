"""Pyramid Speculative Decoding as a Hub `custom_generate` method: no `pip install pyramid-hf` needed.

    out = target.generate(**inputs, custom_generate="ORG/pyramid-sd", trust_remote_code=True,
                          qualifier_model=qualifier, draft_model=draft,  # draft: a model, "prompt_lookup" or None
                          draft_tokens=4, qualifier_tokens=8, max_new_tokens=128, do_sample=False)

Pyramid knobs are keyword arguments with `PyramidConfig`'s names and meanings (draft_tokens, qualifier_tokens,
qualifier_rule, target_rule, divergence, tau_qualifier, tau_target, schedule); pass ``pyramid_stats={}`` to get
the call's per-stage counts back in that dict. Everything else is a plain `generate()` argument: Transformers
prepares logits processors, stopping criteria and the cache exactly as for greedy decoding or sampling, and the
pyramid's own loop decodes with them. The sibling modules are the pyramid_hf package's own files.
"""

from __future__ import annotations

import functools

from .candidate_generator import PROMPT_LOOKUP, build_pyramid_generator
from .config import PyramidConfig
from .decoding import pyramid_decoding
from .levels import vocab_size_of
from .stats import PyramidStats

KNOBS = tuple(PyramidConfig.__dataclass_fields__)


class _PyramidRun:
    """What the decoding loop needs of an assistant, for one generate() call."""

    def __init__(self, qualifier, draft, config: PyramidConfig, lookup_ngram_size: int):
        self.qualifier, self.draft, self.config, self.lookup_ngram_size = qualifier, draft, config, lookup_ngram_size
        self.stats = PyramidStats()

    def _begin_call(self) -> PyramidStats:
        return PyramidStats(generate_calls=1)

    def _end_call(self, stats: PyramidStats) -> None:
        self.stats = stats

    def build_candidate_generator(self, target, logits_processor, generation_config, stats, attention_mask=None):
        return build_pyramid_generator(self.qualifier, self.draft, self.config, target, logits_processor,
                                       generation_config, stats, attention_mask, self.lookup_ngram_size)


def _decode(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
            streamer=None, *, pyramid_run=None, pyramid_streamer=None, **model_kwargs):
    # Transformers hands a callable decoding method only its own extra arguments: the streamer comes bound, and
    # gets the prompt first, as generate() gives it to any streamer it knows of
    if pyramid_streamer is not None:
        pyramid_streamer.put(input_ids.cpu())
    return pyramid_decoding(model, input_ids, logits_processor, stopping_criteria, generation_config,
                            synced_gpus=synced_gpus, streamer=pyramid_streamer, assistant=pyramid_run, **model_kwargs)


def _check(model, qualifier_model, draft_model, kwargs) -> None:
    if qualifier_model is None:
        raise ValueError("custom_generate='pyramid-sd' needs qualifier_model=<a causal LM sharing the target's tokenizer>")
    if kwargs.get("assistant_model") is not None:
        raise ValueError("pass the pyramid's models as qualifier_model= and draft_model=, not assistant_model=")
    for name in ("num_beams", "num_return_sequences"):
        value = kwargs.get(name, getattr(kwargs.get("generation_config") or model.generation_config, name, 1))
        if value not in (None, 1):
            raise ValueError(f"pyramid-sd decodes one sequence by greedy decoding or sampling; got {name}={value}")
    levels = [("qualifier", qualifier_model)]
    if draft_model is not None and not isinstance(draft_model, str) and hasattr(draft_model, "config"):
        levels.append(("draft", draft_model))
    elif isinstance(draft_model, str) and draft_model != PROMPT_LOOKUP:
        raise ValueError(f"draft_model must be a model, {PROMPT_LOOKUP!r} or None, got {draft_model!r}")
    for name, level in levels:
        if vocab_size_of(level) != vocab_size_of(model):
            raise ValueError(f"the {name} and the target have different vocabularies ({vocab_size_of(level)} vs "
                             f"{vocab_size_of(model)} tokens); a pyramid needs one shared tokenizer")


def generate(model, *args, qualifier_model=None, draft_model=None, lookup_ngram_size: int = 2, pyramid_stats=None,
             streamer=None, **kwargs):
    """`model.generate(...)` with the pyramid decoding; ``model`` is the target."""
    _check(model, qualifier_model, draft_model, kwargs)
    config = PyramidConfig(**{k: kwargs.pop(k) for k in KNOBS if k in kwargs})
    run = _PyramidRun(qualifier_model, draft_model, config, lookup_ngram_size)
    decode = functools.partial(_decode, pyramid_run=run, pyramid_streamer=streamer)
    out = model.generate(*args, custom_generate=decode, **kwargs)
    if pyramid_stats is not None:
        pyramid_stats.update(run.stats.to_dict())
    return out
