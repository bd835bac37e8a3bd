"""Reading DCP's ``.metadata`` without executing code from the checkpoint.

Stock DCP stores its metadata as a pickle and reads it with ``pickle.load``, which runs whatever
a tampered file asks for. No library offers a restricted loader for this file, so this one is
hand-written: an unpickler that resolves only an exact list of (module, name) pairs, the
plain-data classes DCP writes. ``find_class`` is never handed to the default resolver with a
name it has not matched exactly, because pickle resolves dotted names (``os.system`` inside an
allowed module) by walking attributes. The decoded object is then checked field by field: file
names must be plain names inside the checkpoint, offsets and lengths non-negative integers.

OLMo-core writes the same DCP metadata, except that each storage entry is its own
``olmo_core.distributed.checkpoint.filesystem._StorageInfo`` (the same three fields as DCP's).
With ``olmo_core=True`` that exact pair is allowed too, decoded into a plain stand-in here (never by
importing olmo_core), checked like DCP's, and handed on as DCP's own ``_StorageInfo``, so DCP's
reader reads OLMo-core checkpoints. OLMo-core's trainer state (``train/rank{R}.pt``) is a
``torch.save`` file: :func:`safe_load_train_state` reads it with ``torch.load(weights_only=True)``
and returns plain data.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pathlib
import pickle
import threading
import types
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
import torch.serialization
from torch.distributed.checkpoint import filesystem as _dcp_fs
from torch.distributed.checkpoint import metadata as _dcp_md
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ..errors import CorruptCheckpointError, UnsafeCheckpointError
from ..storage.layout import check_relpath
from ..storage.local import open_regular

__all__ = [
    "MAX_METADATA_BYTES",
    "MAX_TRAIN_STATE_BYTES",
    "OLMO_CORE_STORAGE_INFO",
    "OlmoCoreStorageInfo",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "allowed_globals",
    "plain_data",
    "safe_load_metadata",
    "safe_load_train_state",
]

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


@dataclass
class OlmoCoreStorageInfo:
    """Plain-data stand-in for OLMo-core's ``_StorageInfo`` while its pickle is decoded."""

    relative_path: str
    offset: int
    length: int


OLMO_CORE_STORAGE_INFO = ("olmo_core.distributed.checkpoint.filesystem", "_StorageInfo")
"""The one class OLMo-core's DCP metadata adds to DCP's own, as an exact (module, name) pair."""

_TABLE = _exact_table()
_OLMO_TABLE = {**_TABLE, OLMO_CORE_STORAGE_INFO: OlmoCoreStorageInfo}


def allowed_globals(olmo_core: bool = False) -> Iterable[tuple[str, str]]:
    """The exact (module, name) pairs a DCP ``.metadata`` pickle may refer to (of an OLMo-core checkpoint)."""
    return sorted(_OLMO_TABLE if olmo_core else _TABLE)


def _shadowed(table: Mapping[tuple[str, str], Any]) -> dict[tuple[str, str], Any]:
    """The table with every Python-level class and function replaced by a fresh stand-in.

    Pickle's BUILD opcode sets attributes on whatever object it is given, classes included, so a
    file could otherwise change an allowed class (or function) for the whole process. Each decode
    gets its own subclasses and wrappers; :func:`_realize` then rebuilds the result from the real
    classes, so nothing a file did to a stand-in outlives the decode.
    """
    out: dict[tuple[str, str], Any] = {}
    for key, value in table.items():
        if isinstance(value, type) and issubclass(value, enum.Enum):
            out[key] = (lambda cls: lambda *args: cls(*args))(value)
        elif isinstance(value, type) and value.__module__ != "builtins" and value not in (torch.Size, OrderedDict):
            out[key] = type(value.__name__, (value,), {"__module__": __name__})
        elif isinstance(value, types.FunctionType):
            out[key] = (lambda fn: lambda *args: fn(*args))(value)
        else:
            out[key] = value
    return out


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, table: Mapping[tuple[str, str], Any]) -> None:
        super().__init__(file)
        self._table = _shadowed(table)

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._table[(module, name)]
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


_LIMIT = 1 << 62


def _short(value: Any) -> str:
    try:
        text = repr(value)
    except Exception:  # huge ints refuse repr(); a hostile object may refuse anything
        text = f"<a {type(value).__name__}>"
    return text[:60]


def _own(obj: Any, cls: type, where: str, what: str) -> dict[str, Any]:
    """The instance attributes of ``obj`` (a stand-in of ``cls``): exactly the declared fields."""
    if not isinstance(obj, cls):
        raise _corrupt(where, f"{what} is a {type(obj).__name__}, not a {cls.__name__}")
    attrs = dict(vars(obj))
    fields = {f.name: f for f in dataclasses.fields(cls)}
    extra = set(attrs) - set(fields)
    if extra:
        raise _corrupt(where, f"{what} carries undeclared attributes {sorted(map(str, extra))[:4]}")
    # A field missing from an older torch's file takes its declared default.
    for name, f in fields.items():
        if name not in attrs:
            if f.default is not dataclasses.MISSING:
                attrs[name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                attrs[name] = f.default_factory()
            else:
                raise _corrupt(where, f"{what} has no {name}")
    return attrs


def _int(value: Any, where: str, what: str, optional: bool = False) -> Any:
    if optional and value is None:
        return None
    if type(value) is not int or not 0 <= value < _LIMIT:
        raise _corrupt(where, f"{what} is {_short(value)}, not a non-negative integer")
    return value


def _size(value: Any, where: str, what: str, optional: bool = False) -> Any:
    if optional and value is None:
        return None
    if type(value) is not torch.Size or len(value) > 64:
        raise _corrupt(where, f"{what} is {_short(value)}, not a torch.Size")
    return torch.Size([_int(n, where, what) for n in value])


def _realize(obj: Any, where: str, olmo_core: bool) -> Metadata:
    """Rebuild decoded metadata from the real DCP classes, checking every field on the way.

    The decode produced per-load stand-ins (see :func:`_shadowed`); what DCP gets is made here from
    plain values only, so no attribute a file set on a stand-in reaches it.
    """
    top = _own(obj, Metadata, where, "the top-level object")
    sd_in = top["state_dict_metadata"]
    if not isinstance(sd_in, dict) or len(sd_in) > 10_000_000:
        raise _corrupt(where, "state_dict_metadata is not a table")
    sd: dict[str, Any] = {}
    for fqn, entry in sd_in.items():
        if type(fqn) is not str:
            raise _corrupt(where, "state_dict_metadata has a key that is not a name")
        what = f"entry {fqn[:80]!r}"
        if isinstance(entry, _dcp_md.BytesStorageMetadata):
            _own(entry, _dcp_md.BytesStorageMetadata, where, what)
            if not olmo_core:
                # ckptkeeper keeps non-tensor state in JSON, so its DCP files never hold pickled objects.
                raise UnsafeCheckpointError(
                    f"{where} declares {fqn[:80]!r} as a pickled object, which ckptkeeper never writes; refusing "
                    "it. The file may be tampered with: restore the checkpoint from a trusted copy"
                )
            sd[fqn] = _dcp_md.BytesStorageMetadata()
            continue
        attrs = _own(entry, _dcp_md.TensorStorageMetadata, where, what)
        props = _own(attrs["properties"], _dcp_md.TensorProperties, where, f"{what}'s properties")
        checks = {"dtype": torch.dtype, "layout": torch.layout, "memory_format": torch.memory_format,
                  "requires_grad": bool, "pin_memory": bool}  # fmt: skip
        for name, kind in checks.items():
            if type(props[name]) is not kind:
                raise _corrupt(where, f"{what}'s {name} is {_short(props[name])}")
        chunks_in = attrs["chunks"]
        if not isinstance(chunks_in, list) or len(chunks_in) > 1_000_000:
            raise _corrupt(where, f"{what}'s chunks are not a list")
        size = _size(attrs["size"], where, f"{what}'s size")
        chunks = []
        for chunk in chunks_in:
            c = _own(chunk, _dcp_md.ChunkStorageMetadata, where, f"a chunk of {what}")
            offsets, sizes = _size(c["offsets"], where, "a chunk offset"), _size(c["sizes"], where, "a chunk size")
            if len(offsets) != len(size) or len(sizes) != len(size):
                raise _corrupt(where, f"a chunk of {what} has the wrong number of dimensions")
            chunks.append(_dcp_md.ChunkStorageMetadata(offsets=offsets, sizes=sizes))
        sd[fqn] = _dcp_md.TensorStorageMetadata(properties=_dcp_md.TensorProperties(**props), size=size, chunks=chunks)
    storage_in = top["storage_data"]
    storage: dict[Any, Any] | None = None
    if storage_in is not None:
        if not isinstance(storage_in, dict):
            raise _corrupt(where, "storage_data is not a table")
        storage = {}
        info_cls: tuple[type, ...] = (
            (_dcp_fs._StorageInfo, OlmoCoreStorageInfo) if olmo_core else (_dcp_fs._StorageInfo,)
        )
        for index, info in storage_in.items():
            i = _own(index, _dcp_md.MetadataIndex, where, "a storage key")
            if type(i["fqn"]) is not str:
                raise _corrupt(where, "a storage key has no name")
            key = _dcp_md.MetadataIndex(
                fqn=i["fqn"], offset=_size(i["offset"], where, "a storage key offset", optional=True),
                index=_int(i["index"], where, "a storage key index", optional=True),
            )  # fmt: skip
            if not isinstance(info, info_cls):
                raise _corrupt(where, f"storage entry of {key.fqn[:80]!r} is a {type(info).__name__}")
            v = _own(info, type(info).__mro__[1], where, f"storage entry of {key.fqn[:80]!r}")
            if v.get("transform_descriptors") is not None:
                raise _corrupt(where, f"{key.fqn[:80]!r} asks for storage transforms, which ckptkeeper does not read")
            if type(v["relative_path"]) is not str:
                raise _corrupt(where, f"storage entry of {key.fqn[:80]!r} names no file")
            storage[key] = _dcp_fs._StorageInfo(
                v["relative_path"], _int(v["offset"], where, "an offset"), _int(v["length"], where, "a length")
            )
    meta_in = top["storage_meta"]
    storage_meta = None
    if meta_in is not None:
        m = _own(meta_in, StorageMeta, where, "storage_meta")
        ident = m["checkpoint_id"]
        storage_meta = StorageMeta(
            checkpoint_id=str(ident) if isinstance(ident, (str, pathlib.PurePath)) else None,
            save_id=m["save_id"] if isinstance(m["save_id"], str) else "",
            load_id=None,
            modules=[x for x in m["modules"] if isinstance(x, str)] if isinstance(m["modules"], list) else [],
        )
    planner = top["planner_data"]
    version = top["version"]
    return Metadata(
        state_dict_metadata=sd,
        planner_data=planner if _plain(planner) else None,
        storage_data=storage,
        storage_meta=storage_meta,
        version=version if isinstance(version, str) or version is None else None,
    )


def _plain(value: Any, depth: int = 0) -> bool:
    if depth > 16:
        return False
    if value is None or type(value) in (str, int, float, bool):
        return True
    if type(value) in (list, tuple):
        return all(_plain(v, depth + 1) for v in value)
    if type(value) in (dict, OrderedDict):
        return all(type(k) is str and _plain(v, depth + 1) for k, v in value.items())
    return False


def safe_load_metadata(
    data: bytes, where: str = ".metadata", files: Iterable[str] | None = None, *, olmo_core: bool = False
) -> Metadata:
    """Decode DCP metadata bytes without running code from them.

    Refuses any class outside DCP's own plain-data types (:class:`UnsafeCheckpointError`); any other
    problem, including a file name that is not a plain name (or, given ``files``, not one of
    them), is a :class:`CorruptCheckpointError` naming ``where``. With ``olmo_core`` OLMo-core's
    storage-info class is allowed as well; the result holds DCP's own ``_StorageInfo`` either way.
    """
    if len(data) > MAX_METADATA_BYTES:
        raise _corrupt(where, f"{len(data)} bytes, more than the {MAX_METADATA_BYTES} ckptkeeper reads")
    try:
        obj = _RestrictedUnpickler(io.BytesIO(data), _OLMO_TABLE if olmo_core else _TABLE).load()
    except UnsafeCheckpointError:
        raise
    except (Exception, MemoryError, RecursionError) as exc:
        raise _corrupt(where, f"{type(exc).__name__}: {exc}") from None
    if not isinstance(obj, Metadata):
        raise UnsafeCheckpointError(f"{where} decoded to {type(obj).__name__}, not DCP Metadata; refusing it")
    obj = _realize(obj, where, olmo_core)
    # _realize checked every type, number and field; what is left is where the data files are.
    known = set(files) if files is not None else None
    for index, info in (obj.storage_data or {}).items():
        rel = info.relative_path
        problem = check_relpath(rel)
        if problem is None and "/" in rel:
            problem = f"data file {rel[:80]!r} is not a plain file name"
        if problem is None and known is not None and rel not in known:
            problem = f"data file {rel[:80]!r} is not a file of this checkpoint"
        if problem is not None:
            raise _corrupt(where, f"storage entry of {index.fqn[:80]!r}: {problem}")
    return obj


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, minus the one path that unpickles: non-tensor ("bytes") items.

    Stock DCP reads such items with ``torch.load(weights_only=False)``. ckptkeeper never stores
    objects in DCP files (non-tensor state is JSON), so a checkpoint that makes DCP read one is
    refused instead of run.
    """

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        raise UnsafeCheckpointError(
            f"the checkpoint asks to unpickle a non-tensor item for {read_item.dest_index.fqn!r}; ckptkeeper "
            "never stores objects in DCP files, so this one is refused. The checkpoint may be tampered with"
        )


class _RegularFilesOnly(_dcp_fs.FileSystem):
    """DCP's local filesystem whose reads open regular files only, never through a final link.

    DCP opens with a plain blocking ``open()``: a data file swapped for a FIFO after ckptkeeper's
    checks would block the load forever; here it is an OSError, which the load reports as a
    corrupt checkpoint.
    """

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[io.IOBase]:
        if "r" not in mode or "+" in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with open(open_regular(str(path)), mode) as stream:
            yield cast(io.IOBase, stream)


class SafeFileSystemReader(FileSystemReader):
    """DCP's filesystem reader with the metadata pickle read through the allow-list above.

    ``files`` names the data files the checkpoint's commit record lists; metadata that points
    anywhere else is refused. ``olmo_core`` reads the metadata of an OLMo-core checkpoint.
    """

    def __init__(self, path: str, files: Iterable[str] | None = None, *, olmo_core: bool = False) -> None:
        super().__init__(path)
        self.fs = _RegularFilesOnly()
        self._files = list(files) if files is not None else None
        self._olmo_core = olmo_core

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = safe_load_metadata(
                f.read(MAX_METADATA_BYTES + 1), str(path), self._files, olmo_core=self._olmo_core
            )
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


# ---------------------------------------------------------------------- OLMo-core trainer state

try:  # numpy 2 keeps the array reconstructor in numpy._core; files written with numpy 1 name numpy.core
    from numpy._core import multiarray as _np_multiarray
except ImportError:  # pragma: no cover (numpy 1)
    from numpy.core import multiarray as _np_multiarray  # type: ignore[no-redef]

# What OLMo-core's trainer state needs beyond torch's own weights-only allow-list: its numpy RNG
# state is an ndarray. Exact names only (torch's weights-only unpickler matches the full name).
_NUMPY_GLOBALS: list[Any] = [
    (np.ndarray, "numpy.ndarray"),
    (np.dtype, "numpy.dtype"),
    (_np_multiarray._reconstruct, "numpy._core.multiarray._reconstruct"),
    (_np_multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),
    (_np_multiarray.scalar, "numpy._core.multiarray.scalar"),
    (_np_multiarray.scalar, "numpy.core.multiarray.scalar"),
    # An unpickled dtype gets its state set, which torch allows only for listed types: the
    # classes of numpy's built-in dtypes (bool, numbers, bytes, str, void, object, datetimes).
    *sorted({type(np.dtype(code)) for code in "?bBhHiIlLqQefdgFDG"}, key=str),
]


_SAFE_GLOBALS_LOCK = threading.Lock()


@contextmanager
def _numpy_arrays_allowed() -> Iterator[None]:
    # torch's allow-list is one set for the whole process: add only what is not there yet (so that
    # leaving removes nothing anyone else added), one load at a time.
    cm = getattr(torch.serialization, "safe_globals", None)
    get = getattr(torch.serialization, "get_safe_globals", None)
    if cm is None or get is None:  # torch < 2.5: numpy arrays stay refused
        yield
        return
    with _SAFE_GLOBALS_LOCK:
        present = set(get())
        with cm([g for g in _NUMPY_GLOBALS if g not in present]):
            yield


_MAX_PLAIN_DEPTH = 64
MAX_TRAIN_STATE_BYTES = 256 << 20
"""The largest OLMo-core trainer-state file ckptkeeper reads."""
# How torch's weights-only unpickler says that a file asked for something it does not allow.
_UNSAFE_MARKS = ("GLOBAL", "allowlisted", "reduce for unrecognized function")


def plain_data(value: Any, where: str = "trainer state", _depth: int = 0) -> Any:
    """``value`` as JSON-like data: dicts with string keys, lists, str, int, float, bool, None.

    Tensors and numpy arrays become (nested) lists, numpy scalars numbers, tuples and sets lists;
    anything else (a dtype, a device, bytes) its ``str``.
    """
    if _depth > _MAX_PLAIN_DEPTH:
        raise ValueError(f"{where} is nested more than {_MAX_PLAIN_DEPTH} levels deep")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    if isinstance(value, Mapping):
        return {str(k): plain_data(v, f"{where}.{k}", _depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain_data(v, f"{where}[{i}]", _depth + 1) for i, v in enumerate(value)]
    return str(value)


def safe_load_train_state(data: bytes, where: str) -> dict[str, Any]:
    """Decode an OLMo-core trainer state (``torch.save`` of a dict) into plain data, running no code.

    ``torch.load(weights_only=True)`` with numpy arrays allowed (by exact name): a file asking for
    anything else is refused (:class:`UnsafeCheckpointError`); one that does not decode, or is not
    a dict, is a :class:`CorruptCheckpointError` naming ``where``.
    """
    if len(data) > MAX_TRAIN_STATE_BYTES:
        raise CorruptCheckpointError(
            f"{where} has {len(data)} bytes, more than the {MAX_TRAIN_STATE_BYTES} ckptkeeper reads for a trainer state"
        )
    try:
        with _numpy_arrays_allowed():
            obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError) as exc:
        if any(m in str(exc) for m in _UNSAFE_MARKS):
            raise UnsafeCheckpointError(
                f"{where} asks for code to run while it is loaded ({_first_line(exc)}); refusing to load it. "
                "The file may be tampered with: restore the checkpoint from a trusted copy"
            ) from None
        raise _bad_state(where, exc) from None
    except (Exception, MemoryError, RecursionError) as exc:
        raise _bad_state(where, exc) from None
    if not isinstance(obj, dict):
        raise CorruptCheckpointError(f"{where} is malformed (a {type(obj).__name__}, not a dict of trainer state)")
    try:
        out = plain_data(obj)
    except (ValueError, RecursionError) as exc:
        raise _bad_state(where, exc) from None
    assert isinstance(out, dict)
    return out


def _first_line(exc: BaseException) -> str:
    for line in str(exc).splitlines():
        if any(m in line for m in _UNSAFE_MARKS):
            return line.strip()[:300]
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def _bad_state(where: str, exc: BaseException) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{where} is not a readable trainer state ({type(exc).__name__}: {_first_line(exc)}); load an earlier "
        "checkpoint or restore this one from a copy"
    )
