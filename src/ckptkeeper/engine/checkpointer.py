"""The Checkpointer: writes, verifies, finds, loads and removes checkpoints in a save folder.

A thin facade over the engine's parts, each in a module of its own: the save pipeline
(:mod:`~ckptkeeper.engine.saving`), the storage's commit method
(:mod:`~ckptkeeper.engine.commit`: a rename on filesystems, the record created last on object
stores), the background writer (:mod:`~ckptkeeper.engine.async_runner`), loading
(:mod:`~ckptkeeper.engine.loading`), discovery and removal (:mod:`~ckptkeeper.engine.deleter`).

Commit protocol. Every save first writes all files into a work folder; the commit record
(``.metadata.json``: step, kind, world size, every file with size and xxh3-64) comes last and
makes the checkpoint visible at once, so a reader that checks the record sees a checkpoint
complete or not at all. Removal deletes the commit record first (or renames the folder away),
so a half-deleted checkpoint is already invalid.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

import torch

from .. import distributed as D
from ..errors import ConfigurationError
from ..storage import storage_for
from ..storage.layout import COMMIT_RECORD
from . import discovery, loading
from .agreement import ctrl_c_after
from .async_runner import AsyncRunner
from .commit import commit_method_for
from .deleter import Deleter, clean_save_folder, discard_replaced, remove_checkpoint
from .discovery import CheckpointInfo
from .gcpause import paused_gc
from .record import CommitRecord
from .save_memo import SaveMemo
from .saving import (
    SaveResult,
    SaveSettings,
    SaveStage,
    checked_metrics,
    emit_save,
    final_path,
    mark_untouched,
    staging_need,
    train_payload,
    write_checkpoint,
)
from .staging import Stager, local_shard
from .state import TrainingState, capture_to_write, flatten_tensors

__all__ = ["CheckpointInfo", "Checkpointer", "SaveResult", "SaveStage"]

log = logging.getLogger(__name__)


# ``depth`` > 0 on a thread while it runs a synchronous save of any checkpointer.
_SYNC_SAVES_HERE = threading.local()


TrainStateArg = Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None
"""A save's ``train_state``: the mapping, or a function that returns it when the state is taken
(called before the state's ``capture()``, as the manager always did)."""


def _train_state_now(train_state: TrainStateArg) -> Mapping[str, Any] | None:
    got = train_state() if callable(train_state) else train_state
    if got is not None and not isinstance(got, Mapping):
        # It raised a bare TypeError deep in the JSON encoding (found by an outside attack).
        raise ConfigurationError(
            f"train_state must be a mapping of names to JSON values (or a function returning one), got "
            f"{type(got).__name__}; pass e.g. train_state={{'epoch': 3}}"
        )
    return got


@dataclasses.dataclass
class _Taken:
    """What a save takes from the caller before its first exchange (see :func:`_take_state`)."""

    metrics: dict[str, float] | None = None
    train: Mapping[str, Any] | None = None
    tensors: dict[str, Any] = dataclasses.field(default_factory=dict)
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    payload: bytes = b""
    failed: BaseException | None = None


def _take_state(
    step: int, state: TrainingState, train_state: TrainStateArg, metrics: Mapping[str, float] | None, world: int
) -> _Taken:
    """The metrics checked, the trainer state (before the capture: the Lightning adapter's hands
    the capture its tensors), the captured state and the trainer state's JSON.

    In one process the first failure is raised. With several ranks it is kept in ``failed`` for
    the ranks to agree on, and the capture still runs after an earlier failure: capturing an
    FSDP1 model runs collectives of its own, which every rank must join (found by an outside
    attack: a rank that skipped them met the others' in the save's first exchange, and gloo
    aborted it).
    """
    taken = _Taken()
    try:
        taken.metrics = checked_metrics(step, metrics)
        taken.train = _train_state_now(train_state)
    except BaseException as exc:
        if world == 1:
            raise
        taken.failed = exc
    try:
        taken.tensors, taken.meta = capture_to_write(state)
        if taken.failed is None:
            taken.payload = train_payload(step, taken.train, taken.meta)
    except BaseException as exc:
        if world == 1:
            raise
        taken.failed = taken.failed or exc
    if taken.failed is not None:
        taken.tensors, taken.meta, taken.payload = {}, {}, b""
    return taken


class Checkpointer:
    """Saves and loads checkpoints of a :class:`TrainingState` under a save folder (path or URL).

    One save may run in the background at a time (:meth:`save_async`); starting another waits
    for it. Loads check the commit record and file sizes first, then read each tensor straight
    into place, verifying checksums on the way.

    Args:
        verify_checksums: check xxh3 checksums on load (sizes are always checked).
        process_group: the group checkpoint collectives use (the callback makes a gloo one for async saves).
        spool_dir: local folder for object-store spools (default: the system temp folder).
        upload_threads: files uploaded or downloaded at once on object stores.
        io_threads: writer threads of the fast single-process path (they compete with training for cores).
        read_threads: reader threads of the fast path on load (per node: the ranks torchrun starts on
            one node, LOCAL_WORLD_SIZE, share them).
        writer: ``"auto"`` (fast path where possible) or ``"dcp"`` (always DCP's own writer).
        staging_budget_bytes: host memory async staging may hold (``CKPTKEEPER_STAGING_BUDGET``); None: no cap.
        over_budget: when a snapshot would exceed the budget, ``"sync"`` saves synchronously instead and
            ``"error"`` raises ConfigurationError.
        on_stage: called with a :class:`SaveStage` at the start of each stage of a save (tests inject
            faults and delays here; see :class:`SaveStage`).
    """

    METADATA_FNAME = COMMIT_RECORD

    def __init__(
        self,
        *,
        verify_checksums: bool = True,
        process_group: Any = None,
        spool_dir: str | None = None,
        upload_threads: int = 8,
        io_threads: int = 2,
        read_threads: int = 4,
        writer: str = "auto",
        staging_budget_bytes: int | None = None,
        over_budget: str = "sync",
        on_stage: Callable[[SaveStage], None] | None = None,
    ) -> None:
        if writer not in ("auto", "dcp"):
            raise ConfigurationError(f"'writer' must be 'auto' or 'dcp', got {writer!r}")
        if over_budget not in ("sync", "error"):
            raise ConfigurationError(f"'over_budget' must be 'sync' or 'error', got {over_budget!r}")
        env_budget = os.environ.get("CKPTKEEPER_STAGING_BUDGET")
        source = "'staging_budget_bytes'"
        if staging_budget_bytes is None and env_budget:
            source = "CKPTKEEPER_STAGING_BUDGET"
            try:
                staging_budget_bytes = int(env_budget)
            except ValueError:
                raise ConfigurationError(
                    f"CKPTKEEPER_STAGING_BUDGET must be a whole number of bytes (e.g. 8000000000), got {env_budget!r}"
                ) from None
        if staging_budget_bytes is not None and staging_budget_bytes < 0:
            raise ConfigurationError(f"{source} must be at least 0 bytes, got {staging_budget_bytes}")
        self.verify_checksums = verify_checksums
        self.process_group = process_group
        self.spool_dir = spool_dir
        self.upload_threads = upload_threads
        self.io_threads = io_threads
        self.read_threads = read_threads
        self.writer = writer
        self.staging_budget_bytes = staging_budget_bytes
        self.over_budget = over_budget
        self.on_stage = on_stage
        self._stager = Stager()
        # What the last saves planned, for the next saves of the same tensors (see save_memo).
        self._save_memo = SaveMemo()
        #: Owns the thread that deletes removed checkpoints' files (see :meth:`remove`).
        self.deleter = Deleter(soft_timeout_s=180.0)
        # Off only in the benchmark, to measure what the load's backup costs.
        self._rollback_loads = True
        self._runner: AsyncRunner[SaveResult] = AsyncRunner()
        # ``depth`` > 0 on a thread while it runs one of this checkpointer's synchronous saves.
        self._sync_saving = threading.local()

    # ------------------------------------------------------------------ saving

    def save(
        self,
        save_folder: str,
        step: int,
        state: TrainingState,
        *,
        train_state: TrainStateArg = None,
        ephemeral: bool = False,
        metrics: Mapping[str, float] | None = None,
    ) -> SaveResult:
        """Write the checkpoint of ``step`` and commit it before returning.

        ``metrics`` (names to finite numbers) go into the commit record, where retention by metric
        (``keep_best``) and ``ckptkeeper inspect`` read them. ``train_state`` (JSON) may be a
        function returning it, called when the state is taken. With several ranks, a failure to
        take the state on one rank (a ``state_dict()`` or that function raising, a NaN metric)
        fails the save on every rank, agreed before anything is written or removed.
        """
        t0 = time.perf_counter()
        self._refuse_in_sync_save("Checkpointer.save()")
        world = D.get_world_size(self.process_group)
        if world == 1:
            checked_metrics(step, metrics)  # before waiting for the last save, as it always was
        # Refused only where it would block (inside the save in flight): a synchronous save uses
        # no writer thread, so a done-callback may make one.
        self._runner.wait("Checkpointer.save()")
        here, anyone = self._sync_saving, _SYNC_SAVES_HERE
        here.depth = getattr(here, "depth", 0) + 1
        anyone.depth = getattr(anyone, "depth", 0) + 1
        try:
            # The caller waits for the whole save: the collector's pauses cost it nothing here.
            with paused_gc(), ctrl_c_after(f"the save of step {step}", self.process_group):
                # A failure here on one rank only (an extra's state_dict() failing, a train_state
                # that cannot be stored, a NaN metric, an interrupt raised from a state_dict())
                # left the others' save going on, pairing its exchanges with this rank's next
                # save: the save's first exchange, before anything is touched, raises it everywhere.
                got = _take_state(step, state, train_state, metrics, world)
                tensors = got.tensors if got.failed is not None else self._on_host(step, got.tensors)
                result = self._write(save_folder, step, tensors, got.payload, ephemeral, t0, got.metrics, got.failed)
        finally:
            here.depth -= 1
            anyone.depth -= 1
        emit_save(result, is_async=False)
        return result

    def _on_host(self, step: int, tensors: dict[str, Any]) -> dict[str, Any]:
        """``tensors`` with those on a GPU copied to host memory; ``tensors`` itself when none is
        on a GPU, when they would not fit the staging budget, or when the copy fails.

        The fast writers write host memory: a synchronous save of a GPU state went to DCP's
        writer (a sync save of a 768 MiB CUDA state took 1.3 s on an H200 where the async one was
        durable in 0.7 s). Where async saves made staging buffers, they are reused (pinned);
        otherwise the copy is pageable memory, freed after the save: a checkpointer used only for
        sync saves keeps no host copy of the state between saves. Several ranks need not agree
        here: each rank's writer is agreed on later, from what it was given.
        """
        if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            return tensors  # no tensor can be on a GPU: nothing to look at (a walk costs ms per 10,000)
        if not any(local_shard(t).is_cuda for _, t in flatten_tensors(tensors)):
            return tensors
        need, short = staging_need(tensors)
        if short is not None:
            return tensors  # the writers refuse it by name
        if self.staging_budget_bytes is not None and need > self.staging_budget_bytes:
            log.info(
                "step %d: staging %.1f MiB of GPU tensors would exceed the staging budget; DCP's writer saves them",
                step,
                need / 2**20,
            )
            return tensors
        self._runner.settle()  # no background save may still be writing from the buffers
        stager = self._stager if self._stager.nbytes else Stager(pin=False)
        try:
            return stager.stage_lazily(tensors)()
        except Exception as exc:  # host memory running out, say: DCP's writer copies tensor by tensor
            stager.release()
            log.warning("step %d: could not copy GPU tensors to host memory (%s); DCP's writer saves them", step, exc)
            return tensors

    def save_async(
        self,
        save_folder: str,
        step: int,
        state: TrainingState,
        *,
        train_state: TrainStateArg = None,
        ephemeral: bool = False,
        metrics: Mapping[str, float] | None = None,
    ) -> tuple[str, Future[SaveResult]]:
        """Snapshot the state now and write it in the background.

        Returns the checkpoint's final path and a future of its :class:`SaveResult`. The state may be
        changed as soon as this returns. A save still in flight is waited for first (its error, if
        any, is raised here). A failed background write raises :class:`CheckpointSaveError` from the
        future, naming the step and file. Reading the future collects nothing: the next save (or
        :meth:`wait`) raises the failure again, on every rank alike (take it with :meth:`wait_for`,
        or :meth:`forget` it, to have it raised once). With several ranks, a staging copy that
        fails on one rank (out of memory, say) fails the save on every rank, from each one's future.
        """
        self._runner.refuse_inside("Checkpointer.save_async()")
        self._refuse_in_sync_save("Checkpointer.save_async()")
        t0 = time.perf_counter()
        if D.get_world_size(self.process_group) == 1:
            checked_metrics(step, metrics)  # before waiting for the last save, as it always was
        self.wait()
        # A save whose outcome was collected elsewhere (forget(), an interrupted wait) may still be
        # writing from the staging buffers this one is about to fill.
        self._runner.settle()
        # With several ranks, from the first exchange until the save is handed over, a Ctrl-C is
        # held: raised inside the staging copy (after the ranks agreed to save), it left the
        # other ranks' background saves waiting for this rank, whose next save then joined their
        # exchanges with another step.
        with ctrl_c_after(f"the hand-over of the async save of step {step}", self.process_group):
            return self._hand_over(save_folder, step, state, train_state, ephemeral, metrics, t0)

    def _hand_over(
        self,
        save_folder: str,
        step: int,
        state: TrainingState,
        train_state: TrainStateArg,
        ephemeral: bool,
        metrics: Mapping[str, float] | None,
        t0: float,
    ) -> tuple[str, Future[SaveResult]]:
        """:meth:`save_async` once the previous save has ended: agree, stage, submit."""
        if D.is_distributed() and self.process_group is None:
            # Background collectives must not share a queue with training's: a group of their own
            # (every rank starts the same saves, so every rank creates it at the same call).
            self.process_group = D.new_cpu_group()
        with paused_gc():
            # Raised before the agreement on one rank only (an extra's state_dict() failing, a
            # train_state that cannot be stored, a NaN metric, an interrupt raised from a
            # state_dict()), the others went on to save without it: agreed on below.
            got = _take_state(step, state, train_state, metrics, D.get_world_size(self.process_group))
            tensors, payload, checked, broken = got.tensors, got.payload, got.metrics, got.failed
            need, short = staging_need(tensors)
        over_here = self.staging_budget_bytes is not None and need > self.staging_budget_bytes
        # All ranks take the same way (error, sync or async), or some would wait in a save the
        # others never start.
        if not D.all_agree(not over_here and short is None and broken is None, group=self.process_group):
            # Every rank is here: a tensor that cannot be staged on any rank (its memory shrunk
            # under it, so the copy would read past its end; or sparse), or a state that could
            # not be taken, fails the save everywhere, before the budget's choice.
            if not D.all_agree(short is None and broken is None, group=self.process_group):
                if broken is not None:
                    raise mark_untouched(broken)
                if short is not None:
                    raise mark_untouched(ConfigurationError(f"step {step}: {short}; nothing was saved")) from short
                raise mark_untouched(
                    ConfigurationError(
                        f"step {step}: another rank could not stage its state (a tensor it cannot stage, or its "
                        "state_dict() or train_state failed; that rank's error says which and why); nothing was saved"
                    )
                )
            budget = self.staging_budget_bytes or 0
            msg = (
                f"step {step}: an async save needs {need / 2**20:.1f} MiB of staging memory on some rank but the "
                f"budget is {budget / 2**20:.1f} MiB"
            )
            if self.over_budget == "error":
                raise ConfigurationError(
                    f"{msg}; raise staging_budget_bytes (or CKPTKEEPER_STAGING_BUDGET) or use over_budget='sync'"
                )
            log.warning("%s; saving synchronously instead", msg)
            self._stager.release()
            done: Future[SaveResult] = Future()
            # The trainer state as taken above: its function is called once per save (the
            # Lightning adapter's runs the user's on_save_checkpoint hooks).
            done.set_result(
                self.save(save_folder, step, state, train_state=got.train, ephemeral=ephemeral, metrics=checked)
            )
            return final_path(save_folder, step), done
        failed: Exception | None = None
        staged: Callable[[], dict[str, Any]] = dict
        with paused_gc():
            try:
                staged = self._stager.stage_lazily(tensors)
            except Exception as exc:
                # The ranks have agreed to save: failing here alone (host memory running out in
                # the copy, say) left the others' background saves to run without this rank.
                # The save goes on to its first round, where it fails on every rank together.
                if D.get_world_size(self.process_group) == 1:
                    raise
                self._stager.release()  # perhaps half made
                failed = exc
        blocked = time.perf_counter() - t0

        def run() -> SaveResult:
            problem, tree = failed, {}
            if problem is None:
                try:
                    with paused_gc():
                        tree = staged()
                except Exception as exc:
                    problem = exc
            r = self._write(save_folder, step, tree, payload, ephemeral, t0, checked, problem)
            result = dataclasses.replace(r, blocked_s=blocked)
            emit_save(result, is_async=True)
            return result

        return final_path(save_folder, step), self._runner.submit(run)

    @property
    def save_in_flight(self) -> bool:
        """Whether a background save has not finished yet."""
        return self._runner.in_flight

    def wait(self) -> SaveResult | None:
        """Wait for the background save, if any; re-raises its error."""
        return self._runner.wait()

    def refuse_inside_save(self, what: str) -> None:
        """Raise :class:`ConfigurationError` when called from inside one of this checkpointer's
        background saves (an ``on_stage`` hook on the writer thread), where ``what`` would wait
        for that save to end, for ever, or from inside one of its synchronous saves (see
        :meth:`_refuse_in_sync_save`). Wrappers (the manager) call it before changing anything."""
        self._runner.refuse_inside(what)
        self._refuse_in_sync_save(what)

    def _refuse_in_sync_save(self, what: str, by_any: bool = False) -> None:
        # A synchronous save's on_stage hook runs on the caller's thread, where nothing waits for
        # the save, but a load there rewrote the state under the save (which then committed a mix
        # of both that passed verify), a load on one rank only left the others waiting in the
        # save's exchange until the process group's timeout, and a nested save or close()
        # interleaved with the save (all found by outside attacks): refused before they change
        # anything, the save fails with the error on every rank together. A load is refused inside
        # any checkpointer's synchronous save on this thread (through another checkpointer it
        # rewrote the state all the same); a save through another one only reads, and is allowed.
        if getattr(_SYNC_SAVES_HERE if by_any else self._sync_saving, "depth", 0):
            raise ConfigurationError(
                f"{what} was called inside a synchronous save (from an on_stage hook?), which is still "
                "reading the state it saves; call it from the training code"
            )

    def wait_for(self, fut: Future[SaveResult]) -> SaveResult | None:
        """Wait for one background save (a future :meth:`save_async` returned); its result.

        Its error is raised once in all: here, unless :meth:`wait` (or another ``wait_for``,
        another thread's included) raised it already, in which case this returns None.
        """
        return self._runner.wait_for(fut, "Checkpointer.wait_for()")

    def forget(self, fut: Future[SaveResult]) -> None:
        """Stop tracking ``fut`` as the save in flight: its caller collected its outcome (or error).

        Without this, the next save (which waits for the one in flight first) would raise the
        same failure a second time (reading the future's ``result()`` collects nothing: with
        several ranks, every rank must raise a failure at the same call). Every rank forgets alike.
        """
        self._runner.forget(fut)

    def close(self) -> None:
        """Wait for the background save and queued deletions; stop both threads.

        A failed save is re-raised; failed deletions were logged (see :meth:`wait_for_removals`).
        """
        self._runner.refuse_inside("Checkpointer.close()")  # before anything is closed
        self._refuse_in_sync_save("Checkpointer.close()")
        try:
            self._runner.close()
        finally:
            self._save_memo.clear()  # its plans hold sharding specs (and so device meshes)
            self.deleter.close()

    def _write(
        self,
        save_folder: str,
        step: int,
        tensors: Mapping[str, Any],
        payload: bytes,
        ephemeral: bool,
        t0: float,
        metrics: Mapping[str, float] | None = None,
        failed: BaseException | None = None,
    ) -> SaveResult:
        # Settings are read now: the manager may give the checkpointer its process group late.
        settings = SaveSettings(self.process_group, self.writer, self.io_threads, self.on_stage, self._save_memo)
        # A subclass's own remove() is called for a checkpoint a save of its step replaces (it may
        # archive instead of delete): that means the old way, old one out first, then the new one in.
        swap = type(self).remove is Checkpointer.remove
        commit = commit_method_for(
            storage_for(save_folder), self.remove, self.spool_dir, self.upload_threads,
            self._discard_replaced if swap else None,
        )  # fmt: skip
        return write_checkpoint(settings, commit, save_folder, step, tensors, payload, ephemeral, t0, metrics, failed)

    # ------------------------------------------------------------------ discovery

    def read_record(self, path: str) -> CommitRecord:
        """The commit record of the checkpoint at ``path``; CheckpointNotFoundError when there is none."""
        return discovery.read_record(path)

    def dir_is_checkpoint(self, path: str) -> bool:
        """Whether ``path`` holds a complete checkpoint (record present, every listed file at its size)."""
        record, problem, _ = discovery.inspect(path)
        return record is not None and problem is None

    def list_checkpoints(self, save_folder: str) -> list[CheckpointInfo]:
        """Every ``step{N}`` folder under ``save_folder``, complete or not, by step."""
        return discovery.list_checkpoints(save_folder)

    def find_checkpoints(self, save_folder: str) -> list[tuple[int, str]]:
        """(step, path) of every complete checkpoint under ``save_folder``, oldest first."""
        return [(i.step, i.path) for i in self.list_checkpoints(save_folder) if i.complete]

    def latest_checkpoint(self, save_folder: str) -> str | None:
        """Path of the newest complete checkpoint, or None."""
        found = self.find_checkpoints(save_folder)
        return found[-1][1] if found else None

    def verify(self, path: str, checksums: bool = True) -> CommitRecord:
        """Check every file of a checkpoint against its commit record; raises CorruptCheckpointError.

        An OLMo-core checkpoint has no checksums: what can be checked is (see :func:`discovery.verify`),
        and its :class:`~ckptkeeper.engine.discovery.OlmoCoreRecord` is returned (``flavor``, ``note``).
        """
        return discovery.verify(path, checksums)

    # ------------------------------------------------------------------ loading

    def load(
        self,
        path: str,
        state: TrainingState,
        check_train_state: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Load the checkpoint at ``path`` into ``state``; returns this rank's trainer state.

        See :func:`ckptkeeper.engine.loading.load`: everything is checked before it is used, tensors
        are read in place and ``state`` is put back exactly as it was on any failure;
        :class:`CorruptCheckpointError` for a damaged checkpoint, :class:`CheckpointMismatchError`
        for an intact one that does not fit. ``check_train_state(train_state)`` runs before any
        tensor is touched.
        """
        self._runner.refuse_inside("Checkpointer.load()")
        self._refuse_in_sync_save("Checkpointer.load()", by_any=True)
        # The caller waits for the whole load (see gcpause for why the collector is paused).
        with paused_gc(), ctrl_c_after(f"the load of {path}", self.process_group):
            return loading.load(self, path, state, check_train_state)

    # ------------------------------------------------------------------ removal

    def remove(
        self,
        path: str,
        run_in_background: Callable[[Callable[[], Any]], Any] | None = None,
        *,
        background: bool = False,
    ) -> None:
        """Remove a checkpoint: invisible at once (rename, or commit record first), files deleted after.

        Only checkpoints ckptkeeper can prove it wrote are removed, and only their own files (see
        :mod:`ckptkeeper.engine.deleter`); anything else raises :class:`ConfigurationError` and is left
        alone. A ``step{N}`` symlink is unlinked, never followed. The slow part (deleting files)
        runs before this returns, unless ``background=True`` (queued on this checkpointer's
        deleter thread; :meth:`wait_for_removals`) or ``run_in_background`` is given (handed to it).
        """
        if run_in_background is not None:
            remove_checkpoint(path, run_in_background)
        else:
            self.deleter.remove(path, background=background)

    def _discard_replaced(self, hidden: str, final: str) -> None:
        # A failure is reported as a removal's is (wait_for_removals): the new checkpoint is in place.
        self.deleter.now(final, lambda: discard_replaced(hidden, final))

    def wait_for_removals(self) -> list[tuple[str, Exception]]:
        """Block until queued deletions are done; returns the (path, error) of those that failed.

        The checkpoint was already invisible; each error says what was left and what cleans it up
        (trash and intent-announced objects: the next run that opens the save folder).
        """
        return self.deleter.wait()

    def clean_scratch(self, save_folder: str) -> list[str]:
        """Delete leftovers of interrupted saves and removals that are provably ckptkeeper's; returns them.

        Local disks: ``.tmp-step{N}-{id}`` and ``.trash-step{N}-{id}`` folders (exact names only).
        Object stores: step folders without a commit record, through their upload intents (only
        the announced objects), and the unfinished multipart uploads those intents announced.

        Work folders of saves running in this process (any thread, any checkpointer, sync or
        async) are not leftovers and are left alone (found by an outside attack: one was deleted
        under its running save, which then committed a checkpoint without its tensors). Other
        processes' saves are kept out by the save folder's lease (:class:`~ckptkeeper.CheckpointManager`).
        """
        return clean_save_folder(save_folder)
