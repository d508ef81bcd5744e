"""One entry point for every model source: a GGUF file, a local folder, an offline package name, or a Hub id.

A Hub id falls back to its offline source when the Hub cannot be reached (``HF_HUB_OFFLINE=1`` or a
connection error) and one exists; one log line says which was used.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from .offline import OFFLINE_SOURCES, cached, fetch, load_gguf

logger = logging.getLogger("pyramid_hf")

_DTYPES = {"auto": "auto", "bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32",
           "fp16": "float16", "float16": "float16"}


@dataclass
class LoadedModel:
    model: object
    tokenizer: object
    origin: str  # where it came from, for logs and reports


def resolve_dtype(dtype):
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(_DTYPES)}")
    return "auto" if dtype == "auto" else getattr(torch, _DTYPES[dtype])


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


@functools.lru_cache(maxsize=1)
def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the Hub endpoint accepts a TCP connection (checked once per process, a few seconds at most).

    Without this check, an unreachable Hub costs ~50 s of huggingface_hub retries per model before the
    offline fallback.
    """
    from huggingface_hub import constants

    host = urllib.parse.urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def offline_name_for(hub_id: str) -> str | None:
    return next((name for name, s in OFFLINE_SOURCES.items() if s.hub_id == hub_id), None)


def _from_folder(folder: Path, dtype, device_map, reduced_vocab: bool = True):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..vocab_head import SIDECAR, apply_reduced_vocab, load_reduced_vocab

    if any(folder.glob("*.bin")) and not any(folder.glob("*.safetensors")):
        raise ValueError(f"{folder} holds only pickled weights (*.bin); convert them to safetensors first")
    tokenizer = AutoTokenizer.from_pretrained(folder) if _has_tokenizer(folder) else None
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map=device_map)
    kept_ids = load_reduced_vocab(folder) if reduced_vocab else None
    if kept_ids is not None:
        apply_reduced_vocab(model, kept_ids)
        logger.info("%s: LM head over a reduced vocabulary of %d tokens (%s; reduced_vocab=False loads the full head)",
                    folder, kept_ids.numel(), SIDECAR)
    return model.eval(), tokenizer


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def load_model(source: str, *, dtype="auto", device_map=None, offline_fallback: str | None = None,
               reduced_vocab: bool = True, cpu_linear: str = "auto") -> LoadedModel:
    """Load a causal LM and its tokenizer from ``source`` (see module docstring).

    A folder written by `FeatureDraft.save` loads as that `FeatureDraft` (it runs only under its qualifier).

    A local folder with a ``reduced_vocab.json`` sidecar gets its reduced-vocabulary LM head
    (`pyramid_hf.vocab_head`) unless ``reduced_vocab=False``.

    ``cpu_linear`` (``"auto"``, ``"skinny"``, ``"onednn"``, ``"torch"``): float32 linears on CPU run their no-grad calls
    on oneDNN or the few-row AVX2 kernel, bf16 ones on oneDNN with weights packed once or the few-row AVX512-BF16
    kernel, where that measured faster than torch's default kernel (`pyramid_hf.cpu_linear`); training is untouched.
    Unless it is ``"torch"``, a CPU model with grouped-query heads also runs its few-token attention calls packed
    (`pyramid_hf.cpu_attention`: torch's SDPA kernel on the query heads of each key/value head as one block; a
    one-token step's attention 5-12x faster, values equal up to rounding order).
    """
    from ..cpu_attention import use_packed_gqa
    from ..cpu_linear import KERNEL_NAMES, route_linears

    loaded = _load(source, resolve_dtype(dtype), device_map, offline_fallback, reduced_vocab)
    routed = route_linears(loaded.model, cpu_linear)
    if routed["layers"]:
        routes = "; ".join(f"{KERNEL_NAMES[k]} at call widths {w}" for k, w in routed["kernels"].items())
        dtype_name = str(next(loaded.model.parameters()).dtype).removeprefix("torch.")
        loaded.origin += f" ({dtype_name} linears: {routes}, measured on this CPU)"
    if cpu_linear != "torch" and use_packed_gqa(loaded.model):
        loaded.origin += " (grouped-query attention packed for few-token calls)"
    return loaded


def _load(source: str, dtype, device_map, offline_fallback: str | None, reduced_vocab: bool) -> LoadedModel:
    from transformers import AutoTokenizer

    from ..feature_draft import FeatureDraft, is_feature_folder

    path = Path(source).expanduser()
    if source.endswith(".gguf"):
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        model, tokenizer = load_gguf(path, None if dtype == "auto" else dtype)
        return LoadedModel(model, tokenizer, f"GGUF file {path}")
    if path.is_dir() and is_feature_folder(path):
        draft = FeatureDraft.load(path, dtype=None if dtype == "auto" else dtype)
        tokenizer = AutoTokenizer.from_pretrained(path) if _has_tokenizer(path) else None
        return LoadedModel(draft, tokenizer, f"feature draft {path}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} is a folder without config.json, not a model folder")
        model, tokenizer = _from_folder(path, dtype, device_map, reduced_vocab)
        return LoadedModel(model, tokenizer, f"local folder {path}")
    if source in OFFLINE_SOURCES:
        return _load_offline(source, dtype, device_map, "asked for by name")
    if source.startswith((".", "/", "~")) or source.count("/") != 1:
        raise FileNotFoundError(f"{source!r} is neither an existing folder or .gguf file, an offline model "
                                f"({', '.join(OFFLINE_SOURCES)}), nor a Hub id (org/name)")
    return _load_hub(source, dtype, device_map, offline_fallback or offline_name_for(source))


def _load_offline(name: str, dtype, device_map, why: str) -> LoadedModel:
    was_cached = cached(name) is not None
    folder = fetch(name)
    model, tokenizer = _from_folder(folder, dtype, device_map)
    state = "cached" if was_cached else "fetched"
    return LoadedModel(model, tokenizer, f"offline package {name} ({state} at {folder}; {why})")


def _load_hub(hub_id: str, dtype, device_map, fallback: str | None) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    offline = hub_offline()
    if offline or not hub_reachable():
        why = "HF_HUB_OFFLINE=1" if offline else "Hub not reachable"
        # a model already in the HF cache still loads offline; only then fall back
        try:
            model = AutoModelForCausalLM.from_pretrained(hub_id, dtype=dtype, device_map=device_map,
                                                         local_files_only=True)
            tokenizer = AutoTokenizer.from_pretrained(hub_id, local_files_only=True)
            logger.info("%s: using the local Hugging Face cache (%s)", hub_id, why)
            return LoadedModel(model.eval(), tokenizer, f"Hub {hub_id} (local HF cache)")
        except OSError:
            if fallback is None:
                raise RuntimeError(f"{why} and {hub_id} is not in the local HF cache, and it has no offline "
                                   f"source (offline models: {', '.join(OFFLINE_SOURCES)})") from None
            logger.info("%s: %s, using offline source %s", hub_id, why, fallback)
            return _load_offline(fallback, dtype, device_map, f"{why}, no HF cache of {hub_id}")
    try:
        model = AutoModelForCausalLM.from_pretrained(hub_id, dtype=dtype, device_map=device_map)
        tokenizer = AutoTokenizer.from_pretrained(hub_id)
    except OSError as error:  # connection errors, missing repos and gated repos surface as OSError
        if fallback is None:
            raise RuntimeError(f"could not load {hub_id} from the Hub ({error.__class__.__name__}: "
                               f"{str(error).splitlines()[0][:200]}) and it has no offline source "
                               f"(offline models: {', '.join(OFFLINE_SOURCES)})") from error
        logger.info("%s: Hub not reachable (%s), using offline source %s", hub_id, error.__class__.__name__, fallback)
        return _load_offline(fallback, dtype, device_map, f"Hub not reachable for {hub_id}")
    logger.info("%s: loaded from the Hub", hub_id)
    return LoadedModel(model.eval(), tokenizer, f"Hub {hub_id}")
