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

Only plain CPU tensors in one process use this path; sharded (DTensor) and multi-rank states go
through DCP's own writer and reader.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..errors import CorruptCheckpointError
from .record import FileEntry, new_hasher

__all__ = ["DATA_FILE", "Segment", "can_use_fast_path", "parse_layout", "read_fast", "write_fast"]

DATA_FILE = "__0_0.distcp"
_CHUNK = 64 << 20
_SMALL_PIECE = 1 << 20  # pieces below this are joined with their neighbours into one write...
_RUN_BYTES = 8 << 20  # ...of up to this many bytes
_CRC_LOCK = threading.Lock()
_SKELETONS: dict[tuple[tuple[int, ...], torch.dtype], tuple[bytes, bytes]] = {}


@dataclass(frozen=True)
class Segment:
    """A byte range of the data file: ``kind`` is "head", "data" or "tail" of tensor ``fqn``."""

    kind: str
    fqn: str
    offset: int
    length: int
    xxh3_64: str

    def to_json(self) -> list[Any]:
        return [self.kind, self.fqn, self.offset, self.length, self.xxh3_64]

    @classmethod
    def from_json(cls, row: Any) -> Segment:
        """Parse one layout row read from a commit record; ValueError when it is not exactly one."""
        if not isinstance(row, list) or len(row) != 5:
            raise ValueError(f"layout row {str(row)[:80]!r} is not [kind, name, offset, length, checksum]")
        kind, fqn, offset, length, digest = row
        if kind not in ("head", "data", "tail") or not isinstance(fqn, str) or not isinstance(digest, str):
            raise ValueError(f"layout row {str(row)[:80]!r} is malformed")
        for v in (offset, length):
            if type(v) is not int or not 0 <= v < 1 << 52:
                raise ValueError(f"layout row {str(row)[:80]!r} has an invalid offset or length")
        return cls(kind, fqn, offset, length, digest)


def parse_layout(rows: Any, file_size: int, metadata: Any, data_file: str = DATA_FILE) -> dict[str, dict[str, Segment]]:
    """Check a data file's layout against its size and DCP's metadata; returns segments by tensor.

    ``data_file`` is the file's name inside ``model_and_optim`` (each rank writes its own).

    The segments must tile the file exactly (head, data, tail of each tensor, in order) and each
    tensor's byte range must be the one DCP's (checksummed) ``.metadata`` gives, so a layout that
    was tampered with is caught before any byte is read. ValueError says what does not fit.
    """
    if not isinstance(rows, list):
        raise ValueError("the data file's layout is not a list")
    segments = [Segment.from_json(r) for r in rows]
    if len(segments) % 3:
        raise ValueError("the data file's layout does not hold whole tensors")
    by_fqn: dict[str, dict[str, Segment]] = {}
    pos = 0
    for i in range(0, len(segments), 3):
        trio = segments[i : i + 3]
        if [s.kind for s in trio] != ["head", "data", "tail"] or len({s.fqn for s in trio}) != 1:
            raise ValueError(f"layout rows {i}..{i + 2} are not one tensor's head, data and tail")
        for s in trio:
            if s.offset != pos:
                raise ValueError(f"segment {s.kind} of {s.fqn[:80]!r} starts at {s.offset}, expected {pos}")
            pos += s.length
        if trio[0].fqn in by_fqn:
            raise ValueError(f"tensor {trio[0].fqn[:80]!r} appears twice in the layout")
        by_fqn[trio[0].fqn] = {s.kind: s for s in trio}
    if pos != file_size:
        raise ValueError(f"the layout covers {pos} bytes, the data file has {file_size}")
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
        props = getattr(md, "properties", None)
        dtype = getattr(props, "dtype", None)
        size = shapes[fqn]
        if size is None or not isinstance(dtype, torch.dtype):
            raise ValueError(f"the DCP metadata has no tensor entry for {fqn[:80]!r}")
        want = math.prod(size) * torch.empty((), dtype=dtype).element_size()
        if segs["data"].length != want:
            raise ValueError(f"{fqn[:80]!r}: the layout holds {segs['data'].length} bytes, its shape needs {want}")
    return by_fqn


def _chunk_sizes(metadata: Any, index: Any) -> tuple[int, ...] | None:
    """The sizes of the stored piece ``index`` names (a whole tensor, or one rank's shard of it)."""
    md = metadata.state_dict_metadata.get(index.fqn)
    for chunk in getattr(md, "chunks", None) or ():
        if tuple(chunk.offsets) == tuple(index.offset):
            return tuple(int(n) for n in chunk.sizes)
    return None


def _leaves(tree: Mapping[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[str, tuple[str, ...], Any]]:
    for key, value in tree.items():
        p = (*path, str(key))
        if isinstance(value, Mapping):
            yield from _leaves(value, p)
        else:
            yield ".".join(p), p, value


def can_use_fast_path(tree: Mapping[str, Any]) -> bool:
    """Whether every leaf is a plain CPU tensor (no DTensor, no GPU tensor, no other object)."""
    for _, _, v in _leaves(tree):
        if type(v) is not torch.Tensor and not isinstance(v, torch.nn.Parameter):
            return False
        if v.device.type != "cpu" or v.is_sparse or v.is_quantized:
            return False
    return True


def _skeleton(t: torch.Tensor) -> tuple[bytes, bytes]:
    key = (tuple(t.shape), t.dtype)
    cached = _SKELETONS.get(key)
    if cached is not None:
        return cached
    buf = io.BytesIO()
    # CRC32 of the data record cannot be known without the data; torch.load does not check it.
    # The option is process-global, so it is switched off only around this call, under a lock.
    with _CRC_LOCK:
        torch.serialization.set_crc32_options(False)
        try:
            with torch.serialization.skip_data():
                torch.save(torch.empty(t.shape, dtype=t.dtype), buf)
        finally:
            torch.serialization.set_crc32_options(True)
    raw = buf.getvalue()
    offset = torch._C.PyTorchFileReader(io.BytesIO(raw)).get_record_offset("data/0")  # type: ignore[attr-defined]
    nbytes = t.numel() * t.element_size()
    pair = (raw[:offset], raw[offset + nbytes :])
    _SKELETONS[key] = pair
    return pair


def exact(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when it is contiguous and owns exactly its storage, else a compact copy."""
    t = t.detach()
    if t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.contiguous().clone()


def _bytes_of(t: torch.Tensor) -> memoryview:
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def _coalesce(pieces: list[tuple[int, memoryview]]) -> list[tuple[int, memoryview | bytes]]:
    """Adjacent small pieces joined into one write each (a copy of small bytes is cheaper than a
    thread-pool job and a system call per tensor header); large pieces are written as they are."""
    out: list[tuple[int, memoryview | bytes]] = []
    run: list[memoryview] = []
    run_start = run_end = 0

    def flush() -> None:
        if run:
            out.append((run_start, run[0] if len(run) == 1 else b"".join(run)))
            run.clear()

    for start, view in sorted(pieces, key=lambda p: p[0]):
        if len(view) >= _SMALL_PIECE:
            flush()
            out.append((start, view))
            continue
        if not run or start != run_end or (run_end - run_start) + len(view) > _RUN_BYTES:
            flush()
            run_start = start
        run.append(view)
        run_end = start + len(view)
    flush()
    return out


def write_fast(model_dir: str, tree: Mapping[str, Any], threads: int = 2) -> tuple[dict[str, FileEntry], list[Segment]]:
    """Write ``tree`` (plain CPU tensors) as a stock DCP checkpoint in ``model_dir``.

    Returns the files written (relative to ``model_dir``) with sizes and xxh3-64 checksums, and
    the layout of the data file with a checksum per segment.
    """
    os.makedirs(model_dir, exist_ok=True)
    leaves = [(fqn, path, exact(value)) for fqn, path, value in _leaves(tree)]
    entry, segments, starts = write_items(os.path.join(model_dir, DATA_FILE), [(f, t) for f, _, t in leaves], threads)
    items = [
        (fqn, path, t, start, segs)
        for (fqn, path, t), start, segs in zip(leaves, starts, _trios(segments), strict=True)
    ]
    metadata = _metadata(items, model_dir)
    meta_bytes = pickle.dumps(metadata)
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
    data_path: str, tensors: list[tuple[str, torch.Tensor]], threads: int = 2
) -> tuple[FileEntry, list[Segment], list[int]]:
    """Write each tensor as one ``torch.save`` blob, one after another, into a new file at ``data_path``.

    Tensors must be contiguous CPU tensors that own their storage exactly (see :func:`exact`).
    Returns the file's size and checksum, its segments (head, data, tail of each tensor, in
    order, each with its checksum) and where each tensor's blob starts.
    """
    items = []
    offset = 0
    for fqn, t in tensors:
        head, tail = _skeleton(t)
        data = _bytes_of(t)
        items.append((fqn, head, data, tail, offset))
        offset += len(head) + len(data) + len(tail)
    total = offset
    fd = os.open(data_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        if total:
            # Reserve the space first: a full disk fails here, before any byte is written.
            os.posix_fallocate(fd, 0, total)
        pieces: list[tuple[int, memoryview]] = []
        for _, head, data, tail, start in items:
            pieces.append((start, memoryview(head)))
            for i in range(0, len(data), _CHUNK):
                pieces.append((start + len(head) + i, data[i : i + _CHUNK]))
            pieces.append((start + len(head) + len(data), memoryview(tail)))

        def write_piece(piece: tuple[int, memoryview | bytes]) -> None:
            _pwrite_all(fd, memoryview(piece[1]), piece[0])

        segments: list[Segment] = []
        whole = new_hasher()
        with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="ckptkeeper-write") as pool:
            jobs = _coalesce(pieces)
            pending = [pool.submit(write_piece, p) for p in sorted(jobs, key=lambda p: -len(p[1]))]
            # Hash while the writers run: one sequential pass over the same memory, GIL released.
            for fqn, head, data, tail, start in items:
                for kind, view, off in (
                    ("head", memoryview(head), start),
                    ("data", data, start + len(head)),
                    ("tail", memoryview(tail), start + len(head) + len(data)),
                ):
                    h = new_hasher()
                    for i in range(0, len(view), _CHUNK):
                        h.update(view[i : i + _CHUNK])
                        whole.update(view[i : i + _CHUNK])
                    segments.append(Segment(kind, fqn, off, len(view), h.hexdigest()))
            for fut in pending:
                fut.result()
        os.fsync(fd)
    finally:
        os.close(fd)
    return FileEntry(total, whole.hexdigest()), segments, [it[4] for it in items]


def _metadata(items: list[Any], model_dir: str) -> Metadata:
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
        storage_meta=StorageMeta(checkpoint_id=model_dir, save_id=uuid.uuid4().hex),
    )


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
) -> None:
    """Fill the tensors of ``tree`` in place from a checkpoint written by :func:`write_fast`.

    ``by_fqn`` is :func:`parse_layout`'s result. Each tensor's bytes are read straight into it
    (several tensors at once, largest first); ``before_write(fqn, start, length)`` is called just
    before each piece of a tensor is written (the loader backs it up there). With ``verify`` every segment's
    checksum is checked on the way and a mismatch raises CorruptCheckpointError naming the file
    and tensor.
    """
    where = os.path.join(model_dir, DATA_FILE)
    jobs = []
    for fqn, _, dest in _leaves(tree):
        segs = by_fqn.get(fqn)
        if segs is None:
            raise KeyError(f"the checkpoint has no tensor {fqn!r}")
        want = dest.numel() * dest.element_size()
        if segs["data"].length != want or not dest.is_contiguous() or dest.device.type != "cpu":
            raise ValueError(f"{fqn}: {segs['data'].length} bytes saved, destination holds {want}")
        jobs.append((fqn, dest, segs))
    # O_NOFOLLOW: a checkpoint's data file is never a link to somewhere else.
    fd = os.open(where, os.O_RDONLY | os.O_NOFOLLOW)
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
                    raise CorruptCheckpointError(
                        f"{where} is corrupt: the bytes of {fqn} ({kind}) have checksum {h.hexdigest()}, the "
                        f"checkpoint says {seg.xxh3_64}; load an earlier checkpoint or restore this one from a copy"
                    )

        def load_run(run: list[tuple[str, torch.Tensor, Mapping[str, Segment]]]) -> None:
            # Many small tensors: one read of their whole span, each segment checked in memory
            # before its bytes are copied into place (a read per header was most of the cost).
            start = run[0][2]["head"].offset
            tail = run[-1][2]["tail"]
            view = memoryview(bytearray(tail.offset + tail.length - start))
            pos = 0
            while pos < len(view):
                n = os.preadv(fd, [view[pos:]], start + pos)
                if n == 0:
                    raise CorruptCheckpointError(f"{where} ends early (truncated file)")
                pos += n
            for fqn, dest, segs in run:
                for kind in ("head", "data", "tail"):
                    seg = segs[kind]
                    if verify:
                        h = new_hasher()
                        h.update(view[seg.offset - start : seg.offset - start + seg.length])
                        if h.hexdigest() != seg.xxh3_64:
                            raise CorruptCheckpointError(
                                f"{where} is corrupt: the bytes of {fqn} ({kind}) have checksum {h.hexdigest()}, "
                                f"the checkpoint says {seg.xxh3_64}; load an earlier checkpoint or restore this "
                                "one from a copy"
                            )
                data = segs["data"]
                if data.length:
                    if before_write is not None:
                        before_write(fqn, 0, data.length)
                    _bytes_of(dest.detach())[:] = view[data.offset - start : data.offset - start + data.length]

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
            futures += [pool.submit(load_run, r) for r in runs]
            error: BaseException | None = None
            for fut in futures:
                # Wait for every reader before reporting, so nothing writes into a tensor afterwards.
                exc = fut.exception()
                if exc is not None and error is None:
                    error = exc
            if error is not None:
                raise error
    finally:
        os.close(fd)
