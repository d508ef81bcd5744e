"""Model sources (Hub id, local folder, GGUF file, offline PyPI data packages) and named presets."""

from .loading import LoadedModel, load_model, resolve_dtype
from .offline import (
    OFFLINE_SOURCES,
    OfflineSource,
    OfflineSourceError,
    assemble_gguf,
    cache_root,
    cached,
    fetch,
    load_gguf,
)
from .presets import PRESETS, ModelSpec, Preset, get_preset, list_presets_table

__all__ = [
    "OFFLINE_SOURCES", "PRESETS", "LoadedModel", "ModelSpec", "OfflineSource", "OfflineSourceError", "Preset",
    "assemble_gguf", "cache_root", "cached", "fetch", "get_preset", "list_presets_table", "load_gguf", "load_model",
    "resolve_dtype",
]
