"""Named trios: three models of one family plus the knobs tuned for them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .offline import OFFLINE_SOURCES, cache_root, cached

PROMPT_LOOKUP = "prompt_lookup"
NGRAM = "ngram"  # == pyramid_hf.ngram_draft.NGRAM (not imported: the source layer stays free of decoding code)


@dataclass(frozen=True)
class ModelSpec:
    """A model by Hub id, with an offline source (OFFLINE_SOURCES name) or a local folder when there is one."""

    hub_id: str | None
    offline: str | None = None
    local_dir: str | None = None  # a folder built by this project (e.g. a distilled draft), relative to the cache
    build_hint: str | None = None  # how to build local_dir when it is missing

    @property
    def folder(self) -> Path | None:
        """local_dir, resolved now: relative paths live under `$PYRAMID_HF_CACHE` as it is set at call time."""
        if self.local_dir is None:
            return None
        return cache_root() / Path(self.local_dir).expanduser()

    @property
    def source(self) -> str:
        """What to hand to `load_model`."""
        if self.local_dir is not None:
            folder = self.folder
            if not (folder / "config.json").is_file():
                raise FileNotFoundError(f"{folder} is not built yet: {self.build_hint or 'build it first'}")
            return str(folder)
        return self.hub_id

    def where(self) -> str:
        if self.local_dir:
            return f"local {self.folder}"
        return self.hub_id + (f" | offline: {self.offline}" if self.offline else "")

    def is_cached(self) -> bool:
        if self.local_dir:
            return (self.folder / "config.json").is_file()
        return bool(self.offline) and cached(self.offline) is not None


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    target: ModelSpec
    qualifier: ModelSpec
    draft: ModelSpec | str  # a model, "prompt_lookup" or "ngram"
    knobs: dict = field(default_factory=dict)  # PyramidConfig kwargs tuned for the trio (on dev prompts only)
    qualifier_vocab_size: int | None = None  # give the qualifier a reduced-vocabulary head (lossless) of this size
    qualifier_quantization: str = "none"  # "int8": int8 weights for the qualifier's narrow calls (CPU, lossless)
    ngram_options: dict = field(default_factory=dict)  # CorpusNgramDraft kwargs when the draft is "ngram"


def _hub(hub_id: str) -> ModelSpec:
    return ModelSpec(hub_id, next((n for n, s in OFFLINE_SOURCES.items() if s.hub_id == hub_id), None))


_DISTILLED_DRAFT = "qwen-coder-cpu-distilled/draft"  # under cache_root(), resolved when used
_FEATURE_DRAFT = "qwen-coder-cpu-feature/draft"

PRESETS: dict[str, Preset] = {p.name: p for p in [
    Preset("llama-3", "the paper's trio (needs the Hub and a GPU)",
           _hub("meta-llama/Llama-3.1-8B-Instruct"), _hub("meta-llama/Llama-3.2-3B-Instruct"),
           _hub("meta-llama/Llama-3.2-1B-Instruct"), {"draft_tokens": 5, "qualifier_tokens": 20}),
    Preset("smollm2", "SmolLM2 135M / 360M / 1.7B Instruct (the 135M is available offline)",
           _hub("HuggingFaceTB/SmolLM2-1.7B-Instruct"), _hub("HuggingFaceTB/SmolLM2-360M-Instruct"),
           _hub("HuggingFaceTB/SmolLM2-135M-Instruct"), {"draft_tokens": 4, "qualifier_tokens": 8}),
    Preset("qwen2.5", "Qwen2.5 0.5B / 1.5B / 7B Instruct (needs the Hub)",
           _hub("Qwen/Qwen2.5-7B-Instruct"), _hub("Qwen/Qwen2.5-1.5B-Instruct"),
           _hub("Qwen/Qwen2.5-0.5B-Instruct"), {"draft_tokens": 4, "qualifier_tokens": 8}),
    Preset("qwen-coder-cpu", "embedded default, works offline: Qwen2.5-Coder 1.5B target, 0.5B qualifier, "
           "n-gram draft (prompt lookup + a standard-library table)", _hub("Qwen/Qwen2.5-Coder-1.5B-Instruct"),
           _hub("Qwen/Qwen2.5-Coder-0.5B-Instruct"), NGRAM,
           # tuned on HumanEval dev tasks: l_D=3 / l_Q=4 (tasks 0-1), then adaptive blocks: up to 12 tokens, cut
           # when the qualifier's confidence < 0.5 (tasks 0-7: 6.90 -> 9.12 tok/s; runs/bench-stop-dev*). With the
           # int8 qualifier (tasks 2-7: 6.23 -> 7.82 tok/s) one draft branch beats trees: a tree's 13-token call is
           # too wide for int8 weights, a 4-token one is not
           {"draft_tokens": 3, "qualifier_tokens": 12, "draft_branches": 1, "block_confidence": 0.5},
           qualifier_vocab_size=32768,  # 100 -> 80 ms per 0.5B forward on this CPU, lossless
           qualifier_quantization="int8",  # 0.5B calls of <= 4 tokens ~40% cheaper, lossless
           # with calls that cheap a wrong proposal costs more than it saves: propose only matches of >= 3 tokens in
           # the text and table continuations seen >= 4 times in >= 70% of cases (dev tasks 8-15: 7.72 -> 9.07 tok/s
           # for min_count 4 / min_share 0.7; 16-23: 7.87 -> 8.58 with min_ngram 3 too; SD 7.88 / 7.89)
           ngram_options={"min_count": 4, "min_share": 0.7, "min_ngram": 3}),
    Preset("qwen-coder-cpu-distilled", "qwen-coder-cpu with the distilled derived draft (built by a recipe)",
           _hub("Qwen/Qwen2.5-Coder-1.5B-Instruct"), _hub("Qwen/Qwen2.5-Coder-0.5B-Instruct"),
           ModelSpec(None, local_dir=_DISTILLED_DRAFT,
                     build_hint="build it with `pyramid-sd models build qwen-coder-cpu-distilled` (recipes/README.md)"),
           {"draft_tokens": 4, "qualifier_tokens": 8}, qualifier_vocab_size=32768),
    Preset("qwen-coder-cpu-feature", "qwen-coder-cpu with a feature draft (one layer over the 0.5B's hidden states, "
           "EAGLE-style; built by a recipe)", _hub("Qwen/Qwen2.5-Coder-1.5B-Instruct"),
           _hub("Qwen/Qwen2.5-Coder-0.5B-Instruct"),
           ModelSpec(None, local_dir=_FEATURE_DRAFT,
                     build_hint="build it with `pyramid-sd models build qwen-coder-cpu-feature` (~10 h on 2 CPU cores, "
                                "resumable; recipes/README.md)"),
           # tuned on HumanEval dev tasks 0-5 with the 2.35-token draft (runs/zen4-sitepk2-test8, 2-core Zen 4): the
           # draft stops after a token it gives < 0.5, the 0.5B's block after one it gives < 0.5, up to 16 tokens;
           # 12.52 tok/s there against 12.10-12.20 for l_D 3 / 4 / 5 with blocks of up to 12, and 10.75 for SD
           {"draft_tokens": 4, "qualifier_tokens": 16, "draft_branches": 1, "block_confidence": 0.5,
            "draft_confidence": 0.5},
           qualifier_vocab_size=32768, qualifier_quantization="int8"),
]}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(PRESETS)}")
    return PRESETS[name]


def list_presets_table() -> str:
    rows = [("preset", "role", "source", "cached")]
    for preset in PRESETS.values():
        for role in ("target", "qualifier", "draft"):
            spec = getattr(preset, role)
            if isinstance(spec, str):
                rows.append((preset.name, role, spec + " (free n-gram drafting, nothing to fetch)", "-"))
            else:
                where = spec.where()
                if role == "qualifier" and preset.qualifier_vocab_size:
                    where += f" (LM head over {preset.qualifier_vocab_size} tokens)"
                if role == "qualifier" and preset.qualifier_quantization != "none":
                    where += f" ({preset.qualifier_quantization} for narrow calls)"
                rows.append((preset.name, role, where, "yes" if spec.is_cached() else "no"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + f"\n\ncache: {cache_root()}  (set PYRAMID_HF_CACHE to move it)"
