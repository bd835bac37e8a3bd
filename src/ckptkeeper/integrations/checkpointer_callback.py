"""CheckpointerCallback: when to save and what to remove, behaviour-compatible with OLMo-core's.

The decisions come from :mod:`ckptkeeper.policy`; this class carries them out through the
trainer. Two deliberate differences from the specification, both about removals it defers:
removals still pending when training ends normally are carried out then, and with async saves
checkpoints superseded by a save that was in flight are removed as soon as that save is durable
(the specification waits for a step with no save in flight, which fast steps may never reach).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .. import distributed as D
from ..errors import CheckpointSaveError, CkptkeeperError
from ..policy import (
    CheckpointPolicyConfig,
    RemovalStrategy,
    RetentionBook,
    SaveKind,
    decide_save,
    needs_final_save,
    removable_from_earlier_runs,
    wants_pre_train_save,
)
from ..storage import is_url
from .trainer import Callback

__all__ = ["CheckpointEvent", "CheckpointerCallback"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointEvent:
    """One save or removal made by the callback, in the order it was made."""

    event: str
    """``"save"`` or ``"remove"``."""
    step: int
    """The checkpoint's step."""
    at_step: int
    """The trainer's step when it happened."""
    kind: str | None = None
    """For saves: ``"permanent"`` or ``"ephemeral"``."""
    path: str = ""


@dataclass
class CheckpointerCallback(Callback):
    """Saves permanent and ephemeral checkpoints on schedule and removes superseded ones.

    Every field has the specification's meaning and default; see
    :class:`~ckptkeeper.policy.CheckpointPolicyConfig` for each. Invalid values raise
    :class:`~ckptkeeper.ConfigurationError` on construction.
    """

    priority: ClassVar[int] = 1

    save_interval: int | None = 250
    ephemeral_save_interval: int | None = None
    pre_train_checkpoint: bool | None = None
    save_async: bool | None = None
    remove: RemovalStrategy | str = RemovalStrategy.ephemeral_only
    ephemeral_cooldown: int | None = None
    fixed_steps: list[int] | None = None
    enabled: bool = True

    history: list[CheckpointEvent] = field(default_factory=list, init=False, repr=False)
    """Every save and removal this callback made, in order."""

    def __post_init__(self) -> None:
        self.policy = CheckpointPolicyConfig(
            save_interval=self.save_interval,
            ephemeral_save_interval=self.ephemeral_save_interval,
            pre_train_checkpoint=self.pre_train_checkpoint,
            save_async=self.save_async,
            remove=self.remove,  # type: ignore[arg-type]  # validated and converted by the config
            ephemeral_cooldown=self.ephemeral_cooldown,
            fixed_steps=tuple(self.fixed_steps) if self.fixed_steps is not None else None,
            enabled=self.enabled,
        )
        self.remove = self.policy.remove
        self._future: Future[Any] | None = None
        self._latest_checkpoint_step = -1
        self._latest_checkpoint_path = ""
        self._book: RetentionBook[str] = RetentionBook()

    @classmethod
    def from_config(cls, cfg: CheckpointPolicyConfig) -> CheckpointerCallback:
        """A callback with the settings of a validated :class:`CheckpointPolicyConfig`."""
        return cls(
            save_interval=cfg.save_interval,
            ephemeral_save_interval=cfg.ephemeral_save_interval,
            pre_train_checkpoint=cfg.pre_train_checkpoint,
            save_async=cfg.save_async,
            remove=cfg.remove,
            ephemeral_cooldown=cfg.ephemeral_cooldown,
            fixed_steps=list(cfg.fixed_steps) if cfg.fixed_steps is not None else None,
            enabled=cfg.enabled,
        )

    # ------------------------------------------------------------------ helpers

    @property
    def checkpoint_pending(self) -> bool:
        """Whether an async save has been started and not yet awaited."""
        return self._future is not None

    @property
    def checkpoints(self) -> list[str]:
        """Permanent checkpoints this run saved."""
        return list(self._book.permanents)

    @property
    def ephemeral_checkpoints(self) -> list[str]:
        """Ephemeral checkpoints (this run's and earlier runs') not yet superseded."""
        return list(self._book.ephemerals)

    def _await_last_checkpoint(self, blocking: bool = True) -> None:
        fut = self._future
        if fut is None:
            return
        # Ranks must notice a finished save at the same step: one that raised the save's error a
        # step earlier than the others would leave them waiting in training collectives.
        if not blocking and not D.all_agree(fut.done()):
            return
        self._future = None
        fut.result()
        if not D.on_rank0(lambda: self.trainer.checkpointer.dir_is_checkpoint(self._latest_checkpoint_path)):
            raise CheckpointSaveError(
                f"the save of step {self._latest_checkpoint_step} finished but {self._latest_checkpoint_path} "
                "is not a complete checkpoint"
            )

    def _save_checkpoint(self, kind: SaveKind, save_async: bool | None = None) -> str:
        use_async = self.save_async if save_async is None else save_async
        was_pending = self.checkpoint_pending
        self._await_last_checkpoint()
        if was_pending:
            # The save that superseded these is durable now; removing them no longer risks anything.
            self._remove_due()
        ephemeral = kind == SaveKind.ephemeral
        if use_async:
            path, self._future = self.trainer.save_checkpoint_async(ephemeral=ephemeral)
        else:
            path = self.trainer.save_checkpoint(ephemeral=ephemeral)
        self._latest_checkpoint_step = self.step
        self._latest_checkpoint_path = path
        self.history.append(CheckpointEvent("save", self.step, self.step, kind.value, path))
        self._book.record_save(path, kind)
        return path

    def _remove_checkpoint(self, path: str) -> None:
        from ..storage import parse_step

        log.info("removing old checkpoint %s", path)
        self.history.append(CheckpointEvent("remove", parse_step(path) or -1, self.step, None, path))
        rank, fs_rank = D.get_rank(), D.get_fs_local_rank()
        if rank == 0 or (not is_url(path) and fs_rank == 0):
            # Making it invisible is immediate; the files go in the background.
            try:
                self.trainer.checkpointer.remove(
                    path,
                    run_in_background=lambda fn: self.trainer.run_bookkeeping_op(
                        fn, op_name=f"remove {path}", soft_timeout=180 if is_url(path) else None
                    ),
                )
            except CkptkeeperError as exc:
                # Retention is housekeeping: a checkpoint it may not delete is left, never a crash.
                log.error("not removing %s: %s", path, exc)

    def _remove_due(self) -> None:
        for path in self._book.take_due():
            self._remove_checkpoint(path)

    # ------------------------------------------------------------------ hooks

    def pre_train(self) -> None:
        if not self.enabled:
            return
        if self.save_async is None:
            self.save_async = D.backend_supports_cpu()
        checkpointer = self.trainer.checkpointer
        if D.is_distributed() and self.save_async and checkpointer.process_group is None:
            if not D.backend_supports_cpu():
                raise RuntimeError("async checkpointing needs a CPU-capable process-group backend (gloo)")
            log.info("creating a separate process group for async checkpointing")
            checkpointer.process_group = D.new_cpu_group(timeout_minutes=30)

        if wants_pre_train_save(self.policy, self.step, self.trainer.checkpoint_loaded):
            self._save_checkpoint(SaveKind.permanent)

        if self.policy.remove == RemovalStrategy.never:
            return

        def discover() -> list[str]:
            try:
                # Only ckptkeeper's own checkpoints are ever removed: an OLMo-core checkpoint in the
                # folder (a run being continued) is resumed from, never deleted.
                infos = checkpointer.list_checkpoints(self.trainer.save_folder)
                existing = [(i.step, i.path) for i in infos if i.complete and i.flavor == "ckptkeeper"]
            except FileNotFoundError:
                existing = []
            return removable_from_earlier_runs(self.policy, existing, self.step)

        found = D.on_rank0(discover)
        self._book.adopt_found(found)
        for path in found:
            log.info("found earlier checkpoint %s; it is removed once the next ephemeral checkpoint is saved", path)

    def post_train_batch(self) -> None:
        if not self.enabled:
            return
        self._await_last_checkpoint(blocking=False)
        if not self.checkpoint_pending:
            self._remove_due()
        kind = decide_save(
            self.policy, self.step, self._latest_checkpoint_step, self.trainer.block_ephemeral_checkpoints
        )
        if kind is not None:
            self._save_checkpoint(kind)

    def post_train(self) -> None:
        if not self.enabled:
            return
        if needs_final_save(self.step, self._latest_checkpoint_step):
            self._save_checkpoint(SaveKind.permanent, save_async=False)
        self._await_last_checkpoint()
        self._remove_due()

    def on_error(self, exc: BaseException) -> None:
        self._drain()

    def close(self) -> None:
        self._drain()

    def _drain(self) -> None:
        # Let a save already in flight finish so it is not lost; its own failure is only logged
        # here because another error (or the normal end) is already being handled.
        if self._future is not None:
            try:
                self._await_last_checkpoint()
            except Exception as err:
                log.error("the checkpoint save in flight failed: %s", err)
                self.trainer.mark_reported(err)
            finally:
                self._future = None
