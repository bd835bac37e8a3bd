"""Snapshotting a tensor tree into reusable host buffers, the start of every async save.

Buffers are allocated once per state layout (names, shapes, dtypes) and reused by every later
save with the same layout, so the training thread pays one memory copy per save and no
allocation or page faults. Buffers are pinned when the source tensors live on a GPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .state import flatten_tensors

__all__ = ["Stager"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class Stager:
    """Copies a tensor tree into buffers it owns; ``allocations`` counts buffer (re)allocations."""

    def __init__(self) -> None:
        self._layout: tuple[tuple[str, tuple[int, ...], torch.dtype], ...] | None = None
        self._buffers: dict[str, torch.Tensor] = {}
        self.allocations = 0

    @property
    def nbytes(self) -> int:
        """Host memory held by the staging buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def release(self) -> None:
        """Drop the buffers (the next stage() allocates anew)."""
        self._buffers = {}
        self._layout = None

    def buffers_for(self, tree: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """This stager's buffers for ``tree``'s layout (allocated when the layout changed), by dotted path."""
        leaves = list(flatten_tensors(tree))
        layout = tuple((p, tuple(_local(t).shape), _local(t).dtype) for p, t in leaves)
        if layout != self._layout:
            self._allocate(leaves)
            self._layout = layout
        return dict(self._buffers)

    def stage(self, tree: Mapping[str, Any]) -> dict[str, Any]:
        """A copy of ``tree`` whose tensors live in this stager's buffers (blocking until copied)."""
        leaves = list(flatten_tensors(tree))
        self.buffers_for(tree)
        any_cuda = False
        for path, t in leaves:
            src = _local(t).detach()
            any_cuda |= src.is_cuda
            self._buffers[path].copy_(src, non_blocking=src.is_cuda)
        if any_cuda:
            torch.cuda.synchronize()
        return self._rebuild(tree, "")

    def _allocate(self, leaves: list[tuple[str, torch.Tensor]]) -> None:
        self._buffers = {}
        for path, t in leaves:
            loc = _local(t)
            self._buffers[path] = torch.empty(
                loc.shape, dtype=loc.dtype, device="cpu", pin_memory=loc.is_cuda and torch.cuda.is_available()
            )
        self.allocations += 1

    def _rebuild(self, tree: Mapping[str, Any], prefix: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            path = f"{prefix}{key}"
            if isinstance(value, Mapping):
                out[key] = self._rebuild(value, path + ".")
            elif isinstance(value, torch.Tensor):
                buf = self._buffers[path]
                if isinstance(value, DTensor):
                    out[key] = DTensor.from_local(
                        buf,
                        value.device_mesh,
                        value.placements,
                        run_check=False,
                        shape=value.shape,
                        stride=value.stride(),
                    )
                else:
                    out[key] = buf
            else:
                out[key] = value
        return out
