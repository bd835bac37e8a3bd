"""Loading a checkpoint so that nothing unverified is trusted and a failed load changes nothing.

The order of a load:

1. the commit record (self-checksummed, schema-checked) and every file's size;
2. the small files (DCP ``.metadata``, trainer state) read whole, checked against the record's
   size and checksum, and only then decoded (allow-listed unpickler, bounded JSON);
3. the destination planned against DCP's metadata (:meth:`TrainingState.plan_load`: names,
   shapes; with ``strict`` every key must match, else :class:`CheckpointMismatchError` names each
   key with both shapes), before any tensor is written;
4. model tensors read in place, each backed up just before it is first written (:class:`Rollback`),
   optimizer state into new tensors; any failure puts the backed-up values back and the old
   optimizer state and extras with them, so everything is as it was.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import threading
from collections.abc import Collection, Mapping
from typing import Any, NamedTuple, cast

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from ..errors import CorruptCheckpointError
from ..storage import is_url, storage_for
from ..storage.layout import MODEL_DIR, train_state_name
from ..storage.local import open_regular
from .fastio import overlapping_spans
from .record import MAX_STATE_BYTES, CommitRecord, FileEntry, check_digest, loads_bounded
from .safe_metadata import MAX_METADATA_BYTES, safe_load_metadata
from .sharded import whole_at_one_rank
from .staging import Stager, local_shard
from .state import MADE_PLAIN, CheckpointMismatchError, LoadPlan, SavedTensor, _dtensor, flatten_tensors

log = logging.getLogger(__name__)

__all__ = [
    "CheckpointMismatchError",
    "HostCopies",
    "Rollback",
    "bounced",
    "check_fit",
    "check_unread",
    "read_metadata",
    "read_train_state",
    "read_verified",
    "saved_tensors",
]


def read_verified(local: str, rel: str, entry: FileEntry, where: str, max_bytes: int) -> bytes:
    """The bytes of one small checkpoint file, checked against its record entry before use.

    The file is opened without following a final symlink and never read past the listed size.
    ``local`` may also be the checkpoint's object-store URL (read in place).
    """
    if entry.bytes > max_bytes:
        raise CorruptCheckpointError(
            f"checkpoint {where} is corrupt: {rel} is listed with {entry.bytes} bytes, more than the "
            f"{max_bytes} ckptkeeper reads for it"
        )
    if is_url(local):
        storage = storage_for(local)
        try:
            data = storage.read_range(storage.join(local, rel), 0, entry.bytes + 1) if entry.bytes else b""
        except FileNotFoundError:
            raise CorruptCheckpointError(f"checkpoint {where} is corrupt: missing file {rel}") from None
        check_digest(where, rel, entry, data)
        return data
    try:
        fd = open_regular(os.path.join(local, rel))
    except FileNotFoundError:
        raise CorruptCheckpointError(f"checkpoint {where} is corrupt: missing file {rel}") from None
    except OSError as exc:
        raise CorruptCheckpointError(f"checkpoint {where}: cannot open {rel} ({exc.strerror})") from None
    try:
        with os.fdopen(fd, "rb") as f:
            data = f.read(entry.bytes + 1)
    except OSError as exc:
        raise CorruptCheckpointError(f"checkpoint {where}: cannot read {rel} ({exc.strerror})") from None
    check_digest(where, rel, entry, data)
    return data


def read_train_state(local: str, rank: int, record: CommitRecord, where: str) -> tuple[dict[str, Any], bool]:
    """(this rank's trainer-state document, whether it is rank 0's stand-in) after checking it."""
    name = train_state_name(rank)
    borrowed = False
    if name not in record.files:
        name, borrowed = train_state_name(0), True
    if name not in record.files:
        raise CorruptCheckpointError(f"checkpoint {where} is corrupt: its commit record lists no trainer state")
    data = read_verified(local, name, record.files[name], where, MAX_STATE_BYTES)
    doc = loads_bounded(data, f"{where}/{name}", max_bytes=MAX_STATE_BYTES, max_depth=64, allow_nonfinite=True)
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{where}/{name} is malformed (not a JSON object)")
    for key, kind in (("train_state", dict), ("state_meta", dict)):
        if not isinstance(doc.get(key, {}), kind):
            raise CorruptCheckpointError(f"{where}/{name} is malformed ({key} is not a JSON object)")
    return doc, borrowed


def read_metadata(local: str, record: CommitRecord, where: str) -> Any:
    """DCP's ``.metadata`` of the checkpoint, checksum-checked, then decoded without running code."""
    rel = f"{MODEL_DIR}/.metadata"
    if rel not in record.files:
        raise CorruptCheckpointError(f"checkpoint {where} is corrupt: its commit record lists no {rel}")
    data = read_verified(local, rel, record.files[rel], where, MAX_METADATA_BYTES)
    data_files = [k[len(MODEL_DIR) + 1 :] for k in record.files if k.startswith(MODEL_DIR + "/")]
    return safe_load_metadata(data, f"{where}/{rel}", data_files)


def check_unread(local: str, record: CommitRecord, where: str) -> None:
    """Check DCP's ``.metadata`` against its size and checksum without decoding it (for loads that
    take shapes from the segment table)."""
    rel = f"{MODEL_DIR}/.metadata"
    if rel not in record.files:
        raise CorruptCheckpointError(f"checkpoint {where} is corrupt: its commit record lists no {rel}")
    read_verified(local, rel, record.files[rel], where, MAX_METADATA_BYTES)


def saved_tensors(metadata: Any) -> dict[str, SavedTensor | None]:
    """Every key of DCP's metadata with its global shape and dtype (None: stored as bytes, not a tensor)."""
    out: dict[str, SavedTensor | None] = {}
    for key, md in metadata.state_dict_metadata.items():
        if type(md) is TensorStorageMetadata:
            dtype = getattr(getattr(md, "properties", None), "dtype", None)
            out[key] = SavedTensor(tuple(int(n) for n in md.size), dtype)
        else:
            out[key] = None
    return out


def check_fit(tensors: Mapping[str, Any], metadata: Any, where: str) -> bool:
    """Check that every destination tensor is in the checkpoint with the same shape.

    Raises :class:`CheckpointMismatchError` naming the keys that are missing or differ (with both
    shapes), before anything is read. Returns whether every dtype matches too (the fast reader
    needs it). :meth:`TrainingState.plan_load` does this and more for a whole state.
    """
    saved = saved_tensors(metadata)
    missing, mismatched = [], []
    same_dtypes = True
    for fqn, t in flatten_tensors(tensors):
        if fqn not in saved:
            missing.append(fqn)
            continue
        info = saved[fqn]
        if info is None:
            raise CorruptCheckpointError(
                f"checkpoint {where} stores {fqn} as bytes, not a tensor; the checkpoint may be tampered with: "
                "load an earlier checkpoint or restore this one from a copy"
            )
        if info.shape != tuple(t.shape):  # a DTensor's shape is the global one, as DCP's metadata records
            mismatched.append(f"{fqn} has shape {list(info.shape)} in the checkpoint and {list(t.shape)} in the model")
        elif info.dtype != t.dtype:
            same_dtypes = False
    if missing or mismatched:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        problems = mismatched[:3] + ([f"it has no {missing[0]}{more}"] if missing else [])
        raise CheckpointMismatchError(
            f"checkpoint {where} does not fit this model/optimizer: {'; '.join(problems)}. Load it into the model "
            "and optimizer it was saved from, or pass strict=False to TrainingState to load what fits"
        )
    return same_dtypes


_SMALL_COPY = 1 << 20
# ctypes.memmove gives up the GIL for the call; for a copy of a few microseconds, getting it back
# (behind threads running Python) costs more than the copy, so small copies keep it.
_MEMMOVE_AT = ctypes.cast(ctypes.memmove, ctypes.c_void_p).value
_memmove_holding_gil = (
    ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(_MEMMOVE_AT)
    if _MEMMOVE_AT
    else ctypes.memmove
)


class Rollback:
    """Backs up destination tensors just before they are overwritten, and puts them back on failure.

    A tensor's backup lives in a :class:`Stager`'s buffer when the stager already holds one of
    the same name, shape and dtype (async saves stage every tensor a load backs up, so a load
    after one costs no memory a save would not, and no fresh memory to fault in); otherwise it
    is made as tensors are backed up, never more than the tensors' own bytes. With
    ``incremental`` the reader backs up each piece of a tensor just before it reads into it
    (:meth:`before_write` with a byte range), so the copies (memory speed) spread over the reader
    threads and overlap with the reads (disk speed) instead of standing in front of them, and runs
    of small tensors a run at a time (:meth:`back_up_whole`). Without it, everything is copied at
    once, up front.
    """

    def __init__(
        self, stager: Stager, tensors: Mapping[str, Any], incremental: bool = False, deferred: Collection[str] = ()
    ) -> None:
        # ``deferred``: tensors the readers fill host copies of (:func:`bounced`); byte ranges of
        # their own memory are not what the readers write, so they are backed up whole, by
        # back_up_whole, before the copies go in.
        self._deferred = frozenset(deferred)
        leaves = list(flatten_tensors(tensors))
        self._leaves = dict(leaves)
        locals_ = [(name, local_shard(t)) for name, t in leaves]
        # Allocating a buffer per tensor up front was a sixth of a 10,000-tensor load: without
        # ready stager buffers, backups are made when taken (runs of small tensors in one block).
        self._buffers = stager.existing_buffers_by_name(locals_)
        self._blocks: list[tuple[list[str], torch.Tensor]] = []  # (names, one block holding their bytes)
        self._saved: dict[str, int] = {}  # bytes backed up from the start of each tensor
        self._lock = threading.Lock()
        by_storage: dict[int, list[str]] = {}
        ends: dict[int, int] = {}  # where each storage's memory ends, by where it starts
        opaque: set[str] = set()
        for name, local in locals_:
            if local.numel():
                try:
                    storage = local.untyped_storage()
                    at = storage.data_ptr()
                    by_storage.setdefault(at, []).append(name)
                    ends[at] = max(ends.get(at, at), at + storage.nbytes())
                except RuntimeError:
                    # A wrapper tensor subclass has no memory of its own (DCP's reader fills it
                    # through its own copy_): backed up whole, up front, with torch's copies.
                    opaque.add(name)
        # Tensors that share memory (tied weights) are backed up up front: backed up one at a
        # time, the second copy would be taken after the first name's load had overwritten it.
        # So are tensors of storages whose memory overlaps another's (two torch.from_numpy views
        # of one array; found by an outside attack).
        shared = {n for names in by_storage.values() if len(names) > 1 for n in names} | opaque
        for at in overlapping_spans((at, end, at) for at, end in ends.items()):
            shared.update(by_storage[at])
        # (buffer, tensor) of each guarded tensor the stager holds a buffer for, paired once here:
        # back_up_whole then costs a dictionary look-up per name (it is called for every piece a
        # load reads, optimizer slots included, 10,000 names a load at 2,500 parameters).
        self._pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if incremental:
            for name, local in locals_:
                buf = self._buffers.get(name)
                if buf is not None and name not in shared and local.numel():
                    self._pairs[name] = (buf, local.detach() if local.requires_grad else local)
        with torch.no_grad():
            for name, t in self._leaves.items():
                if not incremental or name in shared:
                    self._buffer(name).copy_(local_shard(t).detach())
                    self._saved[name] = -1  # the whole tensor

    def _buffer(self, name: str) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None:
            # Same shape, dtype and strides as the tensor, so bytes and elements line up.
            buf = self._buffers[name] = torch.empty_like(local_shard(self._leaves[name]), device="cpu")
        return buf

    @staticmethod
    def _bytes(t: torch.Tensor) -> torch.Tensor:
        return t.detach().reshape(-1).view(torch.uint8)

    def before_write(self, name: str, start: int, length: int) -> None:
        """Back up bytes ``[start, start + length)`` of tensor ``name`` (called just before they are overwritten).

        Pieces of one tensor come in order, from its first byte on. Tensors this rollback does not
        guard (new ones, such as a load's optimizer state) are ignored.
        """
        if name not in self._leaves or self._saved.get(name) == -1 or name in self._deferred:
            return
        src = local_shard(self._leaves[name])
        if 0 < length < _SMALL_COPY and src.is_contiguous() and src.device.type == "cpu":
            # A plain memory copy: torch calls (even a byte view) per small tensor cost more than its
            # bytes. Both are contiguous with the same layout (the buffer was made like the tensor).
            if start + length > src.numel() * src.element_size():
                raise ValueError(f"{name}: bytes {start}..{start + length} are outside the tensor")
            _memmove_holding_gil(self._buffer(name).data_ptr() + start, src.data_ptr() + start, length)
        elif length:
            src = self._bytes(local_shard(self._leaves[name]))
            self._bytes(self._buffer(name))[start : start + length].copy_(src[start : start + length])
        with self._lock:
            self._saved[name] = start + length

    def back_up_whole(self, names: list[str]) -> None:
        """Back up these whole tensors, in bulk copies that run without the GIL.

        For runs of small tensors about to be read: one call per run instead of one per tensor,
        and the copying can run beside the reader (which holds the GIL for its per-tensor work).
        Tensors already backed up, unguarded or empty are skipped.
        """
        pairs, saved, leaves = self._pairs, self._saved, self._leaves
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        paired: list[str] = []
        others: list[str] = []
        for name in names:
            pair = pairs.get(name)
            if pair is None:
                if name in leaves:
                    others.append(name)
            elif saved.get(name) != -1:
                paired.append(name)
                dst.append(pair[0])
                src.append(pair[1])
        if paired:
            with torch.no_grad():
                _copy_all(dst, src)
            with self._lock:
                saved.update(dict.fromkeys(paired, -1))
        if others:
            self._back_up_unpaired(others)

    def _back_up_unpaired(self, names: list[str]) -> None:
        by_dtype: dict[torch.dtype, tuple[list[str], list[torch.Tensor]]] = {}
        for name in names:
            if self._saved.get(name) == -1:
                continue
            t = local_shard(self._leaves[name])
            if t.numel():
                group = by_dtype.setdefault(t.dtype, ([], []))
                group[0].append(name)
                # A load's destinations are detached already (a detach per tensor is not free).
                group[1].append(t.detach() if t.requires_grad else t)
        with torch.no_grad():
            for names_, src_ in by_dtype.values():
                buffers = self._buffers
                if buffers:
                    # Into the buffers the stager holds (no new memory); a block for the rest.
                    held = [i for i, name in enumerate(names_) if name in buffers]
                    if held:
                        _copy_all([buffers[names_[i]] for i in held], [src_[i] for i in held])
                    if len(held) != len(names_):
                        kept = set(held)
                        rest = [i for i in range(len(names_)) if i not in kept]
                        self._block([names_[i] for i in rest], [src_[i] for i in rest])
                else:
                    self._block(names_, src_)
                with self._lock:
                    for name in names_:
                        self._saved[name] = -1

    def _block(self, names: list[str], src: list[torch.Tensor]) -> None:
        # One allocation and one C++ copy loop for the whole group instead of a tensor and a copy
        # call per name; taken apart again only if the load fails.
        block = _flatten(src)
        with self._lock:
            self._blocks.append((names, block))

    def restore(self) -> None:
        """Put every backed-up byte back as it was before the load.

        Never raises: it runs while the load's own error is on its way up, which must not be
        masked. A tensor that cannot be put back (torch refusing the copy) is logged by name.
        """
        with self._lock:
            saved = dict(self._saved)
            blocks = list(self._blocks)
        in_blocks: dict[str, tuple[torch.Tensor, int]] = {}  # name: (its block, where it starts there)
        for names, block in blocks:
            pos = 0
            for name in names:
                in_blocks[name] = (block, pos)
                pos += local_shard(self._leaves[name]).numel()
        for name, upto in saved.items():
            try:
                dest = local_shard(self._leaves[name])
                if upto < 0:
                    found = in_blocks.get(name)
                    if found is not None:
                        block, pos = found
                        dest.detach().copy_(block[pos : pos + dest.numel()].view(dest.shape))
                    else:
                        dest.detach().copy_(self._buffers[name])
                elif upto:
                    self._bytes(dest)[:upto].copy_(self._bytes(self._buffers[name])[:upto])
            except Exception as exc:
                log.error("a failed load could not put %s back as it was: %s", name, exc)


class HostCopies(NamedTuple):
    """Destinations a load reads into host tensors first (see :func:`bounced`)."""

    names: list[str]
    """Their names in the plan (what :class:`Rollback` calls them)."""
    destinations: list[torch.Tensor]
    """The tensors themselves (a DTensor's local shard)."""
    copies: list[torch.Tensor]
    """The host tensors the readers fill, one per destination."""

    @classmethod
    def none(cls) -> HostCopies:
        """No destination read through a host tensor (new lists each time: they are never shared)."""
        return cls([], [], [])

    def copy_in(self) -> None:
        """Copy every host tensor into its destination (once the reads are done and checked)."""
        if self.copies:
            with torch.no_grad():
                _copy_all(self.destinations, self.copies)


def _needs_host_copy(t: torch.Tensor) -> torch.Tensor | None:
    # The local tensor of a destination the fast readers cannot fill in place (they pread into a
    # CPU tensor's memory, which must hold its elements one after another), when a copy_ can fill
    # it from a host tensor; None otherwise. Sparse, quantized, lazily conjugated or negated
    # tensors and tensor subclasses stay with DCP's reader, which refuses or handles them by name.
    kind = type(t)
    local: torch.Tensor
    if kind is DTensor:
        local = cast(DTensor, t)._local_tensor
    elif kind is torch.Tensor or kind is torch.nn.Parameter:
        local = t
    else:
        return None
    if local.is_cpu and local.is_contiguous():
        return None
    if type(local) not in (torch.Tensor, torch.nn.Parameter) or local.layout is not torch.strided:
        return None
    if local.is_quantized or local.is_meta or local.is_conj() or local.is_neg() or local.is_inference():
        # (An inference tensor takes no copy_ outside inference mode: DCP's reader fills it.)
        return None
    return local


def bounced(plan: LoadPlan, budget: int | None = None) -> tuple[LoadPlan, HostCopies]:
    """The plan the fast readers fill, and the destinations they fill through host tensors.

    A destination on a GPU, or whose memory does not hold its elements one after another (a
    transposed parameter), cannot be read into in place, so every load into one went to DCP's
    reader (every load on a GPU machine; about 0.7x DCP's speed at one rank of a CUDA FSDP2 mesh,
    measured on an H200). Here such destinations are replaced by new contiguous host tensors of
    the same shape and dtype (under the same sharding spec for a DTensor; as a plain tensor for
    one that holds its whole tensor, :func:`~ckptkeeper.engine.sharded.whole_at_one_rank`); the
    readers fill and check those, and :meth:`HostCopies.copy_in` copies them in afterwards, so a failed read
    leaves the destinations untouched. It costs one host copy of those tensors while the load
    runs, which must fit ``budget`` bytes (the staging budget); without any such destination, or
    over the budget, ``plan`` itself comes back (and DCP's reader reads it).

    A DTensor that holds its whole tensor and can be read into in place is replaced by its local
    tensor, with no copy: the single-process reader, which takes plain tensors only, then reads a
    one-rank DTensor state (FSDP2 on one GPU) in place.
    """
    names: list[str] = []
    dests: list[torch.Tensor] = []
    copies: list[torch.Tensor] = []
    swapped: dict[int, torch.Tensor] = {}  # id of the plan's tensor: the one the readers fill
    meshes: dict[int, bool] = {}  # for whole_at_one_rank

    def host(name: str, t: torch.Tensor) -> None:
        if id(t) in swapped:
            return  # one tensor under two names (tied weights): one host tensor, copied in once
        whole = whole_at_one_rank(t, meshes)
        local = _needs_host_copy(t)
        if local is None:
            # (``whole`` is the local tensor just looked at: on the CPU and contiguous, or one the
            # fast readers refuse, which sends the load to DCP's reader all the same.)
            if whole is not None and not whole.is_inference():
                swapped[id(t)] = whole  # read in place, as the plain tensor it is at one rank
            return
        buf = torch.empty(local.shape, dtype=local.dtype, device="cpu")
        names.append(name)
        dests.append(local.detach() if local.requires_grad else local)
        copies.append(buf)
        swapped[id(t)] = _dtensor(buf, t._spec) if type(t) is DTensor and whole is None else buf

    if plan.flat is not None:
        # From the flat list, not the tree (a walk of the tree costs a 10,000-tensor load
        # milliseconds): live tensors first; a slot made like a parameter (its twin) lives where
        # the parameter does, so it is looked at only when some parameter was swapped.
        twinned = []
        for key, t, twin in plan.flat:
            if twin is None:
                host(key, t)
            elif twin is not MADE_PLAIN:
                twinned.append((key, t))
        if swapped:
            for key, t in twinned:
                host(key, t)
    else:
        for key, t in flatten_tensors(plan.tensors):
            host(key, t)
    if not swapped or (budget is not None and sum(c.nbytes for c in copies) > budget):
        return plan, HostCopies.none()

    def rebuilt(tree: Mapping[str, Any]) -> dict[str, Any]:
        return {
            k: rebuilt(v) if isinstance(v, Mapping) else swapped.get(id(v), v) if isinstance(v, torch.Tensor) else v
            for k, v in tree.items()
        }

    flat = None
    if plan.flat is not None:
        flat = [(k, t, twin) if id(t) not in swapped else (k, swapped[id(t)], None) for k, t, twin in plan.flat]
    return dataclasses.replace(plan, tensors=rebuilt(plan.tensors), flat=flat), HostCopies(names, dests, copies)


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``d.copy_(s)`` for each pair, in one C++ loop where torch has one."""
    bulk = getattr(torch, "_foreach_copy_", None)  # private, so not relied on
    if bulk is not None:
        bulk(dst, src)
    else:
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)


def _flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A new 1-D tensor holding a copy of ``tensors``' elements one after another (all of one dtype).

    Always a copy: ``flatten_dense_tensors`` of a single tensor returns a view of it, which as a
    backup would be overwritten by the very read it guards against.
    """
    flatten = getattr(torch._C._nn, "flatten_dense_tensors", None)  # private: checked, with a public fallback
    if flatten is None or len(tensors) == 1:
        return torch.cat([t.reshape(-1) for t in tensors])  # cat always makes a new tensor
    block: torch.Tensor = flatten(tensors)
    if block.data_ptr() == tensors[0].data_ptr():  # a view after all (a future torch): copy it
        block = block.clone()
    return block
