"""The only module that touches private Transformers APIs.

`generate(assistant_model=...)` has no public way to bring one's own candidate generator or
verification loop, so two private `GenerationMixin` methods are wrapped (once, on import). The
wrappers act only when the assistant is a `PyramidAssistant`; any other call goes to the original
untouched:

- `_validate_generation_mode(generation_mode, generation_config, generation_mode_kwargs)`:
  refuses generation modes in which Transformers would silently ignore an assistant (beam search,
  contrastive search, constrained beams) and `num_return_sequences > 1`, then runs the original
  checks against the qualifier.
- `_assisted_decoding(input_ids, logits_processor, stopping_criteria, generation_config, ...)`:
  runs the pyramid's own loop (`pyramid_hf.decoding.pyramid_decoding`) in its place.

Draft trees (`pyramid_hf.tree`) need two more things Transformers has no public API for: a custom 4D attention
mask in the form the model's attention implementation reads (`tree_attention_mask`), and moving cached keys and
values of the accepted tree path next to the sequence (`keep_cache_positions`, on `DynamicLayer.keys/values`).
Both fall back to something always correct (no tree / re-feeding the path) where they do not apply.

`EXPECTED_SIGNATURES` lists the parameters relied on; `check_signatures()` (run on install and by
the test suite) fails loudly if an installed Transformers changes them.
"""

from __future__ import annotations

import functools
import inspect

import torch
from transformers.cache_utils import DynamicLayer
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.utils import GenerationMixin

from .cpu_attention import PACKED_GQA

EXPECTED_SIGNATURES = {
    "_validate_generation_mode": ["self", "generation_mode", "generation_config", "generation_mode_kwargs"],
    "_assisted_decoding": [
        "self", "input_ids", "logits_processor", "stopping_criteria", "generation_config", "synced_gpus",
        "streamer", "inputs_tensor", "assistant_model", "assistant_tokenizer", "tokenizer", "model_kwargs",
    ],
}
_SUPPORTED_MODES = (GenerationMode.ASSISTED_GENERATION,)


def _original(name: str):
    method = getattr(GenerationMixin, name)
    return getattr(method, "__pyramid_original__", method)


def check_signatures() -> None:
    """Raise RuntimeError if the private methods we wrap changed their parameters."""
    for name, expected in EXPECTED_SIGNATURES.items():
        if not hasattr(GenerationMixin, name):
            raise RuntimeError(f"transformers.GenerationMixin.{name} is gone; pyramid_hf needs updating")
        found = list(inspect.signature(_original(name)).parameters)
        if found != expected:
            raise RuntimeError(
                f"transformers.GenerationMixin.{name} changed its parameters: expected {expected}, found {found}; "
                "pyramid_hf does not support this transformers version"
            )


def is_pyramid(assistant) -> bool:
    return getattr(assistant, "_is_pyramid_assistant", False) is True


def _validate_generation_mode(original):
    @functools.wraps(original)
    def wrapper(self, generation_mode, generation_config, generation_mode_kwargs):
        assistant = generation_mode_kwargs.get("assistant_model")
        if is_pyramid(assistant):
            if generation_mode not in _SUPPORTED_MODES:
                raise ValueError(
                    f"PyramidAssistant supports greedy decoding and sampling (num_beams=1); this call asks for "
                    f"{getattr(generation_mode, 'value', generation_mode)!r} (num_beams={generation_config.num_beams}), "
                    "in which Transformers would silently ignore the assistant."
                )
            if generation_mode_kwargs.get("assistant_tokenizer") is not None:
                raise ValueError(
                    "PyramidAssistant needs the target, qualifier and draft to share one tokenizer; assistant_tokenizer "
                    "(universal assisted decoding across tokenizers) is not supported with a pyramid."
                )
            if generation_config.num_return_sequences not in (None, 1):
                raise ValueError(
                    f"PyramidAssistant needs num_return_sequences=1, got {generation_config.num_return_sequences}."
                )
            assistant.check_compatible(self)
            generation_mode_kwargs = {**generation_mode_kwargs, "assistant_model": assistant.qualifier}
        return original(self, generation_mode, generation_config, generation_mode_kwargs)

    wrapper.__pyramid_original__ = original
    return wrapper


def _assisted_decoding(original):
    @functools.wraps(original)
    def wrapper(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                streamer=None, inputs_tensor=None, assistant_model=None, assistant_tokenizer=None, tokenizer=None,
                **model_kwargs):
        if is_pyramid(assistant_model):
            from .decoding import pyramid_decoding

            return pyramid_decoding(
                self, input_ids, logits_processor, stopping_criteria, generation_config,
                synced_gpus=synced_gpus, streamer=streamer, assistant=assistant_model, **model_kwargs,
            )
        return original(
            self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=synced_gpus,
            streamer=streamer, inputs_tensor=inputs_tensor, assistant_model=assistant_model,
            assistant_tokenizer=assistant_tokenizer, tokenizer=tokenizer, **model_kwargs,
        )

    wrapper.__pyramid_original__ = original
    return wrapper


def install() -> None:
    """Wrap the two methods once; calling it again is a no-op."""
    check_signatures()
    for name, make in (("_validate_generation_mode", _validate_generation_mode),
                       ("_assisted_decoding", _assisted_decoding)):
        current = getattr(GenerationMixin, name)
        if not hasattr(current, "__pyramid_original__"):
            setattr(GenerationMixin, name, make(current))


# ---------------------------------------------------------------------------- draft trees
TREE_ATTENTION = ("sdpa", PACKED_GQA, "eager")  # implementations that read a custom 4D mask as given


def supports_tree_attention(model) -> bool:
    return getattr(model.config, "_attn_implementation", None) in TREE_ATTENTION


def tree_attention_mask(model, allowed: torch.Tensor, device) -> torch.Tensor:
    """(Q, K) bool (True: may attend) -> the (1, 1, Q, K) mask ``model``'s attention reads: bool for SDPA, additive
    float (0 or the dtype's minimum) for eager. Transformers passes a 4D mask through unchanged."""
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation not in TREE_ATTENTION:
        raise ValueError(f"draft trees need attention that reads a custom mask ({' or '.join(TREE_ATTENTION)}); "
                         f"this model uses {implementation!r}: set draft_branches=1")
    allowed = allowed[None, None].to(device)
    if implementation != "eager":  # SDPA's form
        return allowed
    dtype = model.dtype
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)


def keep_cache_positions(cache, start: int, positions: list[int], pending: int) -> bool:
    """Keep cached positions ``[0, start)`` followed by ``positions`` (ascending, each >= start) and drop the rest
    of the last ``pending`` positions. False (cache untouched) if a layer is not a plain `DynamicLayer` of the
    expected length (sliding windows, quantized or offloaded caches): the caller then crops and re-feeds."""
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        return False
    if any(layer.is_initialized and layer.keys.shape[-2] != start + pending for layer in layers):
        return False
    for layer in layers:
        if not layer.is_initialized:
            continue
        index = torch.tensor(positions, dtype=torch.long, device=layer.keys.device)
        layer.keys = torch.cat([layer.keys[..., :start, :], layer.keys.index_select(-2, index)], dim=-2)
        layer.values = torch.cat([layer.values[..., :start, :], layer.values.index_select(-2, index)], dim=-2)
    return True
