"""Loading a checkpoint into a training state: verify, check the fit, read in place, roll back on failure.

Nothing from a checkpoint is used before it is checked: the commit record, every file's size,
each small file's checksum before it is decoded, whether the checkpoint fits the state. Tensors
are then read straight into place (the fast reader, or DCP's through an allow-listed metadata
reader), each backed up just before it is overwritten, so a failure leaves the state as it was.
Fast-path checkpoints are read per piece (any world size, each rank only the pieces it needs),
on object stores with ranged reads and no local copy; other object-store checkpoints are
downloaded to a spool first and verified there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, cast

from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from .. import distributed as D
from ..errors import CheckpointError, CkptkeeperError, CorruptCheckpointError
from ..storage import Storage, storage_for
from ..storage.layout import MODEL_DIR, train_state_name
from ..storage.local import open_regular
from . import discovery
from .agreement import agree, load_error, unwrap
from .deleter import new_spool
from .fastio import DATA_FILE, TENSORS_KEY, can_use_fast_path, parse_layout, read_fast, saved_from_table
from .flatload import FlatIndex, NotPlaced, flat_index, flat_segments, plan_flat, read_flat
from .loader import (
    CheckpointMismatchError,
    HostCopies,
    Rollback,
    bounced,
    check_unread,
    read_metadata,
    read_train_state,
    saved_tensors,
)
from .metrics import emit
from .record import CommitRecord, hash_file
from .safe_metadata import SafeFileSystemReader, SafeLoadPlanner
from .saving import quiet_dcp, tensor_bytes
from .sharded import (
    INDEX_FILE,
    PIECES_KEY,
    LocalSource,
    PieceIndex,
    RemoteSource,
    Source,
    check_stored,
    index_from_metadata,
    index_from_own_table,
    index_from_tables,
    is_pieces_table,
    plan_reads,
    read_pieces,
    segments_read,
    shard_name,
)
from .state import LoadPlan, SavedTensor, TrainingState

if TYPE_CHECKING:
    from .checkpointer import Checkpointer

__all__ = ["download", "load"]

log = logging.getLogger("ckptkeeper.engine.checkpointer")


def load(
    ck: Checkpointer,
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
    ck._runner.settle()
    t0 = time.perf_counter()
    storage = storage_for(path)
    retries_before = getattr(storage, "retries", 0)
    pg = ck.process_group
    rank = D.get_rank(pg)
    local = storage.local_path(path)
    spool: str | None = None
    try:
        record: CommitRecord | None = None
        train_state: dict[str, Any] | None = None
        reader = "download"
        fetched_before = storage.bytes_fetched
        if local is None:
            # Fast-path checkpoints on object stores are read in place, each rank fetching only
            # the byte ranges it needs; the others are downloaded to a spool and verified there.
            record = agree(lambda: _check_record(path, rank), None, pg, load_error)[rank]
            if discovery.has_layout(record) and not isinstance(record, discovery.OlmoCoreRecord):
                try:
                    train_state, reader = _load_verified(
                        ck, path, path, record, state, False, check_train_state, storage
                    )
                except _NeedsDownload:
                    train_state = None
            if train_state is None:
                spool = new_spool(ck.spool_dir, "load")
                where = spool
                record = agree(lambda: download(ck, storage, path, where), None, pg, load_error)[rank]
                with _reading_ahead(ck, spool, record):
                    train_state, _ = _load_verified(ck, path, spool, record, state, True, check_train_state)
                reader = "download"
        else:
            # One filesystem: rank 0 checks every file's size, the others take its verdict.
            def check() -> CommitRecord:
                if rank != 0:
                    return discovery.read_any_record(path)
                record = discovery.verify(path, checksums=False, structure=False)
                # Fast-path files are checked segment by segment while they are read.
                if ck.verify_checksums and not discovery.has_layout(record):
                    discovery.verify_checksums(path, record)
                return record

            record = agree(check, None, pg, load_error)[rank]
            verified = ck.verify_checksums and not discovery.has_layout(record)
            with _reading_ahead(ck, local, record):
                train_state, reader = _load_verified(ck, path, local, record, state, verified, check_train_state)
        emit("load", path=path, step=record.step, bytes=record.total_bytes, files=len(record.files),
             seconds=time.perf_counter() - t0, retries=getattr(storage, "retries", 0) - retries_before,
             reader=reader, fetched=storage.bytes_fetched - fetched_before)  # fmt: skip
        return train_state
    finally:
        if spool is not None:
            shutil.rmtree(spool, ignore_errors=True)


class _NeedsDownload(Exception):
    """Every rank agreed that an object-store checkpoint cannot be read in place: download it."""


def _check_record(path: str, rank: int) -> CommitRecord:
    # Rank 0 lists the checkpoint and checks every size; the others read the record only.
    if rank != 0:
        return discovery.read_any_record(path)
    return discovery.verify(path, checksums=False, structure=False)


def _load_verified(
    ck: Checkpointer,
    path: str,
    local: str,
    record: CommitRecord,
    state: TrainingState,
    verified: bool,
    check_train_state: Callable[[dict[str, Any]], None] | None,
    remote: Storage | None = None,
) -> tuple[dict[str, Any], str]:
    """Load from ``local`` (a folder, or with ``remote`` the checkpoint's URL, read in place).

    Returns this rank's trainer state and how tensors were read: "fast" (the single-process
    reader), "pieces" (per piece, any world size; ranged reads on object stores) or "dcp".
    """
    pg = ck.process_group
    rank, world = D.get_rank(pg), D.get_world_size(pg)
    olmo = isinstance(record, discovery.OlmoCoreRecord)
    prep: dict[str, Any] = {}

    def fast_reads(plan: LoadPlan, fits: Callable[[LoadPlan], Any]) -> Any:
        # ``fits`` (a fast reader's planning: None where it cannot fill a destination in place)
        # for ``plan``; where it gives None, again with host tensors in place of the destinations
        # it cannot fill (on a GPU, say), copied in once every byte is read and checked. Tried
        # second so that a load with none pays nothing for the look (a pass over every tensor).
        # What the readers fill is kept in prep; DCP's reader, if taken, reads into ``plan``.
        prep.update(into=plan, copies=HostCopies.none())
        found = fits(plan)
        if found is None:
            into, copies = bounced(plan, ck.staging_budget_bytes)
            if into is not plan:
                found = fits(into)
                if found is not None:
                    prep.update(into=into, copies=copies)
        return found

    def prepare() -> str:
        # Everything a rank checks before it touches a tensor, as one agreement round: a rank
        # that finds its trainer state or a segment table corrupt fails every rank together.
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
        tables = {} if olmo else discovery.segment_tables(record)
        # (A one-rank checkpoint of DTensors has the same data file under a per-rank table.)
        single = world == 1 and remote is None and record.world_size == 1 and list(tables) == [DATA_FILE]
        single = single and not is_pieces_table(tables[DATA_FILE] or "")
        metadata: Any = None
        index: PieceIndex | FlatIndex | None = None
        partial = False  # planned from this rank's own table and the shared index only
        listed = None
        if single:
            found = discovery.read_segment_table(path, record, DATA_FILE, local)
            rows, table = (found[0], found[1].get(TENSORS_KEY)) if found is not None else (None, None)
            if table is not None:
                try:
                    listed = saved_from_table(table)
                except ValueError as exc:
                    raise _corrupt(path, exc) from None
        saved: dict[str, SavedTensor | None]
        if listed is not None:
            # The segment table lists shapes and dtypes: DCP's metadata (thousands of pickled
            # objects for a model of many tensors) is not decoded on this path, only checked
            # against its checksum (cheap), so a swapped or damaged file is still refused here.
            check_unread(local, record, path)
            saved = cast("dict[str, SavedTensor | None]", listed)  # its values are SavedTensor tuples
        elif isinstance(record, discovery.OlmoCoreRecord):
            metadata = discovery.check_olmo_core(local, record, path)
            saved = saved_tensors(metadata)
        else:
            # Where every piece is comes from the segment tables (JSON, checked as read) when
            # they say; DCP's metadata (every piece of every rank, pickled) is decoded otherwise.
            if tables and not single:
                index = from_index
                partial = index is not None
                if index is None:
                    index = _index_from_tables(path, record, tables, None if remote else local)
            if index is not None:
                saved = index.saved
            else:
                metadata = read_metadata(local, record, path)
                saved = saved_tensors(metadata)
        # Where each tensor goes, checked against the checkpoint (and state.strict) before anything is read.
        saved_meta = None if olmo else doc.get("state_meta", {})

        def from_every_table() -> tuple[PieceIndex, Any]:
            # Planned again from every rank's table (for a rank the shared index does not serve).
            full = _index_from_tables(path, record, tables, None if remote else local)
            assert full is not None  # format-2 tables always place their pieces
            return full, state.plan_load(full.saved, saved_meta, path)

        try:
            plan = state.plan_load(saved, saved_meta, path)
        except CheckpointMismatchError:
            if not partial:
                raise
            # The index lists tensors the tables do not (a damaged index): the tables decide.
            (index, plan), partial = from_every_table(), False
        report = plan.report
        if partial and (report.missing_keys or report.unexpected_keys or report.mismatched_keys):
            # The same with strict=False, where nothing raised: what the load leaves out or
            # reports is decided by the tables, not by an index that may invent or omit a tensor
            # (found by an outside attack: an invented tensor was reported as unexpected).
            (index, plan), partial = from_every_table(), False
        prep.update(doc=doc, plan=plan)
        if not tables or not plan.same_dtypes:
            return "download" if remote is not None else "dcp"
        if single:
            if fast_reads(plan, lambda p: can_use_fast_path(p.tensors, loading=True) or None) is None:
                return "dcp"
            prep["by_fqn"] = _parsed(path, rows, record, metadata, DATA_FILE, listed)
            return "single"
        if index is None:
            if metadata is None:
                metadata = read_metadata(local, record, path)
            parsed: dict[str, Any] = {}

            def segments(data_file: str) -> Any:
                if data_file not in parsed:
                    rows = discovery.read_segment_rows(path, record, data_file, None if remote else local)
                    if rows is None:
                        raise CorruptCheckpointError(f"checkpoint {path} is corrupt: {data_file} has no segment table")
                    parsed[data_file] = _parsed(path, rows, record, metadata, data_file)
                return parsed[data_file]

            try:
                index = index_from_metadata(metadata, segments)
            except ValueError as exc:
                raise _corrupt(path, exc) from None
        try:
            if isinstance(index, FlatIndex):
                flat_index_ = index
                reads: Any = fast_reads(plan, lambda p: plan_flat(p.tensors, flat_index_, world, p.flat))
                prep["flat"] = reads is not None
            else:
                piece_index = index
                reads = fast_reads(plan, lambda p: plan_reads(p.tensors, piece_index, world, path))
        except (CorruptCheckpointError, NotPlaced):
            if not partial:
                raise
            # This rank's own table and the shared index do not cover its tensors (a replica of
            # a shard another rank wrote, say): plan from every rank's table, as at another
            # world size (which raises if the checkpoint really lacks them).
            index, plan = from_every_table()
            prep.update(plan=plan, flat=False)
            if not plan.same_dtypes:
                return "download" if remote is not None else "dcp"
            every = index
            reads = fast_reads(plan, lambda p: plan_reads(p.tensors, every, world, path))
        if reads is None:
            return "download" if remote is not None else "dcp"
        prep["reads"] = reads
        return "pieces"

    from_index: PieceIndex | FlatIndex | None = None
    if not olmo and world > 1 and record.world_size == world and INDEX_FILE in record.files:
        # Whether every rank plans from its own table and the shared index, decided together:
        # each rank checks the index against its own table (the whole pieces in its own file
        # included), and one that finds it wrong sends every rank to the tables, which decide
        # alone then (a damaged index fails no load its tables can serve).
        try:
            from_index = _index_from_own_table(path, record, rank, world, None if remote else local)
        except Exception as exc:  # any: every rank must reach the vote below, or the others wait in it
            log.warning("not planning from the shared index of %s: %s", path, exc)
            from_index = None
        usable = from_index is not None
        # A round of its own (a rank lost here is named, as in every other round).
        if not all(agree(lambda: usable, None, pg, load_error)):
            from_index = None
    modes = agree(prepare, None, pg, load_error)
    if remote is not None and set(modes) != {"pieces"}:
        raise _NeedsDownload()
    mode = modes[rank] if len(set(modes)) == 1 else "dcp"
    doc, plan = prep["doc"], prep["plan"]
    # Host copies are only made for the fast readers (whose planning, in prepare(), was the last
    # to see the plan); DCP's reads into the destinations themselves.
    copies: HostCopies = prep["copies"] if mode != "dcp" else HostCopies.none()

    def copy_in() -> None:
        if copies.names:
            if guard is not None:
                guard.back_up_whole(copies.names)  # before their memory is written, as the readers' backups are
            copies.copy_in()

    if mode == "dcp" and not verified and ck.verify_checksums:
        # DCP's reader checks no checksums, and segment checks only happen on the fast paths
        # (not taken here, e.g. for another dtype): check every file before reading it.
        discovery.verify_checksums(local, record, path)
        verified = True
    guard: Rollback | None = None
    unguarded = False
    # Only live state is backed up; the rest is read into new tensors. (Summed only under a budget:
    # a walk of the tree costs tens of milliseconds at 10,000 tensors.)
    fits = ck.staging_budget_bytes is None or tensor_bytes(plan.live) <= ck.staging_budget_bytes
    if remote is not None and world > 1 and ck._rollback_loads:
        # Budgets may differ per rank; going to download is a different sequence of rounds, so
        # every rank takes that way or none.
        fits = D.all_agree(fits, group=pg)
    if not ck._rollback_loads:
        pass
    elif fits:
        guard = Rollback(ck._stager, plan.live, incremental=mode != "dcp", deferred=copies.names)
    elif remote is not None:
        raise _NeedsDownload()  # no memory for a backup: verify everything first, on a local copy
    elif mode in ("single", "pieces") and ck.verify_checksums:
        # No memory for a backup: every segment the load reads is checked before any is written
        # (below, all ranks in one round). A whole-file check would not do: the reads trust the
        # segment table's checksums, which a damaged table can give wrong for intact files.
        log.info("the load's backup would exceed the staging budget; checking what %s holds before loading", path)
        unguarded = True
    elif not verified:
        # No memory for a backup: read every byte once to check it before anything is written.
        log.info("the load's backup would exceed the staging budget; verifying %s before loading", path)
        discovery.verify_checksums(local, record, path)
    before_write = guard.before_write if guard is not None else None
    meta_touched = False
    try:
        if mode == "single":
            if unguarded:
                segs = [seg for trio in prep["by_fqn"].values() for seg in trio.values()]
                checked = LocalSource(os.path.join(local, MODEL_DIR))
                try:
                    check_stored(checked, {DATA_FILE: segs})
                finally:
                    checked.close()
            read_fast(os.path.join(local, MODEL_DIR), prep["into"].tensors, prep["by_fqn"], verify=ck.verify_checksums,
                      threads=ck.read_threads, before_write=before_write,
                      back_up_whole=guard.back_up_whole if guard is not None else None)  # fmt: skip
            copy_in()
        elif mode == "pieces":
            source: Source
            if remote is not None:
                source = RemoteSource(remote, remote.join(path, MODEL_DIR), threads=ck.upload_threads)
                threads = ck.upload_threads
            else:
                # The node's disk is shared by its ranks: read_threads is per node, split among them
                # (4 threads on each of 2 ranks read slower here than 2 each).
                local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
                source, threads = LocalSource(os.path.join(local, MODEL_DIR)), max(1, ck.read_threads // local_ranks)
            reads, flat = prep["reads"], prep.get("flat", False)
            whole = guard.back_up_whole if guard is not None else None
            # Where any rank has no backup, every rank checks what it will read, in a round of its
            # own before any rank writes: damage only a rank with a backup reads would otherwise
            # stop the load after the ranks without one had written (found by an outside attack).
            if world > 1 and ck.verify_checksums:
                unguarded = not D.all_agree(not unguarded, group=pg)
            if unguarded:
                try:
                    segments = flat_segments(reads) if flat else segments_read(reads)
                    agree(lambda: check_stored(source, segments), None, pg, load_error)
                except BaseException:
                    source.close()  # read_pieces, which closes it, is not reached
                    raise
            read = read_flat if flat else read_pieces

            def read_and_copy_in() -> None:
                read(source, reads, ck.verify_checksums, threads, before_write, whole)
                copy_in()  # in the same round: a rank whose copy fails fails every rank's load

            agree(read_and_copy_in, None, pg, load_error)
        else:
            data_files = [k[len(MODEL_DIR) + 1 :] for k in record.files if k.startswith(MODEL_DIR + "/")]
            with quiet_dcp():
                dcp_load(
                    plan.tensors,
                    storage_reader=SafeFileSystemReader(os.path.join(local, MODEL_DIR), data_files, olmo_core=olmo),
                    planner=SafeLoadPlanner(),
                    process_group=pg,
                    no_dist=world == 1,
                )
        meta_touched = True
        # OLMo-core keeps hyper-parameters as pickles (not read): the plan kept the current ones.
        agree(lambda: state.apply_load(plan), None, pg, load_error)
    except BaseException as raw:
        if guard is not None:
            guard.restore()
            if meta_touched:
                try:
                    state.undo_load(plan)
                except Exception:
                    log.exception("could not put the optimizer/extra settings back after a failed load")
        inner = unwrap(raw)
        if not isinstance(inner, Exception):
            # Ctrl-C or SystemExit mid-read (DCP's reader wraps it): the state is back as it was
            # (reads go straight into the tensors and are checked there), and the interruption
            # goes on as it is.
            if inner is raw:
                raise
            raise inner from None
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
    train_state: dict[str, Any] = doc.get("train_state", {})
    return train_state, {"single": "fast"}.get(mode, mode)


_EARLY_READ_AHEAD = 512 << 20
_READ_AHEAD_CHUNK = 2 << 20


@contextlib.contextmanager
def _reading_ahead(ck: Checkpointer, local: str, record: CommitRecord) -> Iterator[None]:
    """The block runs while this rank's own data file in ``local`` is read ahead (see
    :class:`_ReadAhead`), at the saved world size, where a rank reads its own file (nearly) whole;
    at another, each rank reads parts of several, and nothing is read ahead."""
    ahead: _ReadAhead | None = None
    rank, world = D.get_rank(ck.process_group), D.get_world_size(ck.process_group)
    if not isinstance(record, discovery.OlmoCoreRecord) and record.world_size == world:
        data = f"{MODEL_DIR}/{shard_name(rank)}"
        entry = record.files.get(data)
        if entry is not None and entry.bytes:
            # The small files this rank reads first (its segment table, the shared index, its
            # trainer state), one after another before any tensor: asked for together up front.
            small = [discovery.segment_tables(record).get(shard_name(rank)), INDEX_FILE, train_state_name(rank)]
            first = [os.path.join(local, rel) for rel in small if rel is not None and rel in record.files]
            ahead = _ReadAhead.start(os.path.join(local, data), entry.bytes, first)
    try:
        yield
    finally:
        if ahead is not None:
            ahead.stop()


class _ReadAhead:
    """Brings the first ``_EARLY_READ_AHEAD`` bytes of a data file into the page cache on a thread
    of its own, until stopped.

    Checking the trainer state, the segment tables and the fit takes a few hundred milliseconds
    for a state of many tensors, before the first tensor is read; with the disk reading
    meanwhile, the reads find their bytes in memory. Measured here (cold cache, 2 ranks, 10,000
    tensors, interleaved runs): 0.57-0.62 s per load without, 0.44-0.45 s with; one process
    0.35-0.37 -> 0.32-0.34 s (with reads into a buffer, before sendfile).
    ``posix_fadvise(WILLNEED)`` alone, used before, does next to nothing: Linux caps one hint at
    the device's read-ahead window (8 MiB here), and a cold read after it took as long as
    without. The bytes go to ``/dev/null`` by ``sendfile`` (no copy into this process: a warm
    file costs 4 ms of CPU per 128 MiB instead of 13-16 ms read into a buffer); plain reads where
    that is refused. Only a head start: every byte a load uses is still read and checked by the
    reader, and whatever goes wrong here (a file that is not regular, a thread that cannot
    start) only means no head start.
    """

    def __init__(self, path: str, nbytes: int, first: list[str] | None = None) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run,
            args=(path, min(nbytes, _EARLY_READ_AHEAD), first or []),
            name="ckptkeeper-read-ahead",
            daemon=True,
        )

    @classmethod
    def start(cls, path: str, nbytes: int, first: list[str] | None = None) -> _ReadAhead | None:
        """A running read-ahead, or None where no thread could be started (a process limit).
        ``first``: small files asked for before the data file (see :meth:`_ask_for`)."""
        ahead = cls(path, nbytes, first)
        try:
            ahead._thread.start()
        except RuntimeError:  # "can't start new thread": the load goes on without a head start
            return None
        return ahead

    @staticmethod
    def _ask_for(paths: list[str]) -> None:
        """Ask the kernel to read these small files now, all at once, without waiting for them.

        The loader reads them one after another, each from a cold disk behind the data file's
        read-ahead: 25-30 ms of waiting per load at 2 ranks and 10,000 tensors, measured here.
        ``WILLNEED`` reads up to the device's read-ahead window (8 MiB here) in the background,
        which holds these files whole.
        """
        advise = getattr(os, "posix_fadvise", None)
        if advise is None:
            return
        for path in paths:
            with contextlib.suppress(OSError):
                fd = open_regular(path)
                try:
                    advise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                finally:
                    os.close(fd)

    def _run(self, path: str, limit: int, first: list[str]) -> None:
        self._ask_for(first)
        with contextlib.suppress(Exception):  # a head start only: the reader reports what is wrong
            fd = open_regular(path)
            try:
                at = self._send(fd, limit)
                if at < limit:
                    self._read(fd, at, limit)
            finally:
                os.close(fd)

    def _read(self, fd: int, at: int, limit: int) -> None:
        # Plain reads into a throwaway buffer, where sendfile is refused.
        buf = memoryview(bytearray(_READ_AHEAD_CHUNK))
        while at < limit and not self._stop.is_set():
            n = os.preadv(fd, [buf[: min(len(buf), limit - at)]], at)
            if n == 0:
                break
            at += n

    def _send(self, fd: int, limit: int) -> int:
        """Where reading is to go on from: ``limit`` when sendfile took it to the end (or was
        stopped), less where sendfile to /dev/null is refused (other systems) and reads take over."""
        at = 0
        try:
            null = os.open(os.devnull, os.O_WRONLY)
        except OSError:
            return at
        try:
            while at < limit and not self._stop.is_set():
                n = os.sendfile(null, fd, at, min(_READ_AHEAD_CHUNK, limit - at))
                if n == 0:
                    break  # the end of the file
                at += n
        except (OSError, AttributeError):  # AttributeError: no os.sendfile here
            return at
        finally:
            os.close(null)
        return limit

    def stop(self) -> None:
        """Stop at the next chunk (the load is done, or failed), waiting a moment for the thread.

        A read stuck in the kernel (a stalled network mount) cannot be interrupted: the wait is
        bounded, and the thread ends when that read returns.
        """
        self._stop.set()
        self._thread.join(timeout=1.0)


def _index_from_own_table(
    path: str, record: CommitRecord, rank: int, world: int, local: str | None
) -> PieceIndex | FlatIndex | None:
    """This rank's pieces and the shared index's whole pieces (see :data:`INDEX_FILE`), for a load
    at the world size the checkpoint was saved at; None where that does not apply (another world
    size, no shared index, a format-1 table), and the caller reads every rank's table. From a
    local folder, in columns (:mod:`~ckptkeeper.engine.flatload`: the common resume, planned and
    read with a few operations per piece). CorruptCheckpointError when the index and this rank's
    own table disagree."""
    own = shard_name(rank)
    tables = discovery.segment_tables(record)
    rel = tables.get(own)
    if record.world_size != world or INDEX_FILE not in record.files or rel is None or not is_pieces_table(rel):
        return None
    try:
        sizes = _data_file_sizes(record, tables)
        doc = discovery.read_table_doc(path, record, own, local)
        assert doc is not None  # listed by segment_tables
        index_doc = discovery.read_index_doc(path, record, local)
        if local is not None:
            return flat_index(doc[1], own, index_doc, world, sizes)
        return index_from_own_table(doc[1], own, index_doc, world, sizes)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise _corrupt(path, exc) from None


def _index_from_tables(path: str, record: CommitRecord, tables: Any, local: str | None) -> PieceIndex | None:
    """Every stored piece, from the segment tables; None when one of them does not place its pieces."""
    found: dict[str, Any] = {}
    for data_file, rel in tables.items():
        if rel is not None and is_pieces_table(rel):
            doc = discovery.read_table_doc(path, record, data_file, local)
            assert doc is not None  # listed by segment_tables
            found[data_file] = doc[1]
            continue
        got = discovery.read_segment_table(path, record, data_file, local)
        if got is None:
            return None
        rows, extra = got
        pieces = extra.get(PIECES_KEY)
        if pieces is None and isinstance(extra.get(TENSORS_KEY), dict) and record.world_size == 1:
            # A single-process table: every tensor is one whole piece.
            pieces = {f: [e[0], e[1], [0] * len(e[1]), e[1]] if isinstance(e, list) and len(e) == 2 and
                      isinstance(e[1], list) else e for f, e in extra[TENSORS_KEY].items()}  # fmt: skip
        if pieces is None:
            return None
        found[data_file] = (rows, pieces)
    try:
        return index_from_tables(found, _data_file_sizes(record, found))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise _corrupt(path, exc) from None


def _data_file_sizes(record: CommitRecord, data_files: Iterable[str]) -> dict[str, int]:
    """Each data file's size as the record lists it; ValueError for one a table describes that it does not list."""
    sizes = {}
    for data_file in data_files:
        rel = f"{MODEL_DIR}/{data_file}"
        if rel not in record.files:
            raise ValueError(f"a segment table describes {rel}, which the checkpoint does not list")
        sizes[data_file] = record.files[rel].bytes
    return sizes


def _corrupt(path: str, exc: Exception) -> CorruptCheckpointError:
    """The error for a checkpoint whose tables say something impossible (``exc`` says what)."""
    return CorruptCheckpointError(
        f"checkpoint {path} is corrupt: {exc}; load an earlier checkpoint or restore this one from a copy"
    )


def _parsed(path: str, rows: Any, record: CommitRecord, metadata: Any, data_file: str, listed: Any = None) -> Any:
    rel = f"{MODEL_DIR}/{data_file}"
    try:
        if rel not in record.files:
            raise ValueError(f"a segment table describes {rel}, which the checkpoint does not list")
        return parse_layout(rows, record.files[rel].bytes, metadata, data_file, listed)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise _corrupt(path, exc) from None


def download(ck: Checkpointer, storage: Storage, path: str, spool: str) -> CommitRecord:
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
        discovery.check_file(path, rel, record.files[rel], size, digest if ck.verify_checksums else None)

    with ThreadPoolExecutor(max_workers=ck.upload_threads) as pool:
        list(pool.map(fetch, names))
    if isinstance(record, discovery.OlmoCoreRecord):
        if ck.verify_checksums:
            discovery.verify_checksums(spool, record, path)  # the CRC-32s, after the structure
        else:
            discovery.check_olmo_core(spool, record, path)
    return record


def _last_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1].strip() if text else type(exc).__name__
