"""CheckpointerCallback: when to save and what to remove, behaviour-compatible with OLMo-core's.

The callback holds the settings; the trainer's :class:`~ckptkeeper.CheckpointManager` carries them
out (the same code a hand-written loop calls through ``save_if_due``). Two deliberate differences
from the specification, both about removals it defers: removals still pending when training ends
normally are carried out then, and with async saves checkpoints superseded by a save that was in
flight are removed as soon as that save is durable (the specification waits for a step with no
save in flight, which fast steps may never reach).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from ..manager import CheckpointEvent, CheckpointManager
from ..policy import CheckpointPolicyConfig, RemovalStrategy
from .callback import Callback

__all__ = ["CheckpointEvent", "CheckpointerCallback"]


@dataclass
class CheckpointerCallback(Callback):
    """Saves permanent and ephemeral checkpoints on schedule and removes superseded ones.

    Every field has the specification's meaning and default; see
    :class:`~ckptkeeper.policy.CheckpointPolicyConfig` for each (the fields are the config's,
    derived from it, so the two cannot drift apart). Invalid values raise
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

    def __post_init__(self) -> None:
        self.policy = CheckpointPolicyConfig(
            **{  # type: ignore[arg-type]  # validated and converted by the config
                f.name: (tuple(v) if f.name == "fixed_steps" and v is not None else v)
                for f in dataclasses.fields(CheckpointPolicyConfig)
                for v in [getattr(self, f.name)]
            }
        )
        self.remove = self.policy.remove

    @classmethod
    def from_config(cls, cfg: CheckpointPolicyConfig) -> CheckpointerCallback:
        """A callback with the settings of a validated :class:`CheckpointPolicyConfig`."""
        values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(CheckpointPolicyConfig)}
        if values["fixed_steps"] is not None:
            values["fixed_steps"] = list(values["fixed_steps"])
        return cls(**values)

    # ------------------------------------------------------------------ what it did

    @property
    def _manager(self) -> CheckpointManager | None:
        trainer = getattr(self, "trainer", None)
        return trainer.manager if trainer is not None else None

    @property
    def history(self) -> list[CheckpointEvent]:
        """Every save and removal made, in order."""
        return list(self._manager.history) if self._manager else []

    @property
    def checkpoint_pending(self) -> bool:
        """Whether an async save has been started and not yet awaited."""
        return bool(self._manager and self._manager.checkpoint_pending)

    @property
    def checkpoints(self) -> list[str]:
        """Permanent checkpoints this run saved."""
        return self._manager.checkpoints if self._manager else []

    @property
    def ephemeral_checkpoints(self) -> list[str]:
        """Ephemeral checkpoints (this run's and earlier runs') not yet superseded."""
        return self._manager.ephemeral_checkpoints if self._manager else []

    # ------------------------------------------------------------------ hooks

    def pre_train(self) -> None:
        if self.enabled:
            self.trainer.manager.begin()

    def post_train_batch(self) -> None:
        if self.enabled:
            self.trainer.manager.save_if_due(self.step, skip_ephemeral=self.trainer.block_ephemeral_checkpoints)

    def post_train(self) -> None:
        if self.enabled:
            self.trainer.manager.finish()

    def on_error(self, exc: BaseException) -> None:
        self.trainer.manager.drain()

    def close(self) -> None:
        self.trainer.manager.drain()
