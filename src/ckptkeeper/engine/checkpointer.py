"""The Checkpointer: writes, verifies, finds, loads and removes checkpoints in a save folder.

Commit protocol. Every save first writes all files into a local folder: ``.tmp-step{N}-<id>``
inside the save folder on a local disk, or a spool folder for object stores. The commit record
(``.metadata.json``: step, kind, world size, every file with size and xxh3-64) is written last.
Then the checkpoint is published at once: a local disk renames the folder into place, an object
store uploads the data files and creates the commit record last, create-only. A reader that
checks the record therefore sees a checkpoint complete or not at all. Removal deletes the commit
record first, so a half-deleted checkpoint is already invalid.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import json
import logging
import os
import shutil
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from .. import distributed as D
from ..errors import (
    CheckpointError,
    CheckpointSaveError,
    CkptkeeperError,
    ConfigurationError,
    CorruptCheckpointError,
    DiskFullError,
)
from ..storage import Storage, storage_for
from ..storage.layout import (
    COMMIT_RECORD,
    MODEL_DIR,
    scratch_name,
    step_dir_name,
    train_state_name,
)
from ..storage.local import translate_os_error
from . import discovery
from .agreement import agree, load_error, unwrap
from .deleter import (
    clean_leftover,
    clean_save_folder,
    local_record_is_ours,
    new_spool,
    read_intents,
    record_is_ours,
    remove_checkpoint,
    write_intent,
)
from .discovery import CheckpointInfo
from .fastio import DATA_FILE, Segment, can_use_fast_path, parse_layout, read_fast, write_fast
from .loader import CheckpointMismatchError, Rollback, read_metadata, read_train_state, saved_tensors
from .metrics import emit
from .record import CommitRecord, FileEntry, check_metrics, hash_file
from .safe_metadata import SafeFileSystemReader, SafeLoadPlanner
from .staging import Stager
from .state import TrainingState, flatten_tensors

__all__ = ["CheckpointInfo", "Checkpointer", "SaveResult", "SaveStage"]

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class SaveResult:
    """What one save did and cost."""

    step: int
    path: str
    ephemeral: bool
    bytes: int
    blocked_s: float
    """Seconds the caller was blocked (for async saves: the snapshot)."""
    durable_s: float
    """Seconds from the call until the checkpoint was committed."""
    files: int = 0
    """Files written (across all ranks)."""
    retries: int = 0
    """Storage requests this process retried during the save (S3; 0 where the client does not say)."""

    @property
    def throughput(self) -> float:
        """Bytes per second from the call until durable."""
        return self.bytes / self.durable_s if self.durable_s > 0 else float("inf")


@dataclass(frozen=True)
class SaveStage:
    """Where a save is, as told to ``Checkpointer(on_stage=...)``: the public fault-injection seam.

    ``on_stage`` is called on every rank at the start of each stage, in the thread doing the save
    (the background writer for async saves). Whatever it raises is handled exactly like an I/O
    error at that point of the save (the checkpoint stays invisible, the error names the step);
    it may also block or sleep to hold a save in flight. Stages, in order: ``"preparing"``,
    ``"writing tensors"``, ``"writing trainer state"``, ``"uploading"`` (object stores only) and
    ``"publishing"`` (rank 0 only).
    """

    name: str
    step: int
    rank: int
    work: str
    """The local folder the files are written to before the commit."""
    final: str
    """Where the checkpoint will be once committed."""


@contextlib.contextmanager
def _quiet_dcp() -> Iterator[None]:
    # DCP warns on every single-process call; the warning is about its own defaults, not ours.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=r"torch\.distributed\.checkpoint.*")
        warnings.filterwarnings("ignore", message=".*process group.*")
        yield


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
        read_threads: reader threads of the fast path on load.
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
        # Off only in the benchmark, to measure what the load's backup costs.
        self._rollback_loads = True
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: Future[SaveResult] | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ saving

    def save(
        self,
        save_folder: str,
        step: int,
        state: TrainingState,
        *,
        train_state: Mapping[str, Any] | None = None,
        ephemeral: bool = False,
        metrics: Mapping[str, float] | None = None,
    ) -> SaveResult:
        """Write the checkpoint of ``step`` and commit it before returning.

        ``metrics`` (names to finite numbers) go into the commit record, where retention by metric
        (``keep_best``) and ``ckptkeeper inspect`` read them.
        """
        t0 = time.perf_counter()
        checked = _check_metrics(step, metrics)
        self.wait()
        tensors, meta = state.capture()
        payload = self._train_payload(step, train_state, meta)
        result = self._write(save_folder, step, tensors, payload, ephemeral, t0, checked)
        _emit_save(result, is_async=False)
        return result

    def save_async(
        self,
        save_folder: str,
        step: int,
        state: TrainingState,
        *,
        train_state: Mapping[str, Any] | None = None,
        ephemeral: bool = False,
        metrics: Mapping[str, float] | None = None,
    ) -> tuple[str, Future[SaveResult]]:
        """Snapshot the state now and write it in the background.

        Returns the checkpoint's final path and a future of its :class:`SaveResult`. The state may be
        changed as soon as this returns. A save still in flight is waited for first (its error, if
        any, is raised here). A failed background write raises :class:`CheckpointSaveError` from the
        future, naming the step and file.
        """
        t0 = time.perf_counter()
        checked = _check_metrics(step, metrics)
        self.wait()
        if D.is_distributed() and self.process_group is None:
            # Background collectives must not share a queue with training's: a group of their own
            # (every rank starts the same saves, so every rank creates it at the same call).
            self.process_group = D.new_cpu_group()
        tensors, meta = state.capture()
        need = _tensor_bytes(tensors)
        over_here = self.staging_budget_bytes is not None and need > self.staging_budget_bytes
        # All ranks take the same way (error, sync or async), or some would wait in a save the
        # others never start.
        if not D.all_agree(not over_here, group=self.process_group):
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
            done.set_result(
                self.save(save_folder, step, state, train_state=train_state, ephemeral=ephemeral, metrics=checked)
            )
            return self._final_path(save_folder, step), done
        staged = self._stager.stage(tensors)
        payload = self._train_payload(step, train_state, meta)
        blocked = time.perf_counter() - t0
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptkeeper-save")

        def run() -> SaveResult:
            r = self._write(save_folder, step, staged, payload, ephemeral, t0, checked)
            result = dataclasses.replace(r, blocked_s=blocked)
            _emit_save(result, is_async=True)
            return result

        fut = self._executor.submit(run)
        with self._lock:
            self._inflight = fut
        return self._final_path(save_folder, step), fut

    @property
    def save_in_flight(self) -> bool:
        """Whether a background save has not finished yet."""
        with self._lock:
            return self._inflight is not None and not self._inflight.done()

    def wait(self) -> SaveResult | None:
        """Wait for the background save, if any; re-raises its error."""
        with self._lock:
            fut, self._inflight = self._inflight, None
        return fut.result() if fut is not None else None

    def close(self) -> None:
        """Wait for the background save and stop the writer thread."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

    @staticmethod
    def _train_payload(step: int, train_state: Mapping[str, Any] | None, meta: Mapping[str, Any]) -> bytes:
        # Serialised at call time, so later changes to the caller's objects cannot leak in.
        doc = {"step": step, "train_state": dict(train_state or {}), "state_meta": meta}
        try:
            return json.dumps(doc).encode()
        except (TypeError, ValueError) as exc:
            raise CheckpointSaveError(
                f"step {step}: trainer state cannot be stored as JSON ({exc}); keep state_dict() values to "
                "tensors, numbers, strings, lists and dicts"
            ) from exc

    def _final_path(self, save_folder: str, step: int) -> str:
        return storage_for(save_folder).join(save_folder, step_dir_name(step))

    def _write(
        self,
        save_folder: str,
        step: int,
        tensors: Mapping[str, Any],
        payload: bytes,
        ephemeral: bool,
        t0: float,
        metrics: Mapping[str, float] | None = None,
    ) -> SaveResult:
        storage = storage_for(save_folder)
        retries_before = getattr(storage, "retries", 0)
        final = storage.join(save_folder, step_dir_name(step))
        pg = self.process_group
        rank, world = D.get_rank(pg), D.get_world_size(pg)
        token = D.broadcast_object(uuid.uuid4().hex[:8], group=pg)
        if storage.supports_rename:
            # A shared filesystem: all ranks write into one temporary folder, renamed at commit.
            work = storage.join(save_folder, scratch_name("tmp", step, token))
        else:
            # An object store: each rank spools its own files locally and uploads them itself.
            work = new_spool(self.spool_dir, "save")
        local_work = storage.local_path(work) or work
        files: dict[str, FileEntry] = {}
        stage = "preparing"

        def enter(name: str) -> None:
            if self.on_stage is not None:
                self.on_stage(SaveStage(name, step, rank, local_work, final))

        def prepare() -> None:
            enter("preparing")
            with translate_os_error(local_work):
                os.makedirs(os.path.join(local_work, MODEL_DIR), exist_ok=True)
            if rank == 0:
                # Local disks only check here (the old checkpoint stays until the new one is in
                # place); object stores must clear the keys the new files will take.
                self._clear_target(storage, final, check_only=storage.supports_rename)

        written: dict[str, FileEntry] = {}
        extra: dict[str, Any] = {"metrics": dict(metrics)} if metrics else {}

        def write_tensors() -> None:
            enter("writing tensors")
            with translate_os_error(local_work):
                out = self._write_tensors(os.path.join(local_work, MODEL_DIR), tensors, world)
            if out is not None:
                fast_files, segments = out
                written.update({f"{MODEL_DIR}/{k}": v for k, v in fast_files.items()})
                extra["layout"] = {f"{MODEL_DIR}/{DATA_FILE}": [seg.to_json() for seg in segments]}

        def finish_own_files() -> dict[str, FileEntry]:
            enter("writing trainer state")
            with translate_os_error(local_work):
                storage_for(local_work).write_bytes(os.path.join(local_work, train_state_name(rank)), payload)
            mine = self._hash_own_files(local_work, rank, world, skip=set(written))
            mine.update(written)
            if not storage.supports_rename:
                enter("uploading")
                # The intent goes first: whatever is uploaded under final is announced as ours.
                write_intent(storage, final, rank, sorted(mine), token)
                self._upload(storage, local_work, final, sorted(mine))
            return mine

        def publish() -> None:
            if rank == 0:
                enter("publishing")
                self._publish(storage, local_work, final, record)

        try:
            agree(prepare, step, pg)
            stage = "writing tensors"
            agree(write_tensors, step, pg)
            stage = "writing trainer state and uploading" if not storage.supports_rename else "writing trainer state"
            for part in agree(finish_own_files, step, pg):
                files.update(part)
            stage = "publishing"
            record = CommitRecord(step=step, ephemeral=ephemeral, world_size=world, files=files, extra=extra)
            agree(publish, step, pg)
        except (Exception, CheckpointException) as raw:
            exc = unwrap(raw)
            if isinstance(exc, CheckpointSaveError):
                self._discard(storage, local_work, final if rank == 0 and stage != "preparing" else None)
                # Another rank failed (its message already says where): keep the original chain.
                if exc is raw:
                    raise
                raise exc from raw
            # torch.save reports a full disk as a RuntimeError about zip positions; free space tells.
            if not isinstance(exc, OSError) and _free_bytes(local_work) < _tensor_bytes(tensors) + len(payload):
                exc = OSError(errno.ENOSPC, "No space left on device", getattr(exc, "filename", None) or local_work)
            self._discard(storage, local_work, final if rank == 0 and stage != "preparing" else None)
            on_rank = f" on rank {rank}" if world > 1 else ""
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFullError(
                    exc.errno,
                    f"step {step}{on_rank}: the disk is full while writing {exc.filename or local_work}; free "
                    "space or choose another save folder (checkpoints already saved were not touched)",
                ) from raw
            where = getattr(exc, "filename", None) or local_work
            raise CheckpointSaveError(
                f"saving step {step} to {final} failed{on_rank} while {stage} ({where}): {exc}"
            ) from exc
        finally:
            if not storage.supports_rename:
                shutil.rmtree(local_work, ignore_errors=True)
        total = sum(e.bytes for e in files.values())
        elapsed = time.perf_counter() - t0
        log.info(
            "saved step %d to %s: %.1f MiB in %.2fs (%.0f MiB/s)",
            step,
            final,
            total / 2**20,
            elapsed,
            total / 2**20 / max(elapsed, 1e-9),
        )
        retries = getattr(storage, "retries", 0) - retries_before
        return SaveResult(step, final, ephemeral, total, elapsed, elapsed, len(files), retries)

    def _upload(self, storage: Storage, local_work: str, final: str, names: list[str]) -> None:
        with ThreadPoolExecutor(max_workers=self.upload_threads) as pool:
            list(pool.map(lambda rel: storage.upload(os.path.join(local_work, rel), storage.join(final, rel)), names))

    def _write_tensors(
        self, model_dir: str, tensors: Mapping[str, Any], world: int
    ) -> tuple[dict[str, FileEntry], list[Segment]] | None:
        """Write the tensor tree in DCP format; returns (files, layout) when the fast path wrote it."""
        if world == 1 and self.writer == "auto" and can_use_fast_path(tensors):
            return write_fast(model_dir, tensors, threads=self.io_threads)
        with _quiet_dcp():
            dcp_save(
                dict(tensors),
                storage_writer=FileSystemWriter(model_dir, sync_files=True),
                process_group=self.process_group,
                no_dist=world == 1,
            )
        return None

    @staticmethod
    def _hash_own_files(local_work: str, rank: int, world: int, skip: set[str] | None = None) -> dict[str, FileEntry]:
        # With several ranks each hashes the files it wrote; rank 0 also owns DCP's .metadata.
        out: dict[str, FileEntry] = {}
        for dirpath, _, names in os.walk(local_work):
            for name in names:
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, local_work).replace(os.sep, "/")
                # The spool's owner marker is the spool's, not the checkpoint's.
                if rel in (COMMIT_RECORD, ".owner.json") or rel in (skip or ()):
                    continue
                if world > 1 and not _written_by(rel, rank):
                    continue
                size, digest = hash_file(full)
                out[rel] = FileEntry(size, digest)
        return out

    def _publish(self, storage: Storage, local_work: str, final: str, record: CommitRecord) -> None:
        if storage.supports_rename:
            storage.write_bytes(os.path.join(local_work, COMMIT_RECORD), record.to_json())
            self._clear_target(storage, final)
            storage.rename_dir(local_work, final)
            return
        # Every rank has uploaded its own files by now; the record goes last, create-only.
        storage.create_exclusive(storage.join(final, COMMIT_RECORD), record.to_json())

    def _clear_target(self, storage: Storage, final: str, check_only: bool = False) -> None:
        """Make room for a new save of this step, deleting only what is provably ckptkeeper's."""
        local = storage.local_path(final)
        if local is not None:
            if not os.path.lexists(local):
                return
            if os.path.islink(local) or not local_record_is_ours(local):
                raise CheckpointSaveError(
                    f"{local} already exists and is not a ckptkeeper checkpoint (no commit record); ckptkeeper "
                    "does not overwrite what it did not write: move it out of the save folder"
                )
            if not check_only:
                self.remove(final)  # an older save of the same step: invisible at once, deleted after
            return
        if not storage.list_dir(final):
            return
        try:
            record = storage.read_bytes(storage.join(final, COMMIT_RECORD))
        except FileNotFoundError:
            record = None
        if record is not None:
            if not record_is_ours(record):
                raise CheckpointSaveError(
                    f"{final} holds a {COMMIT_RECORD} that ckptkeeper did not write; ckptkeeper does not overwrite "
                    "it: move it out of the save folder"
                )
            self.remove(final)
            return
        clean_leftover(storage, final)
        if storage.list_dir(final) and not read_intents(storage, final)[1]:
            left = [f.relpath for f in storage.walk(final)][:3]
            raise CheckpointSaveError(
                f"{final} holds objects ckptkeeper did not write ({', '.join(left)}); ckptkeeper does not "
                "overwrite them: move them out of the save folder"
            )

    @staticmethod
    def _discard(storage: Storage, local_work: str, final: str | None = None) -> None:
        with contextlib.suppress(Exception):
            shutil.rmtree(local_work, ignore_errors=True)
        if final is not None and not storage.supports_rename:
            # Best effort: data objects already uploaded without a commit record are invisible
            # anyway, and the next run removes (through their intents) whatever this cannot.
            with contextlib.suppress(Exception):
                clean_leftover(storage, final)

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

        Nothing from the checkpoint is used before it is checked: the commit record first, then
        every file's size, then each small file's checksum before it is decoded, then whether the
        checkpoint fits ``state``. Tensors are read in place, each one backed up just before it is
        overwritten; if anything fails (a checksum, a read, restoring optimizer or extra state),
        ``state`` is put back exactly as it was and the error is raised. Errors are
        :class:`CorruptCheckpointError` for a damaged checkpoint and
        :class:`~ckptkeeper.engine.state.CheckpointMismatchError` (a ConfigurationError and a
        CheckpointError) when it is intact but does not fit ``state``: its message names each key,
        with the checkpoint's and the model's shapes. With ``TrainingState(..., strict=False)`` what
        fits is loaded and ``state.load_report`` lists the rest. Optimizer state is loaded exactly
        for the parameters that had it (none is made up for the others).

        ``check_train_state(train_state)`` runs before any tensor is touched; whatever it raises
        (other than a CkptkeeperError) becomes a CorruptCheckpointError naming the file.

        An OLMo-core checkpoint (no commit record, no checksums) is checked as far as it can be
        (DCP metadata through the allow-list, file sizes, with ``verify_checksums`` the CRC-32
        inside each ``torch.save`` record); model and optimizer tensors are loaded the same way,
        the optimizer's hyper-parameters and extras keep their current values, and the trainer
        state returned is OLMo-core's ``train/rank{R}.pt`` (rank 0's when there is none for this
        rank), read with ``torch.load(weights_only=True)`` and turned into plain data.
        """
        self._settle()
        t0 = time.perf_counter()
        storage = storage_for(path)
        retries_before = getattr(storage, "retries", 0)
        pg = self.process_group
        rank = D.get_rank(pg)
        local = storage.local_path(path)
        spool: str | None = None
        try:
            if local is None:
                # Each rank downloads and verifies what it loads; all ranks agree before loading.
                spool = new_spool(self.spool_dir, "load")
                where = spool
                record = agree(lambda: self._download(storage, path, where), None, pg, load_error)[rank]
                local = spool
                verified = True
            else:
                # One filesystem: rank 0 checks every file's size, the others take its verdict.
                def check() -> CommitRecord:
                    if rank != 0:
                        return discovery.read_any_record(path)
                    record = discovery.verify(path, checksums=False, structure=False)
                    # Fast-path files are checked segment by segment while they are read.
                    if self.verify_checksums and "layout" not in record.extra:
                        discovery.verify_checksums(path, record)
                    return record

                record = agree(check, None, pg, load_error)[rank]
                verified = self.verify_checksums and "layout" not in record.extra
            train_state = self._load_verified(path, local, record, state, verified, check_train_state)
            emit("load", path=path, step=record.step, bytes=record.total_bytes, files=len(record.files),
                 seconds=time.perf_counter() - t0, retries=getattr(storage, "retries", 0) - retries_before)  # fmt: skip
            return train_state
        finally:
            if spool is not None:
                shutil.rmtree(spool, ignore_errors=True)

    def _load_verified(
        self,
        path: str,
        local: str,
        record: CommitRecord,
        state: TrainingState,
        verified: bool,
        check_train_state: Callable[[dict[str, Any]], None] | None,
    ) -> dict[str, Any]:
        pg = self.process_group
        rank, world = D.get_rank(pg), D.get_world_size(pg)
        olmo = isinstance(record, discovery.OlmoCoreRecord)
        if isinstance(record, discovery.OlmoCoreRecord):
            olmo_state, borrowed = discovery.read_olmo_train_state(local, rank, record, path)
            doc: dict[str, Any] = {"train_state": olmo_state}
        else:
            doc, borrowed = read_train_state(local, rank, record, path)
        if check_train_state is not None:
            try:
                check_train_state(doc.get("train_state", {}))
            except CkptkeeperError:
                raise
            except Exception as exc:
                raise CorruptCheckpointError(
                    f"checkpoint {path}: its trainer state is not usable ({type(exc).__name__}: {str(exc)[:200]}); "
                    "load an earlier checkpoint or restore this one from a copy"
                ) from None
        if borrowed:
            log.warning(
                "checkpoint has no trainer state for rank %d (saved with %d ranks); using rank 0's",
                rank,
                record.world_size,
            )
        if isinstance(record, discovery.OlmoCoreRecord):
            metadata = discovery.check_olmo_core(local, record, path)
        else:
            metadata = read_metadata(local, record, path)
        # Where each tensor goes, checked against the metadata (and state.strict) before anything is read.
        plan = state.plan_load(saved_tensors(metadata), None if olmo else doc.get("state_meta", {}), path)
        tensors, same_dtypes = plan.tensors, plan.same_dtypes
        layout = record.extra.get("layout")
        rows = layout.get(f"{MODEL_DIR}/{DATA_FILE}") if isinstance(layout, dict) else None
        fast = rows is not None and world == 1 and same_dtypes and can_use_fast_path(tensors)
        by_fqn = None
        if fast:
            try:
                by_fqn = parse_layout(rows, record.files[f"{MODEL_DIR}/{DATA_FILE}"].bytes, metadata)
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise CorruptCheckpointError(
                    f"checkpoint {path} is corrupt: {exc}; load an earlier checkpoint or restore this one from a copy"
                ) from None
        need = _tensor_bytes(plan.live)  # only live state is backed up; the rest is read into new tensors
        had_buffers = self._stager.nbytes > 0
        if by_fqn is None and not verified and self.verify_checksums:
            # DCP's reader checks no checksums, and segment checks only happen on the fast path
            # (not taken here, e.g. for another dtype): check every file before reading it.
            discovery.verify_checksums(local, record, path)
            verified = True
        guard: Rollback | None = None
        if not self._rollback_loads:
            pass
        elif self.staging_budget_bytes is None or need <= self.staging_budget_bytes:
            guard = Rollback(self._stager, plan.live, incremental=fast)
        elif not verified:
            # No memory for a backup: read every byte once to check it before anything is written.
            log.info("the load's backup would exceed the staging budget; verifying %s before loading", path)
            discovery.verify_checksums(local, record, path)
        meta_touched = False
        try:
            if by_fqn is not None:
                read_fast(
                    os.path.join(local, MODEL_DIR),
                    tensors,
                    by_fqn,
                    verify=self.verify_checksums,
                    threads=self.read_threads,
                    before_write=guard.before_write if guard is not None else None,
                )
            else:
                data_files = [k[len(MODEL_DIR) + 1 :] for k in record.files if k.startswith(MODEL_DIR + "/")]
                with _quiet_dcp():
                    dcp_load(
                        tensors,
                        storage_reader=SafeFileSystemReader(os.path.join(local, MODEL_DIR), data_files, olmo_core=olmo),
                        planner=SafeLoadPlanner(),
                        process_group=pg,
                        no_dist=world == 1,
                    )
            meta_touched = True
            # OLMo-core keeps hyper-parameters as pickles (not read): the plan kept the current ones.
            state.apply_load(plan)
        except (Exception, CheckpointException) as raw:
            if guard is not None:
                guard.restore()
                if meta_touched:
                    try:
                        state.undo_load(plan)
                    except Exception:
                        log.exception("could not put the optimizer/extra settings back after a failed load")
            inner = unwrap(raw)
            if isinstance(inner, CheckpointError):
                raise inner from raw
            if isinstance(inner, OSError):
                raise CorruptCheckpointError(f"checkpoint {path} could not be read ({inner})") from inner
            # Shapes and keys were checked before reading: what fails here is a load_state_dict
            # (optimizer, extra) refusing what the checkpoint holds.
            raise CheckpointMismatchError(
                f"checkpoint {path} does not fit this model/optimizer ({type(inner).__name__}: {_last_line(inner)}); "
                "load it into the model, optimizer and extras it was saved from"
            ) from inner
        finally:
            if guard is not None and not had_buffers:
                self._stager.release()  # the backup was only for this load
        train_state: dict[str, Any] = doc.get("train_state", {})
        return train_state

    def _settle(self) -> None:
        # A load reuses the staging buffers for its backup: let a background save finish with
        # them first. Its outcome stays with its future, for whoever waits on it.
        with self._lock:
            fut = self._inflight
        if fut is not None:
            concurrent.futures.wait([fut])

    def _download(self, storage: Storage, path: str, spool: str) -> CommitRecord:
        # OLMo-core checkpoints have no record to list their files: every file of the step folder
        # is fetched (its listed size checked), then checked as far as it can be, locally.
        record = discovery.read_any_record(path)
        olmo = isinstance(record, discovery.OlmoCoreRecord)
        names = sorted(record.files)
        root = os.path.realpath(spool)

        def fetch(rel: str) -> None:
            dst = os.path.join(spool, rel)
            # Names were checked when the record was read; this is the second lock on the door.
            if not os.path.realpath(dst).startswith(root + os.sep):
                raise CorruptCheckpointError(f"checkpoint {path} lists {rel!r}, which is outside the checkpoint")
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            try:
                storage.download(storage.join(path, rel), dst)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"checkpoint {path} is corrupt: missing file {rel}") from None
            if olmo:
                discovery.check_file(path, rel, record.files[rel], os.lstat(dst).st_size, None)
                return
            size, digest = hash_file(dst, follow_links=False)
            discovery.check_file(path, rel, record.files[rel], size, digest if self.verify_checksums else None)

        with ThreadPoolExecutor(max_workers=self.upload_threads) as pool:
            list(pool.map(fetch, names))
        if isinstance(record, discovery.OlmoCoreRecord):
            if self.verify_checksums:
                discovery.verify_checksums(spool, record, path)  # the CRC-32s, after the structure
            else:
                discovery.check_olmo_core(spool, record, path)
        return record

    # ------------------------------------------------------------------ removal

    def remove(self, path: str, run_in_background: Callable[[Callable[[], Any]], Any] | None = None) -> None:
        """Remove a checkpoint: invisible at once (rename, or commit record first), files deleted after.

        Only checkpoints ckptkeeper can prove it wrote are removed, and only their own files (see
        :mod:`ckptkeeper.engine.deleter`); anything else raises :class:`ConfigurationError` and is left
        alone. A ``step{N}`` symlink is unlinked, never followed. The slow part (deleting files) is
        handed to ``run_in_background`` when given.
        """
        remove_checkpoint(path, run_in_background)

    def clean_scratch(self, save_folder: str) -> list[str]:
        """Delete leftovers of interrupted saves and removals that are provably ckptkeeper's; returns them.

        Local disks: ``.tmp-step{N}-{id}`` and ``.trash-step{N}-{id}`` folders (exact names only).
        Object stores: step folders without a commit record, through their upload intents (only
        the announced objects), and the unfinished multipart uploads those intents announced.
        """
        return clean_save_folder(save_folder)


def _check_metrics(step: int, metrics: Mapping[str, float] | None) -> dict[str, float] | None:
    if metrics is None:
        return None
    try:
        return check_metrics(dict(metrics))
    except ValueError as exc:
        raise ConfigurationError(
            f"step {step}: metrics must map names to finite numbers ({exc}); pass e.g. metrics={{'val_loss': 0.31}}"
        ) from None


def _emit_save(r: SaveResult, is_async: bool) -> None:
    emit("save", path=r.path, step=r.step, ephemeral=r.ephemeral, bytes=r.bytes, files=r.files,
         blocked_s=r.blocked_s, durable_s=r.durable_s, retries=r.retries, **{"async": is_async})  # fmt: skip


def _written_by(rel: str, rank: int) -> bool:
    if rel == train_state_name(rank):
        return True
    if rel.startswith(MODEL_DIR + "/"):
        base = rel[len(MODEL_DIR) + 1 :]
        if base == ".metadata":
            return rank == 0
        # DCP names each rank's data file __{rank}_{n}.distcp.
        return base.startswith(f"__{rank}_")
    return False


def _free_bytes(path: str) -> int:
    try:
        st = os.statvfs(path)
    except OSError:
        return 1 << 62
    return st.f_bavail * st.f_frsize


def _tensor_bytes(tree: Mapping[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for _, t in flatten_tensors(tree))


def _last_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1].strip() if text else type(exc).__name__
