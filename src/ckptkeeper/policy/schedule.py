"""Pure checkpoint decisions: what to save at a step, and what becomes eligible for removal.

Nothing here touches files, clocks or torch: given the configuration, the step and the
checkpoints known so far, each function answers, and the callback carries the answer out.
That keeps the specification's rules testable with plain tables.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Generic, TypeVar

from .config import CheckpointPolicyConfig, RemovalStrategy

__all__ = [
    "RetentionBook",
    "SaveKind",
    "decide_save",
    "decide_timed_save",
    "is_permanent_step",
    "needs_final_save",
    "removable_from_earlier_runs",
    "wants_pre_train_save",
]

T = TypeVar("T")


class SaveKind(StrEnum):
    """The two kinds of checkpoint: permanent ones stay, ephemeral ones are superseded."""

    permanent = "permanent"
    ephemeral = "ephemeral"


def is_permanent_step(cfg: CheckpointPolicyConfig, step: int) -> bool:
    """Whether ``step`` is one the current settings keep for good (a fixed step or an interval step)."""
    if cfg.fixed_steps is not None and step in cfg.fixed_steps:
        return True
    return cfg.save_interval is not None and step % cfg.save_interval == 0


def decide_save(
    cfg: CheckpointPolicyConfig,
    step: int,
    latest_checkpoint_step: int,
    ephemeral_blocked: bool = False,
) -> SaveKind | None:
    """What to save once ``step`` is done.

    ``latest_checkpoint_step`` is the step of this run's newest save (-1 before any), which the
    ephemeral cooldown counts from; ``ephemeral_blocked`` is the trainer asking to skip ephemerals.
    """
    if is_permanent_step(cfg, step):
        return SaveKind.permanent
    if cfg.ephemeral_save_interval is None or step % cfg.ephemeral_save_interval != 0 or ephemeral_blocked:
        return None
    if cfg.ephemeral_cooldown is not None and step - latest_checkpoint_step < cfg.ephemeral_cooldown:
        return None
    return SaveKind.ephemeral


def wants_pre_train_save(cfg: CheckpointPolicyConfig, step: int, checkpoint_loaded: bool) -> bool:
    """Whether to save before the first step: only at step 0, by default only for a fresh start."""
    if step != 0:
        return False
    if cfg.pre_train_checkpoint is None:
        return not checkpoint_loaded
    return cfg.pre_train_checkpoint


def decide_timed_save(
    scheduled: SaveKind | None,
    save_every_seconds: float | None,
    seconds_since_last_save: float,
    ephemeral_blocked: bool = False,
) -> SaveKind | None:
    """The wall-clock trigger on top of :func:`decide_save`: an ephemeral save once
    ``save_every_seconds`` have passed since the last save, when the schedule saves nothing at
    this step (and ephemerals are not blocked). ``scheduled`` is what :func:`decide_save` said."""
    if scheduled is not None or save_every_seconds is None or ephemeral_blocked:
        return scheduled
    return SaveKind.ephemeral if seconds_since_last_save >= save_every_seconds else None


def needs_final_save(step: int, latest_checkpoint_step: int) -> bool:
    """Whether training ended on a step this run has not saved yet."""
    return step > latest_checkpoint_step


def removable_from_earlier_runs(
    cfg: CheckpointPolicyConfig, found: Iterable[tuple[int, T]], current_step: int
) -> list[T]:
    """Checkpoints left by earlier runs that this run will remove, oldest first.

    Never step 0, never a step beyond the current one (it may belong to a run being resumed later),
    never a permanent step under the *current* settings; beyond that the removal strategy decides.
    """
    chosen: list[tuple[int, T]] = []
    if cfg.remove == RemovalStrategy.never:
        return []
    for step, item in found:
        if step == 0 or step > current_step or is_permanent_step(cfg, step):
            continue
        if cfg.remove == RemovalStrategy.all_non_permanent or (
            cfg.ephemeral_save_interval is not None and step % cfg.ephemeral_save_interval == 0
        ):
            chosen.append((step, item))
    chosen.sort(key=lambda pair: pair[0])
    return [item for _, item in chosen]


@dataclass
class RetentionBook(Generic[T]):
    """The run's retention bookkeeping: superseded ephemerals wait here until removal is safe.

    Only an ephemeral save supersedes: the newest ephemeral checkpoint (or one found from an earlier
    run) stays until the next ephemeral save, which moves every older one to the removal queue.
    """

    ephemerals: list[T] = field(default_factory=list)
    to_remove: list[T] = field(default_factory=list)
    permanents: list[T] = field(default_factory=list)

    def adopt_found(self, items: Iterable[T]) -> None:
        """Treat checkpoints from earlier runs as the oldest ephemerals (removed at the next ephemeral save)."""
        self.ephemerals = list(items) + self.ephemerals

    def record_save(self, item: T, kind: SaveKind) -> list[T]:
        """Note a save; returns what it superseded (now queued for removal)."""
        if kind == SaveKind.permanent:
            self.permanents.append(item)
            return []
        self.ephemerals.append(item)
        superseded = self.ephemerals[:-1]
        self.ephemerals = self.ephemerals[-1:]
        self.to_remove.extend(superseded)
        return superseded

    def forget(self, item: T) -> None:
        """Drop every note of ``item`` (it is being saved again, maybe as another kind)."""
        self.ephemerals = [i for i in self.ephemerals if i != item]
        self.to_remove = [i for i in self.to_remove if i != item]
        self.permanents = [i for i in self.permanents if i != item]

    def snapshot(self) -> tuple[list[T], list[T], list[T]]:
        """The bookkeeping as it is now, for :meth:`restore` (a save that then fails)."""
        return list(self.ephemerals), list(self.to_remove), list(self.permanents)

    def restore(self, snap: tuple[list[T], list[T], list[T]]) -> None:
        """Put the bookkeeping back as :meth:`snapshot` found it: the save noted since then failed,
        so it supersedes nothing (what it queued for removal is not removed) and is not listed."""
        self.ephemerals, self.to_remove, self.permanents = (list(part) for part in snap)

    def withdraw(self, item: T) -> None:
        """``item`` is gone although it was saved (a failed save of its step removed it first, as
        object stores must): forget it, and if it was the newest ephemeral, keep what it had
        superseded (nothing newer stands in for them now) until the next ephemeral save."""
        newest = item in self.ephemerals
        self.forget(item)
        if newest:
            self.ephemerals, self.to_remove = self.to_remove + self.ephemerals, []

    def take_due(self) -> list[T]:
        """Hand over (and forget) everything queued for removal."""
        due, self.to_remove = self.to_remove, []
        return due
