"""The save pipeline: the steps of writing one checkpoint, on every rank, in agreement.

``preparing`` (rank 0 checks the target; the ranks agree on the writer), ``writing tensors``
(the fast writer: one file per rank, see :mod:`~ckptkeeper.engine.sharded`; or DCP's where it
cannot take the state), ``writing trainer state`` (each rank's JSON, then each rank hashes its own files),
``uploading`` (object stores) and ``publishing`` (rank 0 commits). Each step is agreed on by all
ranks (:mod:`~ckptkeeper.engine.agreement`), so a failure anywhere fails the save everywhere,
and how the checkpoint becomes visible is the storage's :mod:`~ckptkeeper.engine.commit` method.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor

from .. import distributed as D
from ..errors import CheckpointSaveError, ConfigurationError, DiskFullError
from ..storage import storage_for
from ..storage.base import Upload
from ..storage.layout import COMMIT_RECORD, MAX_STEP, MODEL_DIR, step_dir_name, train_state_name
from ..storage.local import translate_os_error
from .agreement import agree, unwrap
from .commit import CommitMethod
from .deleter import mark_in_progress
from .discovery import LAYOUT_FILE
from .fastio import (
    DATA_FILE,
    TENSORS_KEY,
    Leaves,
    Segment,
    can_use_fast_path,
    check_plain,
    refuse_unsaveable,
    tensor_table,
    walk,
    write_fast,
    write_synced,
)
from .gcpause import paused_gc
from .metrics import emit
from .record import CommitRecord, FileEntry, check_metrics, hash_file
from .save_memo import KeptPlan, SaveMemo
from .sharded import (
    INDEX_FILE,
    ShardLayout,
    ShardPlan,
    index_bytes,
    metadata_bytes,
    plan_shard,
    recheck_shard,
    shard_name,
    whole_at_one_rank,
    write_shard,
)
from .staging import local_shard
from .state import detached_tree, flatten_tensors, memory_shortfall, short_memory_error

__all__ = ["SaveResult", "SaveSettings", "SaveStage", "final_path", "quiet_dcp", "tensor_bytes", "write_checkpoint"]

log = logging.getLogger("ckptkeeper.engine.checkpointer")


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
    it may also block or sleep to hold a save in flight, but not wait for the save it runs in nor
    change the state it saves (the checkpoint would mix both): the checkpointer's (and its
    manager's) calls that would wait, or load, raise :class:`~ckptkeeper.errors.ConfigurationError`
    there before changing anything (the save then fails with it, on every rank) instead of
    waiting for ever. Stages, in order: ``"preparing"``,
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


@dataclass(frozen=True)
class SaveSettings:
    """What a save takes from its :class:`~ckptkeeper.Checkpointer`, read at the time of the save."""

    process_group: Any
    writer: str
    io_threads: int
    on_stage: Callable[[SaveStage], None] | None
    memo: SaveMemo | None = None
    """The checkpointer's kept save plans (see :mod:`~ckptkeeper.engine.save_memo`)."""


@contextlib.contextmanager
def quiet_dcp() -> Iterator[None]:
    """DCP warns on every single-process call; the warning is about its own defaults, not ours."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=r"torch\.distributed\.checkpoint.*")
        warnings.filterwarnings("ignore", message=".*process group.*")
        yield


def final_path(save_folder: str, step: int) -> str:
    """Where the checkpoint of ``step`` lives once committed."""
    return storage_for(save_folder).join(save_folder, step_dir_name(step))


def train_payload(step: int, train_state: Mapping[str, Any] | None, meta: Mapping[str, Any]) -> bytes:
    """The trainer-state file's content, serialised now so later changes to the caller's objects cannot leak in."""
    # (Not "train_state or {}": a mapping's truth is its len(), which an odd one may get wrong.)
    doc = {"step": step, "train_state": dict(train_state) if train_state is not None else {}, "state_meta": meta}
    clash = _clashing_key(doc["train_state"])
    if clash is not None:
        raise CheckpointSaveError(
            f"step {step}: the train_state holds keys {clash} in one dict, which JSON stores as one key (keys are "
            "stored as strings): one value would be lost; give them different names"
        )
    try:
        return json.dumps(doc).encode()
    except (TypeError, ValueError) as exc:
        # Which of the two it is, asked only now: the advice differs (a train_state holds no tensors).
        try:
            json.dumps(doc["train_state"])
        except (TypeError, ValueError):
            raise CheckpointSaveError(
                f"step {step}: the train_state cannot be stored as JSON ({exc}); keep its values to numbers, "
                "strings, booleans, None, lists and dicts (tensors belong in the model, optimizer or extras)"
            ) from exc
        raise CheckpointSaveError(
            f"step {step}: the state's non-tensor values cannot be stored as JSON ({exc}); keep state_dict() "
            "values to tensors, numbers, strings, lists and dicts"
        ) from exc


_SCALAR_KEYS = {True: "true", False: "false", None: "null"}
_INFINITE_KEYS = {math.inf: "Infinity", -math.inf: "-Infinity"}


def _json_key(key: Any) -> str | None:
    """How ``json.dumps`` writes a dict key, or None for one it refuses (it then names it)."""
    if isinstance(key, str):
        return key
    if key is None or isinstance(key, bool):
        return _SCALAR_KEYS[key]
    try:
        if isinstance(key, int):
            return int.__repr__(key)  # as json writes it
        if isinstance(key, float):
            if key != key:
                return "NaN"
            return _INFINITE_KEYS.get(key) or float.__repr__(key)
    except ValueError:
        return None  # an int too long to write: json.dumps fails on it below
    return None


def _clashing_key(value: Any) -> str | None:
    """Two keys of one dict in ``value`` that JSON writes alike (``1`` and ``"1"``, ``None`` and
    ``"null"``), as words; None when there are none. JSON would keep the second silently (found by
    an outside attack). Dicts whose keys are all strings cost one pass over their keys; lists are
    only searched for the dicts and lists in them."""
    stack, seen = [value], set()
    containers = (dict, list, tuple)
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue  # (a cycle: json.dumps reports it)
        seen.add(id(node))
        if isinstance(node, dict):
            if not all(type(k) is str for k in node):
                written: dict[str, Any] = {}
                for k in node:
                    as_json = _json_key(k)
                    if as_json is None:
                        continue
                    if as_json in written:
                        return f"{written[as_json]!r} and {k!r}"
                    written[as_json] = k
            stack.extend([v for v in node.values() if isinstance(v, containers)])
        else:
            stack.extend([v for v in node if isinstance(v, containers)])
    return None


def checked_metrics(step: int, metrics: Mapping[str, float] | None) -> dict[str, float] | None:
    """``step`` checked and ``metrics`` validated for the commit record; ConfigurationError names what is wrong."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise ConfigurationError(f"step must be a whole number from 0 to 2**62, got {step!r}")
    if metrics is None:
        return None
    try:
        return check_metrics(dict(metrics))
    except ValueError as exc:
        raise ConfigurationError(
            f"step {step}: metrics must map names to finite numbers ({exc}); pass e.g. metrics={{'val_loss': 0.31}}"
        ) from None


def emit_save(r: SaveResult, is_async: bool) -> None:
    """The metrics event of one save."""
    emit("save", path=r.path, step=r.step, ephemeral=r.ephemeral, bytes=r.bytes, files=r.files,
         blocked_s=r.blocked_s, durable_s=r.durable_s, retries=r.retries, **{"async": is_async})  # fmt: skip


_E = TypeVar("_E", bound=BaseException)
_UNTOUCHED = "_ckptkeeper_nothing_touched"


def mark_untouched(exc: _E) -> _E:
    """``exc``, marked as a save's failure that every rank raised before anything was written or
    removed (:func:`untouched`). The rank that failed raises its own exception, of any type: the
    mark, not the type, tells a caller (the manager) that the ranks failed together and that no
    checkpoint can have gone."""
    with contextlib.suppress(AttributeError, TypeError):  # an exception that takes no attributes: unmarked
        setattr(exc, _UNTOUCHED, True)
    return exc


def untouched(exc: BaseException) -> bool:
    """Whether ``exc`` was marked by :func:`mark_untouched`."""
    return bool(getattr(exc, _UNTOUCHED, False))


def write_checkpoint(
    settings: SaveSettings,
    commit: CommitMethod,
    save_folder: str,
    step: int,
    tensors: Mapping[str, Any],
    payload: bytes,
    ephemeral: bool,
    t0: float,
    metrics: Mapping[str, float] | None = None,
    failed: BaseException | None = None,
) -> SaveResult:
    """Write and commit the checkpoint of ``step`` (every rank calls this together).

    ``failed``: this rank's failure before it got here (its state's ``state_dict()`` raised, its
    ``train_state`` cannot be stored, an async save's staging copy ran out of memory). With
    several ranks they agree on it first, before anything is touched (rank 0 clears an object
    store's old keys of this step as it prepares), so that every rank fails the save together
    instead of the others saving without this rank (and pairing their exchanges with its next
    save); this rank raises it as it is, the others a :class:`CheckpointSaveError`.
    """
    storage = commit.storage
    retries_before = getattr(storage, "retries", 0)
    final = storage.join(save_folder, step_dir_name(step))
    pg = settings.process_group
    rank, world = D.get_rank(pg), D.get_world_size(pg)
    if world > 1 and not D.all_agree(failed is None, group=pg):
        if failed is not None:
            raise mark_untouched(failed)
        raise mark_untouched(
            CheckpointSaveError(
                f"step {step}: another rank could not take its state for the save (that rank's error says why); "
                "nothing was saved or removed"
            )
        )
    if failed is not None:
        raise failed  # one process: nothing else waits for it
    token = D.broadcast_object(uuid.uuid4().hex[:8], group=pg)
    work = commit.work_folder(save_folder, step, token)
    files: dict[str, FileEntry] = {}
    written: dict[str, FileEntry] = {}
    # Files this rank wrote that were hashed from the folder rather than as written: each must be
    # found by that walk (a file deleted under the save was otherwise simply left out of the
    # record, and the save committed without it; found by an outside attack).
    expected: set[str] = set()
    extra: dict[str, Any] = {"metrics": dict(metrics)} if metrics else {}
    stage = "preparing"

    def enter(name: str) -> None:
        if settings.on_stage is not None:
            settings.on_stage(SaveStage(name, step, rank, work, final))

    def prepare() -> str | None:
        enter("preparing")
        with translate_os_error(work):
            os.makedirs(os.path.join(work, MODEL_DIR), exist_ok=True)
        if rank == 0:
            commit.prepare(final)
        if world == 1 or settings.writer != "auto":
            return None
        found = plan_shard(tensors, rank, world, settings.memo, eager=settings.on_stage is not None)
        if found is None:
            return None
        shard.append(found)
        return found.signature

    def sink(rel: str) -> Upload | None:
        # Object stores: the data file goes straight up from memory in parts (no local copy of
        # it in the spool); local disks write it into the work folder.
        upload = commit.stream(final, rank, rel, token)
        if upload is not None:
            streamed.append(rel)
        return upload

    def check_for_dcp() -> None:
        # DCP's writer copies each tensor's memory without asking how long it is, and fails on
        # what it cannot store with words that name no tensor. It runs collectives of its own:
        # with several ranks this check is a round of its own before it, or a rank refusing
        # here left the others waiting inside DCP's (found by an outside attack). The tree it
        # checks is the one DCP's writer is given (made once, kept in dcp_tree).
        # As capture() gives them: a save's capture leaves parameters as the model holds them
        # (a Parameter subclass would be refused below, and DCP would record requires_grad in
        # its metadata).
        plain = detached_tree(tensors)
        check_plain(plain)
        short = staging_need(plain)[1]
        if short is not None:
            raise short
        dcp_tree.append(plain)

    def write_tensors() -> None:
        enter("writing tensors")
        if sharded:
            data_rel = f"{MODEL_DIR}/{shard_name(rank)}"
            # The hook above is user code that may have moved tensors since they were planned
            # (what the layout exchange below sends depends on the plan taken here too).
            if settings.on_stage is not None:
                shard[0] = recheck_shard(shard[0], rank, world)
            plan = shard[0]
            with translate_os_error(work):
                shard_files, layout, whole_sums = write_shard(
                    os.path.join(work, MODEL_DIR), plan.pieces, rank, settings.io_threads, sink(data_rel), plan.kept
                )
            if settings.memo is not None and plan.kept is not None:
                settings.memo.keep(plan.kept)
            written.update(shard_files)
            my_layout.append((layout, whole_sums))
            return
        with translate_os_error(work):
            leaves = walk(tensors) if world == 1 and settings.writer == "auto" else None
            if leaves is not None:
                leaves = _one_rank_locals(leaves)
            model_dir = os.path.join(work, MODEL_DIR)
            out: tuple[dict[str, FileEntry], list[Segment]] | None = None
            if leaves is not None and can_use_fast_path(leaves):
                upload = sink(f"{MODEL_DIR}/{DATA_FILE}")
                out = write_fast(model_dir, leaves, threads=settings.io_threads, sink=upload)
            else:
                if not dcp_tree:
                    check_for_dcp()  # one process (several ranks ran it in a round of its own)
                saved = _write_with_dcp(settings, model_dir, dcp_tree[0], world)
                expected.update(
                    f"{MODEL_DIR}/{rel}" for rel in saved if world == 1 or _written_by(f"{MODEL_DIR}/{rel}", rank)
                )
        if out is not None:
            fast_files, segments = out
            written.update({f"{MODEL_DIR}/{k}": v for k, v in fast_files.items()})
            # The segment table goes in a file of its own (hashed with this rank's files): in the
            # record it would grow with the number of tensors, and ls reads every record.
            # Shapes and dtypes ride along, so loads need not decode DCP's metadata (10,000
            # pickled entries cost more than reading the tensors); DCP's .metadata is for DCP.
            with paused_gc():
                table = {f"{MODEL_DIR}/{DATA_FILE}": segments, TENSORS_KEY: tensor_table(leaves or tensors)}
                encoded = json.dumps(table).encode()
            with translate_os_error(work):
                storage_for(work).write_bytes(os.path.join(work, LAYOUT_FILE), encoded)
            expected.add(LAYOUT_FILE)
        return None

    def finish_own_files() -> dict[str, FileEntry]:
        enter("writing trainer state")
        if sharded and rank == 0:
            # DCP's .metadata, from every rank's pieces: stock DCP reads the checkpoint with it.
            encoded = metadata_bytes([layout for layout, _ in all_layouts])
            with translate_os_error(work):
                written[f"{MODEL_DIR}/.metadata"] = write_synced(os.path.join(work, MODEL_DIR, ".metadata"), encoded)
                # The shared index: a rank loading at this world size reads it and its own table
                # instead of every rank's table.
                written[INDEX_FILE] = write_synced(os.path.join(work, INDEX_FILE), index_bytes(all_layouts))
        with translate_os_error(work):
            storage_for(work).write_bytes(os.path.join(work, train_state_name(rank)), payload)
        mine = _hash_own_files(work, rank, world, skip=set(written))
        for rel in sorted(expected | {train_state_name(rank)}):
            if rel not in mine:
                path = os.path.join(work, rel)
                raise FileNotFoundError(errno.ENOENT, "a file this save wrote vanished from its work folder", path)
        mine.update(written)
        if commit.uploads:
            enter("uploading")
        commit.after_files(work, final, rank, sorted(mine), token, streamed)
        return mine

    def publish() -> None:
        if rank == 0:
            enter("publishing")
            commit.publish(work, final, record)

    shard: list[ShardPlan] = []
    sharded = False
    dcp_tree: list[dict[str, Any]] = []  # what DCP's writer is given, once check_for_dcp made and checked it
    my_layout: list[tuple[ShardLayout, tuple[str, ...]]] = []
    streamed: list[str] = []
    all_layouts: list[tuple[ShardLayout, tuple[str, ...]]] = []
    unmark = mark_in_progress(work, final)
    try:
        signatures = agree(prepare, step, pg)
        # Every rank takes the same path: the per-rank fast writer only where all ranks can, and
        # with the same replicated tensors (their writers are chosen from that list).
        sharded = world > 1 and signatures[0] is not None and len(set(signatures)) == 1
        stage = "writing tensors"
        if world > 1 and not sharded:
            agree(check_for_dcp, step, pg)
        agree(write_tensors, step, pg)
        if sharded:
            # Only rank 0 writes DCP's metadata and the shared index, so only rank 0 receives
            # every rank's pieces (and the checksums of its whole ones).
            # With the collector paused (a background save too): unpickling every rank's layout
            # is thousands of objects, and a full collection set off there took rank 0 0.3 s at
            # 10,000 tensors. The ranks have just agreed, so the pause does not wait on a slow one.
            with paused_gc():
                all_layouts = _gather_layouts(my_layout[0], shard[0].kept, settings.memo, pg)
        stage = "writing trainer state and uploading" if commit.uploads else "writing trainer state"
        for part in agree(finish_own_files, step, pg):
            files.update(part)
        stage = "publishing"
        record = CommitRecord(step=step, ephemeral=ephemeral, world_size=world, files=files, extra=extra)
        agree(publish, step, pg)
    except BaseException as raw:
        exc = unwrap(raw)
        discard_final = final if rank == 0 and stage != "preparing" else None
        if not isinstance(exc, Exception):
            # Ctrl-C or SystemExit (raised here, or inside DCP's writer, which wraps it): the save
            # is dropped (its work folder was left behind; found by an outside attack) and the
            # interruption goes on as it is, not as a save error.
            commit.discard(work, discard_final)
            if exc is raw:
                raise
            raise exc from None
        if isinstance(exc, CheckpointSaveError):
            commit.discard(work, discard_final)
            # Another rank failed (its message already says where): keep the original chain.
            if exc is raw:
                raise
            raise exc from raw
        # torch.save reports a full disk as a RuntimeError about zip positions; free space tells.
        if not isinstance(exc, OSError) and _free_bytes(work) < tensor_bytes(tensors) + len(payload):
            exc = OSError(errno.ENOSPC, "No space left on device", getattr(exc, "filename", None) or work)
        commit.discard(work, discard_final)
        on_rank = f" on rank {rank}" if world > 1 else ""
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFullError(
                exc.errno,
                f"step {step}{on_rank}: the disk is full while writing {exc.filename or work}; free "
                "space or choose another save folder (checkpoints already saved were not touched)",
            ) from raw
        # Object stores: the data file went straight to the store, so the local work folder is not
        # where a storage error happened; the error's own text names the object.
        where = getattr(exc, "filename", None) or (final if commit.uploads else work)
        raise CheckpointSaveError(
            f"saving step {step} to {final} failed{on_rank} while {stage} ({where}): {exc}"
        ) from exc
    finally:
        try:
            commit.finish(work)
        finally:
            unmark()
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


def _one_rank_locals(leaves: Leaves) -> Leaves:
    """``leaves`` with each DTensor that holds its whole tensor (see
    :func:`~ckptkeeper.engine.sharded.whole_at_one_rank`) replaced by its local tensor: a DTensor
    state in one process (FSDP2 on one GPU) went to DCP's writer (and its loads to DCP's reader,
    0.65x DCP's own speed on an H200). The per-rank writer would take it too, but its format at
    one rank is one the single-process reader of earlier versions calls corrupt."""
    if not any(type(v) is DTensor for _, _, v in leaves):
        return leaves
    out: Leaves = []
    meshes: dict[int, bool] = {}
    for name, path, v in leaves:
        whole = whole_at_one_rank(v, meshes)
        out.append((name, path, v if whole is None else whole))
    return out


def _gather_layouts(
    mine: tuple[ShardLayout, tuple[str, ...]], kept: KeptPlan | None, memo: SaveMemo | None, pg: Any
) -> list[tuple[ShardLayout, tuple[str, ...]]]:
    """Every rank's layout and whole pieces' checksums, on rank 0 (an empty list on the others).

    A rank whose save reused a plan whose layout rank 0 was sent before sends the plan's token
    instead of the layout (the checksums always): rank 0 keeps the layouts it was sent, and
    unpickling every rank's layout on every save was most of what rank 0 did between the
    writes and the commit (13 ms at 2 ranks and 10,000 tensors; at 1,024 ranks, a million
    entries per save). A rank whose token rank 0 does not have (rank 0 lost it: another
    checkpointer, say) is asked for its layout in a second exchange, so the tokens are only a
    shortcut.
    """
    rank = D.get_rank(pg)
    layout, sums = mine
    token = kept.token if kept is not None and kept.plan is not None else None
    short = token is not None and kept is not None and kept.sent
    first = D.gather_object((token, None if short else layout, sums), group=pg)
    found: list[Any] = []
    missing: list[int] = []
    if rank == 0:
        assert first is not None
        for r, (tok, lay, _) in enumerate(first):
            if lay is None and (memo is None or tok is None or (lay := memo.recall(r, tok)) is None):
                missing.append(r)
            elif tok is not None and memo is not None:
                memo.remember(r, tok, lay)
            found.append(lay)
    missing = D.broadcast_object(missing, group=pg)
    if missing:
        again = D.gather_object(layout if rank in missing else None, group=pg)
        if rank == 0:
            assert first is not None and again is not None
            for r in missing:
                found[r], tok = again[r], first[r][0]
                if memo is not None and tok is not None:
                    memo.remember(r, tok, again[r])
    if kept is not None and token is not None:
        kept.sent = True
    if rank != 0:
        return []
    assert first is not None
    return [(lay, sums_) for lay, (_, _, sums_) in zip(found, first, strict=True)]


def _write_with_dcp(settings: SaveSettings, model_dir: str, tensors: Mapping[str, Any], world: int) -> set[str]:
    """Write the tensor tree with DCP's own writer (what the fast writer does not take); the files
    it wrote, every rank's (relative to ``model_dir``: its ``.metadata`` and the data files its
    metadata names)."""
    with quiet_dcp():
        metadata = dcp_save(
            dict(tensors),
            storage_writer=FileSystemWriter(model_dir, sync_files=True),
            process_group=settings.process_group,
            no_dist=world == 1,
        )
    storage_data = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    names = {info.relative_path for info in storage_data.values() if hasattr(info, "relative_path")}
    return {".metadata", *names}


def _hash_own_files(work: str, rank: int, world: int, skip: set[str] | None = None) -> dict[str, FileEntry]:
    # With several ranks each hashes the files it wrote; rank 0 also owns DCP's .metadata.
    out: dict[str, FileEntry] = {}
    for dirpath, _, names in os.walk(work):
        for name in names:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, work).replace(os.sep, "/")
            # The spool's owner marker is the spool's, not the checkpoint's.
            if rel in (COMMIT_RECORD, ".owner.json") or rel in (skip or ()):
                continue
            if world > 1 and not _written_by(rel, rank):
                continue
            size, digest = hash_file(full)
            out[rel] = FileEntry(size, digest)
    return out


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


def staging_need(tree: Mapping[str, Any]) -> tuple[int, ConfigurationError | None]:
    """:func:`tensor_bytes` of ``tree``, and the error for its first tensor that cannot be copied
    as it is (sparse, nested or meta: :func:`~ckptkeeper.engine.fastio.refuse_unsaveable`; memory
    shorter than its shape: :func:`~ckptkeeper.engine.state.memory_shortfall`), or None, in one
    pass: staging and DCP's writer copy each tensor's memory without asking how long it is. The
    error is returned, not raised: the caller raises it once every rank knows."""
    total = 0
    problem: ConfigurationError | None = None
    strided = torch.strided
    for path, t in flatten_tensors(tree):
        local = local_shard(t)
        if local.layout is not strided or local.is_meta or local.is_nested:
            total += local.numel() * local.element_size()  # (nbytes raises for a sparse one)
            if problem is None:
                try:
                    refuse_unsaveable(path, local)
                except ConfigurationError as exc:
                    problem = exc
            continue
        total += local.nbytes
        if problem is None:
            # memory_shortfall itself, not refuse_short_memory: this runs per tensor per async
            # save, and a call and a DTensor check more cost 4 ms per 10,000 tensors.
            short = memory_shortfall(local)
            if short is not None:
                problem = short_memory_error(path, *short)
    return total, problem


def tensor_bytes(tree: Mapping[str, Any]) -> int:
    """Bytes this rank holds of every tensor in a (nested) tree (a DTensor's or ShardedTensor's local shard)."""
    total = 0
    for _, t in flatten_tensors(tree):
        local = local_shard(t)
        total += local.numel() * local.element_size()
    return total
