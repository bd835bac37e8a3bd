"""The commit record (``step{N}/.metadata.json``): what makes a checkpoint complete.

A checkpoint is complete if and only if its record exists, parses, and every file it lists
exists with the listed size. Checksums (xxh3-64, from the ``xxhash`` library) are checked when
a checkpoint is verified or loaded.

The record is the root of trust, so it checks itself: it carries an xxh3-64 of its own bytes
(with that field blanked), and every field is type-checked on read. Everything read from it is
bounded: its size, its nesting, its numbers, and its file names (plain relative paths only).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import xxhash

from ..errors import CorruptCheckpointError, NewerFormatError
from ..storage.layout import COMMIT_RECORD, MAX_STEP, MODEL_DIR, check_relpath, train_state_name
from ..storage.local import open_regular

__all__ = [
    "FORMAT_VERSION",
    "MAX_RECORD_BYTES",
    "MAX_STATE_BYTES",
    "NEWER_FORMAT",
    "CommitRecord",
    "FileEntry",
    "check_digest",
    "digest_bytes",
    "hash_file",
    "loads_bounded",
    "new_hasher",
    "record_is_ours",
    "record_owner",
]

FORMAT_VERSION = 2
"""2: the record carries ``record_xxh3_64``, a checksum of itself. 1 (still read): without it."""
MAX_RECORD_BYTES = 64 << 20
"""The largest commit record ckptkeeper reads."""
MAX_STATE_BYTES = 256 << 20
"""The largest trainer-state file ckptkeeper reads."""
_FORMAT = "ckptkeeper"
_CHUNK = 8 << 20
_HEX16 = re.compile(r"^[0-9a-f]{16}$")
_SELF_KEY = "record_xxh3_64"
_SELF_HEAD = b'{\n "' + _SELF_KEY.encode() + b'": "'
_SELF_TAIL = b'",\n'
_BLANK = b"0" * 16

_MAX_VERSION = 1 << 30

NEWER_FORMAT = "checkpoint written by a newer ckptkeeper"
"""How the message of a :class:`~ckptkeeper.errors.NewerFormatError` from a commit record starts
(and so the ``problem`` that ``ls`` shows for such a checkpoint)."""


def _refuse_newer(doc: Any, where: str, data: bytes | None = None) -> None:
    """NewerFormatError when ``doc`` is a record of a newer format whose seal holds (``data``:
    its bytes, when the seal is still to be checked).

    Told apart from a damaged version field by the record's own checksum, which every format
    since 2 puts first and later formats must keep: resume does not fall back past such a
    checkpoint (its steps would be saved again over it). Checked before anything else of this
    version's rules, which a newer format need not follow.
    """
    version = doc.get("version") if isinstance(doc, dict) and doc.get("format") == _FORMAT else None
    if type(version) is int and FORMAT_VERSION < version <= _MAX_VERSION and (data is None or _seal_holds(data)):
        raise NewerFormatError(
            f"{NEWER_FORMAT}: its commit record {where} is format version {version}, and this "
            f"ckptkeeper reads versions up to {FORMAT_VERSION}; upgrade ckptkeeper to load it"
        )


def _seal_placed(data: bytes) -> bool:
    """Whether a record starts with its own checksum's field (whatever the checksum says)."""
    head = len(_SELF_HEAD)
    return data.startswith(_SELF_HEAD) and data[head + 16 : head + 16 + len(_SELF_TAIL)] == _SELF_TAIL


def _seal_holds(data: bytes) -> bool:
    """Whether a record's own checksum, in its place at the start, matches the rest of it."""
    if not _seal_placed(data):
        return False
    head = len(_SELF_HEAD)
    return data[head : head + 16].decode("ascii", "replace") == digest_bytes(data[:head] + _BLANK + data[head + 16 :])


_MAX_FILES = 1 << 20
_MAX_FILE_BYTES = 1 << 52


def new_hasher() -> Any:
    """A streaming xxh3-64 hasher (``update(bytes)``, ``hexdigest()``)."""
    return xxhash.xxh3_64()


def digest_bytes(data: bytes | memoryview) -> str:
    """xxh3-64 hex digest of ``data``."""
    return str(xxhash.xxh3_64_hexdigest(data))


def hash_file(
    path: str, follow_links: bool = True, each: Callable[[int, memoryview], None] | None = None
) -> tuple[int, str]:
    """Size and xxh3-64 hex digest of a local file, read in large chunks.

    ``follow_links=False`` refuses a file that is a symlink (OSError), as checkpoint reads do.
    ``each(offset, chunk)`` is called with every chunk read, in file order (verify checks each
    segment's checksum in the same read).
    """
    h = new_hasher()
    n = 0
    with os.fdopen(open_regular(path, follow_links), "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while True:
            got = f.readinto(buf)
            if not got:
                break
            h.update(view[:got])
            if each is not None:
                each(n, view[:got])
            n += got
    return n, h.hexdigest()


def _depth(doc: Any, limit: int) -> int:
    # Iterative, so a deep document cannot exhaust the stack here (json's own parser stops at
    # Python's recursion limit and raises RecursionError, which is caught as corruption).
    deepest = 0
    stack = [(doc, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, level)
            if deepest > limit:
                return deepest
            stack.extend((v, level + 1) for v in (node.values() if isinstance(node, dict) else node))
    return deepest


_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")


def _text_depth(text: str) -> int:
    """The deepest nesting of a JSON text that parsed: its brackets outside strings, counted in C
    (walking a parsed table of 30,000 rows object by object took longer than reading the tensors)."""
    import numpy as np

    brackets = _NOT_BRACKETS.sub("", _STRINGS.sub("", text)).encode()
    if not brackets:
        return 0
    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1)
    return int(np.cumsum(steps).max())


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number a checkpoint stores here")


def loads_bounded(
    data: bytes, where: str, *, max_bytes: int, max_depth: int | None, allow_nonfinite: bool = False
) -> Any:
    """Parse JSON from a checkpoint with limits on size, nesting and numbers.

    ``max_depth=None`` leaves nesting to the caller, who must accept only a fixed shape (the
    segment tables: checking 30,000 rows' depth here cost more than reading their tensors).

    Any problem (not UTF-8, not JSON, too large, too deep, an infinite or huge number) raises
    :class:`CorruptCheckpointError` naming ``where``; nothing else escapes.
    """
    try:
        if len(data) > max_bytes:
            raise ValueError(f"{len(data)} bytes, more than the {max_bytes} ckptkeeper reads")
        text = data.decode("utf-8")
        kwargs: dict[str, Any] = {}
        if not allow_nonfinite:
            kwargs["parse_constant"] = _no_constant
        doc = json.loads(text, **kwargs)
        if max_depth is None:
            return doc
        deep = _text_depth(text) if len(text) > 1 << 16 else _depth(doc, max_depth)
        if deep > max_depth:
            raise ValueError(f"nested more than {max_depth} levels deep")
        return doc
    except (ValueError, UnicodeDecodeError, RecursionError, MemoryError, OverflowError, TypeError) as exc:
        raise CorruptCheckpointError(
            f"{where} is malformed ({type(exc).__name__}: {str(exc)[:200]}); the checkpoint cannot be trusted: "
            "load an earlier checkpoint (resume does this automatically) or restore it from a copy"
        ) from None


def check_digest(where: str, rel: str, entry: FileEntry, data: bytes) -> None:
    """Raise CorruptCheckpointError unless ``data`` has the size and checksum ``entry`` lists."""
    if len(data) != entry.bytes:
        problem = f"{rel} has {len(data)} bytes, the commit record says {entry.bytes}"
    else:
        digest = digest_bytes(data)
        if digest == entry.xxh3_64:
            return
        problem = f"{rel} has checksum {digest}, the commit record says {entry.xxh3_64}"
    raise CorruptCheckpointError(
        f"checkpoint {where} is corrupt: {problem}; load an earlier checkpoint or restore this one from a copy"
    )


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: size in bytes and xxh3-64 checksum (hex)."""

    bytes: int
    xxh3_64: str


def _int(value: Any, name: str, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"{name} is {str(value)[:40]!r}, expected an integer in [{low}, {high}]")
    return value


@dataclass(frozen=True)
class CommitRecord:
    """Everything needed to decide whether a checkpoint is complete and intact."""

    step: int
    ephemeral: bool
    world_size: int
    files: Mapping[str, FileEntry]
    created_unix: float = field(default_factory=time.time)
    version: int = FORMAT_VERSION
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        """Sum of the listed files' sizes."""
        return sum(e.bytes for e in self.files.values())

    def to_json(self) -> bytes:
        """The record as UTF-8 JSON, its first field a checksum of the whole with that field blanked."""
        doc = {
            _SELF_KEY: _BLANK.decode(),
            "format": _FORMAT,
            "version": FORMAT_VERSION,
            "step": self.step,
            "ephemeral": self.ephemeral,
            "world_size": self.world_size,
            "created_unix": self.created_unix,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created_unix)),
            "checksum": "xxh3_64",
            "files": {k: {"bytes": v.bytes, "xxh3_64": v.xxh3_64} for k, v in sorted(self.files.items())},
            "extra": dict(self.extra),
        }
        blank = json.dumps(doc, indent=1, allow_nan=False).encode()
        assert blank.startswith(_SELF_HEAD + _BLANK + _SELF_TAIL)
        return _SELF_HEAD + digest_bytes(blank).encode() + blank[len(_SELF_HEAD) + 16 :]

    @classmethod
    def from_json(cls, data: bytes, where: str) -> CommitRecord:
        """Parse and check a record; CorruptCheckpointError names ``where`` when it is malformed."""
        # The record's own fields have a fixed shape that _from_doc checks; only 'extra' is free
        # form, so nesting is bounded there (a regex pass over a 300 KB record of 3,000 files
        # cost ls more than listing the files).
        try:
            doc = loads_bounded(data, f"commit record {where}", max_bytes=MAX_RECORD_BYTES, max_depth=None)
        except CorruptCheckpointError:
            # A newer format need not keep this version's parsing rules either (NaN metrics, say,
            # which an outside attack used to have a newer checkpoint counted as damaged).
            lenient = None
            if len(data) <= MAX_RECORD_BYTES and _seal_holds(data):
                with contextlib.suppress(CorruptCheckpointError):
                    lenient = loads_bounded(
                        data, where, max_bytes=MAX_RECORD_BYTES, max_depth=None, allow_nonfinite=True
                    )
            _refuse_newer(lenient, where)
            raise
        _refuse_newer(doc, where, data)
        if isinstance(doc, dict) and _depth(doc.get("extra"), 14) > 14:
            raise CorruptCheckpointError(
                f"commit record {where} is malformed ('extra' is nested more than 14 levels deep); the "
                "checkpoint cannot be trusted: load an earlier checkpoint (resume does this automatically) or "
                "restore it from a copy"
            )
        try:
            return cls._from_doc(doc, data)
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as exc:
            raise CorruptCheckpointError(
                f"commit record {where} is malformed ({str(exc)[:300]}); the checkpoint cannot be trusted: "
                "load an earlier checkpoint (resume does this automatically) or restore it from a copy"
            ) from None

    @classmethod
    def _from_doc(cls, doc: Any, data: bytes) -> CommitRecord:
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
            raise ValueError("not a ckptkeeper commit record")
        version = _int(doc.get("version"), "version", 1, _MAX_VERSION)
        if version > FORMAT_VERSION:  # (a sealed one was a NewerFormatError already)
            raise ValueError(
                f"it claims format version {version}, newer than this ckptkeeper's {FORMAT_VERSION}, but its "
                f"own checksum ({_SELF_KEY}) does not match: damaged"
            )
        if version >= 2 or _SELF_KEY in doc:
            if not _seal_placed(data):
                raise ValueError(f"its own checksum ({_SELF_KEY}) is missing or misplaced")
            if not _seal_holds(data):
                raise ValueError("its own checksum does not match its content (changed after it was written)")
        files_doc = doc["files"]
        if not isinstance(files_doc, dict) or len(files_doc) > _MAX_FILES:
            raise ValueError("'files' is not a table of files")
        files: dict[str, FileEntry] = {}
        for rel, entry in files_doc.items():
            problem = check_relpath(rel)
            if problem is None and rel == COMMIT_RECORD:
                problem = "the record lists itself"
            if problem is not None:
                raise ValueError(problem)
            if not isinstance(entry, dict):
                raise ValueError(f"entry of {rel} is not a table")
            digest = entry.get("xxh3_64")
            if not isinstance(digest, str) or not _HEX16.match(digest):
                raise ValueError(f"checksum of {rel} is {str(digest)[:40]!r}, not 16 hex digits")
            files[rel] = FileEntry(_int(entry.get("bytes"), f"size of {rel}", 0, _MAX_FILE_BYTES), digest)
        created = doc["created_unix"]
        if type(created) not in (int, float) or not math.isfinite(created) or created < 0:
            raise ValueError(f"created_unix is {str(created)[:40]!r}")
        ephemeral = doc["ephemeral"]
        if type(ephemeral) is not bool:
            raise ValueError(f"ephemeral is {str(ephemeral)[:40]!r}, not true or false")
        for needed in (f"{MODEL_DIR}/.metadata", train_state_name(0)):
            if needed not in files:
                raise ValueError(f"it does not list {needed}, which every checkpoint has")
        extra = doc.get("extra", {})
        if not isinstance(extra, dict):
            raise ValueError("'extra' is not a table")
        layout = extra.get("layout")
        if layout is not None and (
            not isinstance(layout, dict) or not all(isinstance(v, list) and k in files for k, v in layout.items())
        ):
            raise ValueError("'extra.layout' is not a table of data files and their segments")
        check_metrics(extra.get("metrics", {}))
        return cls(
            step=_int(doc["step"], "step", 0, MAX_STEP),
            ephemeral=ephemeral,
            world_size=_int(doc["world_size"], "world_size", 1, 1 << 24),
            files=files,
            created_unix=float(created),
            version=version,
            extra=extra,
        )


def check_metrics(metrics: Any) -> dict[str, float]:
    """``metrics`` as a table of names to finite numbers (what retention ranks by); ValueError otherwise."""
    if not isinstance(metrics, dict) or len(metrics) > 256:
        raise ValueError("'metrics' is not a table of at most 256 names and numbers")
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not 0 < len(name) <= 200:
            raise ValueError(f"metric name {str(name)[:40]!r} is not a string of 1 to 200 characters")
        try:
            number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        except OverflowError:  # an int beyond float's range
            number = None
        if number is None or not math.isfinite(number):
            raise ValueError(f"metric {name!r} is {str(value)[:40]!r}, not a finite number")
        out[name] = number
    return out


def record_owner(data: bytes) -> Literal["ours", "newer", "foreign"]:
    """Who wrote a ``.metadata.json``, read once: ``"newer"`` for the intact record of a newer
    ckptkeeper's checkpoint (see :class:`~ckptkeeper.errors.NewerFormatError`; this version
    neither loads nor replaces it), ``"ours"`` for any other record :func:`record_is_ours`
    accepts, ``"foreign"`` for the rest (a newer record too, when the damaged-record rule below
    does not find it ours)."""
    newer = False
    try:
        CommitRecord.from_json(data, "record")
        return "ours"
    except NewerFormatError:
        newer = True
    except CorruptCheckpointError:
        pass
    try:
        doc = json.loads(data[: 1 << 20])
    except (ValueError, RecursionError):
        return "foreign"
    if not (isinstance(doc, dict) and doc.get("format") == "ckptkeeper"):
        return "foreign"
    return "newer" if newer else "ours"


def record_is_ours(data: bytes) -> bool:
    """Whether a ``.metadata.json`` was written by ckptkeeper: a valid commit record, or a damaged
    one that still says ``"format": "ckptkeeper"``. Anyone else's file of that name (OLMo-core's
    marker, a user's notes) is not, and nothing next to it is ever deleted."""
    return record_owner(data) != "foreign"
