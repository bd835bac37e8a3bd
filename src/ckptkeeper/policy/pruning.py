"""Which checkpoints a manual prune keeps: composable keep-rules over plain step numbers.

A checkpoint stays if any rule keeps it; the newest checkpoint always stays. Pure: no I/O, no
clock; the ``prune`` command carries the answer out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ..errors import ConfigurationError

__all__ = ["PrunePlan", "PruneRules", "plan_prune"]


@dataclass(frozen=True)
class PruneRules:
    """Keep-rules for a prune; at least one must be given."""

    keep_last: int | None = None
    """Keep the newest N checkpoints (N >= 1)."""
    keep_every: int | None = None
    """Keep every checkpoint whose step is a multiple of K (K >= 1)."""
    keep_steps: Sequence[int] = field(default_factory=tuple)
    """Keep these steps."""

    def __post_init__(self) -> None:
        if self.keep_last is not None and self.keep_last < 1:
            raise ConfigurationError(f"'keep_last' must be at least 1, got {self.keep_last}")
        if self.keep_every is not None and self.keep_every < 1:
            raise ConfigurationError(f"'keep_every' must be at least 1, got {self.keep_every}")
        if any(s < 0 for s in self.keep_steps):
            raise ConfigurationError(f"'keep_steps' must be steps >= 0, got {list(self.keep_steps)}")
        if self.keep_last is None and self.keep_every is None and not self.keep_steps:
            raise ConfigurationError(
                "give at least one keep-rule (keep_last, keep_every or keep_steps); pruning with none would "
                "remove every checkpoint but the newest"
            )


@dataclass(frozen=True)
class PrunePlan:
    """The outcome: steps kept (with the rules that keep each) and steps removed, oldest first."""

    keep: dict[int, list[str]]
    remove: list[int]


def plan_prune(steps: Iterable[int], rules: PruneRules) -> PrunePlan:
    """Apply ``rules`` to the steps of the complete checkpoints of a save folder."""
    ordered = sorted(set(steps))
    keep: dict[int, list[str]] = {}

    def mark(step: int, why: str) -> None:
        keep.setdefault(step, []).append(why)

    if ordered:
        mark(ordered[-1], "newest")
    if rules.keep_last is not None:
        for s in ordered[-rules.keep_last :]:
            mark(s, f"last {rules.keep_last}")
    if rules.keep_every is not None:
        for s in ordered:
            if s % rules.keep_every == 0:
                mark(s, f"every {rules.keep_every}")
    wanted = set(rules.keep_steps)
    for s in ordered:
        if s in wanted:
            mark(s, "listed")
    return PrunePlan(keep=dict(sorted(keep.items())), remove=[s for s in ordered if s not in keep])
