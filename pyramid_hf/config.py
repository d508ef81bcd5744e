"""`PyramidConfig`: the knobs of Pyramid Speculative Decoding, validated on construction."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .acceptance import DIVERGENCE_RANGES, LOSSLESS_RULES, RULES, TARGET_RULES

SCHEDULES = ("constant", "heuristic")


@dataclass
class PyramidConfig:
    """How the draft, the qualifier and the target share the work.

    Modes by the paper's names: PSD exact = both rules "exact"; PSD_A = qualifier_rule "assisted";
    PSD_F = both rules "fuzzy". Only rules "exact"/"assisted" at both stages are lossless.
    """

    draft_tokens: int = field(
        default=4, metadata={"help": "l_D: tokens the draft proposes per inner round (draft -> qualifier)."}
    )
    qualifier_tokens: int = field(
        default=8, metadata={"help": "l_Q: tokens the qualifier sends to the target per outer round."}
    )
    draft_branches: int = field(
        default=1,
        metadata={
            "help": "Draft trees: up to this many different drafts per inner round (e.g. every continuation of the "
            "text's tail seen earlier), checked in ONE qualifier pass with a tree attention mask; the branch with the "
            "longest accepted prefix wins (sampling: recursive rejection over the branches, still lossless). Pays off where "
            "a pass over ~20 tokens costs about one token's pass (CPUs, small models). Drafts that propose branches "
            "(the n-gram draft) only; others propose one draft, as with 1."
        },
    )
    block_confidence: float = field(
        default=0.0,
        metadata={
            "help": "Adaptive l_Q: send the block to the target as soon as the product of the qualifier's probabilities "
            "of its own block tokens (its estimate that the target keeps them all) falls below this; l_Q stays the "
            "cap. 0 keeps blocks at l_Q. Lossless either way: the length depends only on the qualifier's own output."
        },
    )
    draft_confidence: float = field(
        default=0.0,
        metadata={
            "help": "Cut a model draft's proposal after a token it gives probability below this (Transformers' "
            "assistant_confidence_threshold, one level down): fewer draft forwards and narrower qualifier calls where "
            "the draft is unsure. 0 always proposes l_D. Lossless either way: the cut depends only on the draft's output."
        },
    )
    qualifier_rule: str = field(
        default="exact",
        metadata={"help": "Inner-stage rule: 'exact' (lossless), 'assisted' (strict match, PSD_A) or 'fuzzy' (PSD_F)."},
    )
    target_rule: str = field(
        default="exact", metadata={"help": "Outer-stage rule: 'exact' (lossless) or 'fuzzy' (Fuzzy SD)."}
    )
    divergence: str = field(
        default="js", metadata={"help": "Divergence of the fuzzy rules: 'js' (nats, <= ln 2), 'kl' or 'tv' (<= 1)."}
    )
    tau_qualifier: float = field(
        default=0.0, metadata={"help": "Fuzzy threshold of the inner stage: accept iff Div(P_Q, P_D) <= tau."}
    )
    tau_target: float = field(
        default=0.0, metadata={"help": "Fuzzy threshold of the outer stage: accept iff Div(P_T, P_Q) <= tau."}
    )
    schedule: str = field(
        default="constant",
        metadata={
            "help": "'constant' keeps l_D and l_Q fixed; 'heuristic' grows a length by 2 after a round that "
            "accepted everything and shrinks it by 1 after a rejection, within [1, 4 x its initial value]."
        },
    )

    def __post_init__(self):
        for name in ("draft_tokens", "qualifier_tokens", "draft_branches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("block_confidence", "draft_confidence"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
        if self.qualifier_rule not in RULES:
            raise ValueError(f"qualifier_rule must be one of {sorted(RULES)}, got {self.qualifier_rule!r}")
        if self.target_rule not in TARGET_RULES:
            raise ValueError(f"target_rule must be one of {sorted(TARGET_RULES)}, got {self.target_rule!r}")
        if self.divergence not in DIVERGENCE_RANGES:
            raise ValueError(f"divergence must be one of {sorted(DIVERGENCE_RANGES)}, got {self.divergence!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {list(SCHEDULES)}, got {self.schedule!r}")
        low, high = DIVERGENCE_RANGES[self.divergence]
        for stage, rule in (("qualifier", self.qualifier_rule), ("target", self.target_rule)):
            tau = getattr(self, f"tau_{stage}")
            if isinstance(tau, bool) or not isinstance(tau, (int, float)) or tau != tau:
                raise ValueError(f"tau_{stage} must be a number, got {tau!r}")
            if not low <= tau <= high:
                raise ValueError(
                    f"tau_{stage}={tau} is outside the range of divergence {self.divergence!r}: [{low}, {high}]"
                )
            if tau != 0 and rule != "fuzzy":
                raise ValueError(
                    f"tau_{stage}={tau} has no effect with {stage}_rule={rule!r}; set {stage}_rule='fuzzy' or tau_{stage}=0"
                )

    @property
    def lossless(self) -> bool:
        """True when the output is distributed exactly as target-only decoding."""
        return self.qualifier_rule in LOSSLESS_RULES and self.target_rule in LOSSLESS_RULES

    @property
    def mode(self) -> str:
        """The paper's name of this configuration."""
        if self.qualifier_rule == "fuzzy":
            return "psd_f"
        if self.qualifier_rule == "assisted":
            return "psd_a"
        return "psd" if self.target_rule == "exact" else "psd_fuzzy_target"

    def to_dict(self) -> dict:
        return asdict(self)
