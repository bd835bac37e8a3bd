"""The trainer's callback interface: hooks around the loop, state kept in checkpoints.

Apart from the Trainer so that callbacks (the checkpointer callback among them) can be defined
without importing the loop that calls them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from ..engine import SaveResult

if TYPE_CHECKING:
    from .trainer import Trainer

__all__ = ["Callback"]


class Callback:
    """Base class of trainer callbacks; override the hooks you need. Higher ``priority`` runs first."""

    priority: ClassVar[int] = 0
    trainer: Trainer

    @property
    def step(self) -> int:
        """The trainer's global step (number of updates done)."""
        return self.trainer.global_step

    def pre_train(self) -> None:
        """Before the first step (after any checkpoint was loaded)."""

    def post_train_batch(self) -> None:
        """After each step; ``self.step`` already counts it."""

    def post_train(self) -> None:
        """After the last step of a run that finished normally."""

    def on_error(self, exc: BaseException) -> None:
        """When training raised; the exception is re-raised afterwards."""

    def close(self) -> None:
        """Always, last, whether training finished or failed."""

    def post_checkpoint_saved(self, path: str, result: SaveResult) -> None:
        """After a checkpoint is durable (for async saves: once the background write finished)."""

    def post_checkpoint_loaded(self, path: str) -> None:
        """After a checkpoint was loaded at start-up."""

    def state_dict(self) -> dict[str, Any] | None:
        """JSON-able state to keep in checkpoints (None: nothing)."""
        return None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
