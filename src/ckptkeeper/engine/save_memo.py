"""Reusing a per-rank save's plan for the next save of the same tensors.

A training run saves the same tensors again and again: between two saves the optimizer changes
their values, not where they live, their shapes or their sharding. Planning a save of many
tensors is per-tensor Python work that gives the same answer each time: this rank's pieces,
the write jobs (each tensor's ``torch.save`` head and tail, a byte view of its memory, runs of
small neighbours gathered into one ``pwritev``) and the segment table's layout; about 45 ms of a
10,000-tensor save at 2 ranks, measured here. A :class:`SaveMemo` keeps what a checkpointer's
last saves planned; the next save takes it after one pass that finds every tensor as it was
(:func:`fingerprints`, compared a part at a time, so that a save that misses stops early), and
plans anew otherwise; a new plan's fingerprints are taken while its data file is flushed.

What the pass compares, per leaf of the tree in order: its name and key path, its class, the
sharding spec object (held, so its ``id`` stays its own) and the hash DTensor caches on it (which
DTensor drops when a field is set again), and of the tensor whose bytes are written (a DTensor's
local shard): the address of its first byte, its storage's size, its shape, dtype, contiguity,
lazy conjugate or negation bits, device and quantization. These are everything the plan is made from; a byte
view in a kept plan is used only once the pass has found a live tensor of the same size at its
address, and the save holds the tensors that pass found until it ends (a state may make its
tensors when asked for), so the memo never holds a tensor itself. User code that runs between
the pass and the write (an ``on_stage`` hook) gets the pass repeated after it (see
:func:`~ckptkeeper.engine.sharded.recheck_shard`). ``p.data = ...``, ``resize_``, ``set_``, a
swapped local shard, a spec changed in place, a new optimizer state after a load: each changes
something compared, and the save plans anew. Tensors whose save copies them first (a
non-contiguous one, a lazy conjugate) are never kept: their copy dies with the save.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from .fastio import Leaves, _Plan

__all__ = ["KeptPlan", "SaveMemo", "fingerprints"]

_KEEP = 2
"""Plans kept per checkpointer: its synchronous saves write the live tensors, its async saves the
stager's buffers, and a run that mixes them (a final sync save after async ones) keeps both."""

_PARAMETER = torch.nn.Parameter


def fingerprints(leaves: Leaves) -> tuple[list[Any], list[Any]] | None:
    """What a kept plan depends on (see the module's docstring), leaf after leaf in one flat list,
    and the leaves' sharding spec objects (held by a kept plan, so that the ids compared stay
    theirs); None when a leaf is not a plain tensor, parameter or DTensor, or a spec caches no
    hash (nothing is kept then).

    Each leaf gives a fixed number of facts, then its number of dimensions, then its sizes, so two
    such lists are equal exactly when every leaf's facts are (the dimensions always line up).
    Flat, because a kept plan lives as long as the run: a tuple and a ``torch.Size`` per leaf were
    20,000 objects the garbage collector tracked at 10,000 tensors, walked by the collection that
    followed every first save (and by every full collection during training).
    """
    prints: list[Any] = []
    specs: list[Any] = []
    extend = prints.extend
    try:
        for _, _, v in leaves:
            cls = type(v)
            if cls is DTensor:
                spec = v._spec
                h = spec.__dict__.get("_hash")
                if h is None:
                    hash(spec)  # DTensorSpec fills its cached hash on the first call
                    h = spec.__dict__.get("_hash")
                    if h is None:
                        return None
                specs.append(spec)
                t = v._local_tensor
                key: Any = id(spec)
            elif cls is torch.Tensor or cls is _PARAMETER:
                t, key, h = v, cls, None
            else:
                return None
            # The storage's size too: one resized to 0 and then to less may come back at its old address.
            extend((key, h, t.data_ptr(), t.untyped_storage().nbytes(), t.dtype, t.is_contiguous(), t.is_conj(),
                    t.is_neg(), t.is_cpu, t.is_quantized, t.dim(), *t.shape))  # fmt: skip
    except RuntimeError:  # a tensor without plain memory (sparse, say): its data_ptr() raises
        return None
    return prints, specs


_PART = 1024
"""Leaves compared per step, after a sample of them (see :meth:`SaveMemo.take`): a save that
misses stops at the first part that differs instead of fingerprinting every leaf first."""


def _sampled(leaves: Leaves) -> Leaves:
    # The leaves a save compares first: about 128, spread over the whole state.
    return leaves[:: max(1, len(leaves) // 128)]


def _part_prints(leaves: Leaves) -> Iterator[tuple[list[Any], list[Any]] | None]:
    """:func:`fingerprints` of every ``_PART`` leaves, in order, each taken when asked for."""
    for at in range(0, len(leaves), _PART):
        yield fingerprints(leaves[at : at + _PART])


class KeptPlan:
    """One rank's plan of one save, as :class:`SaveMemo` keeps it between saves."""

    __slots__ = ("count", "fqns", "layout", "parts", "paths", "pending", "plan", "rank", "sample", "sent",
                 "signature", "specs", "token", "whole_at", "world")  # fmt: skip

    def __init__(self, rank: int, world: int, signature: str, leaves: Leaves) -> None:
        self.rank, self.world, self.signature = rank, world, signature
        self.pending: Leaves | None = leaves
        """The save's leaves until :meth:`note` has taken their fingerprints (then None)."""
        self.count = 0
        """How many leaves the fingerprints are of (0 until :meth:`note` took them)."""
        self.fqns: list[str] = []
        self.paths: list[tuple[str, ...]] = []
        self.sample: list[Any] = []
        """The fingerprints of :func:`_sampled` leaves (compared first)."""
        self.parts: list[list[Any]] = []
        """The fingerprints of every ``_PART`` leaves, in order."""
        self.specs: list[Any] = []
        self.plan: _Plan | None = None
        """The write jobs of this rank's data file (filled once the first write with it succeeded)."""
        self.layout: Any = None
        """The segment table's layout (a :class:`~ckptkeeper.engine.sharded.ShardLayout`)."""
        self.whole_at: tuple[int, ...] = ()
        """Where the pieces that are whole tensors are in the file (their checksums go to the shared index)."""
        self.token = secrets.token_hex(8)
        """Names this plan's layout to rank 0, which keeps the layouts it was sent (see :meth:`SaveMemo.recall`)."""
        self.sent = False
        """Whether this layout went to rank 0 whole in an earlier save (later saves send the token alone)."""

    def note(self) -> bool:
        """Take the fingerprints of the save's leaves: while its data file is flushed (the disk is
        busy then, the processor mostly idle), since without an ``on_stage`` hook no user code runs
        between planning and then; with one, when the plan is made (``plan_shard``'s ``eager``).
        False when they cannot be kept."""
        if self.pending is None:
            return self.count > 0  # taken already (when the plan was made: see plan_shard's eager)
        leaves, self.pending = self.pending, None
        sample = fingerprints(_sampled(leaves))
        if sample is None:
            return False
        parts: list[list[Any]] = []
        specs: list[Any] = []
        for found in _part_prints(leaves):
            if found is None:
                return False
            parts.append(found[0])
            specs += found[1]
        self.sample, self.parts, self.specs, self.count = sample[0], parts, specs, len(leaves)
        self.fqns = [fqn for fqn, _, _ in leaves]
        self.paths = [path for _, path, _ in leaves]
        return self.count > 0

    def matches(self, leaves: Leaves) -> bool:
        """Whether every one of ``leaves`` is as the fingerprints found it (and no leaf more or less)."""
        # Part by part, stopping at the first that differs (equal counts: as many parts).
        return len(leaves) == self.count and all(
            found is not None and found[0] == kept for found, kept in zip(_part_prints(leaves), self.parts, strict=True)
        )


class SaveMemo:
    """The last per-rank save plans of one checkpointer (thread-safe).

    A save takes the plan that matches its tensors out of the memo (:meth:`take`), so that two
    saves running at once (a synchronous save while a forgotten async one still writes) never
    share one, and gives it back once its data file is written (:meth:`keep`). A failed save
    gives nothing back: the next one plans anew. ``hits`` and ``misses`` count the saves that
    did and did not find their plan. On rank 0 it also keeps the layouts every rank sent (see
    :meth:`remember`), so that a rank saving with a reused plan sends its token instead.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: list[KeptPlan] = []
        self._layouts: dict[int, list[tuple[str, Any]]] = {}  # on rank 0: (token, layout) per rank, newest first
        self.hits = 0
        self.misses = 0
        self.recalled = 0
        """On rank 0: layouts taken from a token alone; ``lost``: tokens it no longer had."""
        self.lost = 0

    def take(self, rank: int, world: int, leaves: Leaves) -> KeptPlan | None:
        """The kept plan for these leaves (removed from the memo), or None."""
        n = len(leaves)
        with self._lock:
            candidates = [k for k in self._kept if k.rank == rank and k.world == world and k.count == n]
        found = None
        # A sample of the leaves first: after a load every optimizer slot is a new tensor, and
        # the async saves' buffers are other tensors than the live ones, so a miss is seen at once.
        sample = fingerprints(_sampled(leaves)) if candidates else None
        parts: dict[int, list[Any] | None] = {}
        for kept in candidates:
            if sample is None or sample[0] != kept.sample:
                continue
            for at in range(0, n, _PART):
                if at not in parts:
                    part = fingerprints(leaves[at : at + _PART])
                    parts[at] = part[0] if part is not None else None
                mine = leaves[at : at + _PART]
                if (
                    parts[at] is None
                    or parts[at] != kept.parts[at // _PART]
                    or [fqn for fqn, _, _ in mine] != kept.fqns[at : at + _PART]
                    or [path for _, path, _ in mine] != kept.paths[at : at + _PART]
                ):
                    break
            else:
                found = kept
                break
        with self._lock:
            if found is not None and any(k is found for k in self._kept):
                self._kept = [k for k in self._kept if k is not found]
                self.hits += 1
                return found
            self.misses += 1
            return None

    def keep(self, kept: KeptPlan) -> None:
        """Keep a plan whose write succeeded, newest first (the oldest beyond two is dropped)."""
        if kept.plan is None or not kept.count:
            return
        with self._lock:
            self._kept = [kept, *(k for k in self._kept if k is not kept)][:_KEEP]

    def clear(self) -> None:
        """Drop every kept plan and every layout kept for rank 0."""
        with self._lock:
            self._kept.clear()
            self._layouts.clear()

    def remember(self, rank: int, token: str, layout: Any) -> None:
        """On rank 0: keep the layout ``rank`` sent under ``token`` (a few per rank, newest first)."""
        with self._lock:
            kept = [(t, lay) for t, lay in self._layouts.get(rank, []) if t != token]
            self._layouts[rank] = [(token, layout), *kept][:_LAYOUTS_PER_RANK]

    def recall(self, rank: int, token: str) -> Any | None:
        """On rank 0: the layout ``rank`` sent under ``token`` in an earlier save, or None."""
        with self._lock:
            for t, layout in self._layouts.get(rank, []):
                if t == token:
                    self.recalled += 1
                    return layout
            self.lost += 1
            return None


_LAYOUTS_PER_RANK = _KEEP
"""Layouts rank 0 keeps per rank: each rank reuses at most its two kept plans, the last two it
used, as rank 0 keeps the last two it was sent or named (a rank that sends a token rank 0 no
longer has is asked for the layout itself, in one more exchange)."""
