"""A small training loop with callback hooks, built so that a resumed run continues bit-exactly.

The step counter follows the specification: it is incremented *before* ``post_train_batch``,
so the checkpoint of step N holds the state after update N. Resume, fallback, the data position,
RNG streams, the save schedule and removals are the :class:`~ckptkeeper.CheckpointManager`'s: the
trainer owns one and only runs the loop and the callbacks around it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import torch
from torch import nn

from ..engine import Checkpointer, SaveFolderLease, SaveResult, Stateful, TrainingState
from ..errors import ConfigurationError
from ..manager import CheckpointManager
from ..policy import CheckpointPolicyConfig
from .callback import Callback
from .checkpointer_callback import CheckpointerCallback

__all__ = ["Callback", "TrainStep", "Trainer"]

log = logging.getLogger(__name__)

TrainStep = Callable[["Trainer", Any], "float | torch.Tensor"]
"""A user train step: takes the trainer and one batch, does one update, returns the loss."""


def _default_step(trainer: Trainer, batch: Any) -> torch.Tensor:
    if trainer.optimizer is None or trainer.loss_fn is None:
        raise ConfigurationError("the default train step needs 'optimizer' and 'loss_fn'; pass them or a train_step")
    inputs, targets = batch
    trainer.optimizer.zero_grad(set_to_none=True)
    loss = trainer.loss_fn(trainer.model(inputs), targets)
    loss.backward()  # type: ignore[no-untyped-call]
    trainer.optimizer.step()
    return loss.detach()


class _CallbackStates:
    """The callbacks' JSON states, as one object the manager keeps under ``callbacks`` by class name."""

    def __init__(self, cb: Callback) -> None:
        self.cb = cb

    def state_dict(self) -> Any:
        return self.cb.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.cb.load_state_dict(state_dict)


class Trainer:
    """Runs ``max_steps`` updates of ``model`` over ``data_loader``, calling callbacks around each.

    On :meth:`fit` it takes the save folder's writer lease (``take_lease``; a second run on the same
    folder stops with :class:`~ckptkeeper.SaveFolderInUseError`), then resumes from the newest
    checkpoint in ``save_folder`` that loads (falling back past corrupt ones), or else from
    ``load_path`` when given. When the save folder holds checkpoints and none of them loads, it
    raises :class:`~ckptkeeper.CorruptCheckpointError` listing each one and why, unless
    ``start_fresh_if_unloadable`` says to train from scratch over them. ``strict=False`` resumes
    from a checkpoint that does not fully fit (a layer or a scheduler added since) and lists what
    was left out in ``trainer.manager.load_report``. Without a
    :class:`~ckptkeeper.CheckpointerCallback` in ``callbacks`` one with default settings is added,
    as in OLMo-core. All of this is done by :attr:`manager`, a :class:`~ckptkeeper.CheckpointManager`
    configured from the checkpointer callback.
    """

    def __init__(
        self,
        *,
        model: nn.Module,
        data_loader: Iterable[Any],
        save_folder: str,
        max_steps: int,
        optimizer: torch.optim.Optimizer | None = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        train_step: TrainStep | None = None,
        callbacks: Sequence[Callback] = (),
        load_path: str | None = None,
        checkpointer: Checkpointer | None = None,
        extra_state: Mapping[str, Stateful] | None = None,
        add_default_checkpointer: bool = True,
        start_fresh_if_unloadable: bool = False,
        take_lease: bool = True,
        strict: bool = True,
    ) -> None:
        if max_steps < 0:
            raise ConfigurationError(f"'max_steps' must be at least 0, got {max_steps}")
        if not save_folder:
            raise ConfigurationError("'save_folder' must be a path or URL")
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.data_loader = data_loader
        self.save_folder = save_folder
        self.max_steps = max_steps
        self.train_step: TrainStep = train_step or _default_step
        self.block_ephemeral_checkpoints = False
        self.losses: dict[int, float] = {}

        cbs = list(callbacks)
        if add_default_checkpointer and not any(isinstance(c, CheckpointerCallback) for c in cbs):
            cbs.append(CheckpointerCallback())
        # Stable sort: equal priorities keep the order they were given in.
        self.callbacks: list[Callback] = sorted(cbs, key=lambda c: -c.priority)
        policy = next((c.policy for c in self.callbacks if isinstance(c, CheckpointerCallback)), None)
        self.manager = CheckpointManager(
            save_folder,
            model=model,
            optimizer=optimizer,
            extra_state=extra_state,
            json_state={type(cb).__name__: _CallbackStates(cb) for cb in self.callbacks},
            config=policy or CheckpointPolicyConfig(enabled=False),
            load_path=load_path,
            checkpointer=checkpointer,
            start_fresh_if_unloadable=start_fresh_if_unloadable,
            take_lease=take_lease,
            strict=strict,
        )
        self.manager.on_saved.append(self._notify_saved)
        self.manager.on_loaded.append(self._notify_loaded)
        for cb in self.callbacks:
            cb.trainer = self

    # ------------------------------------------------------------------ what callbacks see

    @property
    def global_step(self) -> int:
        """Updates done so far."""
        return self.manager.step

    @global_step.setter
    def global_step(self, step: int) -> None:
        self.manager.step = step

    @property
    def checkpointer(self) -> Checkpointer:
        """The engine that writes and reads checkpoints."""
        return self.manager.checkpointer

    @property
    def state(self) -> TrainingState:
        """Model, optimizer and extra state, as one checkpointable unit."""
        return self.manager.state

    @property
    def checkpoint_loaded(self) -> bool:
        """Whether :meth:`fit` resumed from a checkpoint."""
        return self.manager.checkpoint_loaded

    @property
    def loaded_from(self) -> str | None:
        """The checkpoint resumed from, if any."""
        return self.manager.loaded_from

    @property
    def start_step(self) -> int:
        """The step training started at (after any resume)."""
        return self.manager.start_step

    @property
    def lease(self) -> SaveFolderLease | None:
        """The save folder's writer lease while :meth:`fit` runs (rank 0)."""
        return self.manager.lease

    @property
    def load_path(self) -> str | None:
        """Where to start from when the save folder holds no checkpoint."""
        return self.manager.load_path

    @load_path.setter
    def load_path(self, path: str | None) -> None:
        self.manager.load_path = path

    @property
    def start_fresh_if_unloadable(self) -> bool:
        """Train from scratch when the folder holds checkpoints and none loads (instead of raising)."""
        return self.manager.start_fresh_if_unloadable

    @start_fresh_if_unloadable.setter
    def start_fresh_if_unloadable(self, value: bool) -> None:
        self.manager.start_fresh_if_unloadable = value

    # ------------------------------------------------------------------ API used by callbacks

    def save_checkpoint(self, ephemeral: bool = False) -> str:
        """Save the current state synchronously; returns the checkpoint's path."""
        path, _ = self.manager.write_checkpoint(ephemeral=ephemeral)
        return path

    def save_checkpoint_async(self, ephemeral: bool = False) -> tuple[str, Future[SaveResult]]:
        """Snapshot the state now and save it in the background; returns (path, future)."""
        path, fut = self.manager.write_checkpoint(ephemeral=ephemeral, use_async=True)
        assert fut is not None
        return path, fut

    def run_bookkeeping_op(
        self,
        fn: Callable[..., Any],
        *args: Any,
        op_name: str | None = None,
        distributed: bool = False,
        soft_timeout: float | None = None,
        **kwargs: Any,
    ) -> None:
        """Run ``fn`` off the training thread; see :meth:`CheckpointManager.run_bookkeeping_op`."""
        self.manager.run_bookkeeping_op(
            fn, *args, op_name=op_name, distributed=distributed, soft_timeout=soft_timeout, **kwargs
        )

    def wait_for_bookkeeping(self) -> None:
        """Block until every background bookkeeping op has finished."""
        self.manager.wait_for_bookkeeping()

    def load_checkpoint(self, path: str) -> None:
        """Load the checkpoint at ``path`` (model, optimizer, extras and trainer state)."""
        self.manager.open()
        self.manager.load(path)

    def maybe_load_checkpoint(self) -> bool:
        """Resume from the newest checkpoint in the save folder that loads, else from ``load_path``.

        See :meth:`CheckpointManager.restore`; returns whether a checkpoint was loaded.
        """
        self.manager.restore(begin=False)
        return self.manager.checkpoint_loaded

    # ------------------------------------------------------------------ the loop

    def _notify_saved(self, path: str, result: SaveResult) -> None:
        for cb in self.callbacks:
            cb.post_checkpoint_saved(path, result)

    def _notify_loaded(self, path: str) -> None:
        for cb in self.callbacks:
            cb.post_checkpoint_loaded(path)

    def fit(self) -> None:
        """Resume if possible, then train until ``max_steps``, calling every hook."""
        mgr = self.manager
        mgr.restore(begin=False)
        if mgr.checkpoint_loaded and self.global_step >= self.max_steps:
            log.info(
                "checkpoint %s is at step %d, at or past max_steps=%d: nothing to train",
                self.loaded_from,
                self.global_step,
                self.max_steps,
            )
            self.close()
            return
        batches = mgr.data(self.data_loader)
        try:
            for cb in self.callbacks:
                cb.pre_train()
            while self.global_step < self.max_steps:
                batch = next(batches)
                loss = self.train_step(self, batch)
                mgr.check_lease()
                self.global_step += 1
                self.losses[self.global_step] = float(loss)
                for cb in self.callbacks:
                    cb.post_train_batch()
                mgr.poll()
            for cb in self.callbacks:
                cb.post_train()
            mgr.poll(wait=True)
        except BaseException as exc:
            self.mark_reported(exc)
            for cb in self.callbacks:
                try:
                    cb.on_error(exc)
                except Exception:
                    log.exception("callback %s failed in on_error", type(cb).__name__)
            raise
        finally:
            try:
                for cb in self.callbacks:
                    cb.close()
            finally:
                self.close()

    def mark_reported(self, exc: BaseException) -> None:
        """Note that ``exc`` (and what caused it) was already raised or logged, so it is not reported twice."""
        self.manager.mark_reported(exc)

    def close(self) -> None:
        """Finish background work (bookkeeping ops, the checkpointer's writer) and release the lease."""
        self.manager.close(final_save=False)
