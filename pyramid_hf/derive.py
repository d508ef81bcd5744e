"""Derived drafts: a smaller model made from a bigger one by keeping any subset of its decoder layers.

    draft = cut_layers(qualifier, keep=[0, 1, 2, 3, 12, 23])

The result is a fresh model of the same class whose config says ``num_hidden_layers=len(keep)`` (and keeps
per-layer settings such as ``layer_types`` in step), with the kept layers' weights in their original order,
renumbered so every attention layer indexes the KV cache by its new position. Embeddings, final norm and
LM head are copied; tied embeddings stay tied; dtype and generation config are preserved.
"""

from __future__ import annotations

import copy
import re

import torch
from torch import nn

from .levels import text_config

PER_LAYER_CONFIG_LISTS = ("layer_types",)


def decoder_layers_name(model) -> str:
    """Qualified name of the ModuleList holding the decoder layers (e.g. ``model.layers``)."""
    config = text_config(model.config)
    count = int(config.num_hidden_layers)
    names = [name for name, module in model.named_modules()
             if isinstance(module, nn.ModuleList) and len(module) == count and name.endswith("layers")]
    if len(names) != 1:
        raise ValueError(f"cannot tell which ModuleList holds {type(model).__name__}'s {count} decoder layers: "
                         f"found {names or 'none'}")
    return names[0]


def normalize_keep(keep, num_layers: int) -> list[int]:
    """Sorted unique layer indices; negative indices count from the end, as in Python."""
    if isinstance(keep, int):
        keep = range(keep)  # an int keeps that many leading layers
    try:
        indices = [int(i) for i in keep]
    except (TypeError, ValueError):
        raise ValueError(f"keep must be layer indices or a layer count, got {keep!r}") from None
    out = sorted({i + num_layers if i < 0 else i for i in indices})
    if not out:
        raise ValueError("keep at least one decoder layer")
    bad = [i for i in out if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"layer indices {bad} out of range for a model with {num_layers} decoder layers")
    return out


def cut_config(config, keep: list[int]):
    new = copy.deepcopy(config)
    text = text_config(new)
    for name in PER_LAYER_CONFIG_LISTS:
        values = getattr(text, name, None)
        if isinstance(values, (list, tuple)) and len(values) == text.num_hidden_layers:
            setattr(text, name, [values[i] for i in keep])
    text.num_hidden_layers = len(keep)
    return new


def cut_layers(model, keep) -> nn.Module:
    """A new model with only the decoder layers ``keep`` (indices, any subset; or an int: the first N)."""
    prefix = decoder_layers_name(model)
    num_layers = len(model.get_submodule(prefix))
    keep = normalize_keep(keep, num_layers)
    renumber = {old: new for new, old in enumerate(keep)}
    pattern = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.(.*)$")
    state = {}
    for key, tensor in model.state_dict().items():
        match = pattern.match(key)
        if match is None:
            state[key] = tensor
        elif int(match.group(1)) in renumber:
            state[f"{prefix}.{renumber[int(match.group(1))]}.{match.group(2)}"] = tensor
    config = cut_config(model.config, keep)
    with torch.device("meta"):
        derived = type(model)(config)
    tied = getattr(text_config(model.config), "tie_word_embeddings", False)
    missing, unexpected = derived.load_state_dict({k: v.clone() for k, v in state.items()}, strict=False,
                                                  assign=True)
    missing = [k for k in missing if not (tied and k.endswith("lm_head.weight"))]
    if missing or unexpected:
        raise RuntimeError(f"cut model weights do not line up: missing {missing}, unexpected {unexpected}")
    if tied:
        derived.tie_weights()
    for name, buffer in list(derived.named_buffers()):  # non-persistent buffers (rotary tables) are rebuilt
        if buffer.is_meta:
            _rebuild_buffer(derived, model, name)
    derived.generation_config = copy.deepcopy(model.generation_config)
    derived.config.pyramid_kept_layers = keep
    return derived.eval() if not model.training else derived


def _rebuild_buffer(derived, original, name: str) -> None:
    """Copy a non-persistent buffer (e.g. rotary inv_freq) from the original, whose layout it shares."""
    module_name, _, buffer_name = name.rpartition(".")
    source = dict(original.named_buffers()).get(name)
    if source is None:
        raise RuntimeError(f"cannot rebuild buffer {name} of the cut model")
    derived.get_submodule(module_name).register_buffer(buffer_name, source.clone(), persistent=False)
