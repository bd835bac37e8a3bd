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
from ..storage.layout import COMMIT_RECORD, MODEL_DIR, TRAIN_DIR, parse_step
from .record import (
    MAX_RECORD_BYTES,
    MAX_STATE_BYTES,
    CommitRecord,
    FileEntry,
    check_digest,
    hash_file,
    loads_bounded,
)

__all__ = [
    "CheckpointInfo",
    "check_file",
    "inspect",
    "list_checkpoints",
    "read_record",
    "verify",
    "verify_checksums",
    "verify_structure",
]


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


def read_record(path: str, size: int | None = None) -> CommitRecord:
    """The commit record of the checkpoint at ``path``; CheckpointNotFoundError when there is none.

    ``size`` (from a listing) lets an oversized record be refused before it is read.
    """
    storage = storage_for(path)
    where = storage.join(path, COMMIT_RECORD)
    if size is not None and size > MAX_RECORD_BYTES:
        raise CorruptCheckpointError(
            f"commit record {where} has {size} bytes, more than the {MAX_RECORD_BYTES} ckptkeeper reads; "
            "the checkpoint cannot be trusted"
        )
    try:
        local = storage.local_path(where)
        data = _read_local_small(local, MAX_RECORD_BYTES) if local is not None else storage.read_bytes(where)
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"no complete checkpoint at {path} (its commit record {COMMIT_RECORD} is missing); "
            "pass a step folder listed as complete by `ckptkeeper ls`"
        ) from None
    return CommitRecord.from_json(data, where)


def _read_local_small(path: str, limit: int) -> bytes:
    # Never through a symlink, never more than the limit (+1, so that too-large shows).
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise CorruptCheckpointError(f"cannot read {path} ({exc.strerror}); the checkpoint cannot be trusted") from None
    with os.fdopen(fd, "rb") as f:
        return f.read(limit + 1)


def inspect(path: str) -> tuple[CommitRecord | None, str | None, int]:
    """(record or None, what makes it incomplete or None, bytes stored) for one step folder."""
    storage = storage_for(path)
    sizes = {f.relpath: f.size for f in storage.walk(path)}
    stored = sum(sizes.values())
    try:
        record = read_record(path, sizes.get(COMMIT_RECORD))
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


def verify(path: str, checksums: bool = True, structure: bool = True) -> CommitRecord:
    """Check every file of a checkpoint against its commit record; raises CorruptCheckpointError.

    With ``checksums`` every file is read once (object-store files are downloaded to a temporary
    file one at a time, so the local disk needs room for the largest file only). With
    ``structure`` the small files are decoded too (DCP metadata through the allow-list, trainer
    state as bounded JSON) and the data file's layout is checked against the metadata, so a
    checkpoint that verifies also loads into a model of its shape.
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
    if structure:
        verify_structure(path, record)
    return record


def verify_structure(path: str, record: CommitRecord) -> None:
    """Decode the small files (after checking their checksums) and check the data file's layout."""
    from .fastio import DATA_FILE, parse_layout
    from .safe_metadata import MAX_METADATA_BYTES, safe_load_metadata

    storage = storage_for(path)

    def small(rel: str, limit: int) -> bytes:
        entry = record.files[rel]
        if entry.bytes > limit:
            raise CorruptCheckpointError(f"checkpoint {path} is corrupt: {rel} is listed with {entry.bytes} bytes")
        full = storage.join(path, rel)
        local = storage.local_path(full)
        data = _read_local_small(local, limit) if local is not None else storage.read_bytes(full)
        check_digest(path, rel, entry, data)
        return data

    meta_rel = f"{MODEL_DIR}/.metadata"
    if meta_rel not in record.files:
        raise CorruptCheckpointError(f"checkpoint {path} is corrupt: its commit record lists no {meta_rel}")
    data_files = [k[len(MODEL_DIR) + 1 :] for k in record.files if k.startswith(MODEL_DIR + "/")]
    metadata = safe_load_metadata(small(meta_rel, MAX_METADATA_BYTES), f"{path}/{meta_rel}", data_files)
    for rel in record.files:
        if rel.startswith(TRAIN_DIR + "/") and rel.endswith(".json"):
            loads_bounded(small(rel, MAX_STATE_BYTES), f"{path}/{rel}", max_bytes=MAX_STATE_BYTES, max_depth=64,
                          allow_nonfinite=True)  # fmt: skip
    layout = record.extra.get("layout")
    if layout is not None:
        rel = f"{MODEL_DIR}/{DATA_FILE}"
        try:
            if not isinstance(layout, dict) or set(layout) != {rel} or rel not in record.files:
                raise ValueError("the layout does not describe this checkpoint's data file")
            parse_layout(layout[rel], record.files[rel].bytes, metadata)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptCheckpointError(
                f"checkpoint {path} is corrupt: {exc}; load an earlier checkpoint or restore this one from a copy"
            ) from None


def verify_checksums(path: str, record: CommitRecord) -> None:
    """Read every file the record lists and check its checksum (sizes are :func:`inspect`'s job)."""
    storage = storage_for(path)
    local = storage.local_path(path)
    for rel, entry in record.files.items():
        if local is not None:
            try:
                size, digest = hash_file(os.path.join(local, rel), follow_links=False)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"checkpoint {path} is corrupt: missing file {rel}") from None
            except OSError as exc:
                raise CorruptCheckpointError(f"checkpoint {path}: cannot read {rel} ({exc.strerror})") from None
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
