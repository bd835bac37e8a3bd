"""Finding checkpoints in a save folder and checking them against their commit records.

A checkpoint is complete if and only if its commit record exists and parses, and every file it
lists exists with the listed size; that check is cheap (one listing). Checksums are checked by
:func:`verify` (reads every file) and while loading.

Save folders written by OLMo-core are recognised too. Its step folders hold a marker in place of
the commit record (``.metadata.json`` = ``{"ephemeral": bool, "version": str}``, nothing else),
DCP files under ``model_and_optim/`` whose ``.metadata`` pickles OLMo-core's own storage-info
class, and ``train/rank{R}.pt`` (``torch.save``). Such a folder is an OLMo-core checkpoint
(:class:`OlmoCoreRecord`, flavor ``"olmo-core"``): complete when its DCP metadata decodes through
the allow-list, every data file it names holds the bytes it points at, and ``train/rank0.pt``
exists. There are no checksums to check; :func:`verify` checks the structure, the sizes, the
trainer states (read with ``torch.load(weights_only=True)``) and the CRC-32 that ``torch.save``
keeps inside each record of the data files.
"""

from __future__ import annotations

import io
import json
import os
import re
import tempfile
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import xxhash

from ..errors import CheckpointError, CheckpointNotFoundError, CkptkeeperError, CorruptCheckpointError
from ..storage import storage_for
from ..storage.layout import COMMIT_RECORD, MODEL_DIR, TRAIN_DIR, check_relpath, parse_step, train_state_name
from ..storage.local import open_regular
from .record import (
    MAX_RECORD_BYTES,
    MAX_STATE_BYTES,
    NEWER_FORMAT,
    CommitRecord,
    FileEntry,
    check_digest,
    hash_file,
    loads_bounded,
    record_is_ours,
)

if TYPE_CHECKING:
    # Imported where used: listing and ``ckptkeeper ls`` must not pay for importing torch.
    from torch.distributed.checkpoint.metadata import Metadata

__all__ = [
    "FLAVOR_CKPTKEEPER",
    "FLAVOR_OLMO_CORE",
    "LAYOUT_FILE",
    "OLMO_CORE_NOTE",
    "CheckpointInfo",
    "OlmoCoreRecord",
    "check_file",
    "check_olmo_core",
    "flavor_of",
    "has_layout",
    "inspect",
    "list_checkpoints",
    "parse_olmo_marker",
    "read_any_record",
    "read_layout",
    "read_metadata_of",
    "read_olmo_train_state",
    "read_record",
    "read_segment_rows",
    "read_segment_table",
    "read_small",
    "read_table_doc",
    "segment_tables",
    "verify",
    "verify_checksums",
    "verify_note",
    "verify_structure",
]

FLAVOR_CKPTKEEPER = "ckptkeeper"
FLAVOR_OLMO_CORE = "olmo-core"
OLMO_CORE_NOTE = (
    "OLMo-core checkpoint: no checksums recorded; checked its structure, file sizes, trainer state and the "
    "CRC-32 inside each torch.save record"
)
"""What :func:`verify_note` says of an OLMo-core checkpoint."""

_OLMO_META = f"{MODEL_DIR}/.metadata"
_OLMO_TRAIN_RE = re.compile(r"^train/rank(0|[1-9][0-9]{0,6})\.pt$")
_MAX_MARKER_BYTES = 64 << 10
_NO_CHECKSUM = ""


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
    flavor: str = FLAVOR_CKPTKEEPER
    """``"ckptkeeper"``, or ``"olmo-core"`` for a checkpoint written by OLMo-core."""
    metrics: Mapping[str, float] = field(default_factory=dict)
    """The metrics given when it was saved (``save_if_due(step, metrics=...)``), for retention by metric."""

    @property
    def newer_format(self) -> bool:
        """Written by a newer ckptkeeper (see :class:`~ckptkeeper.NewerFormatError`): not complete
        for this version, which cannot read it, but not damaged either."""
        return (self.problem or "").startswith(NEWER_FORMAT)


@dataclass(frozen=True)
class OlmoCoreRecord(CommitRecord):
    """An OLMo-core checkpoint, presented as a commit record that has no checksums.

    ``step`` comes from the folder name, ``ephemeral`` from OLMo-core's marker, ``world_size``
    from the ``train/rank{R}.pt`` files, ``files`` from a listing of the step folder (every file
    but the marker, with its size; ``xxh3_64`` is empty: OLMo-core records none). It is never
    written anywhere (:meth:`to_json` raises).
    """

    olmo_core_version: str = ""
    flavor: str = FLAVOR_OLMO_CORE
    note: str = OLMO_CORE_NOTE

    def to_json(self) -> bytes:
        raise CheckpointError(
            "an OLMo-core checkpoint has no ckptkeeper commit record to write; copy its marker (.metadata.json) instead"
        )


def flavor_of(record: CommitRecord | None) -> str:
    """``"olmo-core"`` for an :class:`OlmoCoreRecord`, else ``"ckptkeeper"``."""
    return FLAVOR_OLMO_CORE if isinstance(record, OlmoCoreRecord) else FLAVOR_CKPTKEEPER


def parse_olmo_marker(data: bytes) -> tuple[bool, str] | None:
    """(ephemeral, OLMo-core version) when ``data`` is exactly OLMo-core's checkpoint marker, else None.

    The marker is a JSON object with only ``ephemeral`` (true or false) and ``version`` (a string).
    """
    if len(data) > _MAX_MARKER_BYTES:
        return None
    try:
        doc = json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(doc, dict) or set(doc) != {"ephemeral", "version"}:
        return None
    ephemeral, version = doc["ephemeral"], doc["version"]
    if type(ephemeral) is not bool or not isinstance(version, str) or len(version) > 200:
        return None
    return ephemeral, version


def _read_marker(path: str, size: int | None = None) -> bytes:
    """The bytes of ``step{N}/.metadata.json`` (commit record or OLMo-core marker), bounded."""
    storage = storage_for(path)
    where = storage.join(path, COMMIT_RECORD)
    if size is not None and size > MAX_RECORD_BYTES:
        raise CorruptCheckpointError(
            f"commit record {where} has {size} bytes, more than the {MAX_RECORD_BYTES} ckptkeeper reads; "
            "the checkpoint cannot be trusted"
        )
    try:
        local = storage.local_path(where)
        return _read_local_small(local, MAX_RECORD_BYTES) if local is not None else storage.read_bytes(where)
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"no complete checkpoint at {path} (its commit record {COMMIT_RECORD} is missing); "
            "pass a step folder listed as complete by `ckptkeeper ls`"
        ) from None


def read_record(path: str, size: int | None = None) -> CommitRecord:
    """The commit record of the ckptkeeper checkpoint at ``path``; CheckpointNotFoundError when there is none.

    ``size`` (from a listing) lets an oversized record be refused before it is read. An OLMo-core
    checkpoint has no commit record: a plain CheckpointError says so (see :func:`read_any_record`).
    """
    data = _read_marker(path, size)
    if parse_olmo_marker(data) is not None:
        raise CheckpointError(
            f"{path} is an OLMo-core checkpoint: its {COMMIT_RECORD} is OLMo-core's marker, not a ckptkeeper "
            "commit record"
        )
    return CommitRecord.from_json(data, storage_for(path).join(path, COMMIT_RECORD))


def read_any_record(path: str) -> CommitRecord:
    """The commit record at ``path``, or for an OLMo-core checkpoint its :class:`OlmoCoreRecord`.

    Nothing beyond the record (or marker) is checked; :func:`inspect` and :func:`verify` do that.
    """
    data = _read_marker(path)
    marker = parse_olmo_marker(data)
    if marker is None:
        return CommitRecord.from_json(data, storage_for(path).join(path, COMMIT_RECORD))
    storage = storage_for(path)
    return _olmo_record(path, marker, {f.relpath: f.size for f in storage.walk(path)})


def _olmo_record(path: str, marker: tuple[bool, str], sizes: dict[str, int]) -> OlmoCoreRecord:
    ephemeral, version = marker
    ranks = sorted(int(m.group(1)) for rel in sizes if (m := _OLMO_TRAIN_RE.match(rel)))
    files = {
        rel: FileEntry(size, _NO_CHECKSUM)
        for rel, size in sorted(sizes.items())
        if rel != COMMIT_RECORD and check_relpath(rel) is None
    }
    return OlmoCoreRecord(
        step=parse_step(path) or 0,
        ephemeral=ephemeral,
        world_size=ranks[-1] + 1 if ranks else 1,
        files=files,
        created_unix=0.0,  # OLMo-core records no creation time
        version=0,
        olmo_core_version=version,
    )


def _read_local_small(path: str, limit: int) -> bytes:
    # Never through a symlink, never more than the limit (+1, so that too-large shows).
    try:
        fd = open_regular(path)
        with os.fdopen(fd, "rb") as f:
            return f.read(limit + 1)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise CorruptCheckpointError(f"cannot read {path} ({exc.strerror}); the checkpoint cannot be trusted") from None


NOT_OURS = "not a ckptkeeper checkpoint"
"""How :func:`inspect` starts the problem of a step folder whose record is somebody else's."""


def inspect(path: str) -> tuple[CommitRecord | None, str | None, int]:
    """(record or None, what makes it incomplete or None, bytes stored) for one step folder.

    For an OLMo-core checkpoint the record is its :class:`OlmoCoreRecord`, and its DCP metadata is
    decoded to tell whether it is complete.
    """
    storage = storage_for(path)
    sizes = {f.relpath: f.size for f in storage.walk(path)}
    stored = sum(sizes.values())
    try:
        data = _read_marker(path, sizes.get(COMMIT_RECORD))
    except CheckpointNotFoundError:
        return None, "no commit record", stored
    except CorruptCheckpointError as exc:
        return None, str(exc), stored
    marker = parse_olmo_marker(data)
    if marker is not None:
        olmo = _olmo_record(path, marker, sizes)
        try:
            check_olmo_core(path, olmo)
        except CorruptCheckpointError as exc:
            return olmo, str(exc), stored
        return olmo, None, stored
    try:
        record = CommitRecord.from_json(data, storage.join(path, COMMIT_RECORD))
    except CorruptCheckpointError as exc:
        # Counting a broken checkpoint errs on the side of "ours" (a destroyed record next to our
        # trainer state is still our checkpoint); deleting never does (see deleter.record_is_ours).
        if not record_is_ours(data) and train_state_name(0) not in sizes:
            return None, f"{NOT_OURS} (its {COMMIT_RECORD} was not written by ckptkeeper)", stored
        return None, str(exc), stored
    folder_step = parse_step(path.rstrip("/").rsplit("/", 1)[-1])
    if folder_step is not None and record.step != folder_step:
        return record, f"its commit record is for step {record.step}, not {folder_step} (copied or renamed?)", stored
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
        olmo = isinstance(record, OlmoCoreRecord)
        out.append(
            CheckpointInfo(
                step=step,
                path=path,
                complete=record is not None and problem is None,
                ephemeral=record.ephemeral if record else None,
                bytes=stored,
                created_unix=record.created_unix if record and not olmo else None,
                problem=problem,
                flavor=flavor_of(record),
                metrics=dict(record.extra.get("metrics", {})) if record and not olmo else {},
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

    An OLMo-core checkpoint returns its :class:`OlmoCoreRecord` (see :func:`verify_note`): its
    DCP metadata decoded and every file it names long enough; with ``checksums`` the CRC-32 inside
    each ``torch.save`` record is checked, with ``structure`` every ``train/rank{R}.pt`` is read
    with ``torch.load(weights_only=True)``. A refused pickle raises UnsafeCheckpointError.
    """
    record, problem, _ = inspect(path)
    if isinstance(record, OlmoCoreRecord):
        metadata = check_olmo_core(path, record)  # raises the precise error
        if checksums:
            _verify_olmo_crc(path, record, metadata)
        if structure:
            for rel in record.files:
                if _OLMO_TRAIN_RE.match(rel):
                    _read_olmo_train_file(path, rel, record, path)
        return record
    if record is None:
        read_record(path)  # raises the precise error
    if problem is not None:
        raise CorruptCheckpointError(
            f"checkpoint {path} is corrupt: {problem}; load an earlier checkpoint (resume does this "
            "automatically) or restore this one from a copy"
        )
    assert record is not None
    segments: dict[str, list[Any]] | None = None
    if structure:
        segments = verify_structure(path, record)
    if checksums:
        # Each data file's segments are checked against its table in the same read as the file:
        # loads trust those sums, so a table that disagrees with intact files must fail here too
        # (not pass verify and then fail the load).
        verify_checksums(path, record, segments=segments)
    return record


def verify_structure(path: str, record: CommitRecord) -> dict[str, list[Any]]:
    """Decode the small files (after checking their checksums) and check the data file's layout.

    Returns each data file's segments (head, data and tail of every piece, keyed by the file's
    path in the record) as its segment table gives them, for :func:`verify_checksums` to check.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .fastio import parse_layout, saved_from_table
    from .safe_metadata import MAX_METADATA_BYTES, safe_load_metadata
    from .sharded import PIECES_KEY, format1_pieces, is_pieces_table, table_pieces

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
    # One table per data file, as every writer makes: where a record lists two (formats 1 and 2),
    # loads read one and a ckptkeeper that knows only format 1 the other, which nothing else checks.
    # Every table counts, a single-process one (a file, or inline in an older record) included:
    # it describes the first data file too (found by an outside attack).
    described: dict[str, str] = {}
    for listed_rel, data_file in _listed_tables(record):
        name = listed_rel or "the commit record's own table"
        if data_file in described:
            raise CorruptCheckpointError(
                f"checkpoint {path} is corrupt: it lists two segment tables of {data_file} ({described[data_file]} "
                f"and {name}); load an earlier checkpoint or restore this one from a copy"
            )
        described[data_file] = name
    segments: dict[str, list[Any]] = {}
    stored_by_file: dict[str, dict[str, Any]] = {}
    for data_file, table_rel in segment_tables(record).items():
        rel = f"{MODEL_DIR}/{data_file}"
        try:
            if rel not in record.files:
                raise ValueError(f"a segment table describes {rel}, which the checkpoint does not list")
            if table_rel is not None and is_pieces_table(table_rel):
                doc = read_table_doc(path, record, data_file)
                assert doc is not None
                pieces = table_pieces(doc[1], data_file, record.files[rel].bytes)
                _check_pieces_table(pieces, metadata, data_file)
                segments[rel] = [seg for _, _, stored, _ in pieces for seg in stored.segs.values()]
                stored_by_file[data_file] = {fqn: stored for fqn, _, stored, _ in pieces}
                continue
            found = read_segment_table(path, record, data_file)
            assert found is not None
            if found[1].get(PIECES_KEY) is not None:
                # A format-1 per-rank table places pieces too, and loads plan from it: each box must
                # be the one DCP's metadata keeps in this file, as for format 2 (two ranks' boxes
                # swapped for same-sized pieces passed verify and loaded scrambled values; found by
                # an outside attack). The same checks as format 2's, the tiling included.
                listed_pieces = list(format1_pieces(data_file, found[0], found[1][PIECES_KEY], record.files[rel].bytes))
                _check_pieces_table(listed_pieces, metadata, data_file)
                by_fqn: Mapping[str, Mapping[str, Any]] = {fqn: stored.segs for fqn, _, stored, _ in listed_pieces}
            else:
                by_fqn = parse_layout(found[0], record.files[rel].bytes, metadata, data_file)
            segments[rel] = [seg for trio in by_fqn.values() for seg in trio.values()]
            if found[1].get("tensors") is not None:
                # The tensor list loads use in place of DCP's metadata must say the same as it.
                listed = saved_from_table(found[1]["tensors"])
                parse_layout(found[0], record.files[rel].bytes, None, data_file, listed)
                for fqn, (shape, dtype) in listed.items():
                    md = metadata.state_dict_metadata.get(fqn)
                    if not isinstance(md, TensorStorageMetadata) or (tuple(md.size), md.properties.dtype) != (
                        shape,
                        dtype,
                    ):
                        raise ValueError(f"the segment table and DCP's metadata disagree about {fqn[:80]!r}")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptCheckpointError(
                f"checkpoint {path} is corrupt: {exc}; load an earlier checkpoint or restore this one from a copy"
            ) from None
    try:
        _check_index(path, record, metadata, stored_by_file)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptCheckpointError(
            f"checkpoint {path} is corrupt: {exc}; load an earlier checkpoint or restore this one from a copy"
        ) from None
    return segments


def _check_index(path: str, record: CommitRecord, metadata: Metadata, tables: Mapping[str, Mapping[str, Any]]) -> None:
    """ValueError unless a multi-rank checkpoint's shared index says what DCP's metadata and the
    segment tables say: the same tensors, and each whole piece where its file's table puts it
    (loads at the saved world size plan from it in place of the other ranks' tables)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .sharded import INDEX_FILE, index_pieces, is_whole

    doc = read_index_doc(path, record)
    if doc is None:
        return
    sizes = {rel[len(MODEL_DIR) + 1 :]: entry.bytes for rel, entry in record.files.items()
             if rel.startswith(f"{MODEL_DIR}/__")}  # fmt: skip
    saved, whole = index_pieces(doc, record.world_size, sizes)
    want = {
        fqn: (tuple(int(n) for n in md.size), md.properties.dtype)
        for fqn, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }
    if {fqn: (tuple(info.shape), info.dtype) for fqn, info in saved.items() if info is not None} != want:
        raise ValueError(f"{INDEX_FILE} and DCP's metadata list other tensors (or shapes, or dtypes)")
    for fqn, stored in whole:
        if tables.get(stored.file, {}).get(fqn) != stored:  # the same box, file and segments (checksums too)
            raise ValueError(f"{INDEX_FILE} places {fqn[:80]!r} where the segment table of {stored.file} does not")
    # The writer lists every whole piece: one left out is damage too (loads then fall back to
    # every table, so it costs them nothing, but verify is asked whether the files are intact).
    listed = {(fqn, stored.file) for fqn, stored in whole}
    if len(listed) != len(whole):
        raise ValueError(f"{INDEX_FILE} lists a whole piece twice")
    for data_file, pieces in tables.items():
        for fqn, stored in pieces.items():
            shape = want.get(fqn, (None,))[0]
            if shape is not None and is_whole(shape, stored.offsets, stored.sizes) and (fqn, data_file) not in listed:
                raise ValueError(f"{INDEX_FILE} leaves out the whole piece of {fqn[:80]!r} in {data_file}")


LAYOUT_FILE = f"{MODEL_DIR}/.ckptkeeper-layout.json"
"""The fast writer's segment table (one row per tensor), a file of the checkpoint listed in its
record, so the record stays small whatever the number of tensors (``ls`` reads only records)."""

MAX_LAYOUT_BYTES = 256 << 20


def _check_pieces_table(found: list[Any], metadata: Metadata, data_file: str) -> None:
    """ValueError unless a format-2 table's pieces (:func:`~ckptkeeper.engine.sharded.table_pieces`)
    are where DCP's metadata puts them, with its shapes, dtypes and boxes (loads use the table)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .fastio import check_layout_metadata

    check_layout_metadata({fqn: stored.segs for fqn, _, stored, _ in found}, metadata, data_file)
    # Which box of each tensor DCP's metadata keeps in this very file (a table that swapped two
    # ranks' offsets for the same bytes would otherwise match a box kept in the other file).
    here = {
        index.fqn: tuple(index.offset or ())
        for index, info in (metadata.storage_data or {}).items()
        if info.relative_path == data_file
    }
    for fqn, whole, stored, _ in found:
        md = metadata.state_dict_metadata.get(fqn)
        if not isinstance(md, TensorStorageMetadata) or (tuple(md.size), md.properties.dtype) != tuple(whole):
            raise ValueError(f"the segment table and DCP's metadata disagree about {fqn[:80]!r}")
        boxes = {tuple(c.offsets): tuple(c.sizes) for c in md.chunks}
        if here.get(fqn) != stored.offsets or boxes.get(stored.offsets) != stored.sizes:
            raise ValueError(
                f"the segment table places a piece of {fqn[:80]!r} in {data_file} where DCP's metadata has another"
            )


def has_layout(record: CommitRecord) -> bool:
    """Whether the checkpoint was written by the fast writer (it has segment tables)."""
    from .sharded import iter_layout_files

    return "layout" in record.extra or LAYOUT_FILE in record.files or any(iter_layout_files(record.files))


def _listed_tables(record: CommitRecord) -> list[tuple[str | None, str]]:
    """Every segment table a record lists, as (its file, or None for one inline in a 0.2 record;
    the data file it describes), in the order in which a later one wins for its data file."""
    from .fastio import DATA_FILE
    from .sharded import iter_layout_files

    out: list[tuple[str | None, str]] = list(iter_layout_files(record.files))
    if LAYOUT_FILE in record.files:
        out.append((LAYOUT_FILE, DATA_FILE))
    if "layout" in record.extra:
        out.append((None, DATA_FILE))
    return out


def segment_tables(record: CommitRecord) -> dict[str, str | None]:
    """For each data file (name inside ``model_and_optim``) with a segment table: the table's
    file (None: inline in a 0.2 record). Single-process checkpoints have one, others one per rank."""
    return {data: rel for rel, data in _listed_tables(record)}


def read_segment_rows(path: str, record: CommitRecord, data_file: str, local: str | None = None) -> Any:
    """The segment rows of ``data_file`` (checksum-checked, bounded), or None when it has no table."""
    found = read_segment_table(path, record, data_file, local)
    return None if found is None else found[0]


def read_table_doc(path: str, record: CommitRecord, data_file: str, local: str | None = None) -> tuple[str, Any] | None:
    """(the table's file, its decoded JSON) of ``data_file``'s segment table, checksum-checked and
    bounded, not yet checked for shape; None when it has no table."""
    tables = segment_tables(record)
    if data_file not in tables:
        return None
    rel = tables[data_file]
    if rel is None or rel == LAYOUT_FILE:
        return LAYOUT_FILE, read_layout(path, record, local)
    data = read_small(local or path, rel, MAX_LAYOUT_BYTES, record.files[rel])
    # max_depth=None: the table parsers accept only their fixed shape, so every deeper table is
    # refused there (json's own recursion limit stops the absurd ones).
    return rel, loads_bounded(data, f"{path}/{rel}", max_bytes=MAX_LAYOUT_BYTES, max_depth=None)


def read_index_doc(path: str, record: CommitRecord, local: str | None = None) -> Any:
    """A multi-rank checkpoint's shared index (``model_and_optim/.ckptkeeper-index.json``),
    decoded, checksum-checked and bounded, not yet checked for shape; None when it has none."""
    from .sharded import INDEX_FILE

    if INDEX_FILE not in record.files:
        return None
    data = read_small(local or path, INDEX_FILE, MAX_LAYOUT_BYTES, record.files[INDEX_FILE])
    return loads_bounded(data, f"{path}/{INDEX_FILE}", max_bytes=MAX_LAYOUT_BYTES, max_depth=None)


def read_segment_table(
    path: str, record: CommitRecord, data_file: str, local: str | None = None
) -> tuple[Any, dict[str, Any]] | None:
    """(segment rows, the table's other entries) of ``data_file``'s format-1 table, checksum-checked
    and bounded; None when it has no table. Single-process tables list their tensors (``"tensors"``:
    ``{fqn: [dtype, shape]}``), format-1 per-rank tables their pieces (``"pieces"``); a format-2
    per-rank table (:func:`read_table_doc`, :func:`~ckptkeeper.engine.sharded.table_pieces`) is
    refused here as describing other files."""
    from .fastio import TENSORS_KEY
    from .sharded import PIECES_KEY

    found = read_table_doc(path, record, data_file, local)
    if found is None:
        return None
    table = found[1]
    key = f"{MODEL_DIR}/{data_file}"
    if not isinstance(table, dict) or key not in table or set(table) - {key, TENSORS_KEY, PIECES_KEY}:
        raise CorruptCheckpointError(
            f"checkpoint {path} is corrupt: the segment table of {data_file} describes other files; load an "
            "earlier checkpoint or restore this one from a copy"
        )
    return table[key], {k: v for k, v in table.items() if k != key}


def read_layout(path: str, record: CommitRecord, local: str | None = None) -> Any:
    """The fast writer's segment table ``{data file: rows}``, or None for a DCP-written checkpoint.

    Read from its own file (checksum-checked, bounded) at ``local`` (a downloaded copy) or ``path``;
    checkpoints written before the table had a file of its own carry it inline in the record.
    """
    inline = record.extra.get("layout")
    if inline is not None:
        return inline
    if LAYOUT_FILE not in record.files:
        return None
    data = read_small(local or path, LAYOUT_FILE, MAX_LAYOUT_BYTES, record.files[LAYOUT_FILE])
    return loads_bounded(data, f"{path}/{LAYOUT_FILE}", max_bytes=MAX_LAYOUT_BYTES, max_depth=None)


def verify_note(path: str) -> str | None:
    """What :func:`verify` could not check at ``path``: for OLMo-core checkpoints, that there are no checksums."""
    try:
        data = _read_marker(path)
    except (CkptkeeperError, OSError):
        return None
    return OLMO_CORE_NOTE if parse_olmo_marker(data) is not None else None


def verify_checksums(
    path: str, record: CommitRecord, where: str | None = None, segments: Mapping[str, list[Any]] | None = None
) -> None:
    """Read every file the record lists and check its checksum (sizes are :func:`inspect`'s job).

    An OLMo-core checkpoint has none: the CRC-32 inside each ``torch.save`` record is checked.
    ``where`` names the checkpoint in errors when ``path`` is a local copy of it. With
    ``segments`` (``{file: [Segment, ...]}``, from :func:`verify_structure`) each listed segment of
    a file is checked against its own checksum in the same read.
    """
    if isinstance(record, OlmoCoreRecord):
        _verify_olmo_crc(path, record, check_olmo_core(path, record, where), where)
        return
    storage = storage_for(path)
    local = storage.local_path(path)
    named = where or path
    for rel, entry in record.files.items():
        listed = (segments or {}).get(rel)
        wrong: list[CorruptCheckpointError] = []
        if local is not None:
            try:
                size, digest = hash_file_and_segments(os.path.join(local, rel), listed, f"{named}/{rel}", wrong)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"checkpoint {named} is corrupt: missing file {rel}") from None
            except OSError as exc:
                raise CorruptCheckpointError(f"checkpoint {named}: cannot read {rel} ({exc.strerror})") from None
        else:
            with tempfile.NamedTemporaryFile(prefix="ckptkeeper-verify-") as tmp:
                storage.download(storage.join(path, rel), tmp.name)
                size, digest = hash_file_and_segments(tmp.name, listed, f"{named}/{rel}", wrong)
        check_file(named, rel, entry, size, digest)
        if wrong:
            # The file is the one the record lists, its table says otherwise about its bytes.
            raise wrong[0]


def hash_file_and_segments(
    path: str, segments: list[Any] | None, where: str, wrong: list[CorruptCheckpointError]
) -> tuple[int, str]:
    """:func:`hash_file` of a checkpoint's file (never through a link), checking in the same read
    each of its ``segments`` (None: it has none listed) against its checksum.

    The first mismatch is appended to ``wrong`` (not raised: a file that is not the one the
    record lists is reported as that first, by the caller). Why not two passes: the data files
    are most of a checkpoint's bytes, and verify already reads each once.
    """
    from .fastio import segment_mismatch

    if segments is None:
        return hash_file(path, follow_links=False)
    # Keyed on offset, length and checksum: an empty segment starts where the next one does, and
    # two empty ones at one offset may claim different checksums (a forged table's): every
    # distinct claim is checked (found by an outside attack).
    ordered = sorted(
        {(s.offset, s.length, s.xxh3_64): s for s in segments}.values(), key=lambda s: (s.offset, s.length)
    )
    part: Any = None  # the hasher of a segment that runs on into the next chunk
    i = 0

    def compare(seg: Any, got: str) -> None:
        if got != seg.xxh3_64 and not wrong:
            wrong.append(segment_mismatch(where, seg.fqn, seg.kind, got, seg.xxh3_64))

    def each(lo: int, chunk: memoryview) -> None:
        nonlocal part, i
        hi = lo + len(chunk)
        while i < len(ordered):
            seg = ordered[i]
            end = seg.offset + seg.length
            if seg.offset > hi or (seg.offset == hi and seg.length):
                break  # starts in a later chunk
            if part is None and seg.offset >= lo and end <= hi:
                compare(seg, xxhash.xxh3_64_hexdigest(chunk[seg.offset - lo : end - lo]))
                i += 1
                continue
            if part is None:
                part = xxhash.xxh3_64()
            part.update(chunk[max(seg.offset, lo) - lo : min(end, hi) - lo])
            if end > hi:
                break  # runs on into the next chunk
            compare(seg, part.hexdigest())
            part = None
            i += 1

    n, digest = hash_file(path, follow_links=False, each=each)
    if i < len(ordered) and not wrong:
        seg = ordered[i]
        wrong.append(
            CorruptCheckpointError(
                f"{where} is corrupt: its segment table places {seg.fqn} ({seg.kind}) past the file's end "
                f"({n} bytes); load an earlier checkpoint or restore this one from a copy"
            )
        )
    return n, digest


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


# ---------------------------------------------------------------------- OLMo-core


def read_small(path: str, rel: str, limit: int, entry: FileEntry | None = None) -> bytes:
    """One small file of the checkpoint at ``path`` (any store), at most ``limit`` bytes.

    With a record ``entry`` that has a checksum, the bytes are checked against it before they are
    returned. Local files are never read through a symlink.
    """
    storage = storage_for(path)
    if entry is not None and entry.bytes > limit:
        raise CorruptCheckpointError(
            f"checkpoint {path} is corrupt: {rel} is listed with {entry.bytes} bytes, more than the {limit} "
            "ckptkeeper reads for it"
        )
    full = storage.join(path, rel)
    try:
        local = storage.local_path(full)
        data = _read_local_small(local, limit) if local is not None else storage.read_bytes(full)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"checkpoint {path} is corrupt: missing file {rel}") from None
    if len(data) > limit:
        raise CorruptCheckpointError(f"checkpoint {path} is corrupt: {rel} is larger than the {limit} bytes expected")
    if entry is not None and entry.xxh3_64 != _NO_CHECKSUM:
        check_digest(path, rel, entry, data)
    return data


def _olmo_incomplete(where: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"OLMo-core checkpoint {where} is incomplete: {why}; load an earlier checkpoint or restore this one from a copy"
    )


def check_olmo_core(path: str, record: OlmoCoreRecord, where: str | None = None) -> Metadata:
    """Decode an OLMo-core checkpoint's DCP metadata and check that every file it names holds its bytes.

    ``path`` is the step folder (any store, or a local copy: then ``where`` names the original).
    Returns the metadata with DCP's own storage-info entries. Raises UnsafeCheckpointError for a
    pickle asking for anything outside the allow-list, CorruptCheckpointError for anything else.
    """
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    from .safe_metadata import MAX_METADATA_BYTES, safe_load_metadata

    where = where or path
    for needed in (_OLMO_META, f"{TRAIN_DIR}/rank0.pt"):
        if needed not in record.files:
            raise _olmo_incomplete(where, f"missing file {needed}")
    size = record.files[_OLMO_META].bytes
    if size > MAX_METADATA_BYTES:
        raise _olmo_incomplete(
            where, f"{_OLMO_META} has {size} bytes, more than the {MAX_METADATA_BYTES} ckptkeeper reads"
        )
    data_files = [
        rel[len(MODEL_DIR) + 1 :]
        for rel in record.files
        if rel.startswith(MODEL_DIR + "/") and "/" not in rel[len(MODEL_DIR) + 1 :] and rel != _OLMO_META
    ]
    data = read_small(path, _OLMO_META, MAX_METADATA_BYTES)
    metadata = safe_load_metadata(data, f"{where}/{_OLMO_META}", data_files, olmo_core=True)
    storage_data = metadata.storage_data or {}
    needs: dict[str, int] = {}
    for info in storage_data.values():
        rel = f"{MODEL_DIR}/{info.relative_path}"
        needs[rel] = max(needs.get(rel, 0), info.offset + info.length)
    for rel, need in sorted(needs.items()):
        have = record.files[rel].bytes
        if have < need:
            raise _olmo_incomplete(where, f"{rel} has {have} bytes, its DCP metadata points at {need}")
    try:
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                missing = any(MetadataIndex(fqn, chunk.offsets) not in storage_data for chunk in md.chunks)
            else:
                missing = MetadataIndex(fqn) not in storage_data
            if missing:
                raise _olmo_incomplete(where, f"its DCP metadata says where {fqn[:80]!r} is stored only in part")
    except (TypeError, AttributeError, ValueError) as exc:
        raise CorruptCheckpointError(
            f"{where}/{_OLMO_META} is not valid DCP metadata ({type(exc).__name__}: {str(exc)[:200]}); load an "
            "earlier checkpoint or restore this one from a copy"
        ) from None
    return metadata


def read_olmo_train_state(
    path: str, rank: int, record: OlmoCoreRecord, where: str | None = None
) -> tuple[dict[str, Any], bool]:
    """(rank ``rank``'s OLMo-core trainer state as plain data, whether it is rank 0's stand-in)."""
    name, borrowed = f"{TRAIN_DIR}/rank{rank}.pt", False
    if name not in record.files:
        name, borrowed = f"{TRAIN_DIR}/rank0.pt", True
    if name not in record.files:
        raise _olmo_incomplete(where or path, f"missing file {name}")
    return _read_olmo_train_file(path, name, record, where or path), borrowed


def _read_olmo_train_file(path: str, rel: str, record: OlmoCoreRecord, where: str) -> dict[str, Any]:
    from .safe_metadata import MAX_TRAIN_STATE_BYTES, safe_load_train_state

    data = read_small(path, rel, MAX_TRAIN_STATE_BYTES, record.files[rel])
    if len(data) != record.files[rel].bytes:
        raise CorruptCheckpointError(f"checkpoint {where} changed while it was read: {rel} has {len(data)} bytes")
    return safe_load_train_state(data, f"{where}/{rel}")


def read_metadata_of(path: str, record: CommitRecord) -> Metadata:
    """The DCP metadata of either flavor (any store), checksum-checked where there is a checksum."""
    from .safe_metadata import MAX_METADATA_BYTES, safe_load_metadata

    if isinstance(record, OlmoCoreRecord):
        return check_olmo_core(path, record)
    rel = f"{MODEL_DIR}/.metadata"
    if rel not in record.files:
        raise CorruptCheckpointError(f"checkpoint {path} is corrupt: its commit record lists no {rel}")
    data = read_small(path, rel, MAX_METADATA_BYTES, record.files[rel])
    data_files = [k[len(MODEL_DIR) + 1 :] for k in record.files if k.startswith(MODEL_DIR + "/")]
    return safe_load_metadata(data, f"{path}/{rel}", data_files)


class _Window(io.RawIOBase):
    """A read-only, seekable view of ``length`` bytes of an open file, from ``start``."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        super().__init__()
        self._fd, self._start, self._len, self._pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._len}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buf: Any) -> int:
        n = min(len(buf), self._len - self._pos)
        if n <= 0:
            return 0
        data = os.pread(self._fd, n, self._start + self._pos)
        buf[: len(data)] = data
        self._pos += len(data)
        return len(data)


def _check_zip_crcs(fd: int, start: int, length: int) -> None:
    # torch.save writes a zip archive per record, with a CRC-32 per member; reading each member
    # to its end makes zipfile compare them. A CRC of 0 on a non-empty member means "not recorded".
    with zipfile.ZipFile(_Window(fd, start, length)) as z:
        for info in z.infolist():
            if info.CRC == 0 and info.file_size:
                continue
            with z.open(info) as member:
                while member.read(1 << 20):
                    pass


def _local_copies(path: str, rels: list[str]) -> Iterator[tuple[str, str]]:
    # (rel, local file) one at a time: local files as they are, remote ones downloaded to a temporary file.
    storage = storage_for(path)
    local = storage.local_path(path)
    for rel in rels:
        if local is not None:
            yield rel, os.path.join(local, rel)
            continue
        with tempfile.NamedTemporaryFile(prefix="ckptkeeper-verify-") as tmp:
            try:
                storage.download(storage.join(path, rel), tmp.name)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"checkpoint {path} is corrupt: missing file {rel}") from None
            yield rel, tmp.name


def _verify_olmo_crc(path: str, record: OlmoCoreRecord, metadata: Metadata, where: str | None = None) -> None:
    where = where or path
    items: dict[str, list[tuple[str, int, int]]] = {}
    for index, info in (metadata.storage_data or {}).items():
        items.setdefault(f"{MODEL_DIR}/{info.relative_path}", []).append((index.fqn, info.offset, info.length))
    for rel in record.files:
        if _OLMO_TRAIN_RE.match(rel):
            items[rel] = [(rel, 0, record.files[rel].bytes)]
    for rel, local_file in _local_copies(path, sorted(items)):
        try:
            fd = os.open(local_file, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"checkpoint {where} is corrupt: missing file {rel}") from None
        except OSError as exc:
            raise CorruptCheckpointError(f"checkpoint {where}: cannot read {rel} ({exc.strerror})") from None
        try:
            for name, start, length in sorted(items[rel], key=lambda item: item[1]):
                try:
                    _check_zip_crcs(fd, start, length)
                except Exception as exc:
                    raise CorruptCheckpointError(
                        f"checkpoint {where} is corrupt: the torch.save record of {name[:80]!r} in {rel} (bytes "
                        f"{start}-{start + length}) fails its check ({type(exc).__name__}: {str(exc)[:200]}); load "
                        "an earlier checkpoint or restore this one from a copy"
                    ) from None
        finally:
            os.close(fd)
