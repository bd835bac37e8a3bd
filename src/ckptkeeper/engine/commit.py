"""How a written checkpoint becomes visible all at once: one commit method per kind of storage.

Every save writes its files into a work folder first and makes them visible in one step at the
end, so a reader sees a checkpoint complete or not at all. How depends on the storage, chosen
once per save by :func:`commit_method_for`:

* :class:`RenameCommit` (local and shared filesystems): all ranks write into one hidden
  ``.tmp-step{N}-<id>`` folder inside the save folder; rank 0 writes the commit record into it
  and renames the folder into place (where a checkpoint of the step is already, the two folders
  swap places in one step on Linux, so the step always has one).
* :class:`RecordLastCommit` (object stores, no rename): each rank writes into a local spool and
  uploads its own files after announcing them in an upload intent; rank 0 creates the commit
  record last, create-only. Data objects without a record are invisible to readers, and the
  intents let the next run clean them up.

Both refuse to replace anything ckptkeeper cannot prove it wrote (:func:`clear_target`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from ..errors import CheckpointSaveError
from ..storage import Storage
from ..storage import local as _local
from ..storage.base import Upload
from ..storage.layout import COMMIT_RECORD, scratch_name
from ..storage.local import fsync_dir, translate_os_error
from .deleter import (
    clean_leftover,
    new_spool,
    read_intents,
    read_local_record,
    unlisted_local_files,
    write_intent,
)
from .record import CommitRecord, record_owner

__all__ = ["CommitMethod", "RecordLastCommit", "RenameCommit", "clear_target", "commit_method_for"]

Remove = Callable[[str], None]
Replaced = Callable[[str, str], None]
"""Deletes the checkpoint a save replaced by a swap: (where it lies now, the step folder it was)."""


class CommitMethod(Protocol):
    """The steps of a save that depend on how the storage makes files visible."""

    storage: Storage
    uploads: bool
    """Whether :meth:`after_files` uploads this rank's files (the save's ``uploading`` stage)."""

    def work_folder(self, save_folder: str, step: int, token: str) -> str:
        """Where this rank writes the checkpoint's files before the commit (a local path)."""
        ...

    def prepare(self, final: str) -> None:
        """Rank 0, before anything is written: make sure ``final`` may be taken."""
        ...

    def stream(self, final: str, rank: int, rel: str, token: str) -> Upload | None:
        """Where rank ``rank`` may write file ``rel`` straight to the storage (announced first), or
        None when it is written into the work folder (local disks)."""
        ...

    def after_files(
        self, work: str, final: str, rank: int, names: Sequence[str], token: str, streamed: Sequence[str] = ()
    ) -> None:
        """Each rank, once its own files are written and hashed (``streamed``: those already stored)."""
        ...

    def publish(self, work: str, final: str, record: CommitRecord) -> None:
        """Rank 0, once every rank's files are in place: make the checkpoint visible."""
        ...

    def finish(self, work: str) -> None:
        """Each rank, always, after the save (succeeded or not)."""
        ...

    def discard(self, work: str, final: str | None) -> None:
        """After a failed save: remove what it wrote (``final`` given on rank 0 past preparing)."""
        ...


class RenameCommit:
    """Commit by renaming a finished hidden folder into place (local and shared filesystems)."""

    uploads = False

    def __init__(self, storage: Storage, remove: Remove, replaced: Replaced | None = None) -> None:
        self.storage = storage
        self._remove = remove
        self._replaced = replaced
        self._keep: set[str] = set()

    def work_folder(self, save_folder: str, step: int, token: str) -> str:
        path = self.storage.join(save_folder, scratch_name("tmp", step, token))
        return self.storage.local_path(path) or path

    def prepare(self, final: str) -> None:
        # The old checkpoint of this step (if any) stays until the new one is in place.
        self._check_target(final)

    def _check_target(self, final: str) -> None:
        """Refuse ``final`` unless it is free or ckptkeeper's own checkpoint with nobody's files in it."""
        clear_target(self.storage, final, self._remove, check_only=True)
        _refuse_foreign_files(self.storage, final)

    def stream(self, final: str, rank: int, rel: str, token: str) -> Upload | None:
        return None

    def after_files(
        self, work: str, final: str, rank: int, names: Sequence[str], token: str, streamed: Sequence[str] = ()
    ) -> None:
        pass

    def publish(self, work: str, final: str, record: CommitRecord) -> None:
        # Every file the record lists is in the work folder at its size, or nothing is published:
        # a work folder deleted or emptied under the save (a clean-up of the folder by something
        # else) had the save commit a record without its tensors and report success (found by an
        # outside attack). A stat per file: the files are few (a handful per rank).
        def size_of(rel: str) -> int | None:
            try:
                return os.stat(os.path.join(work, rel)).st_size
            except FileNotFoundError:
                return None

        require_listed(
            record, size_of, lambda rel: os.path.join(work, rel), "a file of this checkpoint", " from its work folder"
        )
        self.storage.write_bytes(os.path.join(work, COMMIT_RECORD), record.to_json())
        # Checked again: files may have been put there while the save ran (nothing is removed yet).
        self._check_target(final)
        old = self.storage.local_path(final)
        if self._replaced is not None and old is not None and os.path.isdir(old) and not os.path.islink(old):
            # A checkpoint of this step is there: the two folders swap places in one step, so that
            # the step never has no checkpoint (moving the old one to trash first left a moment
            # without any: a kill then lost the step). The old one then lies under the work
            # folder's hidden name, which no listing shows and the next run's clean-up deletes if
            # this process dies before it does.
            try:
                with translate_os_error(final):
                    swapped = _local.exchange_paths(work, old)
            except FileNotFoundError:
                swapped = False  # removed meanwhile (another process's retention): renamed into place below
            if swapped:
                fsync_dir(os.path.dirname(old) or ".")
                # What was swapped out is checked once more: a file somebody put in the folder after
                # the check above, or the record gone (another remover at work on it), and the
                # folders swap back, the save failing as above with nothing lost.
                foreign = unlisted_local_files(work)
                if foreign is None or foreign:
                    raise self._swap_back(work, old)
                self._replaced(work, final)
                return
        clear_target(self.storage, final, self._remove)
        try:
            self.storage.rename_dir(work, final)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            # Found by an outside attack: two processes saving one step, without a swap.
            raise CheckpointSaveError(
                f"{final} appeared while this save was putting its checkpoint there (another save of the same step, "
                "from another process?); this save's checkpoint was not published: save each step from one "
                "process (CheckpointManager holds the save folder's lease for that)"
            ) from exc

    def _swap_back(self, work: str, old: str) -> CheckpointSaveError:
        """Put the swapped-out folder back at ``old``; the error to raise. The save then discards
        ``work`` (the new checkpoint again) unless something other than this save's own files is
        in it. Where the folders cannot swap back, neither is discarded, and the error says where
        each is."""
        try:
            back = _local.exchange_paths(work, old)
        except FileNotFoundError:
            # The step folder (the new checkpoint) went meanwhile, removed by something else: the
            # old checkpoint goes back alone, onto nothing (found by an outside attack).
            try:
                os.rename(work, old)
                fsync_dir(os.path.dirname(old) or ".")
            except OSError:
                back = False
            else:
                return _back_as_it_was(self.storage, old)
        except OSError:
            back = False
        if back:
            fsync_dir(os.path.dirname(old) or ".")
            # The new checkpoint's folder is checked once it is back under the work folder's name
            # (from then on, whatever is written to the step folder lands in the old one): a file
            # written into it since the swap, or its record gone, and it is kept, not discarded
            # (found by outside attacks: the swap back took such files into the discarded folder).
            taken = unlisted_local_files(work)
            kept = "" if taken == [] else self._set_aside(work, old, "unpublished")
            error = _back_as_it_was(self.storage, old)
            if kept:
                what = ", ".join(sorted(taken))[:200] if taken else "its record is gone"
                error = CheckpointSaveError(
                    f"{error}; this save's own folder was changed meanwhile too ({what}): it is kept at {kept}, "
                    "move those files back by hand"
                )
            return error
        where = self._set_aside(work, old, "replaced")
        now = "now holds what this save wrote" if os.path.lexists(old) else "is gone (removed by something else)"
        return CheckpointSaveError(
            f"{old} changed while this save replaced it (its record went, or files ckptkeeper did not write "
            f"appeared) and could not be put back: {old} {now}, and what was there (the old checkpoint and "
            f"those files) is at {where}; move the files back by hand"
        )

    def _set_aside(self, work: str, old: str, kind: str) -> str:
        """Move ``work`` to ``{kind}-step{N}-<hex>`` beside ``old`` (a name no clean-up deletes), or
        keep it where it is (never discarded); where it is now, for the error."""
        aside = os.path.join(os.path.dirname(old), f"{kind}-{os.path.basename(old)}-{secrets.token_hex(4)}")
        try:
            os.rename(work, aside)
        except OSError:
            self._keep.add(work)  # not discarded by the failed save
            return f"{work} (hidden: the next run that opens the folder deletes it, so move them out now)"
        return aside

    def finish(self, work: str) -> None:
        pass  # the rename consumed the work folder; a failed save's is removed by discard

    def discard(self, work: str, final: str | None) -> None:
        if work in self._keep:
            return  # it holds somebody's files (see _swap_back)
        with contextlib.suppress(Exception):
            shutil.rmtree(work, ignore_errors=True)


class RecordLastCommit:
    """Commit by creating the commit record last, create-only (object stores)."""

    uploads = True

    def __init__(self, storage: Storage, remove: Remove, spool_dir: str | None, upload_threads: int) -> None:
        self.storage = storage
        self._remove = remove
        self._spool_dir = spool_dir
        self._upload_threads = upload_threads

    def work_folder(self, save_folder: str, step: int, token: str) -> str:
        return new_spool(self._spool_dir, "save")

    def prepare(self, final: str) -> None:
        # The new files take the keys of any older save of this step: clear them first.
        clear_target(self.storage, final, self._remove)

    def stream(self, final: str, rank: int, rel: str, token: str) -> Upload | None:
        # Announced before the first byte goes up: a writer killed mid-stream leaves an object (or
        # an unfinished multipart upload) that the intent names, so the next run can remove it.
        write_intent(self.storage, final, rank, [rel], token)
        return self.storage.open_upload(self.storage.join(final, rel))

    def after_files(
        self, work: str, final: str, rank: int, names: Sequence[str], token: str, streamed: Sequence[str] = ()
    ) -> None:
        # The intent goes first: whatever is uploaded under final is announced as ours.
        write_intent(self.storage, final, rank, sorted(names), token)
        storage = self.storage
        local = [rel for rel in names if rel not in set(streamed)]
        with ThreadPoolExecutor(max_workers=self._upload_threads) as pool:
            list(pool.map(lambda rel: storage.upload(os.path.join(work, rel), storage.join(final, rel)), local))

    def publish(self, work: str, final: str, record: CommitRecord) -> None:
        # Every rank has uploaded its own files by now. Each listed object is there at its size,
        # or nothing is published (as the rename commit checks its folder): an object deleted or
        # rewritten by something else before the commit gave a record naming a missing or
        # wrong-sized object, reported as a success (found by an outside attack). One listing.
        found = {f.relpath: f.size for f in self.storage.walk(final)}
        where = self.storage.join
        require_listed(record, found.get, lambda rel: where(final, rel), "an uploaded file of this checkpoint")
        self.storage.create_exclusive(self.storage.join(final, COMMIT_RECORD), record.to_json())

    def finish(self, work: str) -> None:
        shutil.rmtree(work, ignore_errors=True)

    def discard(self, work: str, final: str | None) -> None:
        with contextlib.suppress(Exception):
            shutil.rmtree(work, ignore_errors=True)
        if final is not None:
            # Best effort: data objects already uploaded without a commit record are invisible
            # anyway, and the next run removes (through their intents) whatever this cannot.
            with contextlib.suppress(Exception):
                clean_leftover(self.storage, final)


def require_listed(
    record: CommitRecord,
    size_of: Callable[[str], int | None],
    where: Callable[[str], str],
    what: str,
    place: str = "",
) -> None:
    """Raise unless every file ``record`` lists has its listed size (``size_of`` gives None for a
    missing one): FileNotFoundError for a missing file (``what`` vanished ``place``), OSError (EIO)
    for another size, naming the file (``where``). Both commit methods check this before the
    record goes in."""
    for rel, entry in record.files.items():
        size = size_of(rel)
        if size is None:
            raise FileNotFoundError(errno.ENOENT, f"{what} vanished{place} before the commit", where(rel))
        if size != entry.bytes:
            raise OSError(
                errno.EIO, f"{what} changed size before the commit ({size} != {entry.bytes} bytes)", where(rel)
            )


def commit_method_for(
    storage: Storage, remove: Remove, spool_dir: str | None, upload_threads: int, replaced: Replaced | None = None
) -> CommitMethod:
    """The commit method ``storage`` supports: a rename where it has one, else record-last."""
    if storage.supports_rename:
        return RenameCommit(storage, remove, replaced)
    return RecordLastCommit(storage, remove, spool_dir, upload_threads)


def _refuse_foreign_files(storage: Storage, final: str) -> None:
    """Raise CheckpointSaveError when the local checkpoint at ``final`` holds files its record does
    not list (somebody's: eval outputs, notes).

    A new checkpoint of the step cannot take that folder's place without taking those files along
    or leaving them behind: into its hidden work folder (deleted whole if the process dies), or
    with the old checkpoint. Nor can it be renamed onto a folder they keep from being empty (that
    is how such a save lost both checkpoints, found here). The user decides where they go.
    """
    local = storage.local_path(final)
    if local is None or os.path.islink(local) or not os.path.isdir(local):
        return
    foreign = unlisted_local_files(local)
    if foreign is None:  # its record went since it was found ours: another remover is at work on it
        raise CheckpointSaveError(
            f"{local} was being removed by something else while this save was to replace it; save again once "
            "nothing else removes checkpoints of this step"
        )
    if foreign:
        more = f" (and {len(foreign) - 3} more)" if len(foreign) > 3 else ""
        raise CheckpointSaveError(
            f"{local} holds files ckptkeeper did not write ({', '.join(sorted(foreign)[:3])}{more}), so a new "
            "checkpoint of this step cannot take its place; move them out of the folder, or save under another "
            "step (the checkpoint there is unchanged)"
        )


def _back_as_it_was(storage: Storage, old: str) -> CheckpointSaveError:
    """The error of a save whose swapped-out folder went back to ``old``: what is wrong there now
    (:func:`_refuse_foreign_files`'s words), else that it changed and is back."""
    try:
        _refuse_foreign_files(storage, old)
    except CheckpointSaveError as exc:
        return exc
    return CheckpointSaveError(f"{old} changed while this save replaced it; it is back as it was")


def _newer_there(final: str) -> CheckpointSaveError:
    # Whatever way a run came to save this step (a fallback, a manual load, a direct save), the
    # newer checkpoint is what would be lost: an intact one this version cannot even read.
    return CheckpointSaveError(
        f"{final} holds a checkpoint written by a newer ckptkeeper, which this one does not replace: upgrade "
        "ckptkeeper, or move that checkpoint out of the save folder to save this step here"
    )


def clear_target(storage: Storage, final: str, remove: Remove, check_only: bool = False) -> None:
    """Make room for a new save at ``final``, deleting only what is provably ckptkeeper's.

    A checkpoint of a newer ckptkeeper raises CheckpointSaveError and is left as it is. An older
    complete or broken save of the same step (its record is ours) is removed through
    ``remove`` (invisible at once); leftovers of a crashed object-store save are cleaned through
    their intents. Anything else raises CheckpointSaveError: ckptkeeper never overwrites what it
    did not write. ``check_only`` only checks (local disks clear at publish time).
    """
    local = storage.local_path(final)
    if local is not None:
        if not os.path.lexists(local):
            return
        if os.path.islink(local):
            raise CheckpointSaveError(
                f"{local} is a symbolic link (to {os.readlink(local)!r}); ckptkeeper does not save through a link, "
                "nor replace one: remove the link, or save under another step"
            )
        data = read_local_record(local)
        owner = "foreign" if data is None else record_owner(data)
        if owner == "foreign":
            raise CheckpointSaveError(
                f"{local} already exists and is not a ckptkeeper checkpoint (no commit record); ckptkeeper "
                "does not overwrite what it did not write: move it out of the save folder"
            )
        if owner == "newer":
            raise _newer_there(local)
        if not check_only:
            remove(final)  # an older save of the same step: invisible at once, deleted after
        return
    if not storage.list_dir(final):
        return
    try:
        record = storage.read_bytes(storage.join(final, COMMIT_RECORD))
    except FileNotFoundError:
        record = None
    if record is not None:
        owner = record_owner(record)
        if owner == "foreign":
            raise CheckpointSaveError(
                f"{final} holds a {COMMIT_RECORD} that ckptkeeper did not write; ckptkeeper does not overwrite "
                "it: move it out of the save folder"
            )
        if owner == "newer":
            raise _newer_there(final)
        remove(final)
        return
    clean_leftover(storage, final)
    if storage.list_dir(final) and not read_intents(storage, final)[1]:
        left = [f.relpath for f in storage.walk(final)][:3]
        raise CheckpointSaveError(
            f"{final} holds objects ckptkeeper did not write ({', '.join(left)}); ckptkeeper does not "
            "overwrite them: move them out of the save folder"
        )
