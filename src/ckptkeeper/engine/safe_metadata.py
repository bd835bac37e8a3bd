"""Reading DCP's ``.metadata`` without executing code from the checkpoint.

Stock DCP stores its metadata as a pickle and reads it with ``pickle.load``, which runs whatever
a tampered file asks for. No library offers a restricted loader for this file, so this one is
hand-written: an unpickler that resolves only the handful of plain-data classes DCP writes and
refuses everything else with :class:`UnsafeCheckpointError`.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ..errors import UnsafeCheckpointError

__all__ = ["SafeFileSystemReader", "safe_load_metadata"]

_ALLOWED_MODULES = {
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint.planner",
}
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("torch._utils", "_rebuild_tensor_v2"),
}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _ALLOWED_MODULES and not name.startswith("__"):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "torch" and name in ("strided", "sparse_coo", "contiguous_format", "channels_last"):
            return getattr(torch, name)
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"DCP metadata asks for {module}.{name}, which is not plain checkpoint data; refusing to load it. "
            "The file may be tampered with: restore the checkpoint from a trusted copy"
        )


def safe_load_metadata(data: bytes) -> Metadata:
    """Decode DCP metadata bytes, refusing any class outside DCP's own plain-data types."""
    obj = _RestrictedUnpickler(io.BytesIO(data)).load()
    if not isinstance(obj, Metadata):
        raise UnsafeCheckpointError(f"DCP metadata decoded to {type(obj).__name__}, not Metadata")
    return obj


class SafeFileSystemReader(FileSystemReader):
    """DCP's filesystem reader with the metadata pickle read through the allow-list above."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = safe_load_metadata(f.read())
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata
