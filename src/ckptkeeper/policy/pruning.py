"""Which checkpoints to keep: composable keep-rules, used by ``ckptkeeper prune`` and by
:class:`~ckptkeeper.CheckpointManager`'s retention alike.

A checkpoint stays if any rule keeps it; the newest checkpoint and any protected one (a checkpoint
being loaded, a save in flight) always stay. Pure: no I/O and no clock (the caller passes ``now``),
so every rule is tested by tables; the callers carry the answer out.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ..errors import ConfigurationError

__all__ = ["PruneCandidate", "PrunePlan", "PruneRules", "RetentionRules", "plan_prune"]


@dataclass(frozen=True)
class PruneRules:
    """Keep-rules; at least one must be given. A checkpoint stays if any of them keeps it."""

    keep_last: int | None = None
    """Keep the newest N checkpoints (N >= 1)."""
    keep_every: int | None = None
    """Keep every checkpoint whose step is a multiple of K (K >= 1)."""
    keep_steps: Sequence[int] = field(default_factory=tuple)
    """Keep these steps."""
    keep_best: int | None = None
    """Keep the K checkpoints with the best value of ``best_metric`` (given at save time)."""
    best_metric: str | None = None
    """The metric ``keep_best`` ranks by, e.g. ``"val_loss"``; checkpoints saved without it are not ranked."""
    best_mode: str = "min"
    """``"min"`` (lower is better, losses) or ``"max"`` (higher is better, accuracies)."""
    keep_younger_than: float | None = None
    """Keep checkpoints created less than this many seconds ago."""

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every", "keep_best"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigurationError(f"'{name}' must be a whole number of at least 1, got {value!r}")
        object.__setattr__(self, "keep_steps", tuple(self.keep_steps))
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in self.keep_steps):
            raise ConfigurationError(f"'keep_steps' must be steps >= 0, got {list(self.keep_steps)}")
        if self.best_mode not in ("min", "max"):
            raise ConfigurationError(f"'best_mode' must be 'min' or 'max', got {self.best_mode!r}")
        if (self.keep_best is None) != (self.best_metric is None):
            raise ConfigurationError(
                "'keep_best' and 'best_metric' go together: keep_best=K ranks checkpoints by the metric named in "
                "best_metric (pass metrics={'NAME': value} when saving)"
            )
        if self.keep_younger_than is not None and (
            isinstance(self.keep_younger_than, bool)
            or not isinstance(self.keep_younger_than, (int, float))
            or not math.isfinite(self.keep_younger_than)
            or self.keep_younger_than <= 0
        ):
            raise ConfigurationError(
                f"'keep_younger_than' must be a positive number of seconds, got {self.keep_younger_than!r}"
            )
        if (
            self.keep_last is None
            and self.keep_every is None
            and not self.keep_steps
            and self.keep_best is None
            and self.keep_younger_than is None
        ):
            raise ConfigurationError(
                "give at least one keep-rule (keep_last, keep_every, keep_steps, keep_best or keep_younger_than); "
                "pruning with none would remove every checkpoint but the newest"
            )


RetentionRules = PruneRules
"""The same rules, under the name :class:`~ckptkeeper.CheckpointManager` takes them (``retention=``)."""


@dataclass(frozen=True)
class PruneCandidate:
    """What the rules look at for one complete checkpoint."""

    step: int
    created_unix: float | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class PrunePlan:
    """The outcome: steps kept (with the rules that keep each) and steps removed, oldest first."""

    keep: dict[int, list[str]]
    remove: list[int]


def plan_prune(
    checkpoints: Iterable[int | PruneCandidate],
    rules: PruneRules,
    *,
    now: float | None = None,
    protected: Collection[int] = (),
) -> PrunePlan:
    """Apply ``rules`` to complete checkpoints (steps, or candidates carrying age and metrics).

    ``now`` (Unix seconds) is needed only by ``keep_younger_than``; a checkpoint of unknown age is
    kept by that rule, since it cannot be shown to be old. ``protected`` steps always stay.
    """
    by_step: dict[int, PruneCandidate] = {}
    for c in checkpoints:
        cand = c if isinstance(c, PruneCandidate) else PruneCandidate(step=c)
        by_step[cand.step] = cand
    ordered = sorted(by_step)
    keep: dict[int, list[str]] = {}

    def mark(step: int, why: str) -> None:
        keep.setdefault(step, []).append(why)

    if ordered:
        mark(ordered[-1], "newest")
    for s in ordered:
        if s in protected:
            mark(s, "in use")
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
    if rules.keep_best is not None and rules.best_metric is not None:
        metric = rules.best_metric
        ranked = [
            (float(by_step[s].metrics[metric]), s)
            for s in ordered
            if isinstance(by_step[s].metrics.get(metric), (int, float))
            and math.isfinite(float(by_step[s].metrics[metric]))
        ]
        # Ties go to the newer checkpoint: it holds more training for the same score.
        ranked.sort(key=lambda vs: (vs[0] if rules.best_mode == "min" else -vs[0], -vs[1]))
        for _, s in ranked[: rules.keep_best]:
            mark(s, f"best {rules.keep_best} by {metric}")
        if not ranked:
            # No checkpoint carries the metric (a typo, or metrics never passed): ranking by it
            # would remove the best checkpoints unseen. Keep everything until one does.
            for s in ordered:
                mark(s, f"no checkpoint has metric {metric!r}")
    if rules.keep_younger_than is not None:
        if now is None:
            raise ValueError("keep_younger_than needs 'now'")
        for s in ordered:
            created = by_step[s].created_unix
            if created is None or now - created < rules.keep_younger_than:
                mark(s, "recent")
    return PrunePlan(keep=dict(sorted(keep.items())), remove=[s for s in ordered if s not in keep])
