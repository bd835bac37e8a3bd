"""Multi-rank loads at the world size a checkpoint was saved at, planned and read from columns.

The common resume: every rank of the saving job loads again, with the same sharding, from a
local or shared filesystem. Each destination tensor is then exactly one stored piece: the rank's
own shard in its own data file, or a whole (replicated) piece that one rank wrote. The general
reader (:func:`~ckptkeeper.engine.sharded.plan_reads` and
:func:`~ckptkeeper.engine.sharded.read_pieces`, any world size, any overlap) builds three
``Segment`` objects, a ``Stored``, a list and a ``_Read`` per piece and looks at each several
times; at 10,000 tensors per rank that planning cost more than reading the bytes. Here a piece is
one tuple (file, start, kind, data checksum) taken straight from the rank's segment table and
the shared index, a destination is matched to it with one comparison, and runs of neighbouring
pieces are read, checked and copied with a few operations per piece.

It checks what the general path checks (the same table and index validation, the shared index's
whole pieces in this rank's own file against its own table, every head, data and tail checksum
before a byte is used, the same backups before writes) and it takes nothing the general path
would refuse: a destination it cannot place exactly (another sharding, a replica of a shard
another rank wrote) makes it step aside (:class:`NotPlaced`), and the caller plans that load the
general way.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple, cast

import torch
import xxhash
from torch.distributed.tensor import DTensor

from .fastio import (
    _SMALL_PIECE,
    Segment,
    _borrowed_view,
    _leaves,
    _memory_view,
    _new_segment,
    _PyBUF_WRITE,
    _skeleton_of,
    any_overlap,
    fetch_and_place,
    segment_mismatch,
)
from .loader import _memmove_holding_gil
from .sharded import (
    _JOB_RUNS,
    _RUN_BYTES,
    INDEX_FILE,
    JobBuffers,
    KindFacts,
    Source,
    _region,
    _usable,
    bad_table_piece,
    check_whole,
    index_columns,
    table_columns,
    table_short,
)
from .state import MADE_PLAIN, FlatLeaf, SavedTensor

__all__ = ["FlatIndex", "FlatRead", "NotPlaced", "flat_index", "flat_segments", "plan_flat", "read_flat"]

Spot = tuple[str, int, KindFacts, str]
"""Where one stored piece is: (data file, where its header starts there, its kind, its data's xxh3)."""


class FlatIndex(NamedTuple):
    """What a rank loading at the saved world size plans from: every tensor's shape and dtype
    (``saved``, from the shared index) and, by name, the one piece it reads for each tensor."""

    saved: dict[str, SavedTensor | None]
    spots: dict[str, Spot]


class FlatRead(NamedTuple):
    """One destination read whole from one piece (ordered by file and place: the read order)."""

    file: str
    start: int
    order: int
    """The destination's place in the plan: ties in (file, start) never compare tensors."""
    kind: KindFacts
    data_sum: str
    fqn: str
    dest: torch.Tensor
    """The destination's local data (contiguous, on the CPU)."""
    fresh: bool
    """Made by the load's plan (see :data:`~ckptkeeper.engine.state.FlatLeaf`): new memory, which
    overlaps no other destination's, so the overlap check leaves it out."""


class NotPlaced(Exception):
    """A destination is not exactly one piece this index knows: plan the load the general way."""


def flat_index(own_doc: Any, own_file: str, index_doc: Any, world: int, sizes: Mapping[str, int]) -> FlatIndex:
    """The pieces of this rank's own data file (its format-2 table, ``own_doc``) and the shared
    index's whole pieces, checked as :func:`~ckptkeeper.engine.sharded.index_from_own_table`
    checks them; ValueError when the table, the index or the two together say something
    impossible."""
    saved, shapes, whole = index_columns(index_doc, world, sizes)
    names, kinds, sums, facts = table_columns(own_doc, own_file, sizes[own_file])
    spots: dict[str, Spot] = {}
    count = len(facts)
    pos = 0
    for fqn, k, data_sum in zip(names, kinds, sums, strict=True):
        if type(k) is not int or not 0 <= k < count or type(fqn) is not str or type(data_sum) is not str:
            raise bad_table_piece(own_file, fqn)
        kind = facts[k]
        if saved.get(fqn) != kind.tensor:
            raise ValueError(f"the segment table of {own_file} and {INDEX_FILE} disagree about {fqn[:80]!r}")
        spots[fqn] = (own_file, pos, kind, data_sum)
        pos += kind.head + kind.nbytes + kind.tail
    if pos != sizes[own_file]:
        raise table_short(own_file, pos, sizes[own_file])
    for fqn, k, rank, start, data_sum in zip(
        whole["names"], whole["kind"], whole["rank"], whole["start"], whole["sums"], strict=True
    ):
        kind, file = check_whole(saved, shapes, world, sizes, fqn, k, rank, start, data_sum)
        if file == own_file:
            # Checked against this rank's own table, as the general index does (each file's whole
            # pieces by the rank that owns it; the ranks agree before any plans from the index).
            own = spots.get(fqn)  # may be an earlier index row's, in another file: compared too
            if own is None or (own[0], own[1], own[2].offsets, own[2].sizes, own[3]) != (
                own_file,
                start,
                *kind[1:3],
                data_sum,
            ):
                raise ValueError(f"{INDEX_FILE} places {fqn[:80]!r} where the segment table of {own_file} does not")
        elif fqn not in spots:  # this rank's own file holds it already otherwise
            spots[fqn] = (file, start, kind, data_sum)
    return FlatIndex(saved, spots)


def plan_flat(
    tensors: Mapping[str, Any],
    index: FlatIndex,
    world: int,
    leaves: list[FlatLeaf] | None = None,
) -> list[FlatRead] | None:
    """The reads of every destination in ``tensors``, one piece each, in read order; None when a
    destination is one no fast reader takes (the caller uses DCP's reader, as the general planner
    would). :class:`NotPlaced` when a destination is not exactly one piece of ``index``.
    ``leaves``: every leaf of ``tensors`` as (dotted name, tensor, twin), when the caller has them
    (:attr:`~ckptkeeper.engine.state.LoadPlan.flat`)."""
    reads: list[FlatRead] = []
    saved, spots = index.saved, index.spots
    new, append = tuple.__new__, reads.append
    if leaves is None:
        leaves = [(fqn, value, None) for fqn, _, value in _leaves(tensors)]
    # (local shape, global offsets) by id(spec), for this call only (every leaf, and with it its
    # spec, lives until it returns): a parameter's optimizer slots share its spec object, so
    # most DTensors skip _region's checks of a spec it has seen (3-4 ms at 10,000 tensors, measured).
    boxes: dict[int, tuple[torch.Size, tuple[int, ...]]] = {}
    # (local shape, global offsets) by id() of each leaf that passed every check below, for the
    # tensors the plan made from it (their twin, see FlatLeaf): they pass them too, by how they
    # were made, and are only placed (the checks were a third of this function at 10,000 tensors).
    passed: dict[int, tuple[torch.Size, tuple[int, ...]]] = {}
    for order, (fqn, value, twin) in enumerate(leaves):
        fresh = twin is not None
        if fresh:
            if twin is MADE_PLAIN:
                local = value
                shape = local.shape
                offsets: tuple[int, ...] = (0,) * len(shape)
            elif (known := passed.get(id(twin))) is not None:
                local = value._local_tensor if isinstance(value, DTensor) else value
                shape, offsets = known
            else:
                twin = None
        if twin is None:
            if (
                isinstance(value, DTensor)
                and (box := boxes.get(id(value._spec))) is not None
                and value._local_tensor.shape == box[0]
            ):
                local, offsets = value._local_tensor, box[1]
            else:
                region = _region(value, world)
                if region is None:
                    return None
                local, offsets, _ = region  # the global shape was checked by plan_load
                if isinstance(value, DTensor):
                    boxes[id(value._spec)] = (local.shape, offsets)
            info = saved.get(fqn)
            if (
                info is None
                or info.dtype != local.dtype
                or not _usable(local)
                or not local.is_contiguous()
                # Its memory holds the conjugated or negated values: raw bytes copied there would load
                # them wrong (found by an outside attack). DCP's reader copies through the view.
                or local.is_conj()
                or local.is_neg()
            ):
                return None
            shape = local.shape
            passed[id(value)] = (shape, offsets)
        spot = spots.get(fqn)
        if spot is None or spot[2].offsets != offsets or shape != spot[2].sizes:
            if local.numel() == 0:
                continue  # nothing to read (an empty shard): placed or not
            raise NotPlaced(fqn)
        if spot[2].nbytes:
            append(new(FlatRead, (spot[0], spot[1], order, spot[2], spot[3], fqn, local, fresh)))
    reads.sort()
    return reads


def flat_segments(reads: list[FlatRead]) -> dict[str, list[Segment]]:
    """The segments ``reads`` will read, by data file (what :func:`~ckptkeeper.engine.sharded.check_stored` takes)."""
    out: dict[str, list[Segment]] = {}
    new = _new_segment
    for r in reads:
        k = r.kind
        at = r.start + k.head
        out.setdefault(r.file, []).extend(
            (
                new(Segment, ("head", r.fqn, r.start, k.head, k.head_sum)),
                new(Segment, ("data", r.fqn, at, k.nbytes, r.data_sum)),
                new(Segment, ("tail", r.fqn, at + k.nbytes, k.tail, k.tail_sum)),
            )
        )
    return out


def _check(where: str, run: list[FlatRead], got: list[str]) -> None:
    # Only on a mismatch: which segment of which piece it is.
    for i, r in enumerate(run):
        for j, (kind, want) in enumerate((("head", r.kind.head_sum), ("data", r.data_sum), ("tail", r.kind.tail_sum))):
            if got[3 * i + j] != want:
                raise segment_mismatch(f"{where}/{r.file}", r.fqn, kind, got[3 * i + j], want)


def read_flat(
    source: Source,
    reads: list[FlatRead],
    verify: bool = True,
    threads: int = 2,
    before_write: Callable[[str, int, int], None] | None = None,
    back_up_whole: Callable[[list[str]], None] | None = None,
) -> None:
    """Read every planned piece into its destination, each segment checked before its bytes are
    used (with ``verify``), as :func:`~ckptkeeper.engine.sharded.read_pieces` does: pieces of a
    megabyte or more straight into their tensors on ``threads`` readers; runs of smaller
    neighbours into a reused buffer, checked in one call per job and copied. ``before_write`` /
    ``back_up_whole`` are the loader's backups, called before a destination is written."""
    large = sorted((r for r in reads if r.kind.nbytes >= _SMALL_PIECE), key=lambda r: -r.kind.nbytes)
    where = source.where

    def direct(r: FlatRead) -> None:
        k = r.kind
        for at, length, want, name in ((r.start, k.head, k.head_sum, "head"),
                                       (r.start + k.head + k.nbytes, k.tail, k.tail_sum, "tail")):  # fmt: skip
            view = memoryview(bytearray(length))
            source.read_into(r.file, at, view)
            if verify and (got := xxhash.xxh3_64_hexdigest(view)) != want:
                raise segment_mismatch(f"{where}/{r.file}", r.fqn, name, got, want)
        if before_write is not None:
            before_write(r.fqn, 0, k.nbytes)
        view = _borrowed_view(r.dest)  # r.dest (held by the plan) outlives the view
        source.read_into(r.file, r.start + k.head, view)
        if verify and (got := xxhash.xxh3_64_hexdigest(view)) != r.data_sum:
            raise segment_mismatch(f"{where}/{r.file}", r.fqn, "data", got, r.data_sum)

    # Jobs: runs of neighbours (one read each), several runs of one file per job up to a buffer's
    # size (a job and a checksum call per run cost more than a small run's read).
    jobs: list[tuple[list[tuple[str, int, int]], list[FlatRead]]] = []
    runs: list[tuple[str, int, int]] = []
    members: list[FlatRead] = []
    job_bytes = 0
    for r in reads:
        k = r.kind
        if k.nbytes >= _SMALL_PIECE:
            continue
        end = r.start + k.head + k.nbytes + k.tail
        if runs and runs[-1][0] == r.file and runs[-1][2] == r.start and job_bytes + end - r.start <= _RUN_BYTES:
            file, first, last = runs[-1]
            job_bytes += end - last
            runs[-1] = (file, first, end)
        elif runs and runs[0][0] == r.file and job_bytes + end - r.start <= _RUN_BYTES and len(runs) < _JOB_RUNS:
            runs.append((r.file, r.start, end))
            job_bytes += end - r.start
        else:
            if runs:
                jobs.append((runs, members))
            runs, members, job_bytes = [(r.file, r.start, end)], [], end - r.start
        members.append(r)
    if runs:
        jobs.append((runs, members))

    blocks = JobBuffers()

    def fetch(job: tuple[list[tuple[str, int, int]], list[FlatRead]]) -> memoryview:
        whole = memoryview(blocks.take(sum(end - start for _, start, end in job[0])))
        at = 0
        for file, start, end in job[0]:
            source.read_into(file, start, whole[at : at + end - start])
            at += end - start
        return whole

    def place(job: tuple[list[tuple[str, int, int]], list[FlatRead]], whole: memoryview) -> None:
        runs, members = job
        views: list[memoryview] = []
        want: list[str] = []
        offsets: list[int] = []  # where each piece's data starts in the buffer
        at, i = 0, 0
        for _, start, end in runs:
            pos = start
            while pos < end:
                r = members[i]
                k = r.kind
                h = at + pos - start
                d = h + k.head
                views += (whole[h:d], whole[d : d + k.nbytes], whole[d + k.nbytes : d + k.nbytes + k.tail])
                offsets.append(d)
                want += (k.head_sum, r.data_sum, k.tail_sum)
                pos += k.head + k.nbytes + k.tail
                i += 1
            at += end - start
        if verify:
            got = list(map(xxhash.xxh3_64_hexdigest, views))
            if got != want:
                _check(where, members, got)
        if back_up_whole is not None:
            back_up_whole([r.fqn for r in members])
        elif before_write is not None:
            for r in members:
                before_write(r.fqn, 0, r.kind.nbytes)
        block = whole.obj
        # Plain memory copies from the job's buffer, a C call each (a byte view of each destination
        # cost as much again); every destination is contiguous with the piece's byte count.
        base = ctypes.addressof(ctypes.c_char.from_buffer(block))
        move = _memmove_holding_gil
        for r, off in zip(members, offsets, strict=True):
            move(r.dest.data_ptr(), base + off, r.kind.nbytes)
        blocks.give(block)

    # Straight into the tensors only where they are backed up first (without a backup, a job's
    # bytes are checked in a buffer before any is copied), and never into memory two share.
    scatter = getattr(source, "read_scatter", None) if before_write or back_up_whole else None
    # Only the destinations the load did not make itself can share memory (tied weights, views).
    if scatter is not None and any_overlap([r.dest for r in reads if not r.fresh]):
        scatter = None
    try:
        with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="ckptkeeper-read") as pool:
            futures = [pool.submit(direct, r) for r in large]
            if scatter is None:
                fetch_and_place(pool, futures, jobs, fetch, place, ahead=max(2, threads))
            else:
                _scatter_jobs(pool, futures, jobs, scatter, where, verify, before_write, back_up_whole, max(2, threads))
    finally:
        source.close()


_Job = tuple[list[tuple[str, int, int]], list[FlatRead]]
"""A read job: its runs (data file, start, end) and the pieces they hold, in order."""
_Prepared = tuple[_Job, list[list[memoryview]], list[memoryview], bytearray]
"""A job ready to be read: each run's buffers (in order), each piece's data view, and the
scratch buffer that receives every piece's header and trailer (one after another)."""

_UNKNOWN = object()


def _scatter_jobs(
    pool: ThreadPoolExecutor,
    others: list[Future[Any]],
    jobs: list[_Job],
    scatter: Callable[[str, int, list[memoryview]], None],
    where: str,
    verify: bool,
    before_write: Callable[[str, int, int], None] | None,
    back_up_whole: Callable[[list[str]], None] | None,
    ahead: int,
) -> None:
    """Read each job's runs straight into their destinations (one scatter read per run: headers
    and trailers into scratch, each piece's data into its tensor), then check every segment.

    A local file's runs of small pieces are read this way: through a buffer they cost one more
    pass over memory (a copy per piece into its tensor, 128 MB per rank at 2,500 parameters). The
    destinations are backed up before their read is started, in this thread, and a mismatch
    raises once every read has stopped, so the loader puts them back as with the buffered reads.
    Destinations sharing memory never come here (see :func:`read_flat`).

    A piece's header and trailer are its ``torch.save`` skeleton, fixed by its kind: a trailer and
    the next piece's header, neighbours in the file, are read into one scratch buffer, and a
    job's scratch is compared with its pieces' skeletons in one comparison, leaving one checksum
    per piece (its data) where there were three (two thirds of a job's buffers and checksum calls
    at 10,000 small tensors). Where anything differs, every segment is hashed and compared with
    the checksums the checkpoint gives, which names the first one wrong, as before.
    """
    skeletons: dict[int, Any] = {}  # id(kind): its header and trailer bytes (kinds live in the plan)

    def skeleton(k: KindFacts) -> bytes | None:
        found = skeletons.get(id(k), _UNKNOWN)
        if found is _UNKNOWN:
            head, tail, head_sum, tail_sum = _skeleton_of(k.sizes, cast(torch.dtype, k.tensor.dtype))
            same = (len(head), len(tail), head_sum, tail_sum) == (k.head, k.tail, k.head_sum, k.tail_sum)
            found = skeletons[id(k)] = head + tail if same else None
        return cast("bytes | None", found)

    def prepared() -> Iterator[_Prepared]:
        # Taken by fetch_and_place in this thread just before each job's read is started.
        for job in jobs:
            runs, members = job
            if back_up_whole is not None:
                back_up_whole([r.fqn for r in members])
            elif before_write is not None:
                for r in members:
                    before_write(r.fqn, 0, r.kind.nbytes)
            scratch = bytearray(sum(r.kind.head + r.kind.tail for r in members))
            sv = memoryview(scratch)
            # Each destination's bytes as a slice of one view spanning the job's destinations: a
            # view made per destination (a ctypes call each) was 4% of a load of 10,000 tensors.
            # Only the slices are ever read into; the plan holds every destination, and each is
            # contiguous with its piece's byte count (plan_flat), every piece here under
            # _SMALL_PIECE bytes and none empty (plan_flat leaves out pieces of no bytes).
            ptrs = [r.dest.data_ptr() for r in members]
            low = min(ptrs)
            span = _memory_view(low, max(ptrs) + _SMALL_PIECE - low, _PyBUF_WRITE)
            per_run: list[list[memoryview]] = []
            data: list[memoryview] = []
            at = i = 0
            for _, start, end in runs:
                # The members of a run lie one after another from its start: as many as it spans.
                head = members[i].kind.head
                views = [sv[at : at + head]]
                at += head
                pos = start
                while pos < end:
                    k = members[i].kind
                    off = ptrs[i] - low
                    view = span[off : off + k.nbytes]
                    data.append(view)
                    pos += k.head + k.nbytes + k.tail
                    i += 1
                    gap = k.tail + (members[i].kind.head if pos < end else 0)  # this trailer, the next header
                    views += (view, sv[at : at + gap])
                    at += gap
                per_run.append(views)
            yield job, per_run, data, scratch

    def fetch(item: _Prepared) -> None:
        (runs, _), per_run, _, _ = item
        for (file, start, _), views in zip(runs, per_run, strict=True):
            scatter(file, start, views)  # consumes its list (kept only for this read)

    def check(item: _Prepared, _read: None) -> None:
        (_, members), _, data, scratch = item
        if not verify:
            return
        fixed = [skeleton(r.kind) for r in members]
        if (
            None not in fixed
            and scratch == b"".join(cast("list[bytes]", fixed))
            and list(map(xxhash.xxh3_64_hexdigest, data)) == [r.data_sum for r in members]
        ):
            return
        # Something differs: every segment's checksum, compared in order, names the first one wrong.
        sv = memoryview(scratch)
        got: list[str] = []
        want: list[str] = []
        at = 0
        for r, view in zip(members, data, strict=True):
            k = r.kind
            mid = at + k.head
            got += (xxhash.xxh3_64_hexdigest(sv[at:mid]), xxhash.xxh3_64_hexdigest(view),
                    xxhash.xxh3_64_hexdigest(sv[mid : mid + k.tail]))  # fmt: skip
            want += (k.head_sum, r.data_sum, k.tail_sum)
            at = mid + k.tail
        if got != want:
            _check(where, members, got)

    fetch_and_place(pool, others, prepared(), fetch, check, ahead)
