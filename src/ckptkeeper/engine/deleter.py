"""Removing checkpoints and cleaning up, deleting only what ckptkeeper can prove it wrote.

The rules, each one a promise the README makes:

- a checkpoint is removed only when it has a commit record (or, on object stores, upload intents)
  that says which files are ckptkeeper's, and then only those files are deleted;
- local removal first renames ``step{N}`` to ``.trash-step{N}-{id}`` (atomic: the checkpoint is
  gone from every listing at once, and a kill leaves only trash), then deletes in the background;
- a ``step{N}`` that is a symlink is removed by unlinking the link; its target is never touched;
- scratch folders are matched exactly (``.tmp-step{N}-{8 hex}``), never by prefix;
- object-store leftovers of interrupted saves and removals (a step prefix without a commit record)
  are deleted only through their intent objects, which list exactly what was going to be uploaded;
- spool folders are named after their process and removed once that process is gone;
- a broken checkpoint a run starts fresh over is moved aside (``unloadable-step{N}-{hex}``), never
  deleted: no listing, retention rule or clean-up matches that name.

:class:`Deleter` owns the background thread that deletes files of removed checkpoints, so that
training (and the save thread) never waits on a slow ``rmtree`` or a bucket's delete calls.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..errors import CheckpointNotFoundError, ConfigurationError, CorruptCheckpointError, StorageError
from ..storage import Storage, storage_for
from ..storage.layout import (
    COMMIT_RECORD,
    INTENT_DIR,
    check_relpath,
    is_scratch_name,
    parse_step,
    scratch_name,
)
from ..storage.local import fsync_dir, open_regular
from .metrics import emit
from .record import MAX_RECORD_BYTES, CommitRecord, loads_bounded, record_is_ours

__all__ = [
    "Deleter",
    "clean_save_folder",
    "discard_replaced",
    "local_record_is_ours",
    "new_spool",
    "read_intents",
    "read_local_record",
    "record_is_ours",
    "remove_checkpoint",
    "set_aside_unloadable",
    "step_path",
    "sweep_dead_spools",
    "unlisted_local_files",
    "write_intent",
]

log = logging.getLogger(__name__)

SPOOL_PREFIX = "ckptkeeper-spool-"
_MAX_INTENT_BYTES = 64 << 20


def step_path(path: str) -> tuple[Storage, str, str, int]:
    """(storage, canonical path, parent, step) of a checkpoint folder; ConfigurationError otherwise.

    The path is normalised before it is judged (``//step5``, ``/./step5`` and ``file:///step5`` are
    all ``/step5``), and a checkpoint directly in the filesystem root is refused.
    """
    storage = storage_for(path)
    raw_local = storage.local_path(path)
    if raw_local is not None and ".." in raw_local.split(os.sep):
        # Lexical normalisation of "link/.." would judge a different folder than the OS reaches.
        raise ConfigurationError(f"refusing to remove {path!r}: write the path without '..' parts")
    canon = storage.normalise(path)
    if storage.local_path(canon) is not None:
        parent, name = os.path.split(canon)
        at_root = os.path.dirname(parent) == parent  # the parent is "/" (or a drive root)
    else:
        scheme, rest = canon.split("://", 1)
        bucket_and_key = rest.split("/")
        name = bucket_and_key[-1]
        parent = f"{scheme}://{'/'.join(bucket_and_key[:-1])}"
        at_root = len(bucket_and_key) < 2  # the bucket itself
    step = parse_step(name)
    if step is None or at_root:
        # (Said of any folder, the root's reason read oddly for an ordinary one: found by a newcomer.)
        why = (
            "a checkpoint directly in a filesystem or bucket root is never removed"
            if at_root
            else (f"{name!r} is not a step{{N}} folder")
        )
        raise ConfigurationError(
            f"refusing to remove {path!r}: only step{{N}} folders inside a save folder are removed, and {why}"
        )
    return storage, canon, parent, step


def write_intent(storage: Storage, final: str, rank: int, names: list[str], token: str) -> None:
    """Announce, before uploading, exactly which files rank ``rank`` uploads under ``final``."""
    doc = {"format": "ckptkeeper-intent", "rank": rank, "token": token, "files": sorted(names)}
    storage.write_bytes(storage.join(final, INTENT_DIR, f"intent-rank{rank}.json"), json.dumps(doc).encode())


def read_intents(storage: Storage, final: str) -> tuple[set[str], list[str]]:
    """(files announced by intents, the intent objects) under an object-store step folder.

    Intents that do not parse, or announce names that are not plain relative paths, announce
    nothing: a file is deleted only on a clear statement that ckptkeeper uploaded it.
    """
    announced: set[str] = set()
    objects: list[str] = []
    for name in storage.list_dir(storage.join(final, INTENT_DIR)):
        if not (name.startswith("intent-rank") and name.endswith(".json")):
            continue
        full = storage.join(final, INTENT_DIR, name)
        try:
            doc = loads_bounded(storage.read_bytes(full), full, max_bytes=_MAX_INTENT_BYTES, max_depth=4)
        except (CorruptCheckpointError, FileNotFoundError):
            continue
        if not isinstance(doc, dict) or doc.get("format") != "ckptkeeper-intent":
            continue
        files = doc.get("files")
        if isinstance(files, list) and all(check_relpath(f) is None for f in files):
            announced.update(files)
            objects.append(full)
    return announced, objects


def read_local_record(folder: str) -> bytes | None:
    """The commit record of a local step folder (never through a link; at most one byte over the
    limit), or None when it has none or it cannot be read."""
    try:
        with os.fdopen(open_regular(os.path.join(folder, COMMIT_RECORD)), "rb") as f:
            return f.read(MAX_RECORD_BYTES + 1)
    except OSError:
        return None


def local_record_is_ours(folder: str) -> bool:
    """:func:`record_is_ours` for the record of a local step folder (False when it has none)."""
    data = read_local_record(folder)
    return data is not None and record_is_ours(data)


def _ours_on_object_store(storage: Storage, final: str) -> list[str] | None:
    """Every object under ``final`` ckptkeeper can prove it wrote, or None when it can prove nothing."""
    record_path = storage.join(final, COMMIT_RECORD)
    listed: set[str] = set()
    has_record = False
    try:
        data = storage.read_bytes(record_path)
    except FileNotFoundError:
        data = None
    if data is not None and not record_is_ours(data):
        return None  # somebody else's record (OLMo-core's marker, a user's file): nothing here is ours
    if data is not None:
        has_record = True
        with contextlib.suppress(CorruptCheckpointError):  # damaged: the intents still say what is ours
            listed.update(CommitRecord.from_json(data, record_path).files)
    announced, intents = read_intents(storage, final)
    listed |= announced
    if not has_record and not intents:
        return None
    present = {f.relpath for f in storage.walk(final)}
    doomed = [storage.join(final, rel) for rel in sorted(listed & present)]
    return doomed + intents


def remove_checkpoint(path: str, run_in_background: Callable[[Callable[[], Any]], Any] | None = None) -> bool:
    """Remove one checkpoint: invisible at once, files deleted after (in the background if given).

    Returns False when there was nothing to remove. ConfigurationError when ``path`` is not a
    step folder, or is one that ckptkeeper cannot prove it wrote (it is left as it is).
    """
    storage, canon, parent, step = step_path(path)
    local = storage.local_path(canon)
    if local is not None:
        if os.path.islink(local):
            # Someone's link to a checkpoint: the link goes, the folder it points to stays.
            os.unlink(local)
            fsync_dir(parent)
            log.info("removed the link %s (its target was left alone)", local)
            return True
        if not os.path.isdir(local):
            return False
        if not local_record_is_ours(local):
            raise ConfigurationError(
                f"refusing to remove {local}: it has no ckptkeeper commit record, so ckptkeeper cannot tell it "
                "wrote it (an OLMo-core checkpoint, or somebody else's folder); delete it yourself if it is not needed"
            )
        foreign = unlisted_local_files(local)
        if foreign is None:
            return False  # the record went since it was checked: another remover is at work on it
        if foreign:
            # Somebody put files of their own in the checkpoint (eval outputs, notes): the record
            # goes first (invisible at once), then exactly the listed files; theirs stay in step{N}.
            return _remove_listed_only(local, step, foreign, run_in_background)
        try:
            _trash_local(local, local, parent, step, run_in_background)
        except FileNotFoundError:
            return False  # removed meanwhile by another process sharing this disk
        return True
    doomed = _ours_on_object_store(storage, canon)
    if doomed is None:
        if not storage.list_dir(canon):
            return False
        raise ConfigurationError(
            f"refusing to remove {canon}: it has no ckptkeeper commit record or upload intent, so ckptkeeper "
            "cannot tell it wrote it; delete it yourself if it is not needed"
        )
    # The commit record goes first: from then on the checkpoint is invalid for every reader.
    storage.remove_file(storage.join(canon, COMMIT_RECORD))

    def delete_remote() -> None:
        t0 = time.perf_counter()
        before = getattr(storage, "retries", 0)
        # The upload intents go last: a removal cut short (a crash, a kill) leaves objects that
        # the intents still announce, so the next run's clean-up can prove them ours and finish.
        marker = f"/{INTENT_DIR}/"
        try:
            n = storage.remove_files([p for p in doomed if marker not in p])
            n += storage.remove_files([p for p in doomed if marker in p])
        except (OSError, StorageError) as exc:
            raise StorageError(
                f"could not delete the objects of removed checkpoint {canon}: {exc}; the checkpoint is already "
                "invisible, and its upload intents still name what is left, so a run that next opens the save "
                "folder deletes it"
            ) from exc
        emit("remove", path=canon, step=step, files=n, bytes=None, seconds=time.perf_counter() - t0,
             retries=getattr(storage, "retries", 0) - before)  # fmt: skip

    (run_in_background or _now)(delete_remote)
    return True


def _trash_local(
    folder: str, shown: str, parent: str, step: int, run_in_background: Callable[[Callable[[], Any]], Any] | None
) -> None:
    """Rename a local checkpoint ``folder`` (in ``parent``) to trash in one atomic step, unlink its
    record, then delete it (in the background if given). ``shown``: the path errors and the
    ``remove`` event name. FileNotFoundError when ``folder`` is gone already."""
    trash = os.path.join(parent, scratch_name("trash", step, uuid.uuid4().hex[:8]))
    os.rename(folder, trash)  # one atomic step: from here no reader sees it
    fsync_dir(parent)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(trash, COMMIT_RECORD))

    def delete_local() -> None:
        t0 = time.perf_counter()
        files, size = _count(trash)
        failed = _rmtree_collecting(trash)
        if failed:
            raise StorageError(
                f"could not delete {len(failed)} file(s) of removed checkpoint {shown} (now {trash}), e.g. "
                f"{failed[0]}; the checkpoint is already invisible, and the trash folder is deleted again "
                "when a run next opens the save folder"
            )
        emit("remove", path=shown, step=step, files=files, bytes=size, seconds=time.perf_counter() - t0, retries=0)

    (run_in_background or _now)(delete_local)


def discard_replaced(hidden: str, final: str) -> None:
    """Delete the checkpoint of step ``final`` that a new checkpoint of that step replaced by
    swapping folders with it (:class:`~ckptkeeper.engine.commit.RenameCommit`): it lies under the
    new one's hidden work-folder name ``hidden`` now. Deleted as :func:`remove_checkpoint` deletes
    one (trash first, a ``remove`` event naming ``final``); StorageError says what was left."""
    _, canon, parent, step = step_path(final)
    _trash_local(hidden, canon, parent, step, None)


class Deleter:
    """Removes checkpoints: invisible in the caller's thread, files deleted on a thread of its own.

    The part a reader can observe (the rename to trash, or the commit record deleted) happens
    before :meth:`remove` returns; the deletion of the files is queued on one background thread,
    started on first use. A deletion that fails leaves only what no listing shows (trash folders,
    or objects announced by upload intents), which :func:`clean_save_folder` finishes later; its
    error is logged and returned by :meth:`wait`, never raised into training.

    Args:
        soft_timeout_s: log a warning when one deletion takes longer than this (object stores
            can be slow to delete thousands of objects); ``None`` never warns.
    """

    def __init__(self, *, soft_timeout_s: float | None = None) -> None:
        self.soft_timeout_s = soft_timeout_s
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._pending: list[Future[None]] = []
        self._failures: list[tuple[str, Exception]] = []

    def remove(self, path: str, *, background: bool = True) -> bool:
        """Remove the checkpoint at ``path`` (see :func:`remove_checkpoint`); False if there was none.

        With ``background=False`` the files are deleted before this returns.
        """
        if not background:
            return remove_checkpoint(path)
        return remove_checkpoint(path, self.in_background(path))

    def in_background(self, path: str) -> Callable[[Callable[[], Any]], None]:
        """A ``run_in_background`` for :meth:`Checkpointer.remove` that queues on this deleter's thread
        (for callers that must go through ``remove(path, run_in_background)``, e.g. a subclass's)."""
        return lambda fn: self._submit(path, fn)

    def now(self, path: str, fn: Callable[[], Any]) -> None:
        """Run a deletion ``fn`` of ``path`` in this thread; a failure is logged and kept for
        :meth:`wait`, as a background deletion's is (never raised: what is left is invisible)."""
        try:
            fn()
        except Exception as exc:
            self._failed(path, exc)

    def _failed(self, path: str, exc: Exception) -> None:
        # The error says what was left and what cleans it up (the checkpoint is invisible already).
        log.error("deleting the files of removed checkpoint %s failed: %s", path, exc)
        with self._lock:
            self._failures.append((path, exc))

    def _submit(self, path: str, fn: Callable[[], Any]) -> None:
        def run() -> None:
            t0 = time.perf_counter()
            try:
                fn()
            except Exception as exc:
                self._failed(path, exc)
            took = time.perf_counter() - t0
            if self.soft_timeout_s is not None and took > self.soft_timeout_s:
                log.warning("deleting %s took %.0fs (soft timeout %.0fs)", path, took, self.soft_timeout_s)

        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptkeeper-delete")
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(self._executor.submit(run))

    @property
    def pending(self) -> int:
        """How many queued deletions have not finished yet."""
        with self._lock:
            return sum(not f.done() for f in self._pending)

    def wait(self) -> list[tuple[str, Exception]]:
        """Block until every queued deletion is done; returns (and forgets) the ones that failed."""
        while True:
            with self._lock:
                if not self._pending:
                    failures, self._failures = self._failures, []
                    return failures
                fut = self._pending.pop(0)
            fut.result()

    def close(self) -> list[tuple[str, Exception]]:
        """Finish the queued deletions and stop the thread; returns the ones that failed."""
        failures = self.wait()
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        return failures


def unlisted_local_files(folder: str) -> list[str] | None:
    """Files and links in a local checkpoint that its record does not name (nor its intents).

    None when the record is gone (it was there a moment ago: another remover deleted it first).
    """
    try:
        with os.fdopen(open_regular(os.path.join(folder, COMMIT_RECORD)), "rb") as f:
            listed = set(CommitRecord.from_json(f.read(MAX_RECORD_BYTES + 1), folder).files)
    except FileNotFoundError:
        return None
    except (OSError, CorruptCheckpointError):
        return []  # our record, unreadable: the folder is ours as a whole
    out = []
    for dirpath, dirnames, names in os.walk(folder):
        for name in names + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            rel = os.path.relpath(os.path.join(dirpath, name), folder).replace(os.sep, "/")
            if rel != COMMIT_RECORD and rel not in listed and not rel.startswith(INTENT_DIR + "/"):
                out.append(rel)
    return out


def _remove_listed_only(
    folder: str, step: int, foreign: list[str], run_in_background: Callable[[Callable[[], Any]], Any] | None
) -> bool:
    with os.fdopen(open_regular(os.path.join(folder, COMMIT_RECORD)), "rb") as f:
        listed = sorted(CommitRecord.from_json(f.read(MAX_RECORD_BYTES + 1), folder).files)
    os.unlink(os.path.join(folder, COMMIT_RECORD))
    fsync_dir(folder)

    def delete_listed() -> None:
        t0 = time.perf_counter()
        size = 0
        failed: list[str] = []
        for rel in listed:
            try:
                size += _unlink_inside(folder, rel)
            except FileNotFoundError:
                pass
            except OSError as exc:
                failed.append(f"{rel} ({exc.strerror or exc})")
        for dirpath, _, _ in sorted(os.walk(folder, topdown=False), key=lambda w: -len(w[0])):
            with contextlib.suppress(OSError):
                os.rmdir(dirpath)  # only empty ones go
        log.warning("removed checkpoint %s but kept files ckptkeeper did not write: %s", folder, ", ".join(foreign[:5]))
        if failed:
            raise StorageError(
                f"could not delete {len(failed)} file(s) ckptkeeper wrote in removed checkpoint {folder}, e.g. "
                f"{failed[0]}; the folder is no longer a checkpoint (its record is gone, and it holds files of "
                "somebody else's, so it is not deleted whole): delete those files by hand"
            )
        emit("remove", path=folder, step=step, files=len(listed), bytes=size, seconds=time.perf_counter() - t0,
             retries=0)  # fmt: skip

    (run_in_background or _now)(delete_listed)
    return True


def _unlink_inside(folder: str, rel: str) -> int:
    """Unlink ``folder/rel`` without following a link on the way there; returns its size.

    Every folder on the way is opened with O_NOFOLLOW relative to the one before, so a name
    listed as ``x/file`` where ``x`` is somebody's link to elsewhere is never reached (an OSError:
    too many levels of links, or not a folder). The file itself, if a link, is unlinked.
    """
    parts = rel.split("/")
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for name in parts[:-1]:
            inner = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = inner
        size = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False).st_size
        os.unlink(parts[-1], dir_fd=fd)
        return size
    finally:
        os.close(fd)


def _rmtree_collecting(folder: str) -> list[str]:
    """Delete ``folder`` as far as possible; returns what could not be deleted, with why."""
    failed: list[str] = []
    if sys.version_info >= (3, 12):
        shutil.rmtree(folder, onexc=lambda _fn, path, exc: failed.append(f"{path} ({exc})"))
    else:
        shutil.rmtree(folder, onerror=lambda _fn, path, info: failed.append(f"{path} ({info[1]})"))
    return failed


def _count(folder: str) -> tuple[int, int]:
    files = size = 0
    for dirpath, _, names in os.walk(folder):
        for name in names:
            with contextlib.suppress(OSError):
                size += os.lstat(os.path.join(dirpath, name)).st_size
                files += 1
    return files, size


def _now(fn: Callable[[], Any]) -> Any:
    return fn()


def clean_leftover(storage: Storage, final: str) -> int:
    """Delete an object-store step folder's announced objects when it has no commit record."""
    if storage.exists(storage.join(final, COMMIT_RECORD)):
        return 0
    announced, intents = read_intents(storage, final)
    if not intents:
        return 0
    targets = {storage.join(final, rel) for rel in announced}
    aborted = storage.abort_uploads(final, targets)
    if aborted:
        log.info("aborted %d unfinished uploads under %s", aborted, final)
    present = {f.relpath for f in storage.walk(final)}
    doomed = [storage.join(final, rel) for rel in sorted(announced & present)]
    storage.remove_files(doomed)
    storage.remove_files(intents)  # last: a clean-up cut short can be finished by the next one
    return len(doomed) + len(intents)


# Work folders of saves running in this process (real paths, with how many saves use each): not
# leftovers, whoever asks for a clean-up (another thread, another checkpointer, a signal handler).
# A clean-up deleted a running save's work folder, which then committed without its tensors or
# failed (found by an outside attack).
_IN_PROGRESS: dict[str, int] = {}
_IN_PROGRESS_LOCK = threading.Lock()


def _in_progress_key(path: str) -> str:
    # Local paths by their real path (a save made through a symlink is the same save); store
    # URLs without empty parts, as the stores read them (memory:///b/run and s3://b//run name
    # the objects memory://b/run and s3://b/run do: found by an outside attack).
    if "://" not in path:
        return os.path.realpath(path)
    scheme, rest = path.split("://", 1)
    if scheme == "file":
        return os.path.realpath(rest)
    return f"{scheme}://" + "/".join(part for part in rest.split("/") if part)


def mark_in_progress(*paths: str) -> Callable[[], None]:
    """Note ``paths`` (a save's local work folder, and on an object store its step folder there,
    which holds its uploads before the commit record) as in use until the returned function is called."""
    keys = [_in_progress_key(p) for p in paths]
    with _IN_PROGRESS_LOCK:
        for key in keys:
            _IN_PROGRESS[key] = _IN_PROGRESS.get(key, 0) + 1

    def unmark() -> None:
        with _IN_PROGRESS_LOCK:
            for key in keys:
                left = _IN_PROGRESS.get(key, 0) - 1
                if left > 0:
                    _IN_PROGRESS[key] = left
                else:
                    _IN_PROGRESS.pop(key, None)

    return unmark


def _running(path: str) -> bool:
    with _IN_PROGRESS_LOCK:
        return _in_progress_key(path) in _IN_PROGRESS


def clean_save_folder(save_folder: str) -> list[str]:
    """Delete leftovers of interrupted saves and removals that are provably ckptkeeper's; returns them.

    Work folders of saves running in this process are not leftovers and are left alone; those of
    other processes are kept out by the save folder's lease (:class:`~ckptkeeper.CheckpointManager`).
    """
    storage = storage_for(save_folder)
    gone: list[str] = []
    local = storage.local_path(save_folder)
    names = storage.list_dir(save_folder)
    if local is not None:
        for name in names:
            full = os.path.join(local, name)
            # Read after the listing: a save that made its folder before it is marked by now.
            if _running(full):
                continue
            if is_scratch_name(name) and os.path.isdir(full) and not os.path.islink(full):
                shutil.rmtree(full, ignore_errors=True)
                gone.append(full)
        return gone
    for name in names:
        if parse_step(name) is None:
            continue
        full = storage.join(save_folder, name)
        if _running(full):
            continue  # a save of this process is uploading there: its intents are not a crash's
        try:
            if clean_leftover(storage, full):
                gone.append(full)
        except (StorageError, CheckpointNotFoundError) as exc:
            log.warning("could not clean up %s: %s", full, exc)
    return gone


# ---------------------------------------------------------------------- spools


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def _alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # The pid exists; where /proc tells start times, a different one means the pid was reused.
    now = _start_time(pid)
    return started is None or now is None or now == started


def new_spool(spool_dir: str | None, kind: str) -> str:
    """A fresh local spool folder, named and marked so a later process can tell when it is orphaned."""
    base = spool_dir or tempfile.gettempdir()
    sweep_dead_spools(base)
    path = tempfile.mkdtemp(prefix=f"{SPOOL_PREFIX}{os.getpid()}-{kind}-", dir=base)
    with open(os.path.join(path, ".owner.json"), "w") as f:
        json.dump({"pid": os.getpid(), "started": _start_time(os.getpid())}, f)
    return path


def sweep_dead_spools(base: str) -> list[str]:
    """Remove spool folders in ``base`` whose process is gone; returns them."""
    gone: list[str] = []
    try:
        names = os.listdir(base)
    except OSError:
        return gone
    for name in names:
        if not name.startswith(SPOOL_PREFIX):
            continue
        full = os.path.join(base, name)
        try:
            pid = int(name[len(SPOOL_PREFIX) :].split("-", 1)[0])
            with open(os.path.join(full, ".owner.json"), "rb") as f:
                owner = json.loads(f.read(4096))
            started = owner.get("started") if owner.get("pid") == pid else None
        except (ValueError, OSError, AttributeError):
            continue  # not marked as ours: leave it
        if pid != os.getpid() and not os.path.islink(full) and not _alive(pid, started):
            shutil.rmtree(full, ignore_errors=True)
            gone.append(full)
    if gone:
        log.info("removed %d spool folders of processes that are gone", len(gone))
    return gone


UNLOADABLE_PREFIX = "unloadable-"


def set_aside_unloadable(path: str) -> str | None:
    """Move the step folder ``path`` to ``unloadable-step{N}-{8 hex}`` beside it; where it is now
    (None where it stays: on an object store, or where the rename is refused, which is logged).

    For a run that starts fresh over the checkpoints the user was told none of which loads: its
    own checkpoint of the same step would otherwise replace each one (or, for one that is not
    provably ckptkeeper's, stop the run when it comes to that step). A rename loses nothing: what
    a post-mortem needs stays, and one that was intact after all (refused by another trainer,
    written by a newer ckptkeeper, unreadable for a while) is used again by renaming it back.
    Deciding here which of them deserve it went wrong every way (found by outside attacks):
    those left in place were saved over. A symlinked step folder moves as a link; its target is
    never touched. Object stores keep them in place: a folder there cannot be renamed, only
    copied object by object.
    """
    storage = storage_for(path)
    local = storage.local_path(path) if storage.supports_rename else None
    if local is None:
        return None
    # Beside it as the kernel resolves the path: normpath would drop "link/.." as text and put it
    # elsewhere (found by an outside attack).
    here = local.rstrip(os.sep) or local
    parent, name = os.path.split(here)
    aside = os.path.join(parent, f"{UNLOADABLE_PREFIX}{name}-{secrets.token_hex(4)}")
    try:
        os.rename(here, aside)
    except OSError as exc:
        log.warning("could not move %s aside (%s); it stays where it is", path, exc)
        return None
    try:
        fsync_dir(parent or ".")
    except OSError as exc:  # moved all the same: say where (found by an outside attack)
        log.warning("moved %s to %s, but could not make the rename durable (%s)", path, aside, exc)
    return aside
