"""The commit record (``step{N}/.metadata.json``): what makes a checkpoint complete.

A checkpoint is complete if and only if its record exists, parses, and every file it lists
exists with the listed size. Checksums (xxh3-64, from the ``xxhash`` library) are checked when
a checkpoint is verified or loaded, so a flipped bit is caught before any tensor is touched.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import xxhash

from ..errors import CorruptCheckpointError

__all__ = ["FORMAT_VERSION", "CommitRecord", "FileEntry", "hash_file", "new_hasher"]

FORMAT_VERSION = 1
_FORMAT = "ckptkeeper"
_CHUNK = 8 << 20


def new_hasher() -> Any:
    """A streaming xxh3-64 hasher (``update(bytes)``, ``hexdigest()``)."""
    return xxhash.xxh3_64()


def hash_file(path: str) -> tuple[int, str]:
    """Size and xxh3-64 hex digest of a local file, read in large chunks."""
    h = new_hasher()
    n = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while True:
            got = f.readinto(buf)
            if not got:
                break
            h.update(view[:got])
            n += got
    return n, h.hexdigest()


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: size in bytes and xxh3-64 checksum (hex)."""

    bytes: int
    xxh3_64: str


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
        """The record as UTF-8 JSON."""
        doc = {
            "format": _FORMAT,
            "version": self.version,
            "step": self.step,
            "ephemeral": self.ephemeral,
            "world_size": self.world_size,
            "created_unix": self.created_unix,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created_unix)),
            "checksum": "xxh3_64",
            "files": {k: {"bytes": v.bytes, "xxh3_64": v.xxh3_64} for k, v in sorted(self.files.items())},
            "extra": dict(self.extra),
        }
        return json.dumps(doc, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> CommitRecord:
        """Parse a record; CorruptCheckpointError names ``where`` when it is malformed."""
        try:
            doc = json.loads(data)
            if doc.get("format") != _FORMAT:
                raise ValueError("not a ckptkeeper commit record")
            if int(doc["version"]) > FORMAT_VERSION:
                raise ValueError(
                    f"format version {doc['version']} is newer than this ckptkeeper understands "
                    f"({FORMAT_VERSION}); upgrade ckptkeeper"
                )
            files = {str(k): FileEntry(int(v["bytes"]), str(v["xxh3_64"])) for k, v in doc["files"].items()}
            return cls(
                step=int(doc["step"]),
                ephemeral=bool(doc["ephemeral"]),
                world_size=int(doc["world_size"]),
                files=files,
                created_unix=float(doc["created_unix"]),
                version=int(doc["version"]),
                extra=dict(doc.get("extra", {})),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptCheckpointError(
                f"commit record {where} is malformed ({exc}); the checkpoint cannot be trusted: "
                "load an earlier checkpoint or delete this folder"
            ) from exc
