"""The frozen qualifier's hidden states of every training block, kept after their first read.

Training a feature draft reads the same blocks once per epoch, and the qualifier's forward over a block is ~40% of a
step (0.5B qualifier, three unrolled passes, 2-core CPU). A `FeatureStore` keeps, per block, the states the draft
reads (plus the final state when the draft does not read it itself), either in memory for one run or in a folder of
memory-mapped files that later runs over the same blocks reuse (``--feature_cache_dir``), so a continued run starts
at the cached speed. The folder's name is a digest of everything the states depend on: the qualifier's config, dtype
and a sample of every weight, the feature layers, and the blocks' token ids; a changed model or text never reads
another's states. A block is marked done only after its states are flushed, so an interrupted run leaves no
half-written block marked done.

    store = FeatureStore.for_draft(draft, qualifier, blocks, folder="runs/feature-cache")
    store.get([4, 0, 7])            # None until all of them were put, then (selected (3, T, k*H), final (3, T, H))
    store.put([4, 0, 7], selected, final)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger("pyramid_hf")

FORMAT = "pyramid-hf feature store v1"
_NUMPY_DTYPES = {torch.bfloat16: np.uint16, torch.float16: np.float16, torch.float32: np.float32}
_SAMPLES_PER_TENSOR = 4096


def store_key(qualifier, feature_layers, blocks: list[list[int]], dtype: torch.dtype) -> str:
    """A digest of what the stored states depend on (16 hex digits)."""
    digest = hashlib.sha256(FORMAT.encode())
    digest.update(qualifier.config.to_json_string(use_diff=False).encode())
    digest.update(f"{dtype} {list(feature_layers)} {len(blocks)}".encode())
    head = qualifier.get_output_embeddings()  # the states do not depend on the head (a reduced one or not)
    skip = tuple(f"{name}." for name, module in qualifier.named_modules() if module is head and name)
    # a strided sample of every weight: a tuned copy of the same architecture gets its own folder
    for name, tensor in sorted(qualifier.state_dict().items()):
        if skip and name.startswith(skip):
            continue
        flat = tensor.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // _SAMPLES_PER_TENSOR)].float().cpu()
        digest.update(name.encode() + sample.numpy().tobytes())
    digest.update(np.asarray(blocks, dtype=np.int64).tobytes())
    return digest.hexdigest()[:16]


def _mapped(path: Path, shape: tuple[int, ...], dtype) -> tuple[np.memmap, torch.Tensor, bool]:
    """A file of ``shape`` x ``dtype`` (a torch dtype, or numpy's uint8), mapped as a writable tensor; created
    zero-filled, or opened. The flag says whether the file had to be created or resized (its old content is void)."""
    np_dtype = _NUMPY_DTYPES.get(dtype, dtype)
    size = int(np.prod(shape)) * np.dtype(np_dtype).itemsize
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        resized = os.fstat(fd).st_size != size
        if resized:
            os.ftruncate(fd, 0)
            os.ftruncate(fd, size)
    finally:
        os.close(fd)
    array = np.memmap(path, dtype=np_dtype, mode="r+", shape=shape)
    tensor = torch.from_numpy(array)
    return array, tensor.view(dtype) if dtype == torch.bfloat16 else tensor, resized


class FeatureStore:
    """Per-block states (``selected``: what the draft reads; ``final``: what it predicts), in memory or in ``folder``.

    ``final_part``: which ``hidden``-wide part of the selected states is the final state itself (then it is not stored
    twice), or None to store the final states apart.
    """

    def __init__(self, blocks: int, block_size: int, hidden: int, parts: int, final_part: int | None,
                 dtype: torch.dtype, folder: str | os.PathLike | None = None, describe: dict | None = None):
        if dtype not in _NUMPY_DTYPES:
            raise ValueError(f"cannot store {dtype} states; supported: {sorted(map(str, _NUMPY_DTYPES))}")
        if final_part is not None and not 0 <= final_part < parts:
            raise ValueError(f"final_part must name one of the {parts} selected parts, got {final_part}")
        self.hidden, self.final_part, self.dtype = hidden, final_part, dtype
        self.folder = None if folder is None else Path(folder).expanduser()
        selected_shape, final_shape = (blocks, block_size, parts * hidden), (blocks, block_size, hidden)
        self._arrays: list[np.memmap] = []
        if self.folder is None:
            self.selected = torch.empty(selected_shape, dtype=dtype)  # pages are only touched as blocks arrive
            self.final = None if final_part is not None else torch.empty(final_shape, dtype=dtype)
            self.done = torch.zeros(blocks, dtype=torch.uint8)
            return
        from filelock import FileLock

        self.folder.mkdir(parents=True, exist_ok=True)
        with FileLock(str(self.folder / ".lock")):  # data-parallel ranks open the same folder at once
            meta = {"format": FORMAT, "blocks": blocks, "block_size": block_size, "hidden": hidden, "parts": parts,
                    "final_part": final_part, "dtype": str(dtype), **(describe or {})}
            meta_file = self.folder / "meta.json"
            if meta_file.is_file():
                found = json.loads(meta_file.read_text())
                stale = [k for k in ("format", "blocks", "block_size", "hidden", "parts", "final_part", "dtype")
                         if found.get(k) != meta[k]]
                if stale:
                    raise ValueError(f"feature store {self.folder} was written for other states ({', '.join(stale)} "
                                     f"differ: {[found.get(k) for k in stale]} vs {[meta[k] for k in stale]}); "
                                     "delete the folder or choose another --feature_cache_dir")
            else:
                meta_file.write_text(json.dumps(meta, indent=2) + "\n")
            selected_array, self.selected, void = _mapped(self.folder / "selected.bin", selected_shape, dtype)
            self._arrays.append(selected_array)
            self.final = None
            if final_part is None:
                final_array, self.final, final_void = _mapped(self.folder / "final.bin", final_shape, dtype)
                self._arrays.append(final_array)
                void = void or final_void
            self._done_array, self.done, _ = _mapped(self.folder / "done.u8", (blocks,), np.uint8)
            if void:  # states created or resized just now: no flag may claim them
                self.done.zero_()
                self._done_array.flush()
        logger.info("feature store %s: %d of %d blocks already stored", self.folder, int(torch.count_nonzero(self.done)), blocks)

    @classmethod
    def for_draft(cls, draft, qualifier, blocks: list[list[int]], folder=None) -> FeatureStore:
        """A store for ``draft``'s states of ``qualifier`` over ``blocks``; with ``folder``, in its subfolder named by
        `store_key`."""
        from .levels import text_config

        states = int(text_config(qualifier.config).num_hidden_layers) + 1
        layers = list(draft.feature_layers)
        final_part = next((k for k, i in enumerate(layers) if i % states == states - 1), None)
        dtype = qualifier.get_input_embeddings().weight.dtype
        if folder is not None:
            folder = Path(folder).expanduser() / store_key(qualifier, layers, blocks, dtype)
        describe = {"qualifier": str(getattr(qualifier.config, "_name_or_path", "")), "feature_layers": layers}
        return cls(len(blocks), len(blocks[0]), draft.hidden_size, len(layers), final_part, dtype, folder, describe)

    def stored_blocks(self) -> list[int]:
        return torch.nonzero(self.done).flatten().tolist()

    def get(self, keys: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(selected, final) of blocks ``keys`` in that order, or None unless every one of them is stored."""
        if not bool(self.done[keys].all()):
            return None
        selected = self.selected[keys]  # advanced indexing copies out of the mapping
        if self.final is not None:
            return selected, self.final[keys]
        return selected, selected[..., self.final_part * self.hidden : (self.final_part + 1) * self.hidden]

    def put(self, keys: list[int], selected: torch.Tensor, final: torch.Tensor) -> None:
        self.selected[keys] = selected.detach().to("cpu", self.dtype)
        if self.final is not None:
            self.final[keys] = final.detach().to("cpu", self.dtype)
        for array in self._arrays:
            array.flush()  # the states reach the file before the flags that say they are there
        self.done[keys] = 1
        if self.folder is not None:
            self._done_array.flush()
