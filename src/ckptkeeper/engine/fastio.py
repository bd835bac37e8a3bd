"""The fast single-process path: stock DCP files written and read with large parallel I/O.

DCP's own writer serialises every tensor with ``torch.save`` into a Python stream and then we
would read everything back to checksum it; its reader ``torch.load``s every item. Both copy the
data and keep the GIL busy, which slows a training loop that runs beside a background save. No
library writes DCP's format any faster, so this module does it by hand, producing byte-for-byte
what stock ``torch.distributed.checkpoint.load`` reads:

- each tensor becomes one ``torch.save`` blob in ``__0_0.distcp``; the blob's skeleton (zip headers,
  pickle, trailer) does not depend on the tensor's values, so it is made once per shape and dtype
  (``torch.serialization.skip_data``) and cached, and the tensor bytes are written straight from the
  staging buffer with ``os.pwrite`` by writer threads (which release the GIL);
- xxh3 checksums (whole file, and each segment) are computed in the same pass (xxhash releases the
  GIL too), so nothing is read back;
- DCP's ``.metadata`` is built from the layout;
- loads read each tensor's bytes straight into the destination tensor, verifying segment checksums
  on the way, several tensors at once.

This module is the single-process path for plain CPU tensors; several ranks (sharded DTensors,
replicated state) use the same writer and checks per rank through :mod:`.sharded`.
"""

from __future__ import annotations

import contextlib
import copyreg
import ctypes
import errno
import io
import math
import operator
import os
import pickle
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, Any, NamedTuple, TypeVar, cast

import torch
import xxhash
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..errors import ConfigurationError, CorruptCheckpointError
from ..storage.base import Upload
from ..storage.local import open_regular
from .gcpause import paused_gc
from .record import FileEntry, new_hasher
from .state import SavedTensor, refuse_short_memory

__all__ = ["DATA_FILE", "Segment", "can_use_fast_path", "parse_layout", "read_fast", "write_fast"]

DATA_FILE = "__0_0.distcp"
_CHUNK = 64 << 20
_SMALL_PIECE = 1 << 20  # pieces below this are joined with their neighbours into one write...
_RUN_BYTES = 8 << 20  # ...of up to this many bytes
_READ_AHEAD_RUNS = 4  # runs of small tensors the kernel is asked to read ahead of the reader
_BACKUP_THREADS = 2  # runs of small tensors backed up at once, ahead of the reader
_CRC_LOCK = threading.Lock()
_SKELETONS: dict[tuple[tuple[int, ...], torch.dtype], tuple[bytes, bytes, str, str]] = {}
_METADATA: dict[Any, bytes] = {}
_IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") else 16


class Segment(NamedTuple):
    """A byte range of the data file: ``kind`` is "head", "data" or "tail" of tensor ``fqn``.

    A named tuple, not a dataclass: a checkpoint of many small tensors makes three per tensor on
    every save and load, and a tuple is several times cheaper to build.
    """

    kind: str
    fqn: str
    offset: int
    length: int
    xxh3_64: str

    def to_json(self) -> list[Any]:
        return list(self)


_new_segment = _new_saved = tuple.__new__  # Segment(*row) through NamedTuple's __new__ is five times slower

TENSORS_KEY = "tensors"
"""The segment table's entry giving each tensor's dtype and shape: ``{fqn: [dtype, shape]}``."""

_DTYPE_NAMES = {str(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
_DTYPE_STR = {d: name for name, d in _DTYPE_NAMES.items()}


def tensor_table(tree: Mapping[str, Any] | Leaves) -> dict[str, list[Any]]:
    """``{fqn: [dtype, shape]}`` of a tree of plain tensors, for the segment table."""
    names = _DTYPE_STR
    return {fqn: [names.get(v.dtype) or str(v.dtype), list(v.shape)] for fqn, _, v in walk(tree)}


def saved_from_table(table: Any) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The segment table's tensors as ``{fqn: (shape, dtype)}``; ValueError when malformed.

    The values are :class:`~ckptkeeper.engine.state.SavedTensor` tuples (a load uses the table as is).
    """
    if not isinstance(table, dict):
        raise ValueError("the segment table's tensor list is not a table")
    out: dict[str, Any] = {}
    # Checked once per distinct dtype and shape (a model repeats a few shapes thousands of times).
    known: dict[tuple[Any, ...], Any] = {}
    for fqn, entry in table.items():
        if type(entry) is not list or len(entry) != 2 or type(entry[1]) is not list or len(entry[1]) > 64:
            raise ValueError(f"the segment table's entry for {fqn[:80]!r} is not [dtype, shape]")
        key = (entry[0], *entry[1], *map(type, entry[1]))  # the types too: 1.0 and True hash as 1
        try:
            found = known.get(key)
        except TypeError:  # an unhashable dtype or size: caught as invalid below
            found = None
        if found is None:
            dtype = _DTYPE_NAMES.get(entry[0]) if isinstance(entry[0], str) else None
            if dtype is None or not all(type(n) is int and 0 <= n < 1 << 52 for n in entry[1]):
                raise ValueError(f"the segment table's entry for {fqn[:80]!r} has no valid dtype and shape")
            found = known[key] = _new_saved(SavedTensor, (tuple(entry[1]), dtype))
        out[fqn] = found
    return out


def parse_layout(
    rows: Any,
    file_size: int,
    metadata: Any,
    data_file: str = DATA_FILE,
    tensors: Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
) -> dict[str, dict[str, Segment]]:
    """Check a data file's layout against its size and DCP's metadata; returns segments by tensor.

    ``data_file`` is the file's name inside ``model_and_optim`` (each rank writes its own). With
    ``tensors`` (:func:`saved_from_table`; ``metadata`` may then be None) sizes are checked
    against those shapes and dtypes instead of DCP's metadata.

    The segments must tile the file exactly (head, data, tail of each tensor, in order) and each
    tensor's byte range must be the one DCP's (checksummed) ``.metadata`` gives, so a layout that
    was tampered with is caught before any byte is read. ValueError says what does not fit.
    """
    if not isinstance(rows, list):
        raise ValueError("the data file's layout is not a list")
    if len(rows) % 3:
        raise ValueError("the data file's layout does not hold whole tensors")
    by_fqn: dict[str, dict[str, Segment]] = {}
    pos = 0
    new = _new_segment
    # Checked inline, three rows at a time, not by building and validating objects: this runs
    # for every tensor of every load, and a state may hold tens of thousands of tensors.
    rows_iter = iter(rows)
    for i, (h, d, t) in enumerate(zip(rows_iter, rows_iter, rows_iter, strict=True)):
        for row in (h, d, t):
            if type(row) is not list or len(row) != 5:
                raise ValueError(f"layout row {str(row)[:80]!r} is not [kind, name, offset, length, checksum]")
        fqn = h[1]
        if h[0] != "head" or d[0] != "data" or t[0] != "tail" or d[1] != fqn or t[1] != fqn:
            raise ValueError(f"layout rows {3 * i}..{3 * i + 2} are not one tensor's head, data and tail")
        if type(fqn) is not str:
            raise ValueError(f"layout row {str(h)[:80]!r} is malformed")
        for row in (h, d, t):
            offset, length = row[2], row[3]
            if type(length) is not int or type(row[4]) is not str:
                raise ValueError(f"layout row {str(row)[:80]!r} is malformed")
            if type(offset) is not int or offset != pos:
                raise ValueError(f"segment {row[0]} of {fqn[:80]!r} starts at {offset!r}, expected {pos}")
            if not 0 <= length < 1 << 52:
                raise ValueError(f"layout row {str(row)[:80]!r} has an invalid offset or length")
            pos += length
        if fqn in by_fqn:
            raise ValueError(f"tensor {fqn[:80]!r} appears twice in the layout")
        by_fqn[fqn] = {"head": new(Segment, h), "data": new(Segment, d), "tail": new(Segment, t)}
    if pos != file_size:
        raise ValueError(f"the layout covers {pos} bytes, the data file has {file_size}")
    if metadata is None and tensors is None:
        return by_fqn  # the tiling only: the caller checks what the segments hold
    if tensors is not None:
        if set(tensors) != set(by_fqn):
            raise ValueError("the segment table's tensor list and its segments name different tensors")
        for fqn, (shape, dtype) in tensors.items():
            want = math.prod(shape) * dtype.itemsize
            held = by_fqn[fqn]["data"].length
            if held != want:
                raise ValueError(f"{fqn[:80]!r}: the layout holds {held} bytes, its shape needs {want}")
            # The listed shape and dtype must be the ones inside the tensor's own torch.save
            # header (whose bytes are checked against these sums as they are read): the list
            # cannot make a load read [8, 4] as [4, 8]. (Cached per shape and dtype.)
            if (by_fqn[fqn]["head"].xxh3_64, by_fqn[fqn]["tail"].xxh3_64) != skeleton_sums(shape, dtype):
                raise ValueError(
                    f"{fqn[:80]!r}: the segment table's shape or dtype is not the one the data was saved with"
                )
        return by_fqn
    check_layout_metadata(by_fqn, metadata, data_file)
    return by_fqn


def check_layout_metadata(by_fqn: Mapping[str, Mapping[str, Segment]], metadata: Any, data_file: str) -> None:
    """ValueError unless each tensor's byte range in ``data_file`` (``by_fqn``, from its segment
    table) is the one DCP's metadata gives it, and holds as many bytes as that metadata's piece."""
    ranges = {}
    shapes = {}
    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        if info.relative_path == data_file:
            if index.fqn in ranges:
                raise ValueError(f"the DCP metadata puts two pieces of {index.fqn[:80]!r} in {data_file}")
            ranges[index.fqn] = (info.offset, info.length)
            shapes[index.fqn] = _chunk_sizes(metadata, index)
    expected = {
        f: (s["head"].offset, s["head"].length + s["data"].length + s["tail"].length) for f, s in by_fqn.items()
    }
    if ranges != expected:
        raise ValueError("the layout disagrees with the DCP metadata about where tensors are")
    for fqn, segs in by_fqn.items():
        md = metadata.state_dict_metadata.get(fqn)
        found = getattr(getattr(md, "properties", None), "dtype", None)
        size = shapes[fqn]
        if size is None or not isinstance(found, torch.dtype):
            raise ValueError(f"the DCP metadata has no tensor entry for {fqn[:80]!r}")
        want = math.prod(size) * found.itemsize
        if segs["data"].length != want:
            raise ValueError(f"{fqn[:80]!r}: the layout holds {segs['data'].length} bytes, its shape needs {want}")


def _chunk_sizes(metadata: Any, index: Any) -> tuple[int, ...] | None:
    """The sizes of the stored piece ``index`` names (a whole tensor, or one rank's shard of it)."""
    md = metadata.state_dict_metadata.get(index.fqn)
    for chunk in getattr(md, "chunks", None) or ():
        if tuple(chunk.offsets) == tuple(index.offset):
            return tuple(int(n) for n in chunk.sizes)
    return None


Leaves = list[tuple[str, tuple[str, ...], Any]]
"""A tree walked once (:func:`walk`): ``(dotted name, path, value)`` of every leaf, in order."""


def walk(tree: Mapping[str, Any] | Leaves) -> Leaves:
    """The leaves of ``tree`` (given already walked, returned as they are): a save walks a tree of
    10,000 tensors once, not once per step that looks at it."""
    return tree if isinstance(tree, list) else _leaves(tree)


def check_names(leaves: Leaves) -> None:
    """ConfigurationError when two leaves flatten to one dotted name (``{"a.b": x, "a": {"b": y}}``,
    or keys 1 and "1"): DCP's format names each tensor once, so one of them could never be loaded."""
    if len({fqn for fqn, _, _ in leaves}) == len(leaves):
        return
    seen: dict[str, tuple[str, ...]] = {}
    for fqn, path, _ in leaves:
        if fqn in seen:
            raise ConfigurationError(
                f"two entries of the state are both saved as {fqn[:200]!r} (keys {list(seen[fqn])} and "
                f"{list(path)}): rename one, so that no two keys join with '.' to the same name"
            )
        seen[fqn] = path


def check_plain(tree: Mapping[str, Any] | Leaves) -> None:
    """ConfigurationError for a tensor subclass DCP does not know: it would pickle its
    class, which loads (pickle-free by design) then refuse, so the checkpoint could never be loaded."""
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor
    from torch.distributed.tensor import DTensor

    # The tensor types DCP stores without pickling them (ShardedTensor: FSDP1's state dicts).
    native = (torch.Tensor, torch.nn.Parameter, DTensor, ShardedTensor)
    for fqn, _, value in walk(tree):
        if isinstance(value, torch.Tensor) and type(value) not in native:
            raise ConfigurationError(
                f"{fqn[:200]!r} is a {type(value).__name__} (a tensor subclass), which cannot be saved without "
                "pickling its class; save a plain tensor instead (value.as_subclass(torch.Tensor))"
            )
        if type(value) is DTensor and any(p.is_partial() for p in value.placements):
            # DCP's own refusal names neither the tensor nor the fix.
            raise ConfigurationError(
                f"{fqn[:200]} is a DTensor with a Partial placement (a sum still pending across ranks, not its "
                "value), which a checkpoint cannot store; save it reduced: value.redistribute(placements=[Replicate()])"
            )
        if isinstance(value, torch.Tensor) and type(value) is not ShardedTensor:
            refuse_unsaveable(fqn, value)


def refuse_unsaveable(fqn: str, value: torch.Tensor) -> None:
    """ConfigurationError naming ``fqn`` when ``value`` (a DTensor's local shard) cannot be saved:
    sparse (any layout), nested, or on the meta device (no values). DCP's writer and the staging
    copy fail on those with torch's own words, which name no tensor."""
    from torch.distributed.tensor import DTensor

    local = value._local_tensor if isinstance(value, DTensor) else value
    layout = local.layout
    if layout is not torch.strided and layout is not getattr(torch, "_mkldnn", None):
        kind = str(layout).removeprefix("torch.")
        fix = "to_dense()" if kind.startswith("sparse") else "a plain tensor (e.g. torch.cat of its parts)"
        raise ConfigurationError(
            f"{fqn[:200]} is a {kind} tensor, which a checkpoint cannot store yet; save {fix} instead"
        )
    if local.is_nested:
        raise ConfigurationError(
            f"{fqn[:200]} is a nested tensor, which a checkpoint cannot store yet; save its parts (unbind()) instead"
        )
    if local.is_meta:
        raise ConfigurationError(
            f"{fqn[:200]} is on the meta device (made without memory: it holds no values to save); materialise it "
            "first, e.g. module.to_empty(device='cpu') and initialise it"
        )


def _leaves(tree: Mapping[str, Any]) -> Leaves:
    """``(dotted name, path, value)`` of every leaf, in order (a list, without a generator frame
    per nesting level, which cost more than the rest per small tensor)."""
    out: Leaves = []
    stack: list[tuple[tuple[str, ...], Iterator[tuple[Any, Any]]]] = [((), iter(tree.items()))]
    while stack:
        path, items = stack[-1]
        for key, value in items:
            p = (*path, str(key))
            if isinstance(value, dict) or (not isinstance(value, torch.Tensor) and isinstance(value, Mapping)):
                stack.append((p, iter(value.items())))
                break
            out.append((".".join(p), p, value))
        else:
            stack.pop()
    return out


_STRIDED = torch.strided


_PARAMETER = torch.nn.Parameter
_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__


def is_plain(v: Any) -> bool:
    """Whether ``v`` is a tensor the fast writer and reader take: a ``torch.Tensor``, an
    ``nn.Parameter``, or another tensor ``isinstance()`` calls a parameter whose class does not
    override ``__torch_dispatch__``. A class that does is a wrapper with no memory of its own
    (every FSDP2 parameter is a DTensor that ``isinstance()`` calls a Parameter, and so is a
    wrapper subclass of ``nn.Parameter``): given one, the fast writer and reader crashed the
    process or called a good checkpoint corrupt (found by outside attacks). Subclasses that only
    add Python behaviour (``as_subclass``) keep plain memory and the default dispatch."""
    kind = type(v)
    if kind is torch.Tensor or kind is _PARAMETER:
        return True
    return isinstance(v, _PARAMETER) and kind.__torch_dispatch__ is _PLAIN_DISPATCH


def can_use_fast_path(tree: Mapping[str, Any] | Leaves, loading: bool = False) -> bool:
    """Whether every leaf is a plain CPU tensor (no DTensor, no GPU tensor, no other object); to
    load into, also contiguous (its bytes are read straight into its memory)."""
    for _, _, v in walk(tree):
        # Cheap properties only (``v.device`` makes an object per call): this runs per tensor per load.
        if not is_plain(v):
            return False
        # Any layout but strided (sparse CSR and the rest too) goes to DCP's path, which refuses it by name.
        if not v.is_cpu or v.layout is not _STRIDED or v.is_quantized:
            return False
        if loading and (not v.is_contiguous() or v.is_conj() or v.is_neg()):
            return False
    return True


def skeleton_sums(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[str, str]:
    """The checksums of the ``torch.save`` head and tail of a tensor of ``shape`` and ``dtype``."""
    cached = _skeleton_of(shape, dtype)
    return cached[2], cached[3]


def skeleton_layout(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, int, str, str]:
    """(head length, tail length, head checksum, tail checksum) of a tensor's ``torch.save`` blob;
    ValueError when no tensor has that shape and dtype."""
    head, tail, head_sum, tail_sum = _skeleton_of(shape, dtype)
    return len(head), len(tail), head_sum, tail_sum


def _skeleton_of(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[bytes, bytes, str, str]:
    cached = _SKELETONS.get((shape, dtype))
    if cached is None:  # a meta tensor costs more than the look-up: made only on a miss
        if not all(type(n) is int and 0 <= n < 1 << 52 for n in shape):
            raise ValueError(f"no plain tensor has shape {list(shape)[:8]} and dtype {dtype}")
        try:
            cached = _skeleton(torch.empty(shape, dtype=dtype, device="meta"))
        except (RuntimeError, OverflowError) as exc:  # torch's own refusal of a forged shape or dtype
            raise ValueError(f"no tensor of shape {list(shape)[:8]} and dtype {dtype} can be saved: {exc}") from None
    return cached


class _SparseFile(io.RawIOBase):
    """A seekable in-memory file that keeps only the bytes written to it (gaps read as zeros).

    ``torch.save`` under ``skip_data`` seeks over each storage's bytes rather than writing them:
    into a BytesIO that seek was filled with zeros at the next write, so working out the header of
    a 4 GiB tensor cost a 4 GiB buffer (and a forged table's shape could exhaust memory before
    the table was refused). Here the skipped bytes are never stored.
    """

    def __init__(self) -> None:
        super().__init__()
        self._parts: list[tuple[int, bytes]] = []
        self._pos = 0
        self.size = 0

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = bytes(b)
        self._parts.append((self._pos, data))
        self._pos += len(data)
        self.size = max(self.size, self._pos)
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = max(0, base + offset)
        self.size = max(self.size, self._pos)  # a seek past the end extends the file, as on disk
        return self._pos

    def tell(self) -> int:
        return self._pos

    def span(self, start: int, end: int) -> bytes:
        """The bytes in [start, end): what was written there, zeros elsewhere."""
        out = bytearray(max(0, end - start))
        for at, data in self._parts:
            lo, hi = max(at, start), min(at + len(data), end)
            if lo < hi:
                out[lo - start : hi - start] = data[lo - at : hi - at]
        return bytes(out)

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = max(0, min(len(view), self.size - self._pos))
        view[:n] = self.span(self._pos, self._pos + n)
        self._pos += n
        return n


def _skeleton(t: torch.Tensor) -> tuple[bytes, bytes, str, str]:
    """The ``torch.save`` bytes around ``t``'s data (head, tail) and their checksums, cached per shape and dtype."""
    key = (tuple(t.shape), t.dtype)
    cached = _SKELETONS.get(key)
    if cached is not None:
        return cached
    buf = _SparseFile()
    # CRC32 of the data record cannot be known without the data; torch.load does not check it.
    # The option is process-global, so it is switched off only around this call, under a lock.
    with _CRC_LOCK:
        torch.serialization.set_crc32_options(False)
        try:
            with torch.serialization.skip_data():
                # torch.empty is not touched (no memory used), and under skip_data the storage's
                # bytes are sought over in the sparse file, never written. On the CPU whatever the
                # default device: the blob names its device, and every piece is written (as DCP
                # writes them) and read as a CPU tensor's (under torch.set_default_device("meta")
                # saves failed, and a "cuda" default would have written blobs naming a GPU).
                torch.save(torch.empty(t.shape, dtype=t.dtype, device="cpu"), cast(IO[bytes], buf))
        finally:
            torch.serialization.set_crc32_options(True)
    buf.seek(0)
    offset = torch._C.PyTorchFileReader(cast(IO[bytes], buf)).get_record_offset("data/0")  # type: ignore[attr-defined]
    nbytes = t.numel() * t.element_size()
    head, tail = buf.span(0, offset), buf.span(offset + nbytes, buf.size)
    entry = (head, tail, xxhash.xxh3_64_hexdigest(head), xxhash.xxh3_64_hexdigest(tail))
    if len(_SKELETONS) >= 1 << 16:
        # Bounded (~1.5 KB each): a forged table can list many kinds, a real state a few.
        _SKELETONS.clear()
    _SKELETONS[key] = entry
    return entry


def exact(t: torch.Tensor, name: str = "a tensor") -> torch.Tensor:
    """``t`` itself when its memory holds its values one after another, else a compact copy.

    A contiguous view into a larger buffer (an FSDP2 shard of a padded parameter, say) is taken as
    it is: only its own bytes are written, under the head and tail of a compact tensor of its shape
    (:func:`_skeleton`), which is what ``torch.save`` of a compact copy would write. Copying it
    first cost a memory copy per such tensor, and asking for its storage a Python object per tensor.
    A tensor whose memory is shorter than its shape (:func:`~ckptkeeper.engine.state.memory_shortfall`) raises
    :class:`ConfigurationError` naming it (``name``).
    """
    refuse_short_memory(name, t)
    if t.is_nested:
        refuse_unsaveable(name, t)
    if t.requires_grad:
        t = t.detach()  # only its bytes are read; a detach per tensor is not free, so only when needed
    if t.is_conj() or t.is_neg():
        # A lazy conjugate or negation: its memory holds the other values; write the real ones.
        t = t.resolve_conj().resolve_neg()
    return t if t.is_contiguous() else t.contiguous()


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory, which keeps the tensor alive.

    Made through ctypes rather than ``t.view(torch.uint8).numpy()``: five times cheaper, which
    matters once per tensor per save and load when a state holds thousands of small tensors.
    """
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray())
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("only contiguous CPU tensors have a byte view")
    arr = (ctypes.c_ubyte * n).from_address(t.data_ptr())
    arr._tensor = t  # type: ignore[attr-defined]  # the view owns the array, the array the tensor
    return memoryview(arr).cast("B")


_PyBUF_WRITE = 0x200
_memory_view = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)(
    ("PyMemoryView_FromMemory", ctypes.pythonapi)
)


def _borrowed_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory that does not keep the tensor alive.

    For the per-tensor loops of a save or load, where the caller holds every tensor until the last
    use of its view: a third of :func:`_bytes_of`'s cost (no ctypes array object, no attribute
    set on it), which is most of the per-tensor time a load of 10,000 small tensors spends outside
    its reads. The caller has checked that ``t`` is contiguous and on the CPU.
    """
    n = t.nbytes
    return _memory_view(t.data_ptr(), n, _PyBUF_WRITE) if n else memoryview(bytearray())


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


class _Plan(NamedTuple):
    """What a data file will hold, worked out before any byte is written (:func:`_plan_writes`)."""

    skeletons: list[tuple[bytes, bytes, str, str]]
    """Each tensor's ``torch.save`` head, tail and their checksums (see :func:`_skeleton`)."""
    views: list[memoryview]
    """Each tensor's own bytes, borrowed (the caller holds the tensors until the writes are done)."""
    jobs: list[tuple[int, list[Any]]]
    """``(offset, buffers)`` write jobs covering the whole file in order (see :func:`_plan_writes`)."""
    total: int


def _plan_writes(tensors: list[torch.Tensor]) -> _Plan:
    """The head, data and tail of each tensor, one after another, as write jobs in file order.

    Large data goes alone (in parts of _CHUNK); runs of small neighbours (a tensor's header and
    trailer included) are gathered into one ``pwritev`` each, up to _RUN_BYTES and the system's
    iovec limit: a thread-pool job and a system call per tensor header cost more than the bytes,
    and gathering needs no joining copy. One pass per tensor, not one per piece and another per
    list: at 10,000 small tensors this loop is most of a save's own CPU beside the copies.
    Tensors must be contiguous CPU tensors (:func:`exact`).
    """
    skeletons: list[tuple[bytes, bytes, str, str]] = []
    views: list[memoryview] = []
    jobs: list[tuple[int, list[Any]]] = []
    run: list[Any] = []
    run_start = run_bytes = offset = 0
    known = _SKELETONS.get
    view_of = _memory_view
    empty = memoryview(b"")
    small, run_limit, iov_limit = _SMALL_PIECE, _RUN_BYTES, _IOV_MAX - 2
    # Each tensor's bytes as a slice of one view spanning all of them: a view made per tensor
    # (PyMemoryView_FromMemory) is a view and a buffer object, two objects per tensor that the
    # garbage collector tracks for as long as a save memo keeps the plan; slices share the
    # span's one buffer. Only the slices are ever used, each exactly one tensor's bytes (the
    # tensors are contiguous and on the CPU, and the caller holds them while the plan is used).
    ptrs = [t.data_ptr() for t in tensors]
    sizes = [t.nbytes for t in tensors]
    used = [(p, p + n) for p, n in zip(ptrs, sizes, strict=True) if n]
    low = min(used)[0] if used else 0
    span = view_of(low, max(end for _, end in used) - low, _PyBUF_WRITE) if used else empty
    for t, ptr, n in zip(tensors, ptrs, sizes, strict=True):
        sk = known((t.shape, t.dtype))  # torch.Size hashes and compares as the tuple key
        if sk is None:
            sk = _skeleton(t)
        data = span[ptr - low : ptr - low + n] if n else empty
        skeletons.append(sk)
        views.append(data)
        head, tail = sk[0], sk[1]
        size = len(head) + n + len(tail)
        if n >= small:
            # The head ends the current run, the data goes alone, the tail starts the next run.
            if run and (run_bytes + len(head) > run_limit or len(run) >= iov_limit):
                jobs.append((run_start, run))
                run = []
            if not run:
                run_start, run_bytes = offset, 0
            run.append(head)
            jobs.append((run_start, run))
            at = offset + len(head)
            jobs.extend((at + i, [data[i : i + _CHUNK]]) for i in range(0, n, _CHUNK))
            run, run_start, run_bytes = [tail], at + n, len(tail)
        else:
            if run and (run_bytes + size > run_limit or len(run) >= iov_limit):
                jobs.append((run_start, run))
                run = []
            if not run:
                run_start, run_bytes = offset, 0
            if n:
                run += (head, data, tail)
            else:
                run += (head, tail)
            run_bytes += size
        offset += size
    if run:
        jobs.append((run_start, run))
    return _Plan(skeletons, views, jobs, offset)


def _pwritev_all(fd: int, bufs: list[Any], offset: int) -> None:
    """Write consecutive buffers at ``offset`` with one system call (no joining copy)."""
    if len(bufs) == 1:
        _pwrite_all(fd, memoryview(bufs[0]), offset)
        return
    done = os.pwritev(fd, bufs, offset)
    pos = 0
    for buf in bufs:  # a short write (rare): the rest, buffer by buffer
        end = pos + len(buf)
        if end > done:
            skip = max(done - pos, 0)
            _pwrite_all(fd, memoryview(buf)[skip:], offset + pos + skip)
        pos = end


def write_fast(
    model_dir: str, tree: Mapping[str, Any] | Leaves, threads: int = 2, sink: Upload | None = None
) -> tuple[dict[str, FileEntry], list[Segment]]:
    """Write ``tree`` (plain CPU tensors) as a stock DCP checkpoint in ``model_dir``.

    Returns the files written (relative to ``model_dir``) with sizes and xxh3-64 checksums, and
    the layout of the data file with a checksum per segment. With ``sink`` the data file is
    streamed there (see :func:`write_data`); DCP's small ``.metadata`` is still written locally.
    """
    os.makedirs(model_dir, exist_ok=True)
    with paused_gc():
        leaves = [(fqn, path, exact(value, fqn)) for fqn, path, value in walk(tree)]
        check_names(leaves)
    data_path = os.path.join(model_dir, DATA_FILE)
    entry, segments, starts = write_items(data_path, [(f, t) for f, _, t in leaves], threads, sink)
    with paused_gc():
        # DCP's metadata depends only on names, shapes and dtypes (offsets follow from them): the
        # bytes are made once per layout, as the skeletons are (pickling 10,000 entries takes
        # longer than writing their bytes).
        key = (tuple((path, t.shape, t.dtype) for _, path, t in leaves), tuple(starts))
        meta_bytes = _METADATA.get(key)
        if meta_bytes is None:
            meta_bytes = dumps_metadata(_metadata([(f, p, t, s, segs) for (f, p, t), s, segs in
                                                 zip(leaves, starts, _trios(segments), strict=True)]))  # fmt: skip
            with _CRC_LOCK:
                if len(_METADATA) >= 4:
                    _METADATA.pop(next(iter(_METADATA)))
                _METADATA[key] = meta_bytes
    return {DATA_FILE: entry, ".metadata": write_synced(os.path.join(model_dir, ".metadata"), meta_bytes)}, segments


def write_synced(path: str, data: bytes) -> FileEntry:
    """Write a small file, fsync it, and return its size and checksum."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    h = new_hasher()
    h.update(data)
    return FileEntry(len(data), h.hexdigest())


def _trios(segments: list[Segment]) -> Iterator[list[Segment]]:
    for i in range(0, len(segments), 3):
        yield segments[i : i + 3]


def write_items(
    data_path: str,
    tensors: list[tuple[str, torch.Tensor]],
    threads: int = 2,
    sink: Upload | None = None,
) -> tuple[FileEntry, list[Segment], list[int]]:
    """Write each tensor as one ``torch.save`` blob, one after another, into a new file at ``data_path``.

    Tensors must be contiguous CPU tensors (see :func:`exact`); only each one's own bytes are written.
    Returns the file's size and checksum, its segments (head, data, tail of each tensor, in
    order, each with its checksum) and where each tensor's blob starts. With ``sink`` the bytes
    are streamed there instead (see :func:`write_data`).
    """
    with paused_gc():
        plan = _plan_writes([t for _, t in tensors])
    entry, data_sums = _write_planned(data_path, plan, threads, sink, None)
    with paused_gc():
        segments: list[Segment] = []
        starts: list[int] = []
        new = _new_segment
        start = 0
        for (fqn, _), (head, tail, head_sum, tail_sum), data, data_sum in zip(
            tensors, plan.skeletons, plan.views, data_sums, strict=True
        ):
            at = start + len(head)
            n = len(data)
            segments += (
                new(Segment, ("head", fqn, start, len(head), head_sum)),
                new(Segment, ("data", fqn, at, n, data_sum)),
                new(Segment, ("tail", fqn, at + n, len(tail), tail_sum)),
            )
            starts.append(start)
            start = at + n + len(tail)
    return entry, segments, starts


def write_data(
    data_path: str,
    tensors: list[torch.Tensor],
    threads: int = 2,
    sink: Upload | None = None,
    then: Callable[[list[str]], None] | None = None,
) -> tuple[FileEntry, list[str]]:
    """Write each tensor as one ``torch.save`` blob, one after another, into a new file at ``data_path``.

    Tensors must be contiguous CPU tensors (see :func:`exact`). Returns the file's size and
    checksum and each tensor's data checksum, in order (its head and tail are its skeleton's:
    :func:`skeleton_layout`). With ``sink`` the bytes are streamed there instead (an object-store
    upload; ``data_path`` is not written), and the sink is closed (or aborted on failure).
    ``then(data_sums)`` runs once the checksums are known, while the file is being flushed to
    disk (the caller's own bookkeeping overlaps the flush); this returns after both.
    """
    with paused_gc():
        plan = _plan_writes(tensors)
    return _write_planned(data_path, plan, threads, sink, then)


def _write_planned(
    data_path: str, plan: _Plan, threads: int, sink: Upload | None, then: Callable[[list[str]], None] | None
) -> tuple[FileEntry, list[str]]:
    if sink is not None:
        out = _stream_planned(sink, plan)
        if then is not None:
            then(out[1])
        return out
    total = plan.total
    fd = os.open(data_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        if total:
            # Reserve the space first: a full disk fails here, before any byte is written.
            os.posix_fallocate(fd, 0, total)

        def write_job(job: tuple[int, list[Any]]) -> None:
            _pwritev_all(fd, job[1], job[0])

        whole = new_hasher()
        with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="ckptkeeper-write") as pool:
            pending = [pool.submit(write_job, j) for j in plan.jobs]
            # Hash while the writers run (xxhash releases the GIL), each call made from C through
            # map: a Python loop of calls per tensor cost more than hashing a small tensor. The
            # jobs hold every byte of the file in order, so the whole file's hash is fed from them.
            data_sums = list(map(xxhash.xxh3_64_hexdigest, plan.views))
            update = whole.update
            for _, bufs in plan.jobs:
                deque(map(update, bufs), maxlen=0)
            for fut in pending:
                fut.result()
            # The flush waits on the disk (~0.1 s for 150 MB here): the caller's per-piece
            # bookkeeping runs beside it instead of after it.
            flushed = pool.submit(os.fsync, fd)
            try:
                if then is not None:
                    then(data_sums)
            finally:
                # Also on the way out of an error: the file is closed only after its flush.
                flushed.result()
    finally:
        os.close(fd)
    return FileEntry(total, whole.hexdigest()), data_sums


def _stream_planned(sink: Upload, plan: _Plan) -> tuple[FileEntry, list[str]]:
    """The bytes of ``plan`` in file order into ``sink``, hashed in the same pass (the upload
    copies them into parts of its own, so memory stays a few parts whatever the file's size)."""
    data_sums: list[str] = []
    whole = new_hasher()
    try:
        for (head, tail, _, _), data in zip(plan.skeletons, plan.views, strict=True):
            sink.write(head)
            whole.update(head)
            h = new_hasher()
            for i in range(0, len(data), _CHUNK):
                piece = data[i : i + _CHUNK]
                sink.write(piece)
                h.update(piece)
                whole.update(piece)
            sink.write(tail)
            whole.update(tail)
            data_sums.append(h.hexdigest())
        sink.close()
    except BaseException:
        sink.abort()
        raise
    return FileEntry(plan.total, whole.hexdigest()), data_sums


def _reduce_by_state(obj: Any) -> tuple[Any, ...]:
    return (copyreg.__newobj__, (type(obj),), obj.__getstate__())  # type: ignore[attr-defined]


# What object.__reduce_ex__ makes of these classes (copyreg.__newobj__, the class, its state),
# made without the generic path's detours (failed __getnewargs__ look-ups, a copyreg import per
# object): the pickled bytes are the same, in half the time. A .metadata holds one or two of each per
# tensor piece, so at 24,000 pieces this is about half a second of rank 0's save.
_DCP_REDUCERS: dict[type, Callable[[Any], Any]] = {
    **copyreg.dispatch_table,
    **{cls: _reduce_by_state for cls in (MetadataIndex, ChunkStorageMetadata, TensorStorageMetadata, _StorageInfo)},
}


def dumps_metadata(metadata: Metadata) -> bytes:
    """``pickle.dumps(metadata)``, byte for byte, for DCP's ``.metadata`` file (quicker for many entries)."""
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=pickle.DEFAULT_PROTOCOL)
    pickler.dispatch_table = _DCP_REDUCERS
    pickler.dump(metadata)
    return buf.getvalue()


def _metadata(items: list[Any]) -> Metadata:
    sd_meta: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    planner: dict[str, Any] = {}
    for fqn, path, t, start, segs in items:
        zeros = torch.Size([0] * t.dim())
        sd_meta[fqn] = TensorStorageMetadata(
            properties=TensorProperties.create_from_tensor(t),
            size=t.size(),
            chunks=[ChunkStorageMetadata(offsets=zeros, sizes=t.size())],
        )
        storage[MetadataIndex(fqn=fqn, offset=zeros, index=0)] = _StorageInfo(
            DATA_FILE, start, sum(seg.length for seg in segs)
        )
        planner[fqn] = path
    return Metadata(
        state_dict_metadata=sd_meta,
        planner_data=planner,
        storage_data=storage,
        # No per-save identity: the bytes are reused for every save of the same layout.
        storage_meta=StorageMeta(checkpoint_id=None, save_id=""),
    )


R = TypeVar("R")
V = TypeVar("V")


def fetch_and_place(
    pool: ThreadPoolExecutor,
    others: list[Future[Any]],
    runs: Iterable[R],
    fetch: Callable[[R], V],
    place: Callable[[R, V], None],
    ahead: int,
) -> None:
    """Fetch ``runs`` on ``pool`` (``ahead`` at a time, in order) and ``place`` each in this thread.

    Placing many small tensors is Python work per tensor; spread over several threads it only
    fought over the GIL (measured twice as slow), while fetching releases it. ``runs`` is taken
    one at a time, in this thread, just before each is fetched (a generator may prepare a run
    there, and what it raises is handled as a failed run). Every job (the fetches and
    ``others``, already submitted) has stopped before the first error is raised, so nothing
    writes into a tensor afterwards.
    """
    error: BaseException | None = None
    window: deque[tuple[R, Future[V]]] = deque()
    pending = iter(runs)

    def fetch_next() -> None:
        nonlocal error
        try:
            nxt = next(pending, None)
        except BaseException as failed:  # kept, raised once every reader has stopped
            error = error or failed
            return
        if nxt is not None:
            window.append((nxt, pool.submit(fetch, nxt)))

    for _ in range(ahead):
        if error is None:
            fetch_next()
    while window:
        run, got = window.popleft()
        try:
            view = got.result()
            if error is None:
                place(run, view)
        except BaseException as failed:  # kept, raised once every reader has stopped
            error = error or failed
        if error is None:
            fetch_next()
    for done in others:
        exc = done.exception()
        if exc is not None and error is None:
            error = exc
    if error is not None:
        raise error


def pread_full(fd: int, view: memoryview, offset: int, where: str) -> None:
    """Fill ``view`` from ``fd`` at ``offset``; CorruptCheckpointError naming ``where`` if the file ends early."""
    preadv_full(fd, [view], offset, where)


def preadv_full(fd: int, bufs: list[memoryview], offset: int, where: str) -> None:
    """Fill consecutive buffers from ``fd`` at ``offset`` (a scatter read, IOV_MAX at a time).

    ``bufs`` is consumed. Short reads are continued; CorruptCheckpointError naming ``where`` if the
    file ends early.
    """
    i = 0
    while i < len(bufs):
        n = os.preadv(fd, bufs[i : i + _IOV_MAX], offset)
        if n == 0 and any(len(b) for b in bufs[i : i + _IOV_MAX]):
            raise CorruptCheckpointError(f"{where} ends early (truncated file)")
        offset += n
        while i < len(bufs) and n >= len(bufs[i]):
            n -= len(bufs[i])
            i += 1
        if n:
            bufs[i] = bufs[i][n:]


def segment_mismatch(where: str, fqn: str, kind: str, got: str, want: str) -> CorruptCheckpointError:
    """The error for a segment whose bytes do not have the checksum the checkpoint gives."""
    return CorruptCheckpointError(
        f"{where} is corrupt: the bytes of {fqn} ({kind}) have checksum {got}, the checkpoint says {want}; "
        "load an earlier checkpoint or restore this one from a copy"
    )


def check_segments(where: str, tensors: list[tuple[str, Mapping[str, Segment]]], bufs: list[Any]) -> None:
    """Check a run of tensors' bytes against their segment checksums; CorruptCheckpointError for the first
    mismatch. ``bufs`` holds each tensor's head, data and tail, in order.

    Every checksum in one call from C (``map``); the culprit is looked for only on a mismatch (a
    Python loop of a call per segment cost more than hashing a small tensor).
    """
    got = list(map(xxhash.xxh3_64_hexdigest, bufs))
    if got == [seg.xxh3_64 for _, segs in tensors for seg in (segs["head"], segs["data"], segs["tail"])]:
        return
    for i, (fqn, segs) in enumerate(tensors):
        for k, kind in enumerate(("head", "data", "tail")):
            if got[3 * i + k] != segs[kind].xxh3_64:
                raise segment_mismatch(where, fqn, kind, got[3 * i + k], segs[kind].xxh3_64)


def _preadinto(
    fd: int, view: memoryview, offset: int, hasher: Any, where: str, before: Callable[[int, int], None] | None = None
) -> None:
    pos = 0
    while pos < len(view):
        piece = view[pos : pos + _CHUNK]
        if before is not None:
            before(pos, len(piece))  # the loader backs these bytes up just before they are overwritten
        n = os.preadv(fd, [piece], offset + pos)
        if n == 0:
            raise CorruptCheckpointError(f"{where} ends early (truncated file)")
        hasher.update(view[pos : pos + n])
        pos += n


def read_fast(
    model_dir: str,
    tree: Mapping[str, Any],
    by_fqn: Mapping[str, Mapping[str, Segment]],
    verify: bool = True,
    threads: int = 2,
    before_write: Callable[[str, int, int], None] | None = None,
    back_up_whole: Callable[[list[str]], None] | None = None,
) -> None:
    """Fill the tensors of ``tree`` in place from a checkpoint written by :func:`write_fast`.

    ``by_fqn`` is :func:`parse_layout`'s result. Each tensor's bytes are read straight into it
    (several tensors at once, largest first); ``before_write(fqn, start, length)`` is called just
    before each piece of a tensor is written (the loader backs it up there); with
    ``back_up_whole(names)`` runs of small tensors are backed up by it instead, a run at a time,
    on a thread of its own one run ahead of the reads. With ``verify`` every segment's
    checksum is checked on the way and a mismatch raises CorruptCheckpointError naming the file
    and tensor.
    """
    where = os.path.join(model_dir, DATA_FILE)
    jobs = []
    for fqn, _, dest in _leaves(tree):
        segs = by_fqn.get(fqn)
        if segs is None:
            raise KeyError(f"the checkpoint has no tensor {fqn!r}")
        want = dest.nbytes
        if segs["data"].length != want or not dest.is_contiguous() or not dest.is_cpu:
            raise ValueError(f"{fqn}: {segs['data'].length} bytes saved, destination holds {want}")
        jobs.append((fqn, dest, segs))
    # Destinations whose memory overlaps another's (tied weights, views of one buffer) are not
    # read in place: a read into one would change what the other's check sees, or race with it.
    # They are backed up first, then read through scratch, checked, and copied in, in file order.
    aliased = _overlapping(jobs)
    late = sorted((j for j in jobs if j[0] in aliased), key=lambda j: j[2]["head"].offset)
    if aliased:
        jobs = [j for j in jobs if j[0] not in aliased]
        if before_write is not None:
            for fqn, _, segs in late:
                if segs["data"].length:
                    before_write(fqn, 0, segs["data"].length)
    # Never through a link, and never a FIFO or device (which would block the open or a read forever).
    fd = _open_data_file(where)
    try:

        def load(job: tuple[str, torch.Tensor, Mapping[str, Segment]]) -> None:
            fqn, dest, segs = job
            for kind in ("head", "data", "tail"):
                seg = segs[kind]
                h = new_hasher()
                if kind == "data":
                    hook = None
                    if before_write is not None:
                        hook = (lambda name: lambda start, length: before_write(name, start, length))(fqn)
                    _preadinto(fd, _bytes_of(dest.detach()), seg.offset, h, where, hook)
                else:
                    _preadinto(fd, memoryview(bytearray(seg.length)), seg.offset, h, where)
                if verify and h.hexdigest() != seg.xxh3_64:
                    raise segment_mismatch(where, fqn, kind, h.hexdigest(), seg.xxh3_64)

        def read_run(run: list[tuple[str, torch.Tensor, Mapping[str, Segment]]]) -> list[memoryview]:
            # Many small tensors: one scatter read of their whole span, each tensor's bytes straight
            # into it and the headers into scratch (a read per header was most of the cost, and a
            # copy through a buffer one more pass over memory). Each tensor is backed up first.
            bufs: list[memoryview] = []
            backup = before_write if back_up_whole is None else None
            for fqn, dest, segs in run:
                if backup is not None and dest.nbytes:
                    backup(fqn, 0, dest.nbytes)
                bufs += (memoryview(bytearray(segs["head"].length)), _borrowed_view(dest),
                         memoryview(bytearray(segs["tail"].length)))  # fmt: skip
            preadv_full(fd, list(bufs), run[0][2]["head"].offset, where)
            return bufs

        def check_run(run: list[tuple[str, torch.Tensor, Mapping[str, Segment]]], bufs: list[memoryview]) -> None:
            # A mismatch raises; the loader then puts the tensors back from their backups.
            if verify:
                check_segments(where, [(fqn, segs) for fqn, _, segs in run], bufs)

        small = sorted((j for j in jobs if j[2]["data"].length < _SMALL_PIECE), key=lambda j: j[2]["head"].offset)
        runs: list[list[tuple[str, torch.Tensor, Mapping[str, Segment]]]] = []
        run_bytes = 0
        for job in small:
            head, tail = job[2]["head"], job[2]["tail"]
            size = tail.offset + tail.length - head.offset
            prev_end = runs[-1][-1][2]["tail"].offset + runs[-1][-1][2]["tail"].length if runs else -1
            if runs and prev_end == head.offset and run_bytes + size <= _RUN_BYTES:
                runs[-1].append(job)
                run_bytes += size
            else:
                runs.append([job])
                run_bytes = size
        large = [j for j in jobs if j[2]["data"].length >= _SMALL_PIECE]

        with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="ckptkeeper-read") as pool:
            futures = [pool.submit(load, j) for j in sorted(large, key=lambda j: -j[1].numel())]
            # Runs of small tensors are read by this thread alone, the kernel reading ahead of it:
            # their work is Python per tensor, and reader threads taking turns with it over the
            # GIL (each short copy or read giving it up and waiting to get it back) was slower.
            error: BaseException | None = None
            # Backups (fresh memory: page faults, then a copy) were what the reads waited for; two
            # threads, two runs ahead, use the time the loading thread spends waiting on the disk.
            backups = ThreadPoolExecutor(max_workers=_BACKUP_THREADS, thread_name_prefix="ckptkeeper-backup")
            try:
                backed: deque[Future[None]] = deque()
                if back_up_whole is not None:
                    for upcoming in runs[:_BACKUP_THREADS]:
                        backed.append(backups.submit(back_up_whole, [j[0] for j in upcoming]))
                for k, run in enumerate(runs):
                    # A window of runs asked for ahead: all of it at first, then the run entering it.
                    for upcoming in runs[: _READ_AHEAD_RUNS + 1] if k == 0 else runs[k + _READ_AHEAD_RUNS :][:1]:
                        pool.submit(_will_need, fd, upcoming)  # it may block while it queues the reads
                    if back_up_whole is not None:
                        backed.popleft().result()  # this run is backed up; the next ones' backups run meanwhile
                        if k + _BACKUP_THREADS < len(runs):
                            nxt = runs[k + _BACKUP_THREADS]
                            backed.append(backups.submit(back_up_whole, [j[0] for j in nxt]))
                    check_run(run, read_run(run))
            except BaseException as failed:  # raised once every reader has stopped writing
                error = failed
            finally:
                backups.shutdown(wait=True)
            for fut in futures:
                exc = fut.exception()
                error = error or exc
            if error is not None:
                raise error
        for job in late:
            bufs = [memoryview(bytearray(job[2][kind].length)) for kind in ("head", "data", "tail")]
            preadv_full(fd, list(bufs), job[2]["head"].offset, where)
            check_run([job], bufs)
            if bufs[1].nbytes:
                ctypes.memmove(job[1].data_ptr(), ctypes.addressof(ctypes.c_char.from_buffer(bufs[1])), bufs[1].nbytes)
    finally:
        os.close(fd)


def _open_data_file(path: str) -> int:
    """A read-only descriptor of a checkpoint's data file; CorruptCheckpointError unless it is a
    regular file reached without following a link."""
    try:
        return open_regular(path)
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"checkpoint data file {path} is missing; load an earlier checkpoint or restore this one from a copy"
        ) from None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EINVAL, errno.ENOTDIR, errno.EISDIR, errno.ENXIO):
            why = "it must be a regular file, not a link, folder or FIFO: restore this one from a copy, or"
        elif exc.errno in (errno.EACCES, errno.EPERM):
            why = "fix its permissions, or"
        else:  # the disk, the file system or the process's limits: it may read on a retry
            why = "retry once the storage is healthy, or"
        raise CorruptCheckpointError(
            f"{path} cannot be read as a checkpoint's data file ({exc.strerror or exc}): {why} load an "
            "earlier checkpoint (resume does this automatically)"
        ) from None


def _will_need(fd: int, run: list[tuple[str, torch.Tensor, Mapping[str, Segment]]]) -> None:
    start = run[0][2]["head"].offset
    tail = run[-1][2]["tail"]
    if hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, start, tail.offset + tail.length - start, os.POSIX_FADV_WILLNEED)


_NBYTES = operator.attrgetter("nbytes")


def any_overlap(dests: list[torch.Tensor]) -> bool:
    """Whether the bytes of any two of ``dests`` overlap (told in C: nearly always none do)."""
    import numpy as np

    starts = np.fromiter(map(torch.Tensor.data_ptr, dests), dtype=np.uint64, count=len(dests))
    ends = starts + np.fromiter(map(_NBYTES, dests), dtype=np.uint64, count=len(dests))
    used = ends > starts
    order = np.argsort(starts[used], kind="stable")
    first, last = starts[used][order], ends[used][order]
    return bool((first[1:] < np.maximum.accumulate(last)[:-1]).any())


def _overlapping(jobs: list[tuple[str, torch.Tensor, Any]]) -> set[str]:
    """Names of destinations whose bytes overlap another destination's."""
    # Told apart in C first (any_overlap): sorting a tuple per destination (below) took 12-20 ms
    # per load of 10,000 tensors.
    if not any_overlap([job[1] for job in jobs]):
        return set()
    return overlapping_spans(
        (dest.data_ptr(), dest.data_ptr() + n, fqn)
        for fqn, dest, _ in jobs
        if (n := dest.numel() * dest.element_size())
    )


K = TypeVar("K")


def overlapping_spans(spans: Iterable[tuple[int, int, K]]) -> set[K]:
    """The keys of the spans ``(start, end, key)`` (end excluded) that overlap another span."""
    out: set[K] = set()
    reach, reach_key = -1, None
    for start, end, key in sorted(spans, key=_START_END):
        if start < reach:
            out.update((key, cast(K, reach_key)))
        if end > reach:
            reach, reach_key = end, key
    return out


_START_END = operator.itemgetter(0, 1)
