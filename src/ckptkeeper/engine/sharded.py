"""The fast path with several ranks, and ranged loads: each rank writes the pieces it holds as
stock DCP files and reads back only the byte ranges that overlap what it holds.

Saving (every rank at once): a rank's pieces are its local shards of DTensors (FSDP2, Shard and
Replicate placements) and its plain tensors, which are replicated (DDP-style) and so written once:
each replicated piece has one writer, chosen the same way on every rank without talking (the
largest pieces spread over the ranks first; for a DTensor replicated along a mesh dimension, the
holder at a coordinate derived from the name). Each rank writes ``__{rank}_0.distcp`` with the
single-process writer's machinery (preallocated, pwrite from writer threads, xxh3 per segment in
the same pass) and its segment table ``.ckptkeeper-layout-{rank}.json``; rank 0 writes DCP's
``.metadata`` from every rank's pieces, so stock ``torch.distributed.checkpoint.load`` reads the
checkpoint at any world size.

Loading (any world size, any sharding): for every destination tensor the stored pieces that
overlap its local region are found in DCP's metadata. A piece that is exactly the region is read
straight into the tensor; others are read into a buffer, checked, and the overlap copied. Small
pieces that lie next to each other are fetched in one read. Every segment's checksum is checked
before its bytes are used, and the source is a local file (``pread``) or an object store (ranged
GETs, several at once), so an object-store load fetches what the rank needs and nothing else.

What this path does not take (GPU destinations, other placements, dtype changes, DTensors on a
mesh that is not the whole group) goes through DCP's own writer and reader instead; the ranks
agree on which before any of them starts.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
import operator
import os
import threading
import weakref
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, cast

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
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Replicate, Shard

from ..errors import CorruptCheckpointError
from ..storage import Storage
from ..storage.base import Upload
from ..storage.layout import MODEL_DIR
from .fastio import (
    _SMALL_PIECE,
    _STRIDED,
    Leaves,
    Segment,
    _borrowed_view,
    _leaves,
    _new_segment,
    _open_data_file,
    _plan_writes,
    _write_planned,
    check_names,
    check_segments,
    dumps_metadata,
    exact,
    fetch_and_place,
    is_plain,
    parse_layout,
    pread_full,
    preadv_full,
    saved_from_table,
    segment_mismatch,
    skeleton_layout,
    skeleton_sums,
    write_synced,
)
from .gcpause import paused_gc
from .record import FileEntry
from .save_memo import KeptPlan, SaveMemo
from .state import SavedTensor

__all__ = [
    "INDEX_FILE",
    "JobBuffers",
    "LocalSource",
    "Piece",
    "PieceEntry",
    "PieceIndex",
    "RemoteSource",
    "ShardLayout",
    "ShardPlan",
    "Source",
    "Stored",
    "build_metadata",
    "check_stored",
    "format1_pieces",
    "index_bytes",
    "index_from_metadata",
    "index_from_own_table",
    "index_from_tables",
    "index_pieces",
    "is_pieces_table",
    "is_whole",
    "layout_name",
    "local_pieces",
    "metadata_bytes",
    "plan_reads",
    "plan_shard",
    "read_pieces",
    "recheck_shard",
    "segments_read",
    "shard_name",
    "table_name",
    "table_pieces",
    "write_shard",
]

_RUN_BYTES = 8 << 20
_JOB_RUNS = 512  # runs read by one job at most (each its own pread)
PIECES_KEY = "pieces"
"""A format-1 per-rank segment table's entry placing each piece: ``{fqn: [dtype, global shape, offsets, sizes]}``."""
TABLE_FORMAT = 2
"""The per-rank segment table this version writes (:func:`table_name`); format 1 is still read."""
_TABLE_KEYS = frozenset({"format", "file", "kinds", "names", "kind", "sums"})
_TABLE_PREFIX = f"{MODEL_DIR}/.ckptkeeper-pieces-"
_OLD_TABLE_PREFIX = f"{MODEL_DIR}/.ckptkeeper-layout-"
_REGIONS: dict[Any, Any] = {}
_REMOTE_PART = 16 << 20
_BY_SPEC_ID: dict[int, list[Any]] = {}
"""[weak reference to the spec, its hash then, world size, box, writer or None, a save's piece
facts or None] by ``id(spec)``.

A front for :data:`_REGIONS` and :data:`_SPEC_WRITERS`, which are keyed by the spec's value:
FSDP2 makes a spec object per parameter group, equal to the other groups' for a parameter of the
same shape, so most look-ups there ran DTensorSpec's ``__eq__`` (about a microsecond), once per
tensor per load and twice per save, ten milliseconds at 10,000 tensors. Here a spec object is
known by identity, checked with the weak reference (a dead spec's address can be reused) and with
the hash DTensorSpec caches, which it drops when a field is set again (a spec changed in place is
then looked up by value again). Where torch keeps no cached hash, nothing is kept here.
"""


def _spec_entry(spec: Any, world: int) -> list[Any] | None:
    """This very ``spec`` object's entry for ``world`` in :data:`_BY_SPEC_ID`, if it is still good."""
    hit = _BY_SPEC_ID.get(id(spec))
    if hit is not None and hit[0]() is spec and hit[2] == world and hit[1] == spec.__dict__.get("_hash"):
        return hit
    return None


def _keep_spec_box(spec: Any, world: int, box: Any) -> None:
    """Start this spec object's entry with its ``box`` at ``world`` (nothing where torch caches no hash)."""
    _BY_SPEC_ID.pop(id(spec), None)  # another object's at this address, or this one's before a change
    hash(spec)  # fills the spec's cached hash
    h = spec.__dict__.get("_hash")
    if h is None:
        return
    if len(_BY_SPEC_ID) > 1 << 16:
        _BY_SPEC_ID.clear()
    _BY_SPEC_ID[id(spec)] = [weakref.ref(spec), h, world, box, None, None]


def shard_name(rank: int) -> str:
    """The data file rank ``rank`` writes, inside ``model_and_optim`` (DCP's own naming)."""
    return f"__{rank}_0.distcp"


def table_name(rank: int) -> str:
    """The segment table of rank ``rank``'s data file, relative to the checkpoint (format 2).

    Format 1 tables had another name (:func:`layout_name`): a ckptkeeper that predates format 2
    finds no table it knows in a newer checkpoint and loads it through DCP's reader, rather
    than calling it corrupt.
    """
    return f"{_TABLE_PREFIX}{rank}.json"


def layout_name(rank: int) -> str:
    """Where format 1 (before format 2) kept rank ``rank``'s segment table; still read."""
    return f"{_OLD_TABLE_PREFIX}{rank}.json"


def is_pieces_table(rel: str) -> bool:
    """Whether ``rel`` (relative to the checkpoint) is a format-2 per-rank segment table."""
    return rel.startswith(_TABLE_PREFIX)


class Piece(NamedTuple):
    """One piece of one tensor that this rank holds: the whole tensor, or its local shard.

    (A named tuple: a save of many small tensors makes one per tensor.)
    """

    fqn: str
    path: tuple[str, ...]
    tensor: torch.Tensor
    """The local data (the DTensor's local shard, or the plain tensor)."""
    offsets: tuple[int, ...]
    """Where the piece starts in the global tensor."""
    global_shape: tuple[int, ...]
    writer: bool
    """Whether this rank is the one that writes it (replicated pieces are written once)."""


PieceEntry = tuple[str, tuple[str, ...], tuple[int, ...], torch.dtype, tuple[int, ...], tuple[int, ...], int, int]
"""What rank 0 needs of each written piece: (fqn, path, global shape, dtype, offsets, sizes,
start in the rank's data file, length). Rank 0 gathers one per piece of every rank (DCP's
metadata names every piece), so it is kept to plain values."""


def _plain_placements(placements: Any) -> bool:
    # Strided shards (FSDP over TP) and partial sums have offsets DCP's metadata cannot express
    # as one box per rank, or need a reduction first: DCP's own writer handles those.
    return all(type(p) in (Shard, Replicate) for p in placements)


def whole_at_one_rank(t: Any, meshes: dict[int, bool] | None = None) -> torch.Tensor | None:
    """A DTensor's local tensor when it holds the whole tensor (a one-rank mesh, Shard or Replicate
    placements), else None: in one process such a tensor is saved and loaded as that plain tensor,
    in the single-process format (so a DTensor state at one rank, FSDP2 on one GPU, takes the
    single-process fast path, and any reader of that format, older ones included, reads it).

    ``meshes``: the answers for meshes already asked, by ``id`` (the caller holds the tensors, so
    their meshes and ids stay): a mesh's size costs ~2 us a look, 7,500 looks per 10,000 tensors.
    """
    if type(t) is not DTensor:
        return None
    local: torch.Tensor = t._local_tensor
    if local.shape != t.shape:
        return None
    spec = t._spec
    mesh = spec.mesh
    one = meshes.get(id(mesh)) if meshes is not None else None
    if one is None:
        one = mesh.size() == 1
        if meshes is not None:
            meshes[id(mesh)] = one
    if not one or not _plain_placements(spec.placements):
        return None
    return local


def _region(value: Any, world: int) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]] | None:
    """(local data, global offsets, global shape) of a leaf; None when this path cannot take it."""
    if isinstance(value, DTensor):
        local = value._local_tensor  # to_local() runs an autograd function per tensor; only read here
        # The box depends only on the sharding spec (global shape, mesh, this rank's place in it,
        # placements), whose hash DTensor caches: one look-up per tensor instead of asking the
        # mesh for its size, shape and coordinate each time (~13 us, 0.15 s at 12,000 tensors).
        spec = value._spec
        hit = _spec_entry(spec, world)
        if hit is not None:
            found = hit[3]  # this very spec object, unchanged (see _BY_SPEC_ID)
        else:
            found = _REGIONS.get((spec, world))
            if found is None:
                if len(_REGIONS) > 4096:
                    _REGIONS.clear()
                found = _REGIONS[(spec, world)] = _box(value, world)
            _keep_spec_box(spec, world, found)
        if found is _NO_BOX or tuple(local.shape) != found[0]:
            return None
        return local, found[1], found[2]
    if not is_plain(value) or value.is_nested:
        return None  # (a nested tensor has no shape to ask: DCP's path refuses it by name)
    return value, (0,) * value.dim(), tuple(int(n) for n in value.shape)


_NO_BOX = ((), (), ())


def _box(value: DTensor, world: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offsets, global shape) of a DTensor's local shard; _NO_BOX when unplaceable."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not _plain_placements(value.placements) or value.device_mesh.size() != world:
        return _NO_BOX
    # On the CPU whatever the default device: torch's helper makes tensors there and asks them for
    # item() (under a "meta" default, every FSDP2 save failed; found by an outside attack).
    with torch.device("cpu"):
        shape, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    return tuple(int(n) for n in shape), tuple(int(o) for o in offsets), tuple(int(n) for n in value.shape)


def _usable(t: torch.Tensor) -> bool:
    # is_cpu rather than device.type: a device object per look costs a microsecond, per tensor per load.
    # The layout, not is_sparse alone: a sparse CSR tensor is not "sparse" to torch, and has no
    # is_contiguous() to ask (a save that let one through failed with torch's words); DCP's path
    # refuses it by name.
    return t.is_cpu and t.layout is _STRIDED and not t.is_quantized


def _name_hash(fqn: str) -> int:
    # Python's hash() differs between processes; every rank must pick the same writer.
    return zlib.crc32(fqn.encode())


def _dtensor_writer(value: DTensor, fqn: str) -> bool:
    mesh = value.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return False
    for dim, placement in enumerate(value.placements):
        if isinstance(placement, Replicate) and coord[dim] != _name_hash(fqn) % mesh.size(dim):
            return False
    return True


def local_pieces(tree: Mapping[str, Any], rank: int, world: int) -> tuple[list[Piece], str] | None:
    """This rank's pieces of ``tree`` and a signature every rank must share, or None when this
    path cannot take the tree (the caller then uses DCP's writer on every rank).

    The signature covers the replicated (plain) tensors: their writers are chosen from that list,
    so it must be the same list everywhere.
    """
    with paused_gc():  # an object or two per tensor, in a background save too
        leaves = _leaves(tree)
        check_names(leaves)
        return _local_pieces(leaves, rank, world)


class ShardPlan(NamedTuple):
    """What :func:`plan_shard` found for one save on this rank."""

    pieces: list[Piece]
    """This rank's pieces (empty when ``kept`` holds the write plan already)."""
    signature: str
    """What every rank must share (see :func:`local_pieces`)."""
    kept: KeptPlan | None
    """The memo's plan for these tensors (its write plan filled when reused), or None without a memo."""
    held: Leaves | None = None
    """With a reused plan: the leaves whose memory its byte views point into, held until the save
    ends (a state may make its tensors when asked for: nothing else would hold them)."""


def plan_shard(
    tree: Mapping[str, Any], rank: int, world: int, memo: SaveMemo | None = None, eager: bool = False
) -> ShardPlan | None:
    """:func:`local_pieces`, through ``memo``: the plan a save of the same tensors made last time,
    when every tensor is found as it was (see :mod:`~ckptkeeper.engine.save_memo`); None when this
    path cannot take the tree. ``eager``: user code will run before the write (an ``on_stage``
    hook), so a new plan's fingerprints are taken now, from the tensors it is made from, and the
    leaves are held for :func:`recheck_shard`."""
    with paused_gc():
        leaves = _leaves(tree)
        if memo is not None:
            kept = memo.take(rank, world, leaves)
            if kept is not None:
                return ShardPlan([], kept.signature, kept, leaves)
        check_names(leaves)
        planned = _local_pieces(leaves, rank, world)
        if planned is None:
            return None
        fresh = KeptPlan(rank, world, planned[1], leaves) if memo is not None else None
        if fresh is not None and eager and not fresh.note():
            fresh = None
        return ShardPlan(planned[0], planned[1], fresh, leaves if eager else None)


def recheck_shard(plan: ShardPlan, rank: int, world: int) -> ShardPlan:
    """``plan`` as it may be used after user code ran since it was made (an ``on_stage`` hook):
    a reused plan whose tensors are no longer where they were is made anew from the same leaves
    (its byte views would point at memory the tensors left, freed or reused), and a new plan made
    before such a change is written but not kept. ValueError when a plan made anew has another
    signature than the one every rank agreed on (the hook changed replicated tensors: their
    writers were chosen from the old list)."""
    kept, held = plan.kept, plan.held
    if kept is None or held is None:
        return plan
    with paused_gc():
        if kept.matches(held):
            return plan
        if kept.plan is None:
            # A new plan: its pieces hold the tensors it was made from, and are written as they
            # were; it is not kept (its views would be of tensors the leaves no longer hold).
            return ShardPlan(plan.pieces, plan.signature, None)
        planned = _local_pieces(held, rank, world)
    if planned is None or planned[1] != plan.signature:
        raise ValueError("the state's tensors changed during the save (by an on_stage hook?); save again")
    return ShardPlan(planned[0], planned[1], None)


def _local_pieces(leaves: Leaves, rank: int, world: int) -> tuple[list[Piece], str] | None:
    # One pass over the leaves (a save of 10,000 tensors spent a fifth of its time in this
    # function's loops): DTensor pieces are made here, replicated plain tensors once their writers
    # are known.
    pieces: list[Piece | None] = []
    plain: list[tuple[int, str, tuple[str, ...], torch.Tensor, tuple[int, ...], tuple[int, ...], int]] = []
    writers = _SPEC_WRITERS
    new, append = tuple.__new__, pieces.append
    for fqn, path, value in leaves:
        if type(value) is DTensor:
            # A spec already seen, unchanged, whose writer and box are known (FSDP2's shards after
            # the first save): one look-up and the local shard's checks, nothing else per tensor.
            hit = _spec_entry(value._spec, world)
            if hit is not None and hit[5] is not None:
                local_shape, offsets, shape, writer = hit[5]
                local = value._local_tensor
                if local.shape == local_shape and local.is_cpu and not local.is_sparse and not local.is_quantized:
                    append(new(Piece, (fqn, path, local, offsets, shape, writer)))
                    continue
        region = _region(value, world)
        if region is None or not _usable(region[0]):
            return None
        local, offsets, shape = region
        if isinstance(value, DTensor):
            numel = local.numel()
            total = math.prod(shape)
            if numel == 0 and total != 0:
                continue  # an empty shard (more ranks than rows): the other ranks hold every element
            if total == 0:
                local = torch.empty(shape, dtype=local.dtype, device="cpu")
                offsets, writer = (0,) * len(shape), rank == 0
            else:
                # Without a Replicate placement the writer depends on the spec alone (each rank
                # writes its own shard): asked once per spec, not once per tensor.
                spec = value._spec
                entry = _spec_entry(spec, world)  # _region has just looked at (or made) it
                known = entry[4] if entry is not None else None
                if known is None:
                    known = writers.get(spec)
                    if known is not None and entry is not None:
                        entry[4] = known
                if known is not None:
                    writer = known
                else:
                    if len(writers) > 4096:
                        writers.clear()
                    writer = _dtensor_writer(value, fqn)
                    if not any(isinstance(p, Replicate) for p in value.placements):
                        writers[spec] = writer
                        if entry is not None:
                            entry[4] = writer
                if entry is not None and entry[4] is not None:
                    # For the look-up above: the same facts, kept by this spec object (a spec whose
                    # shard is empty or whose tensor has no elements never gets here).
                    entry[5] = (entry[3][0], offsets, shape, entry[4])
            pieces.append(Piece(fqn, path, local, offsets, shape, writer))
        else:
            plain.append((len(pieces), fqn, path, local, offsets, shape, local.numel() * local.element_size()))
            pieces.append(None)  # its place, filled below
    # Largest first onto the least-loaded rank: each rank writes about the same share.
    loads = [(0, r) for r in range(world)]
    owners: dict[str, int] = {}
    for _, fqn, _, _, _, _, nbytes in sorted(plain, key=lambda x: (-x[6], x[1])):
        load, r = heapq.heappop(loads)
        owners[fqn] = r
        heapq.heappush(loads, (load + max(nbytes, 1), r))
    for at, fqn, path, local, offsets, shape, _ in plain:
        pieces[at] = Piece(fqn, path, local, offsets, shape, owners[fqn] == rank)
    # The replicated tensors' writers are chosen from this list: every rank must have the same.
    signature = hashlib.sha256(
        json.dumps([(fqn, list(local.shape), str(local.dtype)) for _, fqn, _, local, _, _, _ in plain]).encode()
    ).hexdigest()
    return [p for p in pieces if p is not None], signature


_SPEC_WRITERS: dict[Any, bool] = {}


class ShardLayout(NamedTuple):
    """What rank 0 needs of one rank's data file to write DCP's metadata: each piece's name, its
    kind (dtype, tensor shape, offsets, sizes; listed once per distinct kind) and, where it is not
    the name split at its dots, its path in the state. Where each piece starts follows (pieces lie
    one after another, each ``torch.save`` blob's length fixed by its kind).

    Gathered from every rank at every save: columns of names and small integers pickle several
    times faster than a tuple per piece, and they are what the segment table holds anyway.
    """

    names: tuple[str, ...]
    kinds: tuple[tuple[torch.dtype, tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...]
    kind: tuple[int, ...]
    paths: tuple[int | str, ...]
    """The paths that are not their names split at their dots, in one flat tuple: for each such
    piece, its index, its path's length, then the path's keys. Most pieces of a nested model are
    such (``("model", "0.0.weight")``): a pair per piece was 8,750 tuples per layout at 10,000
    tensors, kept by the save memo (and on rank 0 for every rank) and walked by the garbage
    collector."""

    def entries(self) -> list[PieceEntry]:
        """One :data:`PieceEntry` per piece, in file order."""
        facts = []
        for dtype, shape, offsets, sizes in self.kinds:
            head, tail, _, _ = skeleton_layout(sizes, dtype)
            facts.append((shape, dtype, offsets, sizes, head + math.prod(sizes) * dtype.itemsize + tail))
        paths: dict[int | str, tuple[str, ...]] = {}
        flat, at = self.paths, 0
        while at < len(flat):
            n = cast(int, flat[at + 1])
            paths[flat[at]] = cast("tuple[str, ...]", flat[at + 2 : at + 2 + n])
            at += 2 + n
        out: list[PieceEntry] = []
        start = 0
        for i, (fqn, k) in enumerate(zip(self.names, self.kind, strict=True)):
            shape, dtype, offsets, sizes, length = facts[k]
            path = paths.get(i)
            out.append(
                (fqn, tuple(fqn.split(".")) if path is None else path, shape, dtype, offsets, sizes, start, length)
            )
            start += length
        return out


def write_shard(
    model_dir: str,
    pieces: list[Piece],
    rank: int,
    threads: int,
    sink: Upload | None = None,
    kept: KeptPlan | None = None,
) -> tuple[dict[str, FileEntry], ShardLayout, tuple[str, ...]]:
    """Write the pieces this rank writes into its data file and its segment table.

    Returns the files written (relative to the checkpoint), what rank 0 needs of them to write
    DCP's metadata, and the data checksums of this rank's whole pieces (in file order: the pieces
    :func:`index_bytes` lists for every rank). With ``sink`` the data file is streamed there
    (object stores). ``kept`` (from :func:`plan_shard`): with its write plan, that plan is written
    (``pieces`` is not looked at); without, the plan made here is stored in it once written,
    unless a tensor had to be copied first (that copy dies with this save).
    """
    name = shard_name(rank)
    table = os.path.join(os.path.dirname(model_dir), table_name(rank))
    made: list[tuple[ShardLayout, FileEntry, tuple[str, ...]]] = []
    if kept is not None and kept.plan is not None:
        plan, reused, copied = kept.plan, True, False
        mine: list[Piece] = []
    else:
        # The collector is paused while the per-piece tables are built (a background save runs
        # here too: its pauses are kept to the table building, never around the writes).
        with paused_gc():
            mine = [p for p in pieces if p.writer]
            tensors = [exact(p.tensor, p.fqn) for p in mine]
            plan, reused = _plan_writes(tensors), False
            # A copy (of a non-contiguous tensor, say) lives only as long as this save.
            copied = any(t.data_ptr() != p.tensor.data_ptr() and t.numel() for t, p in zip(tensors, mine, strict=True))

    def write_table(data_sums: list[str]) -> None:
        # Run while the data file is flushed: the table's per-piece columns and its own write.
        if reused:
            assert kept is not None
            layout, whole_at = kept.layout, kept.whole_at
            encoded = _encode_table(f"{MODEL_DIR}/{name}", layout, data_sums)
            made.append((layout, write_synced(table, encoded), tuple(data_sums[i] for i in whole_at)))
            return
        with paused_gc():
            kinds: dict[tuple[Any, ...], int] = {}
            column = []
            odd: list[int | str] = []
            for i, (p, t) in enumerate(zip(mine, tensors, strict=True)):
                # t.shape (a torch.Size) finds the tuple-keyed kind; a new kind is kept as tuples.
                key = (t.dtype, p.global_shape, p.offsets, t.shape)
                k = kinds.get(key)
                if k is None:
                    k = kinds[(t.dtype, p.global_shape, p.offsets, tuple(t.shape))] = len(kinds)
                column.append(k)
                # The path is the name split at its dots unless a key holds a dot itself.
                if len(p.path) != p.fqn.count(".") + 1:
                    odd += (i, len(p.path), *p.path)
            layout = ShardLayout(tuple(p.fqn for p in mine), tuple(kinds), tuple(column), tuple(odd))
            encoded = _encode_table(f"{MODEL_DIR}/{name}", layout, data_sums)
            whole = _whole_kinds(layout.kinds)
            whole_at = tuple(i for i, k in enumerate(column) if whole[k])
            whole_sums = tuple(data_sums[i] for i in whole_at)
            # Before the table's own write, which waits for the disk behind the data file's flush.
            if kept is not None and not copied and kept.note():
                kept.layout, kept.whole_at = layout, whole_at
        made.append((layout, write_synced(table, encoded), whole_sums))

    entry, _ = _write_planned(os.path.join(model_dir, name), plan, threads, sink, write_table)
    layout, table_entry, whole_sums = made[0]
    if kept is not None and not reused and kept.layout is not None:
        kept.plan = plan  # only now: a plan is kept once a write with it went through
    return {f"{MODEL_DIR}/{name}": entry, table_name(rank): table_entry}, layout, whole_sums


def is_whole(shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]) -> bool:
    """Whether a piece (its box: ``offsets``, ``sizes``) is the whole of a tensor of ``shape``:
    the pieces the shared index lists (:data:`INDEX_FILE`)."""
    return not any(offsets) and tuple(sizes) == tuple(shape)


def _whole_kinds(kinds: Sequence[Sequence[Any]]) -> list[bool]:
    """For each kind (dtype, tensor shape, offsets, sizes): whether its piece is the whole tensor."""
    return [is_whole(shape, offsets, sizes) for _, shape, offsets, sizes in kinds]


INDEX_FILE = f"{MODEL_DIR}/.ckptkeeper-index.json"
"""A multi-rank checkpoint's shared index (written by rank 0, listed in the record): every tensor's
dtype and shape, and where each whole piece lies (the only copy of a replicated tensor, say).

A rank loading at the world size the checkpoint was saved at reads its own segment table and this
file, not every rank's table: at 1,024 ranks of 1,000 tensors each, every rank had read 50 MB of
tables (51 GB across the ranks, and 1,024 GETs each from an object store). Format 1: ``{"format":
1, "world_size": W, "tensors": {"kinds": [[dtype, shape]], "names": [...], "kind": [...]},
"whole": {"kinds": [[dtype, shape]], "names": [...], "kind": [...], "rank": [...], "start":
[...], "sums": [...]}}``; a whole piece's header and trailer follow from its kind, as in the tables.
"""
INDEX_FORMAT = 1
_INDEX_KEYS = frozenset({"format", "world_size", "tensors", "whole"})
_INDEX_PARTS: dict[Any, tuple[bytes, list[tuple[int, int]]]] = {}


def index_bytes(per_rank: list[tuple[ShardLayout, tuple[str, ...]]]) -> bytes:
    """The shared index (:data:`INDEX_FILE`) of a checkpoint whose ranks wrote ``per_rank``
    (each rank's layout and its whole pieces' data checksums, from :func:`write_shard`).

    All but the checksums depend on the layouts only, and are made once per layout, as the
    ``.metadata`` is.
    """
    layouts = tuple(layout for layout, _ in per_rank)
    found = _INDEX_PARTS.get(layouts)
    if found is None:
        with paused_gc():
            found = _index_prefix(layouts)
        if len(_INDEX_PARTS) >= 2:
            _INDEX_PARTS.clear()
        _INDEX_PARTS[layouts] = found
    prefix, order = found
    sums = [per_rank[r][1][j] for r, j in order]
    return prefix + json.dumps(sums, separators=(",", ":")).encode() + b"}}"


def _index_prefix(layouts: tuple[ShardLayout, ...]) -> tuple[bytes, list[tuple[int, int]]]:
    tensor_kinds: dict[tuple[str, tuple[int, ...]], int] = {}
    tensors: dict[str, int] = {}
    whole_kinds: dict[tuple[str, tuple[int, ...]], int] = {}
    names: list[str] = []
    kind: list[int] = []
    ranks: list[int] = []
    starts: list[int] = []
    order: list[tuple[int, int]] = []  # (rank, its j-th whole piece): where each checksum comes from
    for rank, layout in enumerate(layouts):
        whole = _whole_kinds(layout.kinds)
        keys = [(str(dtype), tuple(shape)) for dtype, shape, _, _ in layout.kinds]
        j = 0
        for fqn, k in zip(layout.names, layout.kind, strict=True):
            if fqn not in tensors:
                tensors[fqn] = tensor_kinds.setdefault(keys[k], len(tensor_kinds))
            if whole[k]:
                names.append(fqn)
                kind.append(whole_kinds.setdefault(keys[k], len(whole_kinds)))
                ranks.append(rank)
                order.append((rank, j))
                j += 1
        # Where each piece starts follows from the kinds (the pieces lie one after another).
        starts.extend(entry[6] for entry, k in zip(layout.entries(), layout.kind, strict=True) if whole[k])
    doc = {
        "format": INDEX_FORMAT,
        "world_size": len(layouts),
        "tensors": {
            "kinds": [[d, list(sh)] for d, sh in tensor_kinds],
            "names": list(tensors),
            "kind": list(tensors.values()),
        },
        "whole": {
            "kinds": [[d, list(sh)] for d, sh in whole_kinds],
            "names": names,
            "kind": kind,
            "rank": ranks,
            "start": starts,
            "sums": None,
        },
    }
    text = json.dumps(doc, separators=(",", ":"))
    cut = text.rindex("null}}")
    return text[:cut].encode(), order


def index_columns(
    doc: Any, world: int, sizes: Mapping[str, int]
) -> tuple[dict[str, SavedTensor | None], list[WholeKind], dict[str, list[Any]]]:
    """A shared index (decoded JSON) checked up to its whole pieces: every tensor's dtype and
    shape, each kind of whole piece worked out, and the whole pieces' columns (``names``,
    ``kind``, ``rank``, ``start``, ``sums``, of equal lengths), each entry still to be checked by
    the caller as it is read (:func:`check_whole`). ValueError says what does not fit."""
    if not isinstance(doc, dict) or type(doc.get("format")) is not int or doc["format"] != INDEX_FORMAT:
        raise ValueError(f"{INDEX_FILE} is not a format-{INDEX_FORMAT} index")
    if set(doc) != _INDEX_KEYS or doc["world_size"] != world or type(doc["world_size"]) is not int:
        raise ValueError(f"{INDEX_FILE} has other entries or describes another world size")
    saved: dict[str, SavedTensor | None] = {}
    tensors, whole = doc["tensors"], doc["whole"]
    for part, cols in (
        (tensors, ("kinds", "names", "kind")),
        (whole, ("kinds", "names", "kind", "rank", "start", "sums")),
    ):
        if not isinstance(part, dict) or set(part) != set(cols) or not all(type(part[c]) is list for c in cols):
            raise ValueError(f"{INDEX_FILE} is malformed (its columns are not lists)")
        if len({len(part[c]) for c in cols[1:]}) != 1 or len(part["kinds"]) > len(part["names"]):
            raise ValueError(f"{INDEX_FILE} has columns of different lengths")

    def kinds_of(entries: list[Any]) -> list[SavedTensor]:
        out = []
        for i, entry in enumerate(entries):
            if not (type(entry) is list and len(entry) == 2 and type(entry[1]) is list):
                raise ValueError(f"{INDEX_FILE} has a malformed kind (#{i})")
            out.append(cast(SavedTensor, saved_from_table({"k": entry})["k"]))
        return out

    facts = kinds_of(tensors["kinds"])
    if len(set(tensors["names"])) != len(tensors["names"]):
        raise ValueError(f"{INDEX_FILE} lists a tensor twice")
    for fqn, k in zip(tensors["names"], tensors["kind"], strict=True):
        if type(fqn) is not str or type(k) is not int or not 0 <= k < len(facts):
            raise ValueError(f"{INDEX_FILE} has a malformed tensor entry {str(fqn)[:80]!r}")
        saved[fqn] = facts[k]
    shapes: list[WholeKind] = []
    largest = max(sizes.values(), default=0)
    for info in kinds_of(whole["kinds"]):
        shape = tuple(info.shape)
        dtype = cast(torch.dtype, info.dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > largest:
            raise ValueError(f"{INDEX_FILE} lists a piece larger than any data file")
        head, tail, head_sum, tail_sum = skeleton_layout(shape, dtype)
        shapes.append(
            KindFacts(info, (0,) * len(shape), shape, head, nbytes, tail, head_sum, tail_sum, math.prod(shape))
        )
    return saved, shapes, whole


def check_whole(
    saved: Mapping[str, SavedTensor | None],
    shapes: list[WholeKind],
    world: int,
    sizes: Mapping[str, int],
    fqn: Any,
    k: Any,
    rank: Any,
    start: Any,
    data_sum: Any,
) -> tuple[WholeKind, str]:
    """One whole piece of a shared index checked (its kind, rank, place in its file, and that its
    tensor has one shape and dtype): (its kind, its data file). ValueError says what does not fit."""
    if not (type(fqn) is str and type(k) is int and 0 <= k < len(shapes) and type(rank) is int
            and 0 <= rank < world and type(start) is int and start >= 0 and type(data_sum) is str):  # fmt: skip
        raise ValueError(f"{INDEX_FILE} has a malformed piece of {str(fqn)[:80]!r}")
    facts = shapes[k]
    file = shard_name(rank)
    if file not in sizes or start + facts.head + facts.nbytes + facts.tail > sizes[file]:
        raise ValueError(f"{INDEX_FILE} places {fqn[:80]!r} outside {MODEL_DIR}/{file}")
    if saved.get(fqn) != facts.tensor:
        raise ValueError(f"{INDEX_FILE} gives {fqn[:80]!r} two shapes or dtypes")
    return facts, file


def index_pieces(
    doc: Any, world: int, sizes: Mapping[str, int]
) -> tuple[dict[str, SavedTensor | None], list[tuple[str, Stored]]]:
    """Every tensor's dtype and shape, and the whole pieces (fqn, piece), of a shared index
    (decoded JSON; ``sizes``: each data file's size), checked as read. ValueError says what does
    not fit."""
    saved, shapes, whole = index_columns(doc, world, sizes)
    out: list[tuple[str, Stored]] = []
    new = _new_segment
    for fqn, k, rank, start, data_sum in zip(
        whole["names"], whole["kind"], whole["rank"], whole["start"], whole["sums"], strict=True
    ):
        facts, file = check_whole(saved, shapes, world, sizes, fqn, k, rank, start, data_sum)
        at = start + facts.head
        trio = {
            "head": new(Segment, ("head", fqn, start, facts.head, facts.head_sum)),
            "data": new(Segment, ("data", fqn, at, facts.nbytes, data_sum)),
            "tail": new(Segment, ("tail", fqn, at + facts.nbytes, facts.tail, facts.tail_sum)),
        }
        out.append((fqn, Stored(facts.offsets, facts.sizes, file, trio)))
    return saved, out


def index_from_own_table(
    own_doc: Any, own_file: str, index_doc: Any, world: int, sizes: Mapping[str, int]
) -> PieceIndex:
    """The pieces a rank loading at the saved world size needs to plan: those of its own data file
    (its format-2 table, ``own_doc``) and every whole piece the shared index lists; the tensors'
    dtypes and shapes from the index. ValueError when the two disagree.

    Only this rank's destinations can be checked for coverage here (in :func:`plan_reads`); a
    destination they do not cover (a replica of a shard another rank wrote) is planned from
    every table instead, by the caller.
    """
    saved, whole = index_pieces(index_doc, world, sizes)
    pieces: dict[str, list[Stored]] = {}
    for fqn, info, stored, _ in table_pieces(own_doc, own_file, sizes[own_file]):
        if saved.get(fqn) != info:
            raise ValueError(f"the segment table of {own_file} and {INDEX_FILE} disagree about {fqn[:80]!r}")
        held = pieces.setdefault(fqn, [])
        if any(p.offsets == stored.offsets for p in held):
            raise ValueError(f"two pieces of {fqn} start at {list(stored.offsets)}")
        held.append(stored)
    for fqn, stored in whole:
        if stored.file == own_file:
            # The whole pieces in this rank's own file are checked against its own table: each
            # file's are checked by the rank that owns it, and the caller has every rank agree
            # before any plans from the index (an index naming another tensor's bytes, with
            # their checksum, loaded wrong values on the ranks that trusted it; found by an
            # outside attack).
            if stored not in pieces.get(fqn, ()):  # the same box, file and segments (checksums too)
                raise ValueError(f"{INDEX_FILE} places {fqn[:80]!r} where the segment table of {own_file} does not")
        elif fqn not in pieces:  # this rank's own file holds it already otherwise
            pieces[fqn] = [stored]
    return PieceIndex(saved, pieces)


def _encode_table(data_rel: str, layout: ShardLayout, data_sums: list[str]) -> bytes:
    """A rank's segment table, format 2: ``{"format": 2, "file": data file, "kinds": [[dtype,
    global shape, offsets, sizes], ...], "names": [...], "kind": [...], "sums": [...]}``, one
    column entry per piece in file order (``kind`` indexes ``kinds``; ``sums`` is the xxh3 of
    its data).

    Everything else a load needs follows: each piece's ``torch.save`` head and tail are fixed by
    its sizes and dtype (their lengths and checksums are the writer's own skeleton's), and the
    pieces lie one after another from the file's start. Loads plan from this table and never
    decode DCP's metadata; format 1 listed three rows per piece, each naming it again, and a
    10,000-piece table took longer to decode and check than its tensors took to read.
    """
    key = (data_rel, layout)
    prefix = _TABLE_PARTS.get(key)
    if prefix is None:
        # All but the checksums depend on the layout only: encoded once per layout, as the shared
        # index is (the names are most of a table's bytes).
        doc = {
            "format": TABLE_FORMAT,
            "file": data_rel,
            "kinds": [
                [str(dtype), list(shape), list(offsets), list(sizes)] for dtype, shape, offsets, sizes in layout.kinds
            ],
            "names": layout.names,
            "kind": layout.kind,
            "sums": None,
        }
        text = json.dumps(doc, separators=(",", ":"))
        prefix = text[: text.rindex("null}")].encode()
        if len(_TABLE_PARTS) >= 2:
            _TABLE_PARTS.clear()
        _TABLE_PARTS[key] = prefix
    return prefix + json.dumps(data_sums, separators=(",", ":")).encode() + b"}"


_TABLE_PARTS: dict[Any, bytes] = {}


class Stored(NamedTuple):
    """One stored piece of a tensor: where it sits in the tensor, and its data file's segments."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    segs: Mapping[str, Segment]


@dataclass
class PieceIndex:
    """Every stored piece of every tensor of a multi-rank checkpoint, as a load plans from it."""

    saved: dict[str, SavedTensor | None]
    """Each tensor's global shape and dtype (what :meth:`TrainingState.plan_load` checks against)."""
    pieces: dict[str, list[Stored]]


def _piece_facts(
    fqn: str, entry: list[Any], data_file: str
) -> tuple[SavedTensor, tuple[int, ...], tuple[int, ...], int, tuple[str, str]]:
    """(tensor, offsets, sizes, data bytes, header sums) of a checked piece entry ``[dtype, shape, offsets, sizes]``."""
    whole = cast(SavedTensor, saved_from_table({fqn: [entry[0], entry[1]]})[fqn])
    sizes, dtype = saved_from_table({fqn: [entry[0], entry[3]]})[fqn]
    offsets = tuple(entry[2])
    if not all(type(n) is int and 0 <= n < 1 << 52 for n in offsets) or not len(offsets) == len(whole.shape) == len(
        sizes
    ):
        raise ValueError(f"the segment table of {data_file} places {str(fqn)[:80]!r} nowhere valid")
    if any(o + n > m for o, n, m in zip(offsets, sizes, whole.shape, strict=True)):
        raise ValueError(f"a piece of {str(fqn)[:80]!r} lies outside the tensor")
    return whole, offsets, sizes, math.prod(sizes) * dtype.itemsize, skeleton_sums(sizes, dtype)


_Found = tuple[str, SavedTensor, Stored, int]
"""A piece as read from a segment table: (fqn, its tensor's shape and dtype, the piece, its elements)."""


class KindFacts(NamedTuple):
    """What a segment table's (or the shared index's) kind of piece fixes for every piece of that kind."""

    tensor: SavedTensor
    """The whole tensor's global shape and dtype."""
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    head: int
    """Bytes of the piece's ``torch.save`` header, before its data."""
    nbytes: int
    tail: int
    head_sum: str
    tail_sum: str
    volume: int
    """Elements in the piece."""


WholeKind = KindFacts
"""A kind of whole piece of the shared index (offsets all zero, sizes the tensor's shape)."""


def table_columns(doc: Any, data_file: str, file_size: int) -> tuple[list[Any], list[Any], list[Any], list[KindFacts]]:
    """A format-2 segment table (decoded JSON) of ``data_file`` (``file_size`` bytes) checked up
    to its pieces: (names, kind, sums) columns of equal lengths and no name twice, and each kind
    worked out. Each piece's entries are still to be checked by the caller as it reads them,
    and that the pieces tile the file. ValueError says what does not fit."""
    if not isinstance(doc, dict) or type(doc.get("format")) is not int or doc["format"] != TABLE_FORMAT:
        version = doc.get("format") if isinstance(doc, dict) else None
        if type(version) is int and version > TABLE_FORMAT:
            raise ValueError(
                f"the segment table of {data_file} is format {version}, written by a newer ckptkeeper "
                f"(this one reads formats 1 and {TABLE_FORMAT}): upgrade ckptkeeper to load it"
            )
        raise ValueError(f"the segment table of {data_file} is not a format-{TABLE_FORMAT} table")
    if set(doc) != _TABLE_KEYS or doc["file"] != f"{MODEL_DIR}/{data_file}":
        raise ValueError(f"the segment table of {data_file} describes another file or has other entries")
    kinds, names, kind, sums = doc["kinds"], doc["names"], doc["kind"], doc["sums"]
    if not (type(kinds) is list and type(names) is list and type(kind) is list and type(sums) is list):
        raise ValueError(f"the segment table of {data_file} is malformed (its columns are not lists)")
    if not len(names) == len(kind) == len(sums) or len(set(names)) != len(names):
        raise ValueError(f"the segment table of {data_file} has columns of different lengths or a piece twice")
    if len(kinds) > len(names):
        # Each kind is worked out (a skeleton per distinct one): no more of them than pieces.
        raise ValueError(f"the segment table of {data_file} lists more kinds of piece than pieces")
    facts = []
    for i, entry in enumerate(kinds):
        if not (type(entry) is list and len(entry) == 4 and all(type(x) is list for x in entry[1:])):
            raise ValueError(f"the segment table of {data_file} has a malformed kind of piece (#{i})")
        whole, offsets, sizes, nbytes, _ = _piece_facts(f"kind #{i}", entry, data_file)
        if nbytes > file_size:
            raise ValueError(f"the segment table of {data_file} lists a piece larger than the file")
        head, tail, head_sum, tail_sum = skeleton_layout(sizes, cast(torch.dtype, whole.dtype))
        facts.append(KindFacts(whole, offsets, sizes, head, nbytes, tail, head_sum, tail_sum, math.prod(sizes)))
    return names, kind, sums, facts


def bad_table_piece(data_file: str, fqn: Any) -> ValueError:
    """The error for a malformed piece entry of ``data_file``'s segment table."""
    return ValueError(f"the segment table of {data_file} has a malformed piece of {str(fqn)[:80]!r}")


def table_short(data_file: str, pos: int, file_size: int) -> ValueError:
    """The error for a segment table whose pieces do not tile their data file."""
    return ValueError(f"the segment table of {data_file} covers {pos} bytes, the data file has {file_size}")


def table_pieces(doc: Any, data_file: str, file_size: int) -> list[_Found]:
    """The pieces a format-2 segment table (decoded JSON) places in ``data_file`` (``file_size``
    bytes), checked as they are read: well-formed columns, each kind a valid piece of a valid
    tensor, the pieces' blobs tiling the file exactly. ValueError says what does not fit."""
    names, kind, sums, facts = table_columns(doc, data_file, file_size)
    file = data_file
    count = len(facts)
    new = _new_segment
    out: list[_Found] = []
    pos = 0
    # One pass of plain operations per piece: a rank's table lists every piece it wrote.
    for fqn, k, data_sum in zip(names, kind, sums, strict=True):
        if type(k) is not int or not 0 <= k < count or type(fqn) is not str or type(data_sum) is not str:
            raise bad_table_piece(data_file, fqn)
        whole, offsets, sizes, head, nbytes, tail, head_sum, tail_sum, volume = facts[k]
        at = pos + head
        end = at + nbytes
        trio = {
            "head": new(Segment, ("head", fqn, pos, head, head_sum)),
            "data": new(Segment, ("data", fqn, at, nbytes, data_sum)),
            "tail": new(Segment, ("tail", fqn, end, tail, tail_sum)),
        }
        pos = end + tail
        out.append((fqn, whole, Stored(offsets, sizes, file, trio), volume))
    if pos != file_size:
        raise table_short(data_file, pos, file_size)
    return out


def format1_pieces(data_file: str, rows: Any, listed: Any, file_size: int) -> Iterator[_Found]:
    """The pieces of a format-1 table (``rows``: three segment rows per piece; ``listed``:
    ``{fqn: [dtype, shape, offsets, sizes]}``), checked as :func:`table_pieces` checks format 2,
    and each piece's header sums against its listed size and dtype."""
    if not isinstance(listed, dict):
        raise ValueError(f"the segment table of {data_file} lists no pieces")
    segs = parse_layout(rows, file_size, None, data_file)
    # What a piece's entry implies (its tensor, box, bytes and header sums) is worked out and
    # checked once per distinct entry: thousands of pieces repeat a few shapes and offsets.
    known: dict[tuple[Any, ...], tuple[SavedTensor, tuple[int, ...], tuple[int, ...], int, tuple[str, str]]] = {}
    for fqn, entry in listed.items():
        if not (type(entry) is list and len(entry) == 4 and all(type(x) is list for x in entry[1:])):
            raise ValueError(f"the segment table of {data_file} has a malformed piece of {str(fqn)[:80]!r}")
        # The lengths keep the three lists apart; the types, because 1.0 and True hash as 1.
        lists = entry[1] + entry[2] + entry[3]
        key = (entry[0], len(entry[1]), len(entry[2]), *lists, *map(type, lists))
        try:
            found = known.get(key)
        except TypeError:  # an unhashable dtype or size: refused by the check below
            found = None
        if found is None:
            found = known[key] = _piece_facts(fqn, entry, data_file)
        whole, offsets, sizes_, want, sums = found
        trio = segs.get(fqn)
        if trio is None:
            raise ValueError(f"the segment table of {data_file} has no segments for {str(fqn)[:80]!r}")
        if trio["data"].length != want or (trio["head"].xxh3_64, trio["tail"].xxh3_64) != sums:
            raise ValueError(f"{str(fqn)[:80]!r}: the segment table's size or dtype is not the one its data has")
        yield fqn, whole, Stored(offsets, sizes_, data_file, trio), math.prod(sizes_)
    if set(segs) != set(listed):
        raise ValueError(f"the segment table of {data_file} lists other pieces than it has segments for")


def index_from_tables(tables: Mapping[str, Any], sizes: Mapping[str, int]) -> PieceIndex:
    """The pieces listed by the per-rank segment tables (``{data file: table}``, a table being a
    decoded format-2 document or a format-1 ``(rows, pieces)`` pair; ``sizes``: each data file's
    size), checked as they are read: the pieces tile each file, each piece's size and dtype are the
    ones in its own ``torch.save`` header, and the pieces tile each tensor. ValueError says what
    does not fit.

    Loads plan from this, not from DCP's metadata objects: building those (and hashing a
    MetadataIndex per piece to find them again) cost more than reading thousands of small pieces.
    """
    saved: dict[str, SavedTensor | None] = {}
    pieces: dict[str, list[Stored]] = {}
    covered: dict[str, int] = {}
    for data_file, table in tables.items():
        if isinstance(table, tuple):
            found: Iterator[_Found] | list[_Found] = format1_pieces(data_file, table[0], table[1], sizes[data_file])
        else:
            found = table_pieces(table, data_file, sizes[data_file])
        for fqn, whole, stored, volume in found:
            held = pieces.get(fqn)
            if held is None:
                saved[fqn] = whole
                pieces[fqn] = [stored]
                covered[fqn] = volume
                continue
            if saved[fqn] != whole:
                raise ValueError(f"ranks disagree about the shape or dtype of {fqn}")
            if any(p.offsets == stored.offsets for p in held):
                raise ValueError(f"two pieces of {fqn} start at {list(stored.offsets)}")
            held.append(stored)
            covered[fqn] += volume
    for fqn, info in saved.items():
        assert info is not None
        if covered[fqn] != math.prod(info.shape):
            raise ValueError(f"the ranks' pieces of {fqn} cover {covered[fqn]} of its {math.prod(info.shape)} elements")
    return PieceIndex(saved, pieces)


def index_from_metadata(
    metadata: Metadata, layouts: Callable[[str], Mapping[str, Mapping[str, Segment]]]
) -> PieceIndex:
    """The pieces DCP's (decoded, checked) metadata lists, with their segments from ``layouts(file)``
    (each data file's table, checked against that metadata). ValueError when they disagree."""
    saved: dict[str, SavedTensor | None] = {}
    pieces: dict[str, list[Stored]] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            saved[fqn] = SavedTensor(tuple(int(n) for n in entry.size), entry.properties.dtype)
        else:
            saved[fqn] = None
    for index, info in (metadata.storage_data or {}).items():
        md = metadata.state_dict_metadata.get(index.fqn)
        if not isinstance(md, TensorStorageMetadata) or index.offset is None:
            continue
        chunk = next((c for c in md.chunks if tuple(c.offsets) == tuple(index.offset)), None)
        if chunk is None:
            raise ValueError(f"the metadata lists a piece of {index.fqn[:80]!r} it does not describe")
        segs = layouts(info.relative_path).get(index.fqn)
        if segs is None or segs["head"].offset != info.offset:
            raise ValueError(f"the segment table of {info.relative_path} has no piece of {index.fqn[:80]!r}")
        shape = tuple(int(n) for n in md.size)
        offsets, sizes_ = tuple(int(n) for n in chunk.offsets), tuple(int(n) for n in chunk.sizes)
        if any(o + n > m for o, n, m in zip(offsets, sizes_, shape, strict=True)):
            raise ValueError(f"a piece of {index.fqn[:80]!r} lies outside the tensor")
        pieces.setdefault(index.fqn, []).append(Stored(offsets, sizes_, info.relative_path, segs))
    return PieceIndex(saved, pieces)


def build_metadata(per_rank: list[list[PieceEntry]]) -> Metadata:
    """DCP's metadata for the pieces every rank wrote; ValueError when they do not tile each tensor.

    ``per_rank[r]`` are the pieces rank r wrote into its own data file.
    """
    sd_meta: dict[str, TensorStorageMetadata] = {}
    storage: dict[MetadataIndex, Any] = {}
    planner: dict[str, Any] = {}
    covered: dict[str, int] = {}
    # One torch.Size per distinct shape or offset and one TensorProperties per dtype, shared by
    # every entry that has it: pickle writes a shared object once and refers back to it after,
    # where a torch.Size of its own costs ~9 us each way (rank 0 pickled a .metadata of 24,000
    # pieces in 0.9 s, longer than writing the tensors). DCP only reads these objects.
    sizes_seen: dict[tuple[int, ...], torch.Size] = {}
    props_seen: dict[torch.dtype, TensorProperties] = {}

    def size_of(dims: Any) -> torch.Size:
        key = tuple(dims)
        found = sizes_seen.get(key)
        if found is None:
            found = sizes_seen[key] = torch.Size(key)
        return found

    for rank, entries in enumerate(per_rank):
        file = shard_name(rank)
        for fqn, path, shape, dtype, offsets, sizes, start, length in entries:
            md = sd_meta.get(fqn)
            if md is None:
                props = props_seen.get(dtype)
                if props is None:
                    props = props_seen[dtype] = TensorProperties(dtype=dtype)
                md = sd_meta[fqn] = TensorStorageMetadata(properties=props, size=size_of(shape), chunks=[])
            elif tuple(md.size) != tuple(shape) or md.properties.dtype != dtype:
                raise ValueError(f"ranks disagree about the shape or dtype of {fqn}")
            at = size_of(offsets)
            md.chunks.append(ChunkStorageMetadata(offsets=at, sizes=size_of(sizes)))
            index = MetadataIndex(fqn=fqn, index=len(md.chunks) - 1)
            object.__setattr__(index, "offset", at)  # frozen; its __init__ would make a Size of its own
            if index in storage:
                raise ValueError(f"two pieces of {fqn} start at {list(offsets)}")
            storage[index] = _StorageInfo(file, start, length)
            planner[fqn] = path
            covered[fqn] = covered.get(fqn, 0) + math.prod(sizes)
    for fqn, md in sd_meta.items():
        if covered[fqn] != math.prod(md.size):
            raise ValueError(f"the ranks' pieces of {fqn} cover {covered[fqn]} of its {math.prod(md.size)} elements")
    return Metadata(
        state_dict_metadata=dict(sd_meta),
        planner_data=planner,
        storage_data=storage,
        # No per-save identity (as the one-process writer): the bytes are reused for every save
        # of the same layout, and a work folder's path would be stale after the commit anyway.
        storage_meta=StorageMeta(checkpoint_id=None, save_id=""),
    )


_METADATA_BYTES: dict[Any, bytes] = {}


def metadata_bytes(per_rank: list[ShardLayout]) -> bytes:
    """The ``.metadata`` file of a multi-rank checkpoint whose ranks wrote ``per_rank``.

    Made once per layout: saves of one run repeat it, and at thousands of pieces per rank
    building and pickling DCP's objects took rank 0 longer than writing its tensors.
    """
    key = tuple(per_rank)
    found = _METADATA_BYTES.get(key)
    if found is None:
        with paused_gc():
            found = dumps_metadata(build_metadata([layout.entries() for layout in per_rank]))
        if len(_METADATA_BYTES) >= 2:
            _METADATA_BYTES.clear()
        _METADATA_BYTES[key] = found
    return found


# ------------------------------------------------------------------------------------ loading


class Source(Protocol):
    """Where a checkpoint's data files are read from."""

    where: str

    def read_into(self, rel: str, offset: int, view: memoryview) -> None:
        """Fill ``view`` with data file ``rel``'s bytes from ``offset`` (CorruptCheckpointError if it ends early)."""

    def close(self) -> None:
        """Release what reading held (open files)."""


class LocalSource:
    """Data files in a local ``model_and_optim`` folder, read with ``pread``."""

    batches_reads = True
    """Reads of pieces apart in a file may share a job: a pread is cheap next to a job's overhead."""

    def __init__(self, model_dir: str) -> None:
        self.where = model_dir
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def _fd(self, rel: str) -> int:
        with self._lock:
            if rel not in self._fds:
                # Never through a link, and never a FIFO or device (which would block forever).
                self._fds[rel] = _open_data_file(os.path.join(self.where, rel))
            return self._fds[rel]

    def read_into(self, rel: str, offset: int, view: memoryview) -> None:
        pread_full(self._fd(rel), view, offset, os.path.join(self.where, rel))

    def read_scatter(self, rel: str, offset: int, views: list[memoryview]) -> None:
        """Fill ``views`` one after another from ``rel`` at ``offset`` (scatter reads; ``views`` is consumed)."""
        preadv_full(self._fd(rel), views, offset, os.path.join(self.where, rel))

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


class RemoteSource:
    """Data files in an object store, read with ranged GETs (large ranges in parallel parts)."""

    def __init__(self, storage: Storage, model_url: str, threads: int = 8) -> None:
        self.where = model_url
        self._storage = storage
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="ckptkeeper-get")

    def read_into(self, rel: str, offset: int, view: memoryview) -> None:
        url = self._storage.join(self.where, rel)

        def get(start: int) -> None:
            part = view[start : start + _REMOTE_PART]
            data = self._storage.read_range(url, offset + start, len(part))
            if len(data) != len(part):
                raise CorruptCheckpointError(f"{url} ends early (truncated object)")
            part[:] = data

        starts = range(0, len(view), _REMOTE_PART)
        if len(starts) <= 1:
            if len(view):
                get(0)
            return
        for fut in [self._pool.submit(get, s) for s in starts]:
            fut.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class _Read(NamedTuple):
    """One stored piece to read for one destination: its segments and the overlap to copy.

    A named tuple whose derived facts are worked out once (:meth:`make`): a load of many small
    tensors plans one per piece and looks at each several times.
    """

    fqn: str
    dest: torch.Tensor
    """The destination's local data."""
    file: str
    segs: Mapping[str, Segment]
    piece_offsets: tuple[int, ...]
    piece_sizes: tuple[int, ...]
    dest_offsets: tuple[int, ...]
    lo: tuple[int, ...]
    hi: tuple[int, ...]
    """The overlap, in global coordinates: [lo, hi) on each dimension."""
    whole: bool
    """Whether the piece is exactly the destination (read straight into it)."""
    span: tuple[int, int]
    """The piece's bytes in its file (head to tail)."""

    @classmethod
    def make(
        cls,
        fqn: str,
        dest: torch.Tensor,
        file: str,
        segs: Mapping[str, Segment],
        piece_offsets: tuple[int, ...],
        piece_sizes: tuple[int, ...],
        dest_offsets: tuple[int, ...],
        lo: tuple[int, ...],
        hi: tuple[int, ...],
    ) -> _Read:
        whole = piece_offsets == dest_offsets and piece_sizes == tuple(dest.shape)
        span = (segs["head"].offset, segs["tail"].offset + segs["tail"].length)
        return cls(fqn, dest, file, segs, piece_offsets, piece_sizes, dest_offsets, lo, hi, whole, span)


def _overlap(
    a_off: tuple[int, ...], a_size: tuple[int, ...], b_off: tuple[int, ...], b_size: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    lo = tuple(max(a, b) for a, b in zip(a_off, b_off, strict=True))
    hi = tuple(min(a + n, b + m) for a, n, b, m in zip(a_off, a_size, b_off, b_size, strict=True))
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return None
    return lo, hi


def plan_reads(tensors: Mapping[str, Any], index: PieceIndex, world: int, where: str) -> list[_Read] | None:
    """Which stored pieces each destination tensor needs; None when this path cannot take the
    destinations (the caller uses DCP's reader). CorruptCheckpointError when the stored pieces do
    not tile a destination.
    """
    reads: list[_Read] = []
    for fqn, _, value in _leaves(tensors):
        region = _region(value, world)
        if region is None:
            return None
        local, offsets, _ = region  # the global shape was checked by plan_load
        info = index.saved.get(fqn)
        if info is None or info.dtype != local.dtype:
            return None
        if not _usable(local) or not local.is_contiguous() or local.is_conj() or local.is_neg():
            return None  # (a lazy conjugate or negation holds the other values: DCP's reader copies right)
        if local.numel() == 0:
            continue
        found: list[_Read] = []
        dest_sizes = tuple(local.shape)
        for c_off, c_size, file, segs in index.pieces.get(fqn, ()):
            if c_off == offsets and c_size == dest_sizes:
                # The common case (the same world size): the piece is the destination, read whole
                # (built directly: what make() works out is known here).
                end = tuple(map(operator.add, c_off, c_size))
                tail = segs["tail"]
                span = (segs["head"].offset, tail.offset + tail.length)
                found.append(_Read(fqn, local, file, segs, c_off, c_size, offsets, c_off, end, True, span))
                continue
            if c_off and (c_off[0] >= offsets[0] + dest_sizes[0] or offsets[0] >= c_off[0] + c_size[0]):
                continue  # apart on the first dimension (another rank's rows): the usual miss, told cheaply
            ov = _overlap(c_off, c_size, offsets, dest_sizes)
            if ov is not None:
                found.append(_Read.make(fqn, local, file, segs, c_off, c_size, offsets, ov[0], ov[1]))
        if len(found) == 1 and found[0].whole:
            reads.append(found[0])
            continue
        volume = sum(math.prod(h - low for low, h in zip(r.lo, r.hi, strict=True)) for r in found)
        disjoint = all(
            _overlap(a.piece_offsets, a.piece_sizes, b.piece_offsets, b.piece_sizes) is None
            for i, a in enumerate(found)
            for b in found[i + 1 :]
        )
        if volume != local.numel() or not disjoint:
            raise CorruptCheckpointError(
                f"checkpoint {where} is corrupt: its pieces of {fqn} do not cover this rank's part exactly once"
            )
        reads.extend(found)
    return reads


def _check(where: str, read: _Read, kind: str, view: memoryview) -> None:
    got = xxhash.xxh3_64_hexdigest(view)
    if got != read.segs[kind].xxh3_64:
        raise segment_mismatch(f"{where}/{read.file}", read.fqn, kind, got, read.segs[kind].xxh3_64)


def _copy_overlap(read: _Read, data: memoryview) -> None:
    dtype = read.dest.dtype
    src = torch.frombuffer(data, dtype=dtype) if len(data) else torch.empty(0, dtype=dtype, device="cpu")
    src = src.view(read.piece_sizes)
    dst = read.dest.detach()
    for dim, (low, high) in enumerate(zip(read.lo, read.hi, strict=True)):
        src = src.narrow(dim, low - read.piece_offsets[dim], high - low)
        dst = dst.narrow(dim, low - read.dest_offsets[dim], high - low)
    dst.copy_(src)


class JobBuffers:
    """The read buffers of one load's jobs, reused from job to job (thread-safe).

    A fresh buffer per job cost more than its read (zeroed, and its pages faulted in: 150 MB per
    rank at 2,500 parameters).
    """

    def __init__(self) -> None:
        self._spare: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self, need: int) -> bytearray:
        """A buffer of at least ``need`` bytes: a spare one, or a new one."""
        with self._lock:
            block = self._spare.pop() if self._spare and len(self._spare[-1]) >= need else None
        if block is None:
            # Only jobs of about a buffer's size get one that is kept for reuse: small ones (an
            # object store's run of a few pieces, with many in flight) take what they need.
            block = bytearray(_RUN_BYTES if _RUN_BYTES // 2 <= need <= _RUN_BYTES else need)
        return block

    def give(self, block: object) -> None:
        """Hand back a buffer from :meth:`take` whose views are all done with (kept if reusable)."""
        if isinstance(block, bytearray) and len(block) == _RUN_BYTES:
            with self._lock:
                self._spare.append(block)


def read_pieces(
    source: Source,
    reads: list[_Read],
    verify: bool = True,
    threads: int = 2,
    before_write: Callable[[str, int, int], None] | None = None,
    back_up_whole: Callable[[list[str]], None] | None = None,
) -> None:
    """Read every planned piece into its destination, checking each segment before its bytes are used.

    ``before_write(fqn, 0, nbytes)`` is called once per destination tensor before it is first
    written (the loader backs it up there). With ``back_up_whole``, destinations read whole from
    a run of small pieces are backed up by one call per run instead (one bulk copy, not a call
    and a lock per tensor).
    """
    backed: set[str] = set()
    lock = threading.Lock()
    tensor_locks: dict[str, threading.Lock] = {}

    def backup(read: _Read) -> None:
        if before_write is None:
            return
        with lock:
            own = tensor_locks.setdefault(read.fqn, threading.Lock())
        # Held until the copy is done: another reader with another piece of the same tensor must
        # not write into it while its backup is still being taken.
        with own:
            if read.fqn not in backed:
                before_write(read.fqn, 0, read.dest.numel() * read.dest.element_size())
                backed.add(read.fqn)

    def direct(read: _Read) -> None:
        for kind in ("head", "tail"):
            seg = read.segs[kind]
            view = memoryview(bytearray(seg.length))
            source.read_into(read.file, seg.offset, view)
            if verify:
                _check(source.where, read, kind, view)
        backup(read)
        seg = read.segs["data"]
        view = _borrowed_view(read.dest)  # read.dest (held by the plan) outlives the view
        if len(view) != seg.length:
            raise CorruptCheckpointError(
                f"{source.where}/{read.file}: {read.fqn} holds {seg.length} bytes, expected {len(view)}"
            )
        source.read_into(read.file, seg.offset, view)
        if verify:
            _check(source.where, read, "data", view)

    blocks = JobBuffers()

    def fetch(job: list[list[_Read]]) -> list[memoryview]:
        # One buffer for the job; each run (neighbouring pieces) is one read into its part of it.
        sizes = [run[-1].span[1] - run[0].span[0] for run in job]
        whole = memoryview(blocks.take(sum(sizes)))
        bufs, at = [], 0
        for run, size in zip(job, sizes, strict=True):
            buf = whole[at : at + size]
            source.read_into(run[0].file, run[0].span[0], buf)
            bufs.append(buf)
            at += size
        return bufs

    def place(job: list[list[_Read]], bufs: list[memoryview]) -> None:
        # Each piece's head, data and tail in the job's buffer; the data view is also what is copied.
        views = [buf[seg.offset - run[0].span[0] : seg.offset - run[0].span[0] + seg.length]
                 for run, buf in zip(job, bufs, strict=True)
                 for read in run for seg in (read.segs["head"], read.segs["data"], read.segs["tail"])]  # fmt: skip
        if verify:
            # Every checksum of the job in one call (each run lies in one file: runs are made of
            # neighbours, jobs of runs of one file).
            check_segments(f"{source.where}/{job[0][0].file}", [(read.fqn, read.segs) for run in job for read in run],
                           views)  # fmt: skip
        if back_up_whole is not None:
            # Only destinations this one piece fills: no other reader thread writes into them.
            back_up_whole([read.fqn for run in job for read in run if read.whole])
        for read, piece in zip((read for run in job for read in run), views[1::3], strict=True):
            if back_up_whole is None or not read.whole:
                backup(read)
            if read.whole:
                _borrowed_view(read.dest)[:] = piece  # a plain memory copy; read.dest outlives the view
            else:
                _copy_overlap(read, piece)
        if bufs:
            blocks.give(bufs[0].obj)  # every view of it is done with: it can take the next job

    large = [r for r in reads if r.whole and r.segs["data"].length >= _SMALL_PIECE]
    rest = sorted((r for r in reads if not (r.whole and r.segs["data"].length >= _SMALL_PIECE)),
                  key=lambda r: (r.file, r.span[0]))  # fmt: skip
    runs: list[list[_Read]] = []
    for read in rest:
        if runs:
            prev = runs[-1]
            if (prev[-1].file == read.file and prev[-1].span[1] == read.span[0]
                    and read.span[1] - prev[0].span[0] <= _RUN_BYTES):  # fmt: skip
                prev.append(read)
                continue
        runs.append([read])
    # Runs that are not neighbours (a replicated tensor's pieces in another rank's file, each between
    # that rank's own shards) are fetched together where reads are cheap: a job and a checksum call
    # per run cost more than the read itself (1,250 runs of 1.5 KB per rank at 2,500 parameters).
    # Object stores keep a job per run: there each is a request, and the pool runs them in parallel.
    jobs: list[list[list[_Read]]] = []
    job_bytes = 0
    batches = getattr(source, "batches_reads", False)
    for run in runs:
        size = run[-1].span[1] - run[0].span[0]
        if (batches and jobs and jobs[-1][0][0].file == run[0].file
                and job_bytes + size <= _RUN_BYTES and len(jobs[-1]) < _JOB_RUNS):  # fmt: skip
            jobs[-1].append(run)
            job_bytes += size
        else:
            jobs.append([run])
            job_bytes = size
    try:
        with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="ckptkeeper-read") as pool:
            futures = [pool.submit(direct, r) for r in sorted(large, key=lambda r: -r.segs["data"].length)]
            fetch_and_place(pool, futures, jobs, fetch, place, ahead=max(2, threads))
    finally:
        source.close()


def check_stored(source: Source, segments: Mapping[str, Iterable[Segment]]) -> None:
    """Check each listed segment of each data file (``{file: segments}``) against its checksum,
    reading each byte once; CorruptCheckpointError for the first that does not match.

    For a load without a backup (over the staging budget): every byte it will use is checked
    against the table before any is written. A whole-file checksum would not do: the reads trust
    the table's per-segment checksums, and a table can disagree with intact files.
    """
    for rel, listed in segments.items():
        # Keyed on offset, length and checksum: an empty tensor's data segment starts where its
        # tail does, and two empty segments at one offset may claim different checksums (a
        # forged table's): each must be checked (found by outside attacks).
        ordered = sorted({(seg.offset, seg.length, seg.xxh3_64): seg for seg in listed}.values(),
                         key=lambda s: (s.offset, s.length))  # fmt: skip
        run: list[Segment] = []
        for seg in ordered:
            if run and (
                seg.offset != run[-1].offset + run[-1].length or seg.offset + seg.length > run[0].offset + _RUN_BYTES
            ):
                _check_run(source, rel, run)
                run = []
            if seg.length > _RUN_BYTES:
                _check_long(source, rel, seg)
            else:
                run.append(seg)
        _check_run(source, rel, run)


def _check_run(source: Source, rel: str, run: list[Segment]) -> None:
    if not run:
        return
    start = run[0].offset
    buf = memoryview(bytearray(run[-1].offset + run[-1].length - start))
    source.read_into(rel, start, buf)
    views = [buf[seg.offset - start : seg.offset - start + seg.length] for seg in run]
    for seg, got in zip(run, map(xxhash.xxh3_64_hexdigest, views), strict=True):
        if got != seg.xxh3_64:
            raise segment_mismatch(f"{source.where}/{rel}", seg.fqn, seg.kind, got, seg.xxh3_64)


def _check_long(source: Source, rel: str, seg: Segment) -> None:
    hasher = xxhash.xxh3_64()
    chunk = memoryview(bytearray(_RUN_BYTES))
    for at in range(0, seg.length, _RUN_BYTES):
        part = chunk[: min(_RUN_BYTES, seg.length - at)]
        source.read_into(rel, seg.offset + at, part)
        hasher.update(part)
    if hasher.hexdigest() != seg.xxh3_64:
        raise segment_mismatch(f"{source.where}/{rel}", seg.fqn, seg.kind, hasher.hexdigest(), seg.xxh3_64)


def segments_read(reads: list[_Read]) -> dict[str, list[Segment]]:
    """The segments ``reads`` will read, by data file (what :func:`check_stored` is given)."""
    out: dict[str, list[Segment]] = {}
    for read in reads:
        out.setdefault(read.file, []).extend((read.segs["head"], read.segs["data"], read.segs["tail"]))
    return out


def iter_layout_files(files: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    """(segment table, data file) pairs of a multi-rank fast-path checkpoint's listed files
    (format-1 tables first, so that where a record lists both for a file, format 2's is last)."""
    for prefix in (_OLD_TABLE_PREFIX, _TABLE_PREFIX):
        for rel in files:
            if rel.startswith(prefix) and rel.endswith(".json"):
                rank = rel[len(prefix) : -len(".json")]
                if rank.isdigit() and str(int(rank)) == rank:
                    yield rel, shard_name(int(rank))
