"""Per-stage counters of a pyramid run: what was proposed, what was kept, what it cost."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

LEVELS = ("draft", "qualifier", "target")


@dataclass
class PyramidStats:
    """Counts for one `generate()` call (``assistant.stats``) or summed over many (``assistant.total_stats``).

    Inner stage = draft -> qualifier, outer stage = qualifier -> target.
    """

    draft_proposed: int = 0
    draft_accepted: int = 0
    qualifier_proposed: int = 0
    qualifier_accepted: int = 0
    inner_rounds: int = 0
    tree_rounds: int = 0  # inner rounds that checked a draft tree (pyramid_hf.tree) instead of one draft
    tree_nodes: int = 0  # tokens the qualifier read in those rounds' trees
    tree_other_branch_won: int = 0  # tree rounds won by a branch other than the draft's first guess
    target_calls: int = 0
    new_tokens: int = 0
    generate_calls: int = 0
    wall_time_s: float = 0.0
    forward_calls: dict = field(default_factory=lambda: dict.fromkeys(LEVELS, 0))
    forward_time_s: dict = field(default_factory=lambda: dict.fromkeys(LEVELS, 0.0))
    inner_accepted_hist: Counter = field(default_factory=Counter)  # accepted draft tokens per inner round
    outer_accepted_hist: Counter = field(default_factory=Counter)  # accepted qualifier tokens per target call

    # ------------------------------------------------------------------ recording
    def record_forward(self, level: str, seconds: float) -> None:
        self.forward_calls[level] += 1
        self.forward_time_s[level] += seconds

    def record_inner(self, proposed: int, accepted: int) -> None:
        self.inner_rounds += 1
        self.draft_proposed += proposed
        self.draft_accepted += accepted
        self.inner_accepted_hist[accepted] += 1

    def record_tree(self, nodes: int, winner: int) -> None:
        self.tree_rounds += 1
        self.tree_nodes += nodes
        self.tree_other_branch_won += winner > 0

    def record_outer(self, proposed: int, accepted: int) -> None:
        self.target_calls += 1
        self.qualifier_proposed += proposed
        self.qualifier_accepted += accepted
        self.outer_accepted_hist[accepted] += 1

    # ------------------------------------------------------------------ derived
    @property
    def draft_acceptance_rate(self) -> float:
        """Share of draft proposals the qualifier kept."""
        return self.draft_accepted / self.draft_proposed if self.draft_proposed else 0.0

    @property
    def qualifier_acceptance_rate(self) -> float:
        """Share of qualifier proposals the target kept."""
        return self.qualifier_accepted / self.qualifier_proposed if self.qualifier_proposed else 0.0

    @property
    def mean_tokens_per_target_call(self) -> float:
        """Emitted tokens per target forward in the decoding loop (1.0 = no speed-up over AR)."""
        return self.new_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def mean_tokens_per_qualifier_call(self) -> float:
        """Qualifier-level tokens (kept draft tokens + the qualifier's own) per inner round."""
        return (self.draft_accepted + self.inner_rounds) / self.inner_rounds if self.inner_rounds else 0.0

    @property
    def overhead_time_s(self) -> float:
        """Wall time spent outside model forwards (framework overhead)."""
        return max(0.0, self.wall_time_s - sum(self.forward_time_s.values()))

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time_s if self.wall_time_s else 0.0

    # ------------------------------------------------------------------ bookkeeping
    def reset(self) -> None:
        fresh = PyramidStats()
        self.__dict__.update(fresh.__dict__)

    def add(self, other: PyramidStats) -> None:
        """Add ``other``'s counts into this one."""
        for name, value in other.__dict__.items():
            mine = getattr(self, name)
            if isinstance(mine, Counter):
                mine.update(value)
            elif isinstance(mine, dict):
                for key, v in value.items():
                    mine[key] = mine.get(key, 0) + v
            else:
                setattr(self, name, mine + value)

    def to_dict(self) -> dict:
        out = {k: (dict(sorted(v.items())) if isinstance(v, Counter) else (dict(v) if isinstance(v, dict) else v))
               for k, v in self.__dict__.items()}
        out.update(
            draft_acceptance_rate=self.draft_acceptance_rate,
            qualifier_acceptance_rate=self.qualifier_acceptance_rate,
            mean_tokens_per_target_call=self.mean_tokens_per_target_call,
            mean_tokens_per_qualifier_call=self.mean_tokens_per_qualifier_call,
            overhead_time_s=self.overhead_time_s,
            tokens_per_s=self.tokens_per_s,
        )
        return out

    def summary(self) -> str:
        return (
            f"{self.new_tokens} tokens in {self.wall_time_s:.2f}s ({self.tokens_per_s:.1f} tok/s); "
            f"draft->qualifier {self.draft_accepted}/{self.draft_proposed} ({self.draft_acceptance_rate:.1%}); "
            f"qualifier->target {self.qualifier_accepted}/{self.qualifier_proposed} "
            f"({self.qualifier_acceptance_rate:.1%}); {self.mean_tokens_per_target_call:.2f} tokens/target call; "
            f"forwards D/Q/T {self.forward_calls['draft']}/{self.forward_calls['qualifier']}/"
            f"{self.forward_calls['target']}"
            + (f"; draft trees in {self.tree_rounds}/{self.inner_rounds} inner rounds ({self.tree_nodes} nodes, "
               f"{self.tree_other_branch_won} won by another branch)" if self.tree_rounds else "")
        )
