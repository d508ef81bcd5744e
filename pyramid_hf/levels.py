"""One level of the pyramid: a model with its own KV cache, on its own device and dtype.

A `ModelLevel` remembers which token ids its cache holds. Asked for the next-token logits of the
last ``n`` positions of a sequence, it keeps the longest cached prefix that still agrees with the
sequence, crops the rest (so every rejection at any stage is rolled back automatically), feeds
only the new tokens, and returns float32 logits on the caller's device.
"""

from __future__ import annotations

import inspect
import time

import torch
from transformers import DynamicCache

from ._hf import keep_cache_positions, tree_attention_mask
from .stats import PyramidStats


def model_input_device(model) -> torch.device:
    """Device of the input embeddings (the first stage of a model placed with ``device_map``)."""
    embeddings = model.get_input_embeddings()
    return embeddings.weight.device if embeddings is not None else next(model.parameters()).device


def text_config(config):
    """The language-model part of a config (itself for plain causal LMs)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def vocab_size_of(model) -> int:
    return int(text_config(model.config).vocab_size)


class ModelLevel:
    """A causal LM used as one level (draft, qualifier or target), batch size 1."""

    def __init__(self, model, name: str, stats: PyramidStats, cache=None, keep_hidden=False):
        self.model = model
        self.name = name
        self.stats = stats
        self.device = model_input_device(model)
        self.cache = cache if cache is not None else DynamicCache(config=model.config)
        self.cached_ids = torch.empty(1, 0, dtype=torch.long)  # ids whose keys/values the cache holds
        params = inspect.signature(model.forward).parameters
        self._takes_logits_to_keep = "logits_to_keep" in params
        self._sync = self.device.type == "cuda"
        # hidden states of every cached position, for a feature draft below: True keeps the last one (what the LM
        # head reads); a callable picks from the output's ``hidden_states`` (a `FeatureDraft.select_features`)
        if callable(keep_hidden):
            self.select_hidden = keep_hidden
        else:
            self.select_hidden = (lambda states: states[-1]) if keep_hidden else None
        self.hidden: torch.Tensor | None = None  # (1, len(cached_ids), width) when keep_hidden
        self.pending_nodes = 0  # draft-tree nodes the cache holds past cached_ids, until commit_tree_path()
        self.pending_hidden: torch.Tensor | None = None
        self.pending_ids: tuple[int, ...] = ()

    @property
    def keep_hidden(self) -> bool:
        return self.select_hidden is not None

    def _common_prefix(self, input_ids: torch.Tensor) -> int:
        n = min(self.cached_ids.shape[1], input_ids.shape[1])
        if n == 0:
            return 0
        same = self.cached_ids[0, :n].to(input_ids.device) == input_ids[0, :n]
        return int(same.to(torch.int64).cumprod(0).sum().item())

    def crop_to(self, keep: int) -> None:
        drop = self.cached_ids.shape[1] + self.pending_nodes - keep
        self.pending_nodes, self.pending_hidden = 0, None
        if drop > 0:
            self.cache.crop(-drop)
            self.cached_ids = self.cached_ids[:, :keep]
            if self.hidden is not None:
                self.hidden = self.hidden[:, :keep]

    def hidden_for(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Kept hidden states (1, F, width) of the longest cached prefix of ``input_ids`` (needs keep_hidden)."""
        if not self.keep_hidden:
            raise RuntimeError(f"the {self.name} level does not keep hidden states")
        if self.hidden is None:
            return torch.empty(1, 0, 0)
        return self.hidden[:, : self._common_prefix(input_ids)]

    @torch.no_grad()
    def next_token_logits(
        self, input_ids: torch.Tensor, num_positions: int = 1, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits predicting positions ``L - n + 1 .. L`` of ``input_ids`` (1, L): returns (n, V) float32."""
        length = input_ids.shape[1]
        if not 1 <= num_positions <= length:
            raise ValueError(f"num_positions must be in [1, {length}], got {num_positions}")
        keep = min(self._common_prefix(input_ids), length - num_positions)
        self.crop_to(keep)
        kwargs = {}
        if attention_mask is not None:
            mask = attention_mask[:, :length].to(self.device)
            kwargs["attention_mask"] = mask
            kwargs["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, keep:]
        return self._forward(input_ids, keep, input_ids[:, keep:], num_positions, kwargs)

    def _forward(self, input_ids, keep: int, new_ids, num_positions: int, kwargs: dict) -> torch.Tensor:
        """Feed ``new_ids`` after the ``keep`` cached positions; cached_ids becomes ``input_ids`` (the sequence part
        of new_ids; tree nodes past it are pending). Returns the last ``num_positions`` logits, float32."""
        kwargs.update(cache=self.cache, use_cache=True)
        if self._takes_logits_to_keep:
            kwargs["logits_to_keep"] = num_positions
        if self.keep_hidden:
            kwargs["output_hidden_states"] = True
        start = time.perf_counter()
        out = self.model(input_ids=new_ids.to(self.device), **kwargs)
        sequence_new = input_ids.shape[1] - keep
        if self.keep_hidden:
            kept = self.select_hidden(out.hidden_states)  # (1, new, width)
            seq_kept = kept[:, :sequence_new]
            self.hidden = seq_kept if self.hidden is None else torch.cat([self.hidden, seq_kept], dim=1)
            self.pending_hidden = kept[:, sequence_new:]
        logits = out.logits[0, -num_positions:]
        logits = logits.to(device=input_ids.device, dtype=torch.float32)
        if self._sync:
            torch.cuda.synchronize(self.device)
        self.stats.record_forward(self.name, time.perf_counter() - start)
        self.cached_ids = torch.cat([self.cached_ids.to(input_ids.device), input_ids[:, keep:]], dim=1)
        self.pending_nodes = new_ids.shape[1] - sequence_new
        return logits

    # ------------------------------------------------------------------ draft trees
    @torch.no_grad()
    def tree_logits(self, input_ids: torch.Tensor, tree, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """One pass over ``input_ids`` (1, L) and a `DraftTree` after it: (1 + N, V) float32 logits, row 0 for the
        position after ``input_ids``, row 1 + i for the position after node i. Nodes stay in the cache until
        `commit_tree_path` keeps one path of them (any other call drops them)."""
        length, nodes = input_ids.shape[1], len(tree)
        keep = min(self._common_prefix(input_ids), length - 1)
        self.crop_to(keep)
        fed = length - keep
        allowed = torch.zeros(fed + nodes, length + nodes, dtype=torch.bool)
        allowed[:fed, :length] = torch.ones(fed, length, dtype=torch.bool).tril(keep)  # causal over the sequence
        allowed[fed:, :length] = True
        allowed[fed:, length:] = tree.ancestor_mask()
        depths = torch.tensor(tree.depths())
        if attention_mask is not None:
            padding = attention_mask[0, :length].to(torch.bool).cpu()
            allowed[:, :length] &= padding
            allowed[torch.arange(fed), keep + torch.arange(fed)] = True  # every row sees itself (no empty rows)
            positions = (padding.long().cumsum(-1) - 1).clamp(min=0)
        else:
            positions = torch.arange(length)
        position_ids = torch.cat([positions[keep:], positions[-1] + depths])[None].to(self.device)
        tree_ids = torch.tensor([tree.ids], dtype=input_ids.dtype)
        new_ids = torch.cat([input_ids[:, keep:].cpu(), tree_ids], dim=1)
        mask = tree_attention_mask(self.model, allowed, self.device)
        logits = self._forward(input_ids, keep, new_ids, nodes + 1, {"attention_mask": mask,
                                                                      "position_ids": position_ids})
        self.pending_ids = tree.ids
        return logits

    def commit_tree_path(self, path_nodes: list[int]) -> None:
        """Keep the pending tree nodes ``path_nodes`` (a root-to-node path) after the sequence, drop the others."""
        if not self.pending_nodes:
            raise RuntimeError(f"the {self.name} level holds no draft tree")
        length = self.cached_ids.shape[1]
        if not keep_cache_positions(self.cache, length, [length + i for i in path_nodes], self.pending_nodes):
            self.crop_to(length)  # a cache that cannot be rearranged: the path is fed again next time
            return
        path_ids = torch.tensor([[self.pending_ids[i] for i in path_nodes]], dtype=self.cached_ids.dtype,
                                device=self.cached_ids.device)
        self.cached_ids = torch.cat([self.cached_ids, path_ids], dim=1)
        if self.keep_hidden and self.pending_hidden is not None:
            self.hidden = torch.cat([self.hidden, self.pending_hidden[:, path_nodes]], dim=1)
        self.pending_nodes, self.pending_hidden = 0, None
