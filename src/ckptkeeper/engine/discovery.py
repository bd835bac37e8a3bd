"""Finding checkpoints in a save folder and checking them against their commit records.

A checkpoint is complete if and only if its commit record exists and parses, and every file it
lists exists with the listed size; that check is cheap (one listing). Checksums are checked by
:func:`verify` (reads every file) and while loading.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

from ..errors import CheckpointNotFoundError, CorruptCheckpointError
from ..storage import storage_for
from ..storage.layout import COMMIT_RECORD, parse_step
from .record import CommitRecord, FileEntry, hash_file

__all__ = ["CheckpointInfo", "check_file", "inspect", "list_checkpoints", "read_record", "verify", "verify_checksums"]


@dataclass(frozen=True)
class CheckpointInfo:
    """One folder in a save folder, as ``ls`` shows it."""

    step: int
    path: str
    complete: bool
    ephemeral: bool | None
    bytes: int
    created_unix: float | None
    problem: str | None = None


def read_record(path: str) -> CommitRecord:
    """The commit record of the checkpoint at ``path``; CheckpointNotFoundError when there is none."""
    storage = storage_for(path)
    try:
        data = storage.read_bytes(storage.join(path, COMMIT_RECORD))
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"no complete checkpoint at {path} (its commit record {COMMIT_RECORD} is missing); "
            "pass a step folder listed as complete by `ckptkeeper ls`"
        ) from None
    return CommitRecord.from_json(data, storage.join(path, COMMIT_RECORD))


def inspect(path: str) -> tuple[CommitRecord | None, str | None, int]:
    """(record or None, what makes it incomplete or None, bytes stored) for one step folder."""
    storage = storage_for(path)
    sizes = {f.relpath: f.size for f in storage.walk(path)}
    stored = sum(sizes.values())
    try:
        record = read_record(path)
    except CheckpointNotFoundError:
        return None, "no commit record", stored
    except CorruptCheckpointError as exc:
        return None, str(exc), stored
    for rel, entry in record.files.items():
        if rel not in sizes:
            return record, f"missing file {rel}", stored
        if sizes[rel] != entry.bytes:
            return record, f"{rel} has {sizes[rel]} bytes, the commit record says {entry.bytes}", stored
    return record, None, stored


def list_checkpoints(save_folder: str) -> list[CheckpointInfo]:
    """Every ``step{N}`` folder under ``save_folder``, complete or not, by step."""
    storage = storage_for(save_folder)
    out = []
    for name in storage.list_dir(save_folder):
        step = parse_step(name)
        if step is None:
            continue
        path = storage.join(save_folder, name)
        record, problem, stored = inspect(path)
        out.append(
            CheckpointInfo(
                step=step,
                path=path,
                complete=record is not None and problem is None,
                ephemeral=record.ephemeral if record else None,
                bytes=stored,
                created_unix=record.created_unix if record else None,
                problem=problem,
            )
        )
    return sorted(out, key=lambda i: i.step)


def verify(path: str, checksums: bool = True) -> CommitRecord:
    """Check every file of a checkpoint against its commit record; raises CorruptCheckpointError.

    With ``checksums`` every file is read once (object-store files are downloaded to a temporary
    file one at a time, so the local disk needs room for the largest file only).
    """
    record, problem, _ = inspect(path)
    if record is None:
        read_record(path)  # raises the precise error
    if problem is not None:
        raise CorruptCheckpointError(
            f"checkpoint {path} is corrupt: {problem}; load an earlier checkpoint (resume does this "
            "automatically) or restore this one from a copy"
        )
    assert record is not None
    if checksums:
        verify_checksums(path, record)
    return record


def verify_checksums(path: str, record: CommitRecord) -> None:
    """Read every file the record lists and check its checksum (sizes are :func:`inspect`'s job)."""
    storage = storage_for(path)
    local = storage.local_path(path)
    for rel, entry in record.files.items():
        if local is not None:
            size, digest = hash_file(os.path.join(local, rel))
        else:
            with tempfile.NamedTemporaryFile(prefix="ckptkeeper-verify-") as tmp:
                storage.download(storage.join(path, rel), tmp.name)
                size, digest = hash_file(tmp.name)
        check_file(path, rel, entry, size, digest)


def check_file(path: str, rel: str, entry: FileEntry, size: int, digest: str | None) -> None:
    """Raise CorruptCheckpointError when a file's size (or, given, checksum) differs from its record entry."""
    if size != entry.bytes:
        problem = f"{rel} has {size} bytes, the commit record says {entry.bytes}"
    elif digest is not None and digest != entry.xxh3_64:
        problem = f"{rel} has checksum {digest}, the commit record says {entry.xxh3_64}"
    else:
        return
    raise CorruptCheckpointError(
        f"checkpoint {path} is corrupt: {problem}; load an earlier checkpoint or restore this one from a copy"
    )
