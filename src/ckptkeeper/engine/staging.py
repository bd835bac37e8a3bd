"""Snapshotting a tensor tree into reusable host buffers, the start of every async save.

Buffers are allocated once per state layout (names, shapes, dtypes) and reused by every later
save with the same layout, so the training thread pays one memory copy per save and no
allocation or page faults. Buffers are pinned when the source tensors live on a GPU.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
from torch.distributed.tensor import DTensor

from ..errors import ConfigurationError
from .state import _dtensor, flatten_tensors

ShardedTensor: Any = None  # FSDP1's sharded state dicts hold these (torch's older sharding API)
with contextlib.suppress(ImportError):  # torch built without distributed: there are none
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor

__all__ = ["Stager", "local_shard"]


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose bytes this rank holds: a DTensor's local shard, a ShardedTensor's one
    local shard (an empty tensor where this rank holds none), any other tensor itself.

    Without to_local()'s autograd function (a few dozen microseconds per tensor, inside the time
    an async save blocks training): the stager and the load's backups only copy the bytes.
    """
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return t  # the common case, decided without isinstance's subclass walk
    if isinstance(t, DTensor):
        return t._local_tensor
    if ShardedTensor is not None and isinstance(t, ShardedTensor):
        return _sharded_local(t)
    return t


def _sharded_local(t: Any) -> torch.Tensor:
    # A ShardedTensor answers almost no torch function (numel, copy_, ...): its shard is a plain tensor.
    shards = t.local_shards()
    if len(shards) == 1:
        return cast(torch.Tensor, shards[0].tensor)
    if not shards:
        return torch.empty(0, dtype=t.metadata().tensor_properties.dtype, device="cpu")
    raise ConfigurationError(
        f"a ShardedTensor holds {len(shards)} local shards on this rank; ckptkeeper backs up and stages one "
        "per rank (as FSDP1's sharded state dicts have): save it with torch.distributed.checkpoint instead"
    )


def _sharded_copy(t: Any) -> Any:
    """A snapshot of a ShardedTensor in host memory (torch's own copy, as DCP's async save makes
    it: ``to("cpu")`` moves the shards and their placements, a CPU one is deep-copied). Made anew
    per save: FSDP1 state is rare enough not to be worth reusable buffers of its own."""
    if not t.local_shards():
        return t  # nothing of it on this rank
    return t.to(device="cpu") if t.device.type != "cpu" else copy.deepcopy(t)


def _layout_of(locals_: list[tuple[str, torch.Tensor]]) -> tuple[tuple[str, torch.Size, torch.dtype], ...]:
    # torch.Size is a tuple: compared as one without a copy per tensor.
    return tuple((p, t.shape, t.dtype) for p, t in locals_)


class Stager:
    """Copies a tensor tree into buffers it owns; ``allocations`` counts buffer (re)allocations.

    ``pin``: the buffers of GPU tensors are pinned host memory (copied at several times the speed
    of pageable memory, but slow to allocate: worth it for buffers that are reused).
    """

    def __init__(self, pin: bool = True) -> None:
        self._pin = pin
        self._layout: tuple[tuple[str, torch.Size, torch.dtype], ...] | None = None
        self._buffers: dict[str, torch.Tensor] = {}
        self.allocations = 0

    @property
    def nbytes(self) -> int:
        """Host memory held by the staging buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def release(self) -> None:
        """Drop the buffers (the next stage_lazily() allocates anew)."""
        self._buffers = {}
        self._layout = None

    def buffers_for(self, tree: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """This stager's buffers for ``tree``'s layout (allocated when the layout changed), by dotted path."""
        self._buffers_for([(p, local_shard(t)) for p, t in flatten_tensors(tree)])
        return dict(self._buffers)

    def existing_buffers_by_name(self, locals_: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """This stager's buffers for those of ``locals_`` it holds one of the same name, shape and
        dtype for (in any order; nothing is allocated). A load backs up its live tensors, a part
        of what an async save stages, in them."""
        if not self._buffers:
            return {}
        found = {}
        get = self._buffers.get
        for name, t in locals_:
            buf = get(name)
            if buf is not None and buf.shape == t.shape and buf.dtype == t.dtype:
                found[name] = buf
        return found

    def _buffers_for(self, locals_: list[tuple[str, torch.Tensor]]) -> None:
        layout = _layout_of(locals_)
        if layout != self._layout:
            self._allocate(locals_)
            self._layout = layout

    def stage_lazily(self, tree: Mapping[str, Any]) -> Callable[[], dict[str, Any]]:
        """Copy ``tree``'s tensors into this stager's buffers now; returns a function that builds
        the staged tree around them (DTensor wrappers cost more than the copy of a small shard, so
        an async save builds them in the background, after training has its state back)."""
        locals_: list[tuple[str, torch.Tensor]] = []
        sharded: dict[str, Any] = {}  # ShardedTensors (FSDP1): copied whole, in torch's way
        for p, t in flatten_tensors(tree):
            kind = type(t)
            if kind is torch.Tensor or kind is torch.nn.Parameter:
                locals_.append((p, t))
            elif ShardedTensor is not None and isinstance(t, ShardedTensor):
                sharded[p] = _sharded_copy(t)
            else:
                locals_.append((p, local_shard(t)))
        self._buffers_for(locals_)
        gpus: set[int] = set()
        with torch.no_grad():
            for path, src in locals_:
                if src.is_cuda:
                    gpus.add(src.get_device())
                    self._buffers[path].copy_(src, non_blocking=True)
                else:
                    self._buffers[path].copy_(src)
        # Every GPU the copies came from (one process may hold tensors on several: pipeline
        # stages, device_map), not only the current one: the writer reads the buffers next.
        for gpu in gpus:
            torch.cuda.synchronize(gpu)
        return lambda: self._rebuild(tree, "", sharded)

    def _allocate(self, leaves: list[tuple[str, torch.Tensor]]) -> None:
        self._buffers = {}
        for path, loc in leaves:
            if loc.device.type == "cpu" and loc.is_contiguous():
                # Same shape, dtype and (contiguous) layout, at a third of torch.empty's argument parsing.
                self._buffers[path] = torch.empty_like(loc)
            else:
                self._buffers[path] = torch.empty(
                    loc.shape,
                    dtype=loc.dtype,
                    device="cpu",
                    pin_memory=self._pin and loc.is_cuda and torch.cuda.is_available(),
                )
        self.allocations += 1

    def _rebuild(self, tree: Mapping[str, Any], prefix: str, sharded: Mapping[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            path = f"{prefix}{key}"
            if isinstance(value, Mapping):
                out[key] = self._rebuild(value, path + ".", sharded)
            elif path in sharded:
                out[key] = sharded[path]
            elif isinstance(value, torch.Tensor):
                buf = self._buffers[path]
                if isinstance(value, DTensor):
                    # The staged shard under the live tensor's own sharding spec. DTensor.from_local
                    # would move a CPU buffer back onto a CUDA mesh's device (undoing the staging,
                    # in the background thread) and cost an autograd call and a new spec per
                    # tensor (a quarter of a background save at 10,000 tensors). The writers only
                    # read the spec and the local bytes.
                    out[key] = _dtensor(buf, value._spec)
                else:
                    out[key] = buf
            else:
                out[key] = value
        return out
