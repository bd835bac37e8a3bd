"""Checkpointing knobs: the validated, frozen configuration the policy decides from.

Each field mirrors the specification's callback setting of the same name, with the same default.
Each field's ``metadata`` says how ``ckptkeeper train`` offers it (``cli``) and with what help text,
so the command line, the callback and the manager take their settings from this one list.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from ..errors import ConfigurationError

__all__ = ["CheckpointPolicyConfig", "RemovalStrategy"]


class RemovalStrategy(StrEnum):
    """Which checkpoints found in the save folder (left by earlier runs) may be removed."""

    ephemeral_only = "ephemeral_only"
    """Only checkpoints at a multiple of the current ``ephemeral_save_interval``."""

    all_non_permanent = "all_non_permanent"
    """Every checkpoint that is not permanent under the current settings."""

    never = "never"
    """Never remove checkpoints found at start-up."""


def _positive_or_none(name: str, value: int | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigurationError(f"'{name}' must be an integer or None, got {value!r}")
    if value < 1:
        raise ConfigurationError(f"'{name}' must be at least 1, got {value}; use None to turn it off")


@dataclass(frozen=True)
class CheckpointPolicyConfig:
    """When to save and what to remove. Validated on construction (raises :class:`ConfigurationError`)."""

    save_interval: int | None = field(
        default=250, metadata={"cli": "interval", "help": "permanent checkpoint interval in steps, or none"}
    )
    """Steps between permanent checkpoints; ``None`` turns interval saves off."""

    ephemeral_save_interval: int | None = field(
        default=None, metadata={"cli": "interval", "help": "ephemeral checkpoint interval in steps, or none"}
    )
    """Steps between ephemeral checkpoints, each removed once a newer ephemeral one is saved.
    Must be smaller than ``save_interval``."""

    pre_train_checkpoint: bool | None = field(
        default=None, metadata={"cli": "tri", "help": "save at step 0: auto (fresh starts only), true or false"}
    )
    """Save at step 0 before training. ``None``: only when the run did not resume from a checkpoint."""

    save_async: bool | None = field(
        default=None, metadata={"cli": "flag", "help": "write checkpoints in the background (default: where possible)"}
    )
    """Write checkpoints in the background. ``None``: on when the process-group backend can run on CPU
    (always, for a single process)."""

    remove: RemovalStrategy = field(
        default=RemovalStrategy.ephemeral_only,
        metadata={"cli": "choice", "help": "which checkpoints of earlier runs may be removed"},
    )
    """Which checkpoints left by earlier runs are removed once the next ephemeral checkpoint is saved."""

    ephemeral_cooldown: int | None = field(
        default=None, metadata={"cli": "interval", "help": "steps after any save before an ephemeral one, or none"}
    )
    """Steps that must pass after any save before an ephemeral checkpoint is saved again."""

    fixed_steps: tuple[int, ...] | None = field(
        default=None, metadata={"cli": "steps", "help": "extra permanent steps, e.g. 3,7,12"}
    )
    """Extra steps at which permanent checkpoints are saved."""

    enabled: bool = True
    """``False`` turns the checkpointer callback off entirely."""

    def __post_init__(self) -> None:
        _positive_or_none("save_interval", self.save_interval)
        _positive_or_none("ephemeral_save_interval", self.ephemeral_save_interval)
        _positive_or_none("ephemeral_cooldown", self.ephemeral_cooldown)
        if (
            self.save_interval is not None
            and self.ephemeral_save_interval is not None
            and self.ephemeral_save_interval >= self.save_interval
        ):
            raise ConfigurationError(
                f"'ephemeral_save_interval' ({self.ephemeral_save_interval}) must be less than "
                f"'save_interval' ({self.save_interval}); make it smaller or set save_interval=None"
            )
        try:
            strategy = RemovalStrategy(self.remove)
        except ValueError:
            allowed = ", ".join(s.value for s in RemovalStrategy)
            raise ConfigurationError(f"'remove' must be one of {allowed}; got {self.remove!r}") from None
        object.__setattr__(self, "remove", strategy)
        if self.fixed_steps is not None:
            steps = tuple(self.fixed_steps)
            for s in steps:
                if isinstance(s, bool) or not isinstance(s, int) or s < 0:
                    raise ConfigurationError(f"'fixed_steps' must hold non-negative integers, got {s!r}")
            object.__setattr__(self, "fixed_steps", steps)
        for name in ("pre_train_checkpoint", "save_async"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ConfigurationError(f"'{name}' must be True, False or None, got {value!r}")
        if not isinstance(self.enabled, bool):
            raise ConfigurationError(f"'enabled' must be True or False, got {self.enabled!r}")
