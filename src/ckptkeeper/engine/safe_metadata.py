"""Reading DCP's ``.metadata`` without executing code from the checkpoint.

Stock DCP stores its metadata as a pickle and reads it with ``pickle.load``, which runs whatever
a tampered file asks for. No library offers a restricted loader for this file, so this one is
hand-written: an unpickler that resolves only an exact list of (module, name) pairs, the
plain-data classes DCP writes. ``find_class`` is never handed to the default resolver with a
name it has not matched exactly, because pickle resolves dotted names (``os.system`` inside an
allowed module) by walking attributes. The decoded object is then checked field by field: file
names must be plain names inside the checkpoint, offsets and lengths non-negative integers.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import torch
import torch.serialization
from torch.distributed.checkpoint import filesystem as _dcp_fs
from torch.distributed.checkpoint import metadata as _dcp_md
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ..errors import CorruptCheckpointError, UnsafeCheckpointError
from ..storage.layout import check_relpath

__all__ = ["MAX_METADATA_BYTES", "SafeFileSystemReader", "allowed_globals", "safe_load_metadata"]

MAX_METADATA_BYTES = 512 << 20
"""The largest DCP ``.metadata`` ckptkeeper decodes."""

_MD = "torch.distributed.checkpoint.metadata"
_MD_NAMES = (
    "Metadata",
    "MetadataIndex",
    "StorageMeta",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "_MEM_FORMAT_ENCODING",
)


def _exact_table() -> dict[tuple[str, str], Any]:
    # Every allowed name maps to the object itself, looked up here once: the unpickler returns
    # these objects and never asks the import system or getattr for anything.
    table: dict[tuple[str, str], Any] = {(_MD, n): getattr(_dcp_md, n) for n in _MD_NAMES if hasattr(_dcp_md, n)}
    table[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _dcp_fs._StorageInfo
    table[("torch", "Size")] = torch.Size
    table[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    table[("pathlib", "PosixPath")] = pathlib.PurePosixPath
    table[("pathlib", "PurePosixPath")] = pathlib.PurePosixPath
    table[("collections", "OrderedDict")] = OrderedDict
    for name, value in vars(torch).items():
        if isinstance(value, (torch.dtype, torch.memory_format, torch.layout)):
            table[("torch", name)] = value
    return table


_TABLE = _exact_table()


def allowed_globals() -> Iterable[tuple[str, str]]:
    """The exact (module, name) pairs a DCP ``.metadata`` pickle may refer to."""
    return sorted(_TABLE)


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return _TABLE[(module, name)]
        except (KeyError, TypeError):
            raise UnsafeCheckpointError(
                f"DCP metadata asks for {module}.{name}, which is not plain checkpoint data; refusing to load it. "
                "The file may be tampered with: restore the checkpoint from a trusted copy"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError("DCP metadata refers to a persistent object; refusing to load it")


def _corrupt(where: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{where} is not valid DCP metadata ({why}); load an earlier checkpoint or restore this one from a copy"
    )


def _check_index(where: str, index: Any) -> None:
    if type(index) is not _dcp_md.MetadataIndex or not isinstance(index.fqn, str):
        raise _corrupt(where, f"storage key {type(index).__name__} is not a MetadataIndex")


def safe_load_metadata(data: bytes, where: str = ".metadata", files: Iterable[str] | None = None) -> Metadata:
    """Decode DCP metadata bytes without running code from them.

    Refuses any class outside DCP's own plain-data types (:class:`UnsafeCheckpointError`); any other
    problem, including a file name that is not a plain name (or, given ``files``, not one of
    them), is a :class:`CorruptCheckpointError` naming ``where``.
    """
    if len(data) > MAX_METADATA_BYTES:
        raise _corrupt(where, f"{len(data)} bytes, more than the {MAX_METADATA_BYTES} ckptkeeper reads")
    try:
        obj = _RestrictedUnpickler(io.BytesIO(data)).load()
    except UnsafeCheckpointError:
        raise
    except (Exception, MemoryError, RecursionError) as exc:
        raise _corrupt(where, f"{type(exc).__name__}: {exc}") from None
    if type(obj) is not Metadata:
        raise UnsafeCheckpointError(f"{where} decoded to {type(obj).__name__}, not DCP Metadata; refusing it")
    known = set(files) if files is not None else None
    sd_meta = getattr(obj, "state_dict_metadata", None)
    storage = getattr(obj, "storage_data", None)
    if not isinstance(sd_meta, dict) or not all(isinstance(k, str) for k in sd_meta):
        raise _corrupt(where, "state_dict_metadata is not a table of names")
    for fqn, entry in sd_meta.items():
        if type(entry) not in (_dcp_md.TensorStorageMetadata, _dcp_md.BytesStorageMetadata):
            raise _corrupt(where, f"entry {fqn[:80]!r} is a {type(entry).__name__}")
    if storage is not None:
        if not isinstance(storage, dict):
            raise _corrupt(where, "storage_data is not a table")
        for index, info in storage.items():
            _check_index(where, index)
            if type(info) is not _dcp_fs._StorageInfo:
                raise _corrupt(where, f"storage entry of {index.fqn[:80]!r} is a {type(info).__name__}")
            rel = info.relative_path
            problem = check_relpath(rel)
            if problem is None and "/" in rel:
                problem = f"data file {rel[:80]!r} is not a plain file name"
            if problem is None and known is not None and rel not in known:
                problem = f"data file {rel[:80]!r} is not a file of this checkpoint"
            if problem is not None:
                raise _corrupt(where, problem)
            for field in ("offset", "length"):
                value = getattr(info, field)
                if type(value) is not int or value < 0:
                    raise _corrupt(where, f"{field} of {index.fqn[:80]!r} is {value!r}")
            if getattr(info, "transform_descriptors", None) is not None:
                raise _corrupt(where, f"{index.fqn[:80]!r} asks for storage transforms, which ckptkeeper does not read")
    return obj


class SafeFileSystemReader(FileSystemReader):
    """DCP's filesystem reader with the metadata pickle read through the allow-list above.

    ``files`` names the data files the checkpoint's commit record lists; metadata that points
    anywhere else is refused.
    """

    def __init__(self, path: str, files: Iterable[str] | None = None) -> None:
        super().__init__(path)
        self._files = list(files) if files is not None else None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = safe_load_metadata(f.read(MAX_METADATA_BYTES + 1), str(path), self._files)
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata
