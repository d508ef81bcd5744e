"""The decoding methods a benchmark compares, each as the `generate()` keyword arguments that run it.

    ar            target alone (autoregressive)
    sd_qualifier  Transformers' two-model SD, the qualifier drafting for the target
    sd_lookup     Transformers' prompt lookup decoding (free n-gram drafts) for the target
    sd_draft      Transformers' two-model SD, the draft model drafting for the target
    psd           PyramidSD, exact rules at both stages (lossless)
    psd_a         PSD_A: strict-match inner stage, target stage exact or fuzzy (tau_target)
    psd_f         PSD_F: fuzzy rules at both stages (tau_qualifier, tau_target)
"""

from __future__ import annotations

from dataclasses import dataclass

from ..assistant import PROMPT_LOOKUP, PyramidAssistant
from ..config import PyramidConfig
from ..trio import Trio

SD_METHODS = ("sd_qualifier", "sd_lookup", "sd_draft")
PSD_METHODS = ("psd", "psd_a", "psd_f")
ALL_METHODS = ("ar",) + SD_METHODS + PSD_METHODS


@dataclass(frozen=True)
class Method:
    """One method at one setting of its knobs."""

    method: str
    knobs: tuple = ()  # sorted (name, value) pairs, hashable

    def __post_init__(self):
        if self.method not in ALL_METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose from {ALL_METHODS}")

    @classmethod
    def make(cls, method: str, **knobs) -> Method:
        return cls(method, tuple(sorted(knobs.items())))

    @property
    def knob_dict(self) -> dict:
        return dict(self.knobs)

    @property
    def label(self) -> str:
        if not self.knobs:
            return self.method
        return self.method + " " + " ".join(f"{k}={v}" for k, v in self.knobs)

    @property
    def lossless(self) -> bool:
        """Whether the method reproduces the target's own decoding (token for token under greedy)."""
        if self.method == "psd_f":
            return False
        if self.method == "psd_a":
            # strict match == exact under greedy; a fuzzy target stage is lossy
            return float(self.knob_dict.get("tau_target", 0.0)) == 0.0
        return True

    def pyramid_config(self) -> PyramidConfig:
        knobs = self.knob_dict
        common = dict(draft_tokens=knobs.get("draft_tokens", 4), qualifier_tokens=knobs.get("qualifier_tokens", 8),
                      draft_branches=knobs.get("draft_branches", 1),
                      block_confidence=knobs.get("block_confidence", 0.0),
                      draft_confidence=knobs.get("draft_confidence", 0.0), divergence=knobs.get("divergence", "js"))
        if self.method == "psd":
            return PyramidConfig(**common)
        tau_target = float(knobs.get("tau_target", 0.0))
        if self.method == "psd_a":
            return PyramidConfig(**common, qualifier_rule="assisted", target_rule="fuzzy" if tau_target else "exact",
                                 tau_target=tau_target)
        return PyramidConfig(**common, qualifier_rule="fuzzy", target_rule="fuzzy",
                             tau_qualifier=float(knobs.get("tau_qualifier", 0.0)), tau_target=tau_target)


def method_kwargs(method: Method, trio: Trio, assistants: dict) -> dict:
    """The `generate()` kwargs that run ``method`` on ``trio`` (``assistants`` caches PyramidAssistants)."""
    knobs = method.knob_dict
    if method.method == "ar":
        return {}
    if method.method == "sd_lookup":
        return {"prompt_lookup_num_tokens": int(knobs["num_tokens"])}
    if method.method in ("sd_qualifier", "sd_draft"):
        if method.method == "sd_draft" and not trio.has_model_draft:
            raise ValueError("sd_draft needs a preset whose draft is a model")
        assistant = trio.qualifier if method.method == "sd_qualifier" else trio.draft
        _set_assistant_schedule(assistant, knobs["num_tokens"], knobs.get("confidence", 0.0))
        return {"assistant_model": assistant}
    if method not in assistants:
        draft = trio.draft if trio.draft is not None else None
        if isinstance(draft, str) and draft != PROMPT_LOOKUP:
            raise ValueError(f"unknown draft {draft!r}")
        assistants[method] = PyramidAssistant(trio.qualifier, draft, method.pyramid_config())
    return {"assistant_model": assistants[method]}


def _set_assistant_schedule(assistant, num_tokens, confidence: float = 0.0) -> None:
    """Transformers reads the draft length from the ASSISTANT's generation config."""
    gen = assistant.generation_config
    if num_tokens == "heuristic":  # Transformers' own default: adaptive length and a confidence cut-off
        gen.num_assistant_tokens, gen.num_assistant_tokens_schedule = 20, "heuristic"
        gen.assistant_confidence_threshold = 0.4
    else:
        gen.num_assistant_tokens, gen.num_assistant_tokens_schedule = int(num_tokens), "constant"
        gen.assistant_confidence_threshold = float(confidence)  # 0: never cut a draft early


def _sd_method(method: str, setting) -> Method:
    """setting: a draft length, or (length, confidence threshold)."""
    if isinstance(setting, tuple):
        return Method.make(method, num_tokens=setting[0], confidence=setting[1])
    return Method.make(method, num_tokens=setting)


def default_grid(trio: Trio, knobs: dict, sd_tokens=(3, 5, 8), lookup_tokens=(4, 10), psd_grid=None,
                 tau_grid=((0.1, 0.05), (0.2, 0.1), (0.3, 0.2))) -> dict[str, list[Method]]:
    """Candidate settings per method family; the bench keeps each family's best on the tuning prompts.

    ``knobs`` are the preset's tuned PyramidConfig values (draft_tokens, qualifier_tokens, draft_branches,
    block_confidence, draft_confidence, taus).
    ``tau_grid`` holds (tau_target, tau_qualifier) pairs for psd_f (tau_qualifier <= tau_target works best).
    """
    l_d, l_q = knobs.get("draft_tokens", 4), knobs.get("qualifier_tokens", 8)
    defaults = (knobs.get("draft_branches", 1), knobs.get("block_confidence", 0.0), knobs.get("draft_confidence", 0.0))

    def pyramid_knobs(setting) -> dict:  # (l_D, l_Q[, branches[, block confidence[, draft confidence]]]); defaults unnamed
        d, q, b, c, dc = (*setting, *defaults[len(setting) - 2 :])
        return {"draft_tokens": d, "qualifier_tokens": q} | ({"draft_branches": b} if b != 1 else {}) \
            | ({"block_confidence": c} if c else {}) | ({"draft_confidence": dc} if dc else {})

    psd_grid = psd_grid or [(l_d, l_q)]
    grid = {
        "ar": [Method.make("ar")],
        "sd_qualifier": [_sd_method("sd_qualifier", k) for k in sd_tokens]
        + [Method.make("sd_qualifier", num_tokens="heuristic")],
        "sd_lookup": [Method.make("sd_lookup", num_tokens=k) for k in lookup_tokens],
        "psd": [Method.make("psd", **pyramid_knobs(s)) for s in psd_grid],
        "psd_a": [Method.make("psd_a", **pyramid_knobs(s)) for s in psd_grid],
    }
    if trio.has_model_draft:
        grid["sd_draft"] = [_sd_method("sd_draft", k) for k in sd_tokens]
    # psd_f is not tuned away: each tau is its own point on the speed/quality curve
    grid["psd_f"] = [Method.make("psd_f", **pyramid_knobs((l_d, l_q)), tau_target=t, tau_qualifier=q)
                     for t, q in tau_grid]
    return grid
