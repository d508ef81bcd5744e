"""A feature-level draft (EAGLE-style): one decoder layer that reads the qualifier's own hidden states.

A draft cut from the qualifier must rebuild, from tokens alone, what the qualifier computes in all of its layers;
on this project's CPU budget such drafts plateau far below the acceptance that pays off. A feature draft instead
continues the qualifier's computation: element ``j`` of its input is ``fc([f_j ; e(x_{j+1})])``, the qualifier's
last hidden state at position ``j`` (what its LM head reads to predict ``x_{j+1}``) joined with the embedding of the
token that followed, and one decoder layer plus a final norm predict ``f_{j+1}``. The qualifier's own LM head turns
that prediction into the distribution of ``x_{j+2}``. Drafting further, the draft feeds its own predicted feature in
place of the qualifier's (Li et al., EAGLE, 2024). With ``feature_layers`` naming several of the qualifier's hidden
states (e.g. a low, a middle and the final one, as in EAGLE-3), a learnt ``fuse`` map turns their concatenation into
``f_j`` for the positions the qualifier has read.

The draft borrows the qualifier's input embeddings and LM head (a reduced-vocabulary head on the qualifier makes the
draft cheaper too), so its folder holds only the new parts: ``fc`` and one decoder layer (~17M parameters for a
896-wide qualifier), saved as ``config.json`` (a one-layer decoder config of the qualifier's architecture),
``feature_draft.safetensors`` and ``feature_draft.json``.

    draft = FeatureDraft.from_qualifier(qualifier_model)          # untrained; train with training/train_feature_draft.py
    draft.save(folder); draft = FeatureDraft.load(folder)
    PyramidAssistant(qualifier=qualifier_model, draft=draft, ...)  # exact rules stay lossless, as with any draft
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from transformers import AutoConfig, AutoModel, DynamicCache

from .levels import text_config
from .stats import PyramidStats

CONFIG_FILE = "feature_draft.json"
WEIGHTS_FILE = "feature_draft.safetensors"
FORMAT = "pyramid-hf feature draft v2"  # v2: embed_scale
_DROP_KEYS = ("quantization_config", "architectures", "auto_map", "_name_or_path", "transformers_version",
              "torch_dtype", "dtype")


def decoder_config_for(qualifier_config):
    """A one-layer, embedding-free (vocab 8) decoder config of the qualifier's architecture and width."""
    fields = text_config(qualifier_config).to_dict()
    for key in _DROP_KEYS:
        fields.pop(key, None)
    if isinstance(fields.get("layer_types"), list):
        fields["layer_types"] = fields["layer_types"][:1]
    fields.update(num_hidden_layers=1, vocab_size=8, pad_token_id=None, bos_token_id=None, eos_token_id=None,
                  tie_word_embeddings=False)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def check_feature_layers(feature_layers: tuple[int, ...], num_layers: int) -> None:
    """``feature_layers`` must name distinct hidden states of a qualifier with ``num_layers`` decoder layers."""
    if not feature_layers or any(not -(num_layers + 1) <= i <= num_layers for i in feature_layers):
        raise ValueError(f"feature_layers must be indices into the qualifier's {num_layers + 1} hidden states "
                         f"(-{num_layers + 1} .. {num_layers}), got {list(feature_layers)}")
    if len({i % (num_layers + 1) for i in feature_layers}) != len(feature_layers):
        raise ValueError(f"feature_layers names one hidden state twice: {list(feature_layers)}")


def is_feature_folder(folder) -> bool:
    return (Path(folder) / CONFIG_FILE).is_file()


class FeatureDraft(nn.Module):
    """``fc`` (2H -> H) and a one-layer decoder (the qualifier's architecture); hidden states in, hidden states out."""

    def __init__(self, decoder_config, meta: dict | None = None):
        super().__init__()
        self.decoder = AutoModel.from_config(decoder_config)
        hidden = int(decoder_config.hidden_size)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        # token embeddings are ~300x smaller than post-norm hidden states (Qwen2.5-0.5B: RMS 0.017 vs 5.7); unscaled,
        # the token that was actually chosen barely reaches the layer and the draft learns ~3x slower
        self.embed_scale = nn.Parameter(torch.ones(1))
        self.meta = dict(meta or {})
        # which of the qualifier's hidden states the draft reads (indices into ``output_hidden_states``; -1 is the
        # final, post-norm one); with several, ``fuse`` maps their concatenation to one state (EAGLE-3's low, middle
        # and high layers), the earlier ones RMS-normalised first (a residual stream is far from the final scale)
        self.feature_layers = tuple(int(i) for i in self.meta.get("feature_layers", (-1,)))
        self.fuse = nn.Linear(len(self.feature_layers) * hidden, hidden, bias=False) \
            if len(self.feature_layers) > 1 else None

    @property
    def config(self):
        return self.decoder.config

    @property
    def hidden_size(self) -> int:
        return int(self.decoder.config.hidden_size)

    def select_features(self, hidden_states) -> torch.Tensor:
        """The states this draft reads, from a model output's ``hidden_states`` (embeddings, then every layer):
        (B, T, k * H), the final state as it is and earlier ones RMS-normalised."""
        final = len(hidden_states) - 1
        parts = []
        for index in self.feature_layers:
            state = hidden_states[index]
            if index % len(hidden_states) != final:
                state = F.rms_norm(state.float(), (state.shape[-1],)).to(state.dtype)
            parts.append(state)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def fuse_features(self, selected: torch.Tensor) -> torch.Tensor:
        """(B, T, k * H) selected states -> (B, T, H), the input the draft's ``fc`` reads for a real position."""
        return selected if self.fuse is None else self.fuse(selected.to(self.fuse.weight.dtype))

    @classmethod
    def from_qualifier(cls, qualifier_model, init_layer: int = -1, seed: int = 0,
                       feature_layers: tuple[int, ...] | list[int] = (-1,)) -> FeatureDraft:
        """A new draft for ``qualifier_model``: its decoder layer ``init_layer`` and final norm are copied as a
        starting point; ``fc`` reads the token embedding (scaled to the hidden states' size) as is and the feature
        through small random weights. With several ``feature_layers``, ``fuse`` starts by passing the last of them
        through (so a new draft starts as the one-layer design) and learns to mix in the others."""
        layers = int(text_config(qualifier_model.config).num_hidden_layers)
        feature_layers = tuple(int(i) for i in feature_layers)
        check_feature_layers(feature_layers, layers)
        meta = {"init_layer": init_layer}
        if feature_layers != (-1,):
            meta["feature_layers"] = list(feature_layers)
        draft = cls(decoder_config_for(qualifier_model.config), meta=meta)
        decoder = qualifier_model.get_decoder()  # Llama-like: .layers and a final .norm
        draft.decoder.layers[0].load_state_dict(decoder.layers[init_layer].state_dict())
        draft.decoder.norm.load_state_dict(decoder.norm.state_dict())
        hidden = draft.hidden_size
        with torch.no_grad():
            embeddings = qualifier_model.get_input_embeddings().weight.float()
            feature_rms = decoder.norm.weight.float().pow(2).mean().sqrt()  # post-norm states: RMS ~ |norm weight|
            draft.embed_scale.fill_(float(feature_rms / embeddings.pow(2).mean().sqrt().clamp(min=1e-12)))
            draft.fc.weight.zero_()
            draft.fc.weight[:, :hidden].normal_(0.0, 0.5 / hidden**0.5, generator=torch.Generator().manual_seed(seed))
            draft.fc.weight[:, hidden:].copy_(torch.eye(hidden))
            if draft.fuse is not None:
                draft.fuse.weight.zero_()
                highest = max(range(len(feature_layers)), key=lambda k: feature_layers[k] % (layers + 1))
                draft.fuse.weight[:, highest * hidden : (highest + 1) * hidden].copy_(torch.eye(hidden))
        dtype = next(qualifier_model.parameters()).dtype
        return draft.to(dtype=dtype, device=next(qualifier_model.parameters()).device).eval()

    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor, *, cache=None, position_ids=None,
                attention_mask=None, lm_head=None):
        """features, token_embeds (B, T, H): element j = (f_j, e(x_{j+1})); returns the predicted f_{j+1} (B, T, H)
        and, given the qualifier's ``lm_head``, also the logits (B, V) it gives the last prediction (one module call,
        so forward hooks time the draft's whole cost)."""
        inputs = self.fc(torch.cat([features, token_embeds * self.embed_scale], dim=-1))
        hidden = self.decoder(inputs_embeds=inputs, cache=cache, use_cache=cache is not None,
                              position_ids=position_ids, attention_mask=attention_mask).last_hidden_state
        if lm_head is None:
            return hidden
        weight = lm_head.weight
        return hidden, lm_head(hidden[:, -1].to(weight.device, weight.dtype))

    # ------------------------------------------------------------------ files
    def save(self, folder, **meta) -> Path:
        from safetensors.torch import save_file

        folder = Path(folder).expanduser()
        folder.mkdir(parents=True, exist_ok=True)
        self.decoder.config.save_pretrained(folder)
        state = {name: tensor.detach().contiguous().cpu() for name, tensor in self.state_dict().items()}
        save_file(state, str(folder / WEIGHTS_FILE), metadata={"format": FORMAT})
        payload = {"format": FORMAT, "hidden_size": self.hidden_size, **self.meta, **meta}
        (folder / CONFIG_FILE).write_text(json.dumps(payload, indent=2) + "\n")
        return folder

    @classmethod
    def load(cls, folder, dtype=None, device=None) -> FeatureDraft:
        from safetensors.torch import load_file

        folder = Path(folder).expanduser()
        if not is_feature_folder(folder):
            raise ValueError(f"{folder} is not a feature-draft folder (no {CONFIG_FILE})")
        meta = json.loads((folder / CONFIG_FILE).read_text())
        if meta.get("format") != FORMAT:
            raise ValueError(f"{folder / CONFIG_FILE}: unknown format {meta.get('format')!r}, expected {FORMAT!r}")
        draft = cls(AutoConfig.from_pretrained(folder), meta={k: v for k, v in meta.items() if k != "format"})
        state = load_file(str(folder / WEIGHTS_FILE))
        missing, unexpected = draft.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"{folder / WEIGHTS_FILE} does not fit its config: missing {missing}, "
                             f"unexpected {unexpected}")
        if dtype is None:
            dtype = next(iter(state.values())).dtype
        return draft.to(dtype=dtype, device=device or "cpu").eval()

    def check_qualifier(self, qualifier_model) -> None:
        width = int(text_config(qualifier_model.config).hidden_size)
        if width != self.hidden_size:
            raise ValueError(f"the feature draft reads hidden states of width {self.hidden_size}, but the qualifier's "
                             f"are {width} wide: it was trained for another qualifier")
        check_feature_layers(self.feature_layers, int(text_config(qualifier_model.config).num_hidden_layers))


class FeatureDraftLevel:
    """The draft level of a pyramid over a `FeatureDraft`, fed by the qualifier level's hidden states.

    Duck-types `ModelLevel.next_token_logits` for one position. Its cache holds one element per position ``j``
    (``f_j`` joined with ``x_{j+1}``); the first ``true_elements`` were built from the qualifier's real hidden
    states, later ones from the draft's own predictions, and those are rebuilt as soon as real ones exist.
    """

    def __init__(self, draft: FeatureDraft, qualifier, stats: PyramidStats, name: str = "draft"):
        self.draft = draft
        self.qualifier = qualifier  # a ModelLevel with keep_hidden=draft.select_features
        self.stats = stats
        self.name = name
        self.device = next(draft.parameters()).device
        self.dtype = next(draft.parameters()).dtype
        self.cache = DynamicCache(config=draft.decoder.config)
        self.cached_ids = torch.empty(1, 0, dtype=torch.long)  # x_{j+1} of every cached element j
        self.outputs = torch.empty(1, 0, draft.hidden_size, device=self.device, dtype=self.dtype)  # predicted f_{j+1}
        self.true_elements = 0
        self.embed = qualifier.model.get_input_embeddings()
        self.head = qualifier.model.get_output_embeddings()

    def _valid_elements(self, input_ids: torch.Tensor) -> int:
        n = min(self.cached_ids.shape[1], input_ids.shape[1] - 1)
        same = self.cached_ids[0, :n] == input_ids[0, 1 : n + 1].to(self.cached_ids.device)
        return int(same.to(torch.int64).cumprod(0).sum().item()) if n else 0

    def _crop(self, keep: int) -> None:
        drop = self.cached_ids.shape[1] - keep
        if drop > 0:
            self.cache.crop(-drop)
            self.cached_ids = self.cached_ids[:, :keep]
            self.outputs = self.outputs[:, :keep]
        self.true_elements = min(self.true_elements, keep)

    def _feed(self, features: torch.Tensor, next_ids: torch.Tensor, attention_mask) -> torch.Tensor:
        """Append elements for features (1, T, H) joined with next_ids (1, T); their predictions go to outputs.
        Returns the logits (1, V) of the last one."""
        start, count = self.cached_ids.shape[1], next_ids.shape[1]
        if attention_mask is not None:
            mask = attention_mask[:, : start + count].to(self.device)
            kwargs = {"attention_mask": mask, "position_ids": (mask.long().cumsum(-1) - 1).clamp(min=0)[:, start:]}
        else:
            kwargs = {"position_ids": torch.arange(start, start + count, device=self.device)[None]}
        embeds = self.embed(next_ids.to(self.embed.weight.device)).to(device=self.device, dtype=self.dtype)
        out, logits = self.draft(features.to(device=self.device, dtype=self.dtype), embeds, cache=self.cache,
                                 lm_head=self.head, **kwargs)
        self.cached_ids = torch.cat([self.cached_ids, next_ids.to(self.cached_ids.device)], dim=1)
        self.outputs = torch.cat([self.outputs, out], dim=1)
        return logits

    @torch.no_grad()
    def next_token_logits(self, input_ids: torch.Tensor, num_positions: int = 1,
                          attention_mask: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits (1, V) float32 for the token after ``input_ids`` (1, L), or None before the qualifier has run."""
        if num_positions != 1:
            raise ValueError("a feature draft proposes one position at a time")
        length = input_ids.shape[1]
        start = time.perf_counter()
        real = self.qualifier.hidden_for(input_ids)  # (1, F, H): the qualifier's states for x_0 .. x_{F-1}
        usable = min(real.shape[1], length - 1)  # element j needs f_j and x_{j+1}
        keep = self._valid_elements(input_ids)
        if usable > self.true_elements:
            keep = min(keep, self.true_elements)  # rebuild elements that used the draft's own predictions
        self._crop(keep)
        logits = None
        if keep < usable:
            features = self.draft.fuse_features(real[:, keep:usable].to(device=self.device, dtype=self.dtype))
            logits = self._feed(features, input_ids[:, keep + 1 : usable + 1], attention_mask)
            self.true_elements = usable
        if self.cached_ids.shape[1] == 0:
            return None  # nothing to start from: the qualifier has not read the prompt yet
        for j in range(self.cached_ids.shape[1], length - 1):  # past the qualifier's states: own predictions
            logits = self._feed(self.outputs[:, -1:], input_ids[:, j + 1 : j + 2], attention_mask)
        if logits is None:  # everything was cached: only the head is left to run
            logits = self.head(self.outputs[:, -1].to(self.head.weight.device, self.head.weight.dtype))
        logits = logits.to(device=input_ids.device, dtype=torch.float32)
        self.stats.record_forward(self.name, time.perf_counter() - start)
        return logits
