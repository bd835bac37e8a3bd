"""CheckpointManager: ckptkeeper for any training loop.

One object holds everything a run needs from ckptkeeper: it resumes from the newest checkpoint
that loads (falling back past corrupt ones), puts back the RNG streams and the data position,
decides at each step whether to save (OLMo-core's ``CheckpointerCallback`` rules: permanent and
ephemeral intervals, fixed steps, cooldown, pre-train and final saves, removal of superseded and
earlier runs' checkpoints), saves in the background with one save in flight, applies retention
rules beyond the seed (keep last N, every K-th, best K by a metric, younger than a duration),
saves on a wall-clock timer or once on a preemption signal, and holds the save folder's lease.

The built-in :class:`~ckptkeeper.Trainer` and :class:`~ckptkeeper.CheckpointerCallback` are thin
layers over this class, so there is one implementation of resume, fallback, schedule and retention.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any, Protocol, TypeVar

from torch import nn
from torch.optim import Optimizer

from . import distributed as D
from ._resume import DataPosition, check_train_state, from_olmo_core, rng_state, set_rng_state
from .engine import Checkpointer, SaveFolderLease, SaveResult, Stateful, TrainingState
from .engine.agreement import ctrl_c_after
from .engine.async_runner import is_outcome
from .engine.deleter import set_aside_unloadable
from .engine.discovery import NOT_OURS
from .engine.record import check_metrics
from .engine.saving import final_path, untouched
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    CkptkeeperError,
    ConfigurationError,
    CorruptCheckpointError,
    NewerFormatError,
    SaveFolderInUseError,
)
from .policy import (
    CheckpointPolicyConfig,
    PruneCandidate,
    RemovalStrategy,
    RetentionBook,
    RetentionRules,
    SaveKind,
    decide_save,
    decide_timed_save,
    needs_final_save,
    plan_prune,
    removable_from_earlier_runs,
    wants_pre_train_save,
)
from .storage import is_url, parse_step, storage_for
from .storage.layout import MAX_STEP

__all__ = ["CheckpointEvent", "CheckpointManager", "JsonStateful"]

log = logging.getLogger("ckptkeeper.manager")


_CHOOSING = "choosing the checkpoint to resume from"


def _stop_if_pressed(said: list[Any]) -> None:
    """Stop every rank when any rank's first item in ``said`` (every rank's, in rank order) says
    it was interrupted: that rank raises its held Ctrl-C as it leaves the block, the others this."""
    pressed = [r for r, s in enumerate(said) if s[0]]
    if pressed:
        raise CheckpointError(
            f"stopped: Ctrl-C on rank {pressed[0]} while {_CHOOSING}; nothing was resumed (start the run again)"
        )


def _step_order(path: str) -> tuple[int, str]:
    # Checkpoints in step order (step5 before step10), then by path.
    step = parse_step(path)
    return (-1 if step is None else step, path)


_T = TypeVar("_T")


class JsonStateful(Protocol):
    """State kept as JSON in the trainer state: ``state_dict()`` returns a JSON-able dict (or None)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class CheckpointEvent:
    """One save or removal made by the manager, in the order it was made."""

    event: str
    """``"save"`` or ``"remove"``."""
    step: int
    """The checkpoint's step."""
    at_step: int
    """The training step when it happened."""
    kind: str | None = None
    """For saves: ``"permanent"`` or ``"ephemeral"``."""
    path: str = ""


@dataclass
class _InFlight:
    """An async save in flight and the run's bookkeeping from before it (put back if it fails)."""

    future: Future[SaveResult]
    path: str
    before: tuple[int, str, SaveKind | None, float]
    """The newest save's step, path and kind before this one, and when it started (timed saves)."""
    book: tuple[list[str], list[str], list[str]]
    """:meth:`RetentionBook.snapshot` from before this save was noted."""


class CheckpointManager:
    """Checkpoints for a training loop you write yourself.

    ::

        mgr = CheckpointManager("runs/a", model=model, optimizer=opt, extra_state={"sched": sched},
                                config=CheckpointPolicyConfig(save_interval=1000, ephemeral_save_interval=100))
        step = mgr.restore()              # newest good checkpoint, else 0
        for batch in mgr.data(loader, max_steps=max_steps):   # continues the data position
            ...                           # one update
            step += 1
            mgr.save_if_due(step)
        mgr.close()                       # final save, waits for the writer, releases the folder

    Args:
        save_folder: where checkpoints go (a path, ``s3://`` or ``gs://`` URL).
        model, optimizer: what to checkpoint; optimizer state is keyed by parameter name.
        extra_state: more objects with ``state_dict()``/``load_state_dict()`` (LR schedulers, a
            ``GradScaler``): their tensors are stored as tensors, the rest as JSON.
        json_state: objects whose whole state is JSON-able (counters, a framework's loop state);
            kept in the trainer-state file, given back through ``load_state_dict`` on restore.
        config: when to save and what to remove (the seed's rules); default ``CheckpointPolicyConfig()``.
        retention: keep-rules for permanent checkpoints beyond the seed (off by default: permanent
            checkpoints stay forever). A checkpoint stays if any rule keeps it; the newest complete
            checkpoint and one being loaded always stay.
        save_every_seconds: also save (an ephemeral checkpoint) when this much wall-clock time has
            passed since the last save.
        save_on_signals: signals (e.g. ``signal.SIGTERM``, ``signal.SIGUSR1``) that mean
            preemption: at the next :meth:`save_if_due` the manager waits for any save in flight,
            saves that step, closes, and exits with ``SystemExit(0)`` (``exit_on_signal=False``:
            returns and sets :attr:`preempted` instead). Installed by :meth:`restore` (main thread).
        load_path: a checkpoint (or save folder) to start from when ``save_folder`` holds none.
        checkpointer: the engine (default ``Checkpointer()``): writer threads, staging budget, spool.
        start_fresh_if_unloadable: when the folder holds checkpoints and none loads, start from
            scratch instead of raising :class:`~ckptkeeper.CorruptCheckpointError` (the broken
            checkpoints are first moved aside on a local disk, see
            :func:`~ckptkeeper.engine.deleter.set_aside_unloadable`).
        take_lease: hold the folder's writer lease while open (a second run on it is refused).
        strict: ``False`` loads what matches the model and reports the rest in :attr:`load_report`.
        state: an already built :class:`~ckptkeeper.TrainingState` (instead of model/optimizer/extra_state).
    """

    def __init__(
        self,
        save_folder: str,
        *,
        model: nn.Module | None = None,
        optimizer: Optimizer | None = None,
        extra_state: Mapping[str, Stateful] | None = None,
        json_state: Mapping[str, JsonStateful] | None = None,
        config: CheckpointPolicyConfig | None = None,
        retention: RetentionRules | None = None,
        save_every_seconds: float | None = None,
        save_on_signals: Sequence[int] = (),
        exit_on_signal: bool = True,
        load_path: str | None = None,
        checkpointer: Checkpointer | None = None,
        start_fresh_if_unloadable: bool = False,
        take_lease: bool = True,
        strict: bool = True,
        state: TrainingState | None = None,
    ) -> None:
        if not isinstance(save_folder, str) or not save_folder:
            raise ConfigurationError("'save_folder' must be a path or URL")
        if state is None:
            if model is None:
                raise ConfigurationError("CheckpointManager needs 'model' (or a TrainingState as 'state')")
            state = _training_state(model, optimizer, extra_state, strict)
        elif model is not None or optimizer is not None or extra_state is not None:
            raise ConfigurationError("pass either 'state' or model/optimizer/extra_state, not both")
        if config is None:
            config = CheckpointPolicyConfig()
        if not isinstance(config, CheckpointPolicyConfig):
            raise ConfigurationError(f"'config' must be a CheckpointPolicyConfig, got {type(config).__name__}")
        if retention is not None and not isinstance(retention, RetentionRules):
            raise ConfigurationError(f"'retention' must be a RetentionRules, got {type(retention).__name__}")
        if save_every_seconds is not None and (
            isinstance(save_every_seconds, bool)
            or not isinstance(save_every_seconds, (int, float))
            or not math.isfinite(save_every_seconds)
            or save_every_seconds <= 0
        ):
            raise ConfigurationError(f"'save_every_seconds' must be a positive number, got {save_every_seconds!r}")
        signals = []
        for sig in save_on_signals:
            try:
                signals.append(signal.Signals(sig))
            except ValueError:
                raise ConfigurationError(f"'save_on_signals' holds {sig!r}, which is not a signal") from None
        self.save_folder = save_folder
        self.config = config
        self.retention = retention
        self.save_every_seconds = save_every_seconds
        self.save_on_signals = tuple(signals)
        self.exit_on_signal = exit_on_signal
        self.load_path = load_path
        self.checkpointer = checkpointer or Checkpointer()
        self.state = state
        self.json_state: dict[str, JsonStateful] = dict(json_state or {})
        self.start_fresh_if_unloadable = start_fresh_if_unloadable
        self.take_lease = take_lease

        self.step = 0
        """The training step: the one restored, then the one last passed to :meth:`save_if_due`/:meth:`save`."""
        self.start_step = 0
        self.checkpoint_loaded = False
        self._picked_fresh = False  # pick() chose to start fresh: restore() loads nothing
        self.loaded_from: str | None = None
        self.preempted = False
        """True once a preemption signal was handled (with ``exit_on_signal=False``)."""
        self.history: list[CheckpointEvent] = []
        """Every save and removal this manager made, in order."""
        self.lease: SaveFolderLease | None = None
        self.on_saved: list[Callable[[str, SaveResult], None]] = []
        """Called with (path, result) once a checkpoint is durable (async: when its write finished)."""
        self.on_loaded: list[Callable[[str], None]] = []
        """Called with the path after a checkpoint was loaded."""

        self._save_async = config.save_async
        self._opened = False
        self._begun = False
        self._closed = False
        self._writing: int | None = None  # the thread inside write_checkpoint (user code runs there)
        self._future: Future[Any] | None = None
        self._latest_step = -1
        self._latest_path = ""
        self._latest_kind: SaveKind | None = None
        # The async save in flight, with the bookkeeping from before it, put back if it fails.
        self._in_flight: _InFlight | None = None
        self._resaved_start = False  # a save of the step this run resumed at was made (see finish)
        self._book: RetentionBook[str] = RetentionBook()
        self._pending: list[tuple[str, Future[SaveResult]]] = []
        self._bookkeeping = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptkeeper-bookkeeping")
        self._bookkeeping_futures: list[Future[Any]] = []
        self._bookkeeping_closed = False
        #: ``(path, error)`` of each removed checkpoint whose files could not all be deleted
        #: (collected by :meth:`wait_for_bookkeeping` and :meth:`close`; each was also logged).
        self.removal_failures: list[tuple[str, Exception]] = []
        self._reported: set[int] = set()
        self._position = DataPosition()
        self._loader: Any = None
        self._last_save_time = time.monotonic()
        self._signalled: int | None = None
        self._warned_metrics: set[str] = set()
        self._old_handlers: dict[int, Any] = {}

    # ------------------------------------------------------------------ context manager

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(final_save=exc is None)

    # ------------------------------------------------------------------ what the run sees

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

    @property
    def load_report(self) -> Any:
        """With ``strict=False``: what the last load left out (missing and unexpected keys)."""
        return getattr(self.state, "load_report", None)

    @property
    def epoch(self) -> int:
        """The epoch :meth:`data` is in (restored on resume)."""
        return self._position.epoch

    # ------------------------------------------------------------------ start

    def restore(self, *, begin: bool = True) -> int:
        """Take the folder, load the newest checkpoint that loads, and return its step (0: fresh start).

        Corrupt or unloadable checkpoints are skipped with a warning (each failed load leaves the
        model untouched); when the folder holds checkpoints and none loads,
        :class:`~ckptkeeper.CorruptCheckpointError` lists them, unless ``start_fresh_if_unloadable``.
        With no checkpoint in the folder, ``load_path`` (if given) is loaded. Then (``begin``) the
        pre-train save is made when the policy asks for one and earlier runs' checkpoints due for
        removal are noted.
        """
        self._refuse_in_save("CheckpointManager.restore()")
        if self._closed:
            raise ConfigurationError("this CheckpointManager is closed; make a new one")
        try:
            # Before loading (which can take minutes): a preemption signal now is kept for the
            # first save_if_due instead of killing the process mid-restore.
            self._install_signals()
            self.open()
            if not self.checkpoint_loaded and not self._picked_fresh:
                self._resume()
            self.start_step = self.step
            if begin:
                self.begin()
        except BaseException:
            self.close(final_save=False)
            raise
        return self.step

    def open(self) -> None:
        """Check the save folder is usable, take its lease (rank 0) and clear leftovers of crashed saves."""
        if self._opened:
            return

        def prepare() -> None:
            storage_for(self.save_folder).check_access(self.save_folder)
            if self.take_lease:
                # Before any clean-up: scratch in this folder may belong to the lease holder.
                lease = SaveFolderLease(self.save_folder)
                lease.acquire()
                self.lease = lease
                lease.start_renewing()
            self.checkpointer.clean_scratch(self.save_folder)

        D.on_rank0(prepare)
        self._opened = True

    def begin(self) -> None:
        """Start the save schedule at :attr:`step`: pre-train save, earlier runs' removals, triggers."""
        if self._begun:
            return
        if not self._opened:
            raise ConfigurationError("call restore() before training (it resumes, or returns 0 on a fresh start)")
        self._begun = True
        self._install_signals()
        self._last_save_time = time.monotonic()
        if not self.config.enabled:
            return
        if self._save_async is None:
            self._save_async = D.backend_supports_cpu()
        if D.is_distributed() and self._save_async and self.checkpointer.process_group is None:
            if not D.backend_supports_cpu():
                raise ConfigurationError(
                    "async checkpointing needs a CPU-capable process-group backend (gloo); pass "
                    "CheckpointPolicyConfig(save_async=False) or initialise with backend 'cpu:gloo,cuda:nccl'"
                )
            log.info("creating a separate process group for async checkpointing")
            self.checkpointer.process_group = D.new_cpu_group(timeout_minutes=30)

        if wants_pre_train_save(self.config, self.step, self.checkpoint_loaded):
            self._save(SaveKind.permanent)

        if self.config.remove == RemovalStrategy.never:
            return

        def discover() -> list[str]:
            try:
                # Only ckptkeeper's own checkpoints are ever removed: an OLMo-core checkpoint in the
                # folder (a run being continued) is resumed from, never deleted.
                infos = self.checkpointer.list_checkpoints(self.save_folder)
                existing = [(i.step, i.path) for i in infos if i.complete and i.flavor == "ckptkeeper"]
            except FileNotFoundError:
                existing = []
            return removable_from_earlier_runs(self.config, existing, self.step)

        found = D.on_rank0(discover)
        self._book.adopt_found(found)
        for path in found:
            log.info("found earlier checkpoint %s; it is removed once the next ephemeral checkpoint is saved", path)

    # ------------------------------------------------------------------ loading

    def load(self, path: str) -> None:
        """Load the checkpoint at ``path`` now: model, optimizer, extras, RNG, data position, JSON state."""
        self._refuse_in_save("CheckpointManager.load()")
        names = list(self.json_state)
        ts = self.checkpointer.load(
            path, self.state, check_train_state=lambda raw: check_train_state(from_olmo_core(raw), names)
        )
        self._apply_train_state(from_olmo_core(ts))
        self.checkpoint_loaded = True
        self.loaded_from = path
        for fn in self.on_loaded:
            fn(path)

    def _apply_train_state(self, ts: Mapping[str, Any]) -> None:
        self.step = int(ts["global_step"])
        self._position.apply(ts.get("data", {}), ts["rng"])
        saved = ts.get("callbacks", {})
        for name, obj in self.json_state.items():
            if name in saved:
                obj.load_state_dict(dict(saved[name]))
        set_rng_state(ts["rng"])

    def _resume(self) -> bool:
        def loaded(path: str, pressed: list[int]) -> None:
            # Each try starts only when no rank was interrupted during the one before: a Ctrl-C
            # held through a failed load does not go on to the next checkpoint.
            _stop_if_pressed(D.all_gather_object((bool(pressed),)))
            self.load(path)

        return self._first_good_held(loaded) is not None

    def pick(self, accept: Callable[[str, dict[str, Any]], None] | None = None) -> tuple[str, dict[str, Any]] | None:
        """The checkpoint :meth:`restore` would load, and its trainer state, without loading it.

        The same choice and fallback rules (newest first; corrupt ones skipped; all corrupt:
        CorruptCheckpointError unless ``start_fresh_if_unloadable``; else ``load_path``), with a
        full checksum verification of every file as the test instead of a load. For frameworks
        that read the trainer state before their model and optimizer exist; None: nothing to load.
        ``accept(path, train_state)`` may refuse a checkpoint by raising CorruptCheckpointError
        (one another trainer wrote, say): the next older one is tried. Once it has answered None,
        :meth:`restore` loads nothing either: it would try the same checkpoints without ``accept``.
        ``restore`` never applies ``accept``: load the path picked with :meth:`load`. With several
        ranks it is a collective: every rank verifies each candidate, and one that fails on any
        rank is skipped by all (or, for an error other than a corrupt or missing checkpoint, stops
        all), so every rank picks the same.
        """

        def verified(path: str, pressed: list[int]) -> dict[str, Any]:
            # Agreed: a rank whose own read failed for a moment picked an older checkpoint than
            # the others, and the ranks of a Hugging Face run resumed from different steps.
            usable: dict[str, Any] = {}
            mine: BaseException | None = None
            if not pressed:
                try:
                    usable = self._verified(path, accept)
                except BaseException as exc:
                    mine = exc
            skip = isinstance(mine, (CorruptCheckpointError, CheckpointNotFoundError))
            why = None if mine is None else f"rank {D.get_rank()}: {type(mine).__name__}: {mine}"
            said = D.all_gather_object((bool(pressed), skip, why))
            _stop_if_pressed(said)
            failed = [(s[1], s[2]) for s in said if s[2] is not None]
            listing = "; ".join(str(f[1]) for f in failed)
            # Classified from every rank's outcome: a rank whose own error was a skippable one
            # went on to the next candidate while another stopped (an outside attack).
            fatal = any(not f[0] for f in failed)
            if mine is not None and (not skip or not fatal):
                raise mine
            if fatal:
                raise CheckpointError(f"picking {path} failed on a rank ({listing})") from mine
            if failed:
                raise CorruptCheckpointError(f"checkpoint {path} failed on another rank ({listing})")
            return usable

        found = self._first_good_held(verified)
        # (restore() loaded a checkpoint pick() had refused, left in place on an object store or
        # where the rename failed: found by an outside attack.)
        self._picked_fresh = found is None
        return found

    def _verified(self, path: str, accept: Callable[[str, dict[str, Any]], None] | None) -> dict[str, Any]:
        """This rank's test of one candidate of :meth:`pick`: its usable trainer state."""
        from .engine.reader import read_train_state

        self.checkpointer.verify(path, checksums=True)
        ts = read_train_state(path).get("train_state", {})
        try:
            check_train_state(from_olmo_core(ts), list(self.json_state))
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptCheckpointError(f"checkpoint {path}: its trainer state cannot be used ({exc})") from None
        usable = dict(from_olmo_core(ts))
        if accept is not None:
            accept(path, usable)
        return usable

    def _first_good_held(self, attempt: Callable[[str, list[int]], _T]) -> tuple[str, _T] | None:
        """:meth:`_first_good`, with a Ctrl-C on any rank held until every rank is out of its
        exchanges, then stopping every rank together (``attempt`` gets the list that says whether
        this rank was interrupted, to share it in its own exchange)."""
        with ctrl_c_after(_CHOOSING, None) as pressed:
            try:
                found = self._first_good(lambda path: attempt(path, pressed))
            except BaseException as exc:
                # The last round is met on the way out too: a try that failed on one rank after
                # its agreed part (an on_loaded callback, a JSON state's load_state_dict) left
                # the others waiting in it alone (an outside attack). Not for a second Ctrl-C,
                # which stops this rank at once.
                if not isinstance(exc, KeyboardInterrupt):
                    with contextlib.suppress(Exception):
                        D.all_gather_object((bool(pressed), f"rank {D.get_rank()}: {type(exc).__name__}: {exc}"))
                raise
            # Pressed during the last exchange, a Ctrl-C is known to its rank alone: one more
            # round, so that every rank stops here or none does.
            said = D.all_gather_object((bool(pressed), None))
            _stop_if_pressed(said)
            failed = [str(s[1]) for s in said if s[1] is not None]
            if failed:
                raise CheckpointError(f"resuming failed on another rank ({'; '.join(failed)})")
        return found

    def _first_good(self, attempt: Callable[[str], _T]) -> tuple[str, _T] | None:
        """Try ``attempt`` on the folder's checkpoints, newest first, then on ``load_path``.

        The one place the fallback rules live (:meth:`restore` loads, :meth:`pick` verifies).
        """
        # Settings each rank reads for itself decide which exchanges follow: ranks that differ
        # met different collectives and waited for ever (an outside attack).
        # (Whether there is a load_path, not its spelling: only rank 0's is resolved and used.)
        given = (self.load_path is not None, bool(self.start_fresh_if_unloadable))
        every = D.all_gather_object(given)
        if any(g != given for g in every):
            listing = ", ".join(
                f"rank {r}: {'a' if g[0] else 'no'} load_path, start_fresh_if_unloadable={g[1]}"
                for r, g in enumerate(every)
            )
            raise ConfigurationError(
                f"the ranks were given different resume settings ({listing}); give every rank the same "
                "load_path and start_fresh_if_unloadable"
            )

        def survey() -> tuple[list[str], list[tuple[str, str]], list[tuple[int, str, str]]]:
            # Complete checkpoints, newest first; the ones that claim to be checkpoints (they have
            # a commit record) but are broken (folders without a record are not ours); and those
            # a newer ckptkeeper wrote, which are not broken: never counted as unloadable (that
            # offered a fresh start, which then moved them aside; an outside attack).
            infos = self.checkpointer.list_checkpoints(self.save_folder)
            good = [i.path for i in reversed(infos) if i.complete]
            broken = [
                (i.path, i.problem or "")
                for i in infos
                if not i.complete
                and not i.newer_format
                and i.problem != "no commit record"
                and not (i.problem or "").startswith(NOT_OURS)
            ]
            return good, broken, [(i.step, i.path, i.problem or "") for i in infos if i.newer_format]

        candidates, failures, newer = D.on_rank0(survey)
        unloadable: list[tuple[str, str]] = []  # set aside once the run is sure to start without them
        broken = list(failures)
        for path in candidates:
            self._refuse_to_go_back_past(newer, path)
            try:
                found = path, attempt(path)
            except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
                log.warning("skipping checkpoint %s: %s; trying the previous one", path, exc)
                failures.append((path, str(exc)))
                continue
            # The broken ones later than the one loaded were passed over without a try: said here,
            # or a resume went back past them without a word.
            for skipped, why in broken:
                if _step_order(skipped) > _step_order(path):
                    log.warning("skipping checkpoint %s: %s", skipped, why)
            return found
        # (A fallback that loads an older checkpoint leaves the newer ones it skipped in place, and
        # the resumed run saves their steps over them: setting them aside by default hid intact
        # ones that failed for a moment, and a pick() the ranks disagree on made it a stray
        # collective; both found by an outside attack. Only a fresh start, asked for, moves them.)
        if self.load_path is None:
            self._refuse_to_go_back_past(newer, None)  # before "none loads" offers a fresh start
        if failures:
            failures.sort(key=lambda f: _step_order(f[0]))  # (the survey's and the tries' are distinct paths)
            listing = "; ".join(f"{p}: {why}" for p, why in failures)
            if not self.start_fresh_if_unloadable:
                raise CorruptCheckpointError(
                    f"none of the {len(failures)} checkpoints in {self.save_folder} can be loaded ({listing}). "
                    "Restore one from a copy, or pass start_fresh_if_unloadable=True (ckptkeeper train: "
                    "--start-fresh-if-unloadable) to train from scratch; on a local disk these are then moved "
                    "aside (unloadable-step{N}-...), not saved over"
                )
            log.warning(
                "no checkpoint in %s could be loaded (%s); starting from %s as asked",
                self.save_folder,
                listing,
                self.load_path or "scratch",
            )
            unloadable = failures
        if self.load_path is None:
            self._set_aside(unloadable)
            return None
        load_path = self.load_path

        # Only rank 0 lists (object stores bill and throttle listings); the others take its answer.
        def resolve() -> str | None:
            if self.checkpointer.dir_is_checkpoint(load_path):
                return load_path
            return self.checkpointer.latest_checkpoint(load_path)

        resolved = D.on_rank0(resolve)
        if resolved is None:
            raise CheckpointNotFoundError(
                f"load_path {load_path} holds no complete checkpoint; pass a step folder or a save "
                "folder that `ckptkeeper ls` shows as complete"
            )
        self._refuse_to_go_back_past(newer, resolved)
        # Asked for explicitly: a corrupt load_path raises, there is nothing to fall back to.
        found = resolved, attempt(resolved)
        # Never the checkpoint just loaded (load_path may name the save folder itself).
        self._set_aside([f for f in unloadable if f[0] != resolved])
        return found

    def _refuse_to_go_back_past(self, newer: list[tuple[int, str, str]], start: str | None) -> None:
        """Raise NewerFormatError when the run would resume from ``start`` (a checkpoint's path;
        None: from scratch) while the save folder holds a later checkpoint that a newer ckptkeeper
        wrote (``newer``: step, path, why): the run would save those steps again, replacing it.
        From rank 0's survey and the agreed tries, so every rank decides alike. The saves would
        refuse to replace it anyway (see :func:`~ckptkeeper.engine.commit.clear_target`); this
        stops the run before it loads anything."""
        from_step = -1 if start is None else parse_step(start)
        ahead = [(path, why) for step, path, why in newer if from_step is None or step > from_step]
        if not ahead:
            return
        listing = "; ".join(f"{path} ({why})" for path, why in ahead)
        them = "it" if len(ahead) == 1 else "them"
        way = f"resume from {start}" if start is not None else "start from scratch"
        raise NewerFormatError(
            f"{listing}. To {way} would save the same steps again and replace {them}: upgrade ckptkeeper "
            f"to resume from the newest, or, to {way} anyway, move {them} out of {self.save_folder} first"
        )

    def _set_aside(self, failures: list[tuple[str, str]]) -> None:
        """Move aside the checkpoints a fresh start goes over (``failures``: each with why it could
        not be loaded; see :func:`~ckptkeeper.engine.deleter.set_aside_unloadable`), once the run
        is sure to start without them: after a ``load_path`` has loaded, so that a run that stops
        on it moves nothing (found by an outside attack). Rank 0 alone, without a collective: a
        broadcast here, when the ranks' answers to :meth:`pick` were not yet agreed, was reached
        by one rank alone and met the others' next collective (found by an outside attack); the
        ranks' next save meets rank 0 after its renames."""
        if not failures or D.get_rank() != 0:
            return
        for path, why in failures:
            where = set_aside_unloadable(path)
            if where is not None:
                log.warning(
                    "moved %s, which could not be loaded (%s), to %s: kept for a post-mortem; rename it back to "
                    "use it (if it is intact after all), or delete it",
                    path,
                    why,
                    where,
                )
            else:
                log.warning(
                    "%s, which could not be loaded (%s), stays in place (not on a local disk, or it could not be "
                    "renamed); a save of its step by this run replaces it, or stops at it if it is not "
                    "ckptkeeper's: copy it elsewhere now if you need it",
                    path,
                    why,
                )

    # ------------------------------------------------------------------ data

    def data(self, loader: Iterable[Any], *, max_steps: int | None = None, epochs: int | None = None) -> Iterator[Any]:
        """Batches of ``loader`` from the restored position on, epoch after epoch.

        After a resume the consumed batches of the current epoch are skipped (a plain
        ``DataLoader``'s shuffle is replayed from the RNG state the epoch began with), so the run
        sees exactly the batches an uninterrupted run would. The position goes into every
        checkpoint. ``max_steps``: stop once :attr:`step` (what you pass to :meth:`save_if_due`)
        reaches it, before another batch is drawn; a resumed run that is already there gets no
        batch at all. ``epochs``: stop at the end of that many epochs in all (restored ones count).
        With neither, it keeps going: break out of the loop when training is done.
        """
        if self._closed:
            raise ConfigurationError("this CheckpointManager is closed; make a new one to train again")
        if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 0):
            raise ConfigurationError(f"'max_steps' must be a whole number >= 0, got {max_steps!r}")
        self._loader = loader
        done = None if max_steps is None else (lambda: self.step >= max_steps)
        return self._position.batches(loader, epochs, done)

    # ------------------------------------------------------------------ saving

    def save_if_due(
        self, step: int, *, metrics: Mapping[str, float] | None = None, skip_ephemeral: bool = False
    ) -> str | None:
        """Call after each update with the number of updates done; saves when the policy says so.

        Returns the path of the checkpoint started at this step, or None. With async saves, a
        save's failure is raised at a later call (or at :meth:`close`), once that call's own save,
        if one is due, is under way: a failure never costs the next save. ``metrics`` are stored in
        the commit record of a checkpoint saved at this step (retention's ``keep_best`` ranks by
        them). ``skip_ephemeral`` skips an ephemeral save due at this step.
        """
        self._refuse_in_save("CheckpointManager.save_if_due()")
        metrics = self._at_step(step, metrics)
        if not self.config.enabled:
            return None
        # A preemption signal first: a failed save's error raised here would stop a loop that
        # does not catch it before the preemption save (the preemption logs that error instead).
        if self.save_on_signals and not D.all_agree(self._signalled is None):
            return self._preempt(metrics)
        earlier = self._collect(blocking=False)
        if not self.checkpoint_pending:
            self._remove_due()
        # An on_saved callback's error is raised after this call's own save too (it stopped the
        # save that was due, an outside attack found).
        callback_error = self._poll_deferred()
        if earlier is None:
            earlier = callback_error
        elif callback_error is not None:
            log.error("an on_saved callback failed: %s", callback_error, exc_info=callback_error)
        if step == self._latest_step or self._loaded_here(step):
            # Called twice for one step (a framework hook, say), or at the step this run resumed
            # from this folder's checkpoint of it: saved already (writing it again removed the
            # resume point first on object stores, and lost it if that save failed).
            kind = None
        else:
            kind = decide_save(self.config, step, self._latest_step, skip_ephemeral)
            if kind is None and self.save_every_seconds is not None:
                # Rank 0's clock decides: ranks must start the same saves.
                elapsed = D.on_rank0(lambda: time.monotonic() - self._last_save_time)
                kind = decide_timed_save(kind, self.save_every_seconds, elapsed, skip_ephemeral)
        path = None if kind is None else self._save(kind, metrics=metrics, held=earlier)
        if earlier is not None:
            raise earlier
        return path

    def save(
        self,
        step: int,
        *,
        metrics: Mapping[str, float] | None = None,
        ephemeral: bool = False,
        force: bool = False,
        wait: bool = False,
    ) -> str:
        """Save ``step`` now, whatever the schedule says; returns the checkpoint's path.

        Permanent unless ``ephemeral``. When this run already saved this step, nothing is written
        and that checkpoint's path is returned, unless ``force`` (the step's checkpoint is written
        again, replacing it). The save in flight is waited for first; one that failed does not
        count (its step is written again, and its error is raised once this save is under way).
        Async when the policy's ``save_async`` is; ``wait=True`` returns only once the checkpoint
        is durable.
        """
        self._refuse_in_save("CheckpointManager.save()")
        metrics = self._at_step(step, metrics)
        # The save in flight first (the next save would wait for it anyway): if it failed, its
        # step is not saved, whoever collected its error (checkpointer.wait(), another thread).
        earlier = self._collect(blocking=True)
        # Saved already at this step: nothing to write, unless forced or an ephemeral is to become
        # permanent (it would otherwise be removed once superseded).
        upgrade = self._latest_kind == SaveKind.ephemeral and not ephemeral
        if step == self._latest_step and self._latest_path and not force and not upgrade:
            path = self._latest_path
        else:
            kind = SaveKind.ephemeral if ephemeral else SaveKind.permanent
            path = self._save(kind, metrics=metrics, held=earlier)
            if wait:
                try:
                    self._await_last()
                except BaseException:
                    self._report_aside(earlier)
                    raise
                self._remove_due()
        if earlier is not None:
            raise earlier
        return path

    def finish(self) -> None:
        """The end of a normal run: save the last step if this run has not, wait, carry out removals."""
        self._refuse_in_save("CheckpointManager.finish()")
        if not self._begun or not self.config.enabled:
            self.poll(wait=True)
            return
        # The save in flight first: if it failed, its step counts as not saved and the final save
        # below writes it; its error is raised once that is done (not before: the final step
        # would be lost with it).
        failed = self._collect(blocking=True)
        # A run that resumed and trained no further has nothing new to save, unless a save of
        # the loaded step (force=True) failed after removing its checkpoint (object stores clear a
        # step first): the loaded checkpoint is written back (outside attacks had the next run
        # resume from an older one). Looked at once that save has ended.
        trained = not (self.checkpoint_loaded and self.step == self.start_step)
        if not trained and self._resaved_start:
            trained = not D.on_rank0(lambda: self.checkpointer.dir_is_checkpoint(self.loaded_from or ""))
        try:
            if trained and needs_final_save(self.step, self._latest_step):
                self._save(SaveKind.permanent, use_async=False)
            self._await_last()
        except BaseException:
            self._report_aside(failed)
            raise
        self._remove_due()
        self.poll(wait=True)
        if failed is not None:
            raise failed

    def wait(self) -> None:
        """Block until the save in flight (if any) is durable; raises its error."""
        self._refuse_in_save("CheckpointManager.wait()")
        self._await_last()
        # A save this manager never got the future of (Ctrl-C while it was being handed to the
        # writer) is still the checkpointer's in flight: waited for, its error raised.
        self.checkpointer.wait()
        self.poll(wait=True)

    def close(self, *, final_save: bool | None = None) -> None:
        """Finish: final save (see below), wait for the writer and housekeeping, release the folder.

        ``final_save=None`` (default) saves the last step when it is not saved yet, unless an
        exception is being raised (``close()`` in a ``finally`` after an error does not save a
        half-done step). Safe to call twice.
        """
        # Before anything is closed: from inside the save it would wait for (an on_stage hook),
        # closing half-way released the folder's lease under that save and lost its error.
        self._refuse_in_save("CheckpointManager.close()")
        if self._closed:
            return
        if final_save is None:
            final_save = sys.exc_info()[1] is None
        try:
            if final_save and self._begun:
                self.finish()
        finally:
            self._closed = True
            self._restore_signals()
            try:
                self.drain()
            finally:
                try:
                    self.wait_for_bookkeeping()
                finally:
                    self._bookkeeping_closed = True
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

    def drain(self) -> None:
        """Let a save in flight finish (after an error): its own failure is logged, not raised."""
        self._refuse_in_save("CheckpointManager.drain()")
        fut = self._future
        if fut is not None:
            try:
                self._await_last()
            except BaseException as err:
                # The save's own outcome is logged, a KeyboardInterrupt raised inside it too (it
                # replaced the error close() was draining after, an outside attack found); an
                # interruption of this wait goes on as it is.
                if not isinstance(err, Exception) and not is_outcome(fut, err):
                    raise
                self._report_aside(err, "the checkpoint save in flight failed")
            finally:
                self._future = None

    def _refuse_in_save(self, what: str) -> None:
        # Called from inside this manager's own background save (an on_stage hook on the writer
        # thread), each of these would wait for that save: an error, before anything changes.
        # From inside its own write_checkpoint (a synchronous save's hook, a json_state object's
        # state_dict(): user code on the caller's thread), close() released the folder's lease
        # under the running save: refused the same way.
        self.checkpointer.refuse_inside_save(what)
        if self._writing == threading.get_ident():
            raise ConfigurationError(
                f"{what} was called inside this manager's own save (from an on_stage hook or a json_state "
                "object?), which is still writing; call it from the training code"
            )

    def mark_reported(self, exc: BaseException) -> None:
        """Note that ``exc`` (and what caused it) was already raised or logged, so it is not reported twice."""
        seen: BaseException | None = exc
        while seen is not None and id(seen) not in self._reported:
            self._reported.add(id(seen))
            seen = seen.__cause__ or seen.__context__

    # ------------------------------------------------------------------ writing (low level)

    def train_state(self) -> dict[str, Any]:
        """The JSON trainer state a checkpoint of the current step carries."""
        objects = {}
        for name, obj in self.json_state.items():
            sd = obj.state_dict()
            if sd is not None:
                objects[name] = sd
        return {
            "global_step": self.step,
            "rng": rng_state(),
            "data": self._position.to_json(self._loader),
            "callbacks": objects,
            "world_size": D.get_world_size(),
        }

    def write_checkpoint(
        self, *, ephemeral: bool = False, use_async: bool = False, metrics: Mapping[str, float] | None = None
    ) -> tuple[str, Future[SaveResult] | None]:
        """Write the current step's checkpoint with no schedule bookkeeping (for trainers' own hooks).

        Returns (path, future of the async write or None when it was synchronous).
        """
        self._refuse_in_save("CheckpointManager.write_checkpoint()")
        if not self._opened:
            raise ConfigurationError("call restore() before saving (it takes the save folder and resumes)")
        failed = self._poll_deferred()
        if failed is not None:
            # Raised here it would stop the save about to start (the schedule's callers have run
            # the callbacks already and raise their errors after their save).
            log.error("an on_saved callback failed: %s", failed, exc_info=failed)
        # Marked while user code runs here (the trainer state's objects, a synchronous save's hooks).
        self._writing = threading.get_ident()
        try:
            # Taken by the checkpointer, inside its save: a json_state object whose state_dict()
            # failed on one rank only then fails the save on every rank (raised here, the other
            # ranks' save went on and paired its exchanges with this rank's next one).
            ts = self.train_state
            if use_async:
                path, fut = self.checkpointer.save_async(
                    self.save_folder, self.step, self.state, train_state=ts, ephemeral=ephemeral, metrics=metrics
                )
                self._pending.append((path, fut))
                self._last_save_time = time.monotonic()
                return path, fut
            result = self.checkpointer.save(
                self.save_folder, self.step, self.state, train_state=ts, ephemeral=ephemeral, metrics=metrics
            )
        finally:
            self._writing = None
        self._last_save_time = time.monotonic()
        self._notify_saved(result.path, result)
        return result.path, None

    def _save(
        self,
        kind: SaveKind,
        use_async: bool | None = None,
        metrics: Mapping[str, float] | None = None,
        held: BaseException | None = None,
    ) -> str:
        """Write this step's checkpoint. ``held``: an earlier save's error the caller raises after
        this save (logged here if this save fails, whose error is then raised instead)."""
        use_async = bool(self._save_async) if use_async is None else use_async
        was_pending = self.checkpoint_pending
        earlier = self._collect(blocking=True)
        if was_pending and earlier is None:
            # The save that superseded these is durable now; removing them no longer risks anything.
            self._remove_due()
        try:
            path = self._write(kind, use_async, metrics)
        except BaseException:
            self._report_aside(earlier or held)
            raise
        if earlier is not None:
            # Raised once this save is under way: an earlier save's failure never costs this one.
            raise earlier
        return path

    def _poll_deferred(self) -> BaseException | None:
        """:meth:`poll`, an on_saved callback's error returned instead of raised (the caller raises
        it once its own save is under way)."""
        try:
            self.poll()
        except Exception as exc:
            return exc
        return None

    def _loaded_here(self, step: int) -> bool:
        """Whether this run resumed at ``step`` from this save folder's checkpoint of that step."""
        if not self.checkpoint_loaded or step != self.start_step or not self.loaded_from:
            return False
        return self.loaded_from.rstrip("/") == final_path(self.save_folder, step).rstrip("/")

    def _report_aside(self, earlier: BaseException | None, what: str = "an earlier checkpoint save failed too") -> None:
        # Not raised (another error is on its way up, or the caller goes on): logged, not lost.
        if earlier is not None:
            log.error("%s: %s", what, earlier)
            self.mark_reported(earlier)

    def _collect(self, blocking: bool) -> BaseException | None:
        """Collect the save in flight (without ``blocking``, only once it is done on every rank).
        Its failure is returned, not raised: its step then counts as not saved (see
        :meth:`_forget_failed`), and the caller raises it once its own save is under way. Only
        the save's own outcome (a KeyboardInterrupt raised inside it included); an interruption
        of this wait is raised at once."""
        fut = self._future
        try:
            self._await_last(blocking=blocking)
        except BaseException as exc:
            if fut is not None and (isinstance(exc, CkptkeeperError) or is_outcome(fut, exc)):
                return exc
            raise
        return None

    def _write(self, kind: SaveKind, use_async: bool, metrics: Mapping[str, float] | None) -> str:
        before = (self._latest_step, self._latest_path, self._latest_kind, self._last_save_time)
        book = self._book.snapshot()
        if self.checkpoint_loaded and self.step == self.start_step:
            self._resaved_start = True
        try:
            path, fut = self.write_checkpoint(
                ephemeral=kind == SaveKind.ephemeral, use_async=use_async, metrics=metrics
            )
        except BaseException as exc:
            # Nothing was noted for this save; a checkpoint of this step saved before may be gone.
            # A ckptkeeper error is every rank's (saves fail together); anything else (Ctrl-C)
            # may be this rank's alone, so each rank looks for itself, without a collective. A
            # failure the ranks agreed on before the save touched anything (one rank's own error,
            # of any type, the others' save error) left every checkpoint as it was: a look there
            # is not needed, and by the type alone the ranks went different ways (one into a
            # collective the others skipped; found by an outside attack).
            if not untouched(exc):
                self._withdraw_if_gone(
                    final_path(self.save_folder, self.step), together=isinstance(exc, CkptkeeperError)
                )
            raise
        self._future = fut
        self._in_flight = None if fut is None else _InFlight(fut, path, before, book)
        self._latest_step = self.step
        self._latest_path = path
        self._latest_kind = kind
        self.history.append(CheckpointEvent("save", self.step, self.step, kind.value, path))
        self._book.forget(path)  # a second save of this step replaces the first, kind included
        self._book.record_save(path, kind)
        if fut is None:
            self._apply_retention()
        return path

    def _await_last(self, blocking: bool = True) -> None:
        fut = self._future
        if fut is None:
            return
        # Ranks must notice a finished save at the same step: one that raised the save's error a
        # step earlier than the others would leave them waiting in training collectives.
        if not blocking and not D.all_agree(fut.done()):
            return
        try:
            # Collected through the checkpointer: a save's error is raised once, whoever waits
            # (this, checkpointer.wait(), another thread, a signal handler's wait).
            self.checkpointer.wait_for(fut)
        except BaseException as exc:
            if is_outcome(fut, exc):
                self._forget_failed(fut)
                if self._future is fut:
                    self._future = None  # the save's own error, raised here
            # Otherwise interrupted while waiting (Ctrl-C): the save is still the one in flight,
            # awaited again next time.
            raise
        if self._future is fut:  # a signal handler's save may have started another meanwhile
            self._future = None
        if fut.cancelled() or fut.exception() is not None:
            # It failed, and its error was raised by another waiter (the same on every rank: a
            # save fails on all ranks together, so none goes on to the round below).
            self._forget_failed(fut)
            return
        if not D.on_rank0(lambda: self.checkpointer.dir_is_checkpoint(self._latest_path)):
            error = CheckpointSaveError(
                f"the save of step {self._latest_step} finished but {self._latest_path} is not a complete checkpoint"
            )
            self._forget_failed(fut)
            raise error
        if self._in_flight is not None and self._in_flight.future is fut:
            self._in_flight = None
        self._apply_retention()

    def _forget_failed(self, fut: Future[SaveResult]) -> None:
        """The async save of ``fut`` failed: it saved nothing, so the run's bookkeeping goes back to
        before it. Otherwise the step counted as saved (``save(step)`` returned its path without
        writing, ``close()`` skipped the final save) and the ephemeral checkpoint it superseded
        was removed at the next call: a disk that filled up cost the run every good ephemeral
        checkpoint, one per failed save (found by an outside attack)."""
        flight = self._in_flight
        if flight is None or flight.future is not fut:
            return
        self._in_flight = None
        if self._latest_path == flight.path:  # no later save was recorded meanwhile
            # The timed-save clock too: a failed save does not put off the next one by an interval.
            self._latest_step, self._latest_path, self._latest_kind, self._last_save_time = flight.before
        self._book.restore(flight.book)
        self._withdraw_if_gone(flight.path)

    def _withdraw_if_gone(self, path: str, together: bool = True) -> None:
        """After a failed save to ``path``: a save of a step saved before (made permanent, or
        forced) removes that step's checkpoint first on object stores (same keys). If it is gone,
        the run's bookkeeping stops listing it, and what it had superseded stays (found by an
        outside attack: the manager listed the removed one and removed the older ephemeral, so
        resume went back to step 0)."""
        listed = path in (*self._book.ephemerals, *self._book.to_remove, *self._book.permanents)
        if not listed:
            return
        exists = self.checkpointer.dir_is_checkpoint
        if D.on_rank0(lambda: exists(path)) if together else exists(path):
            return
        self._book.withdraw(path)
        if self._latest_path == path:
            self._latest_step, self._latest_path, self._latest_kind = -1, "", None

    def _notify_saved(self, path: str, result: SaveResult) -> None:
        for fn in self.on_saved:
            fn(path, result)

    def poll(self, wait: bool = False) -> None:
        """Call ``on_saved`` for async saves that have finished (``wait``: for all of them, waiting)."""
        if wait:
            self._refuse_in_save("CheckpointManager.poll(wait=True)")
        ready = [(path, fut) for path, fut in self._pending if wait or fut.done()]
        # Taken off the list before any callback runs: one that raises is not called again for
        # the same save (an outside attack saw it notified twice); the rest stay to be done.
        self._pending = [item for item in self._pending if item not in ready]
        for i, (path, fut) in enumerate(ready):
            try:
                result = fut.result()
            except BaseException as exc:
                if is_outcome(fut, exc):
                    # The save's own failure (a KeyboardInterrupt raised inside it too: it came
                    # back at every later call, for ever), raised where the schedule awaits it.
                    continue
                self._pending = ready[i:] + self._pending  # interrupted while waiting
                raise
            try:
                self._notify_saved(path, result)
            except BaseException:
                self._pending = ready[i + 1 :] + self._pending
                raise

    # ------------------------------------------------------------------ removal

    def _remove_due(self) -> None:
        for path in self._book.take_due():
            self._remove(path)

    def _remove(self, path: str) -> None:
        log.info("removing old checkpoint %s", path)
        step = parse_step(path.rstrip("/").rsplit("/", 1)[-1])
        self.history.append(CheckpointEvent("remove", -1 if step is None else step, self.step, None, path))
        rank, fs_rank = D.get_rank(), D.get_fs_local_rank()
        if rank == 0 or (not is_url(path) and fs_rank == 0):
            # Making it invisible is immediate; the files go in the background.
            try:
                # The checkpointer's deleter thread, not the bookkeeping one: a slow bucket delete
                # must not hold up retention, user ops or the next removal's visibility. Passed as
                # run_in_background, the signature a Checkpointer subclass may have overridden.
                if _takes_hook(self.checkpointer.remove):
                    self.checkpointer.remove(path, self.checkpointer.deleter.in_background(path))
                else:
                    self.checkpointer.remove(path)  # a subclass's own remove(path): runs as it is
            except (CkptkeeperError, OSError) as exc:
                # Retention is housekeeping: a checkpoint it may not (or cannot) delete is left, never a crash.
                log.error("not removing %s: %s", path, exc)

    def _apply_retention(self) -> None:
        rules = self.retention
        if rules is None or D.get_rank() != 0:
            return
        current = self.step
        # A save in flight is not complete yet, so it is not listed; it is protected all the same.
        in_flight = self._latest_step if self.checkpoint_pending else None

        def work() -> None:
            infos = self.checkpointer.list_checkpoints(self.save_folder)
            complete = [i for i in infos if i.complete]
            if not complete:
                return
            keep_always = {max(i.step for i in complete)}
            if in_flight is not None:
                keep_always.add(in_flight)
            permanent = {
                i.step: i for i in complete if i.flavor == "ckptkeeper" and i.ephemeral is False and i.step <= current
            }
            plan = plan_prune(
                [PruneCandidate(i.step, i.created_unix, i.metrics) for i in permanent.values()],
                rules,
                now=time.time(),
                protected=keep_always,
            )
            for step in plan.remove:
                path = permanent[step].path
                log.info("retention: removing %s (no keep-rule keeps it)", path)
                self.history.append(CheckpointEvent("remove", step, current, None, path))
                try:
                    self.checkpointer.remove(path)
                except (CkptkeeperError, OSError) as exc:
                    log.error("retention: not removing %s: %s", path, exc)

        self.run_bookkeeping_op(work, op_name="retention")

    # ------------------------------------------------------------------ housekeeping

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

        if distributed or self._bookkeeping_closed:
            run()
            return
        self._bookkeeping_futures = [f for f in self._bookkeeping_futures if not f.done()]
        self._bookkeeping_futures.append(self._bookkeeping.submit(run))

    def wait_for_bookkeeping(self) -> None:
        """Block until every background bookkeeping op and queued deletion has finished.

        Failed deletions were logged when they failed and are added to :attr:`removal_failures`;
        they never raise (housekeeping must not kill a run; each error says what was left).
        """
        while self._bookkeeping_futures:
            self._bookkeeping_futures.pop(0).result()
        self.removal_failures.extend(self.checkpointer.wait_for_removals())

    # ------------------------------------------------------------------ triggers

    def _install_signals(self) -> None:
        if not self.save_on_signals or self._old_handlers:
            return
        if threading.current_thread() is not threading.main_thread():
            raise ConfigurationError(
                "save_on_signals needs restore() to be called from the main thread (Python delivers signals there)"
            )
        for sig in self.save_on_signals:
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_signals(self) -> None:
        for sig, old in self._old_handlers.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, old)
        self._old_handlers.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: the save happens at the next step boundary, where the state is consistent.
        self._signalled = signum

    def _preempt(self, metrics: Mapping[str, float] | None) -> str | None:
        sig = self._signalled
        name = signal.Signals(sig).name if sig is not None else "a signal on another rank"
        log.warning("%s received: saving step %d and stopping", name, self.step)
        # A save in flight is finished first: if it failed, its step is saved again below instead
        # of counting as saved (its error is logged, not raised, so that the preemption save
        # still happens).
        self._report_aside(self._collect(blocking=True), "the checkpoint save in flight failed")
        self.poll()  # on_saved for saves that finished
        path: str | None = self._latest_path or None
        if needs_final_save(self.step, self._latest_step):
            path = self._save(SaveKind.permanent, use_async=False, metrics=metrics)
        self.close(final_save=False)
        self.preempted = True
        if self.exit_on_signal:
            log.warning("step %d is saved (%s); exiting", self.step, path)
            raise SystemExit(0)
        return path

    # ------------------------------------------------------------------ checks

    def _at_step(self, step: int, metrics: Mapping[str, float] | None) -> dict[str, float] | None:
        """What save_if_due and save do first: check the step, start the schedule, move to the step."""
        self._check_step(step)
        usable = self._usable_metrics(step, metrics)
        if not self._begun:
            self.begin()
        self.step = step
        self.check_lease()
        return usable

    def _check_step(self, step: int) -> None:
        if self._closed:
            raise ConfigurationError("this CheckpointManager is closed; make a new one to save again")
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
            raise ConfigurationError(f"step must be a whole number from 0 to 2**62, got {step!r}")
        if step < self.step:
            raise ConfigurationError(
                f"step {step} is before step {self.step}, which this run already reached; pass the number of "
                "updates done so far (restore() returns the step to continue from)"
            )

    def _usable_metrics(self, step: int, metrics: Mapping[str, float] | None) -> dict[str, float] | None:
        # A NaN loss or a stray string must not stop training at a save: what cannot be stored is
        # left out of the record, with a warning (once per metric name).
        if metrics is None:
            return None
        if not isinstance(metrics, Mapping):
            raise ConfigurationError(f"metrics must be a dict of names to numbers, got {type(metrics).__name__}")
        good: dict[str, float] = {}
        for name, value in metrics.items():
            try:
                if len(good) >= 256:
                    raise ValueError("more than 256 metrics")
                if hasattr(value, "item") and not isinstance(value, (int, float)):
                    value = value.item()  # a one-element tensor or a numpy scalar: its number
                good.update(check_metrics({name: value}))
            except (ValueError, RuntimeError, TypeError) as exc:
                if name not in self._warned_metrics:
                    self._warned_metrics.add(str(name))
                    log.warning("step %d: metric %r is not stored with the checkpoint (%s)", step, name, exc)
        return good

    def check_lease(self) -> None:
        """Raise SaveFolderInUseError when another run took the save folder's lease over."""
        if self.lease is not None and self.lease.lost:
            raise SaveFolderInUseError(
                f"another run took over the lease of save folder {self.save_folder}; stopping so that "
                "the two runs do not overwrite each other's checkpoints"
            )


def _training_state(
    model: nn.Module, optimizer: Optimizer | None, extra: Mapping[str, Stateful] | None, strict: bool
) -> TrainingState:
    return TrainingState(model, optimizer, extra, strict=strict)


def _takes_hook(remove: Callable[..., Any]) -> bool:
    """Whether ``remove`` accepts ``run_in_background`` (a subclass may override it as remove(path))."""
    try:
        params = list(inspect.signature(remove).parameters.values())
    except (TypeError, ValueError):
        return True
    return len(params) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)
