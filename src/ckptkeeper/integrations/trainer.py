"""A small training loop with callback hooks, built so that a resumed run continues bit-exactly.

The step counter follows the specification: it is incremented *before* ``post_train_batch``,
so the checkpoint of step N holds the state after update N. Everything a resumed run needs to
continue exactly (global step, RNG streams of python/numpy/torch, the data position, callback
and user state) goes into the checkpoint as JSON or as tensors, never as a pickle.
"""

from __future__ import annotations

import base64
import logging
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar

import torch
from torch import nn

from .. import distributed as D
from ..engine import Checkpointer, SaveFolderLease, SaveResult, Stateful, TrainingState
from ..engine.discovery import NOT_OURS
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigurationError,
    CorruptCheckpointError,
    SaveFolderInUseError,
)
from ..storage import storage_for

__all__ = ["Callback", "TrainStep", "Trainer"]

log = logging.getLogger(__name__)

TrainStep = Callable[["Trainer", Any], "float | torch.Tensor"]
"""A user train step: takes the trainer and one batch, does one update, returns the loss."""


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


def _default_step(trainer: Trainer, batch: Any) -> torch.Tensor:
    if trainer.optimizer is None or trainer.loss_fn is None:
        raise ConfigurationError("the default train step needs 'optimizer' and 'loss_fn'; pass them or a train_step")
    inputs, targets = batch
    trainer.optimizer.zero_grad(set_to_none=True)
    loss = trainer.loss_fn(trainer.model(inputs), targets)
    loss.backward()  # type: ignore[no-untyped-call]
    trainer.optimizer.step()
    return loss.detach()


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": _py_rng_to_json(random.getstate()),
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()  # type: ignore[misc]
        state["numpy"] = [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
    except ImportError:  # numpy is optional for the library
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return state


def _py_rng_to_json(state: Any) -> list[Any]:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _from_olmo_core(ts: Mapping[str, Any]) -> Mapping[str, Any]:
    """OLMo-core's trainer state in this Trainer's shape (unchanged when it is already ours).

    OLMo-core keeps each RNG state under ``{"version", "state"}`` with torch's as a list of byte
    values; its data-loader position has no equivalent here, so a run continued from an OLMo-core
    checkpoint starts a new pass over its data loader.
    """
    rng = ts.get("rng")
    if not (isinstance(rng, Mapping) and isinstance(rng.get("python"), Mapping)):
        return ts
    ours: dict[str, Any] = {"python": rng["python"]["state"]}
    torch_state = rng.get("torch")
    if isinstance(torch_state, Mapping):
        ours["torch"] = base64.b64encode(bytes(torch_state["state"])).decode()
    numpy_state = rng.get("numpy")
    if isinstance(numpy_state, Mapping):
        ours["numpy"] = numpy_state["state"]
    return {"global_step": ts["global_step"], "rng": ours, "data": {}, "callbacks": {}}


def _numpy_state() -> Any:
    try:
        import numpy as np
    except ImportError:
        return None
    return np.random.get_state()


def _restore_numpy_state(state: Any) -> None:
    if state is not None:
        import numpy as np

        np.random.set_state(state)


def _set_rng_state(state: Mapping[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(
            [torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8) for s in state["cuda"]]
        )


class Trainer:
    """Runs ``max_steps`` updates of ``model`` over ``data_loader``, calling callbacks around each.

    On :meth:`fit` it takes the save folder's writer lease (``take_lease``; a second run on the same
    folder stops with :class:`~ckptkeeper.SaveFolderInUseError`), then resumes from the newest
    checkpoint in ``save_folder`` that loads (falling back past corrupt ones), or else from
    ``load_path`` when given. When the save folder holds checkpoints and none of them loads, it
    raises :class:`~ckptkeeper.CorruptCheckpointError` listing each one and why, unless
    ``start_fresh_if_unloadable`` says to train from scratch over them. Without a
    :class:`~ckptkeeper.CheckpointerCallback` in ``callbacks`` one with default settings is added,
    as in OLMo-core.
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
        self.load_path = load_path
        self.start_fresh_if_unloadable = start_fresh_if_unloadable
        self.take_lease = take_lease
        self.lease: SaveFolderLease | None = None
        self._reported: set[int] = set()
        self.train_step: TrainStep = train_step or _default_step
        self.checkpointer = checkpointer or Checkpointer()
        self.state = TrainingState(model, optimizer, extra_state)
        self.global_step = 0
        self.checkpoint_loaded = False
        self.loaded_from: str | None = None
        self.block_ephemeral_checkpoints = False
        self.losses: dict[int, float] = {}
        self.start_step = 0

        from .checkpointer_callback import CheckpointerCallback

        cbs = list(callbacks)
        if add_default_checkpointer and not any(isinstance(c, CheckpointerCallback) for c in cbs):
            cbs.append(CheckpointerCallback())
        # Stable sort: equal priorities keep the order they were given in.
        self.callbacks: list[Callback] = sorted(cbs, key=lambda c: -c.priority)
        for cb in self.callbacks:
            cb.trainer = self
        self._bookkeeping = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptkeeper-bookkeeping")
        self._bookkeeping_futures: list[Future[Any]] = []
        self._pending_saves: list[tuple[str, Future[SaveResult]]] = []
        self._iterator: Iterator[Any] | None = None
        self._epoch = 0
        self._batch_in_epoch = 0
        self._epoch_rng: dict[str, Any] | None = None
        self._resume_data: dict[str, Any] | None = None

    # ------------------------------------------------------------------ API used by callbacks

    def save_checkpoint(self, ephemeral: bool = False) -> str:
        """Save the current state synchronously; returns the checkpoint's path."""
        self._dispatch_finished_saves()
        result = self.checkpointer.save(
            self.save_folder, self.global_step, self.state, train_state=self._train_state(), ephemeral=ephemeral
        )
        self._notify_saved(result.path, result)
        return result.path

    def save_checkpoint_async(self, ephemeral: bool = False) -> tuple[str, Future[SaveResult]]:
        """Snapshot the state now and save it in the background; returns (path, future)."""
        self._dispatch_finished_saves()
        path, fut = self.checkpointer.save_async(
            self.save_folder, self.global_step, self.state, train_state=self._train_state(), ephemeral=ephemeral
        )
        self._pending_saves.append((path, fut))
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
        """Run ``fn`` off the training thread (deletions and other slow housekeeping).

        A failure is logged, never raised into training: housekeeping must not kill a run.
        ``distributed=True`` ops run inline because every rank must take part in them.
        """
        name = op_name or getattr(fn, "__name__", "bookkeeping op")

        def run() -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            except Exception:
                log.exception("bookkeeping op %r failed; training continues", name)
                return None
            finally:
                took = time.perf_counter() - t0
                if soft_timeout is not None and took > soft_timeout:
                    log.warning("bookkeeping op %r took %.0fs (soft timeout %.0fs)", name, took, soft_timeout)

        if distributed:
            run()
            return
        self._bookkeeping_futures = [f for f in self._bookkeeping_futures if not f.done()]
        self._bookkeeping_futures.append(self._bookkeeping.submit(run))

    def wait_for_bookkeeping(self) -> None:
        """Block until every background bookkeeping op has finished."""
        for fut in self._bookkeeping_futures:
            fut.result()
        self._bookkeeping_futures.clear()

    # ------------------------------------------------------------------ state

    def _train_state(self) -> dict[str, Any]:
        data_state: dict[str, Any] = {
            "epoch": self._epoch,
            "batch_in_epoch": self._batch_in_epoch,
            "epoch_rng": self._epoch_rng,
        }
        if isinstance(self.data_loader, Stateful):
            data_state["loader"] = self.data_loader.state_dict()
        callbacks = {}
        for cb in self.callbacks:
            sd = cb.state_dict()
            if sd is not None:
                callbacks[type(cb).__name__] = sd
        return {
            "global_step": self.global_step,
            "rng": _rng_state(),
            "data": data_state,
            "callbacks": callbacks,
            "world_size": D.get_world_size(),
        }

    def _check_train_state(self, ts: Mapping[str, Any]) -> None:
        # Everything _apply_train_state will use, checked before any tensor is loaded: a trainer
        # state that passed its checksum but cannot be applied must not leave a half-loaded model.
        step = ts["global_step"]
        if type(step) is not int or step < 0:
            raise ValueError(f"global_step is {step!r}")
        data = ts.get("data", {})
        for key in ("epoch", "batch_in_epoch"):
            if type(data.get(key, 0)) is not int or data.get(key, 0) < 0:
                raise ValueError(f"data.{key} is {data.get(key)!r}")
        saved = (random.getstate(), torch.get_rng_state())
        np_saved = _numpy_state()
        try:
            _set_rng_state(ts["rng"])
            if data.get("epoch_rng") is not None:
                _set_rng_state(data["epoch_rng"])
        finally:
            random.setstate(saved[0])
            torch.set_rng_state(saved[1])
            _restore_numpy_state(np_saved)
        if not isinstance(ts.get("callbacks", {}), Mapping):
            raise ValueError("callbacks is not a table")

    def _apply_train_state(self, ts: Mapping[str, Any]) -> None:
        self.global_step = int(ts["global_step"])
        data = ts.get("data", {})
        self._epoch = int(data.get("epoch", 0))
        self._batch_in_epoch = int(data.get("batch_in_epoch", 0))
        self._epoch_rng = data.get("epoch_rng")
        if isinstance(self.data_loader, Stateful) and "loader" in data:
            self.data_loader.load_state_dict(data["loader"])
        else:
            self._resume_data = {"rng": ts["rng"]}
        by_name = ts.get("callbacks", {})
        for cb in self.callbacks:
            if type(cb).__name__ in by_name:
                cb.load_state_dict(by_name[type(cb).__name__])
        _set_rng_state(ts["rng"])

    def load_checkpoint(self, path: str) -> None:
        """Load the checkpoint at ``path`` (model, optimizer, extras and trainer state)."""
        ts = self.checkpointer.load(
            path, self.state, check_train_state=lambda raw: self._check_train_state(_from_olmo_core(raw))
        )
        self._apply_train_state(_from_olmo_core(ts))
        self.checkpoint_loaded = True
        self.loaded_from = path
        for cb in self.callbacks:
            cb.post_checkpoint_loaded(path)

    def maybe_load_checkpoint(self) -> bool:
        """Resume from the newest checkpoint in the save folder that loads, else from ``load_path``.

        A checkpoint that fails verification or loading (any corruption) is skipped with a warning
        and the next older one is tried; a failed load leaves the model as it was. When checkpoints
        exist and none loads, CorruptCheckpointError lists them all, unless
        ``start_fresh_if_unloadable``. A corrupt ``load_path`` (explicitly asked for) raises.
        """

        def survey() -> tuple[list[str], list[tuple[str, str]]]:
            # Complete checkpoints, newest first; and the ones that claim to be checkpoints (they
            # have a commit record) but are broken. Folders without a record are not ours.
            infos = self.checkpointer.list_checkpoints(self.save_folder)
            good = [i.path for i in reversed(infos) if i.complete]
            # Folders whose .metadata.json is somebody else's are not checkpoints of this run either.
            broken = [
                (i.path, i.problem or "")
                for i in infos
                if not i.complete and i.problem != "no commit record" and not (i.problem or "").startswith(NOT_OURS)
            ]
            return good, broken

        candidates, failures = D.on_rank0(survey)
        for path in candidates:
            try:
                self.load_checkpoint(path)
                return True
            except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
                log.warning("skipping checkpoint %s: %s; trying the previous one", path, exc)
                failures.append((path, str(exc)))
        if failures:
            listing = "; ".join(f"{p}: {why}" for p, why in sorted(failures))
            if not self.start_fresh_if_unloadable:
                raise CorruptCheckpointError(
                    f"none of the {len(failures)} checkpoints in {self.save_folder} can be loaded ({listing}). "
                    "Restore one from a copy, or pass start_fresh_if_unloadable=True (ckptkeeper train: "
                    "--start-fresh-if-unloadable) to train from scratch; the broken checkpoints stay where they are"
                )
            log.warning(
                "no checkpoint in %s could be loaded (%s); starting from %s as asked",
                self.save_folder,
                listing,
                self.load_path or "scratch",
            )
        if self.load_path is not None:
            # Only rank 0 lists (object stores bill and throttle listings); the others take its answer.
            def resolve(path: str) -> str | None:
                return path if self.checkpointer.dir_is_checkpoint(path) else self.checkpointer.latest_checkpoint(path)

            resolved = D.on_rank0(lambda: resolve(self.load_path or ""))
            if resolved is None:
                raise CheckpointNotFoundError(
                    f"load_path {self.load_path} holds no complete checkpoint; pass a step folder or a save "
                    "folder that `ckptkeeper ls` shows as complete"
                )
            self.load_checkpoint(resolved)
            return True
        return False

    # ------------------------------------------------------------------ data

    def _next_batch(self) -> Any:
        if self._iterator is None:
            self._iterator = self._open_iterator()
        try:
            batch = next(self._iterator)
        except StopIteration:
            self._epoch += 1
            self._batch_in_epoch = 0
            self._epoch_rng = _rng_state()
            self._iterator = iter(self.data_loader)
            try:
                batch = next(self._iterator)
            except StopIteration:
                raise ConfigurationError("the data loader yields no batches") from None
        self._batch_in_epoch += 1
        return batch

    def _open_iterator(self) -> Iterator[Any]:
        resume = self._resume_data
        self._resume_data = None
        if resume is None or (self._batch_in_epoch == 0 and self._epoch_rng is None):
            if self._epoch_rng is None:
                self._epoch_rng = _rng_state()
            return iter(self.data_loader)
        # Replay the epoch from the RNG state it began with, skip what was consumed, then
        # put back the checkpoint's RNG state: the rest of the epoch matches the original run.
        if self._epoch_rng is not None:
            _set_rng_state(self._epoch_rng)
        it = iter(self.data_loader)
        for _ in range(self._batch_in_epoch):
            try:
                next(it)
            except StopIteration:
                break
        _set_rng_state(resume["rng"])
        return it

    # ------------------------------------------------------------------ the loop

    def _notify_saved(self, path: str, result: SaveResult) -> None:
        for cb in self.callbacks:
            cb.post_checkpoint_saved(path, result)

    def _dispatch_finished_saves(self, wait: bool = False) -> None:
        still = []
        for path, fut in self._pending_saves:
            if wait or fut.done():
                try:
                    result = fut.result()
                except Exception:
                    continue  # the checkpointer callback raises it where the specification does
                self._notify_saved(path, result)
            else:
                still.append((path, fut))
        self._pending_saves = still

    def fit(self) -> None:
        """Resume if possible, then train until ``max_steps``, calling every hook."""

        def prepare_folder() -> None:
            storage_for(self.save_folder).check_access(self.save_folder)
            if self.take_lease:
                # Before any clean-up: scratch in this folder may belong to the lease holder.
                lease = SaveFolderLease(self.save_folder)
                lease.acquire()
                self.lease = lease
                lease.start_renewing()
            self.checkpointer.clean_scratch(self.save_folder)

        try:
            D.on_rank0(prepare_folder)
            self.maybe_load_checkpoint()
        except BaseException:
            self.close()
            raise
        self.start_step = self.global_step
        if self.checkpoint_loaded and self.global_step >= self.max_steps:
            log.info(
                "checkpoint %s is at step %d, at or past max_steps=%d: nothing to train",
                self.loaded_from,
                self.global_step,
                self.max_steps,
            )
            self.close()
            return
        try:
            for cb in self.callbacks:
                cb.pre_train()
            while self.global_step < self.max_steps:
                batch = self._next_batch()
                loss = self.train_step(self, batch)
                if self.lease is not None and self.lease.lost:
                    raise SaveFolderInUseError(
                        f"another run took over the lease of save folder {self.save_folder}; stopping so that "
                        "the two runs do not overwrite each other's checkpoints"
                    )
                self.global_step += 1
                self.losses[self.global_step] = float(loss)
                for cb in self.callbacks:
                    cb.post_train_batch()
                self._dispatch_finished_saves()
            for cb in self.callbacks:
                cb.post_train()
            self._dispatch_finished_saves(wait=True)
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
        seen: BaseException | None = exc
        while seen is not None and id(seen) not in self._reported:
            self._reported.add(id(seen))
            seen = seen.__cause__ or seen.__context__

    def close(self) -> None:
        """Finish background work (bookkeeping ops, the checkpointer's writer) and release the lease."""
        try:
            self.wait_for_bookkeeping()
        finally:
            self._bookkeeping.shutdown(wait=True)
            try:
                self.checkpointer.close()
            except CheckpointError as exc:
                if id(exc) not in self._reported:
                    log.error("a background save failed after training stopped: %s", exc)
            finally:
                if self.lease is not None:
                    self.lease.release()
                    self.lease = None
