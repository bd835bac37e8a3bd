"""Turning a training state into checkpoint content and back.

A state is split into two trees with the same keys: the tensors (written in stock DCP format)
and everything else (plain JSON: optimizer hyper-parameters, counters, user state). Loading
rebuilds the full state from both, so nothing in a checkpoint is ever unpickled.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

__all__ = [
    "Stateful",
    "TrainingState",
    "flatten_tensors",
    "merge_trees",
    "split_tensors",
    "state_digest",
    "to_json_tree",
]


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict()`` (schedulers, data loaders, counters)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def to_json_tree(value: Any, where: str = "state") -> Any:
    """``value`` as plain JSON types (tuples become lists); TypeError names what cannot be stored."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [to_json_tree(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        return {str(k): to_json_tree(v, f"{where}.{k}") for k, v in value.items()}
    raise TypeError(
        f"{where} holds a {type(value).__name__}, which a checkpoint cannot store without pickle; "
        "return tensors, numbers, strings, lists or dicts from state_dict()"
    )


def split_tensors(tree: Mapping[str, Any], where: str = "state") -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a nested dict into (tensor leaves, JSON leaves), each keeping the nesting."""
    tensors: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    for key, value in tree.items():
        k = str(key)
        if _is_tensor(value):
            tensors[k] = value
        elif isinstance(value, Mapping):
            t, r = split_tensors(value, f"{where}.{k}")
            if t:
                tensors[k] = t
            rest[k] = r
        else:
            if isinstance(value, (list, tuple)) and any(_is_tensor(v) for v in value):
                raise TypeError(f"{where}.{k} is a list holding tensors; put tensors in a dict with string keys")
            rest[k] = to_json_tree(value, f"{where}.{k}")
    return tensors, rest


def merge_trees(rest: Mapping[str, Any], tensors: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`split_tensors`."""
    out: dict[str, Any] = dict(rest)
    for key, value in tensors.items():
        if isinstance(value, Mapping):
            out[key] = merge_trees(rest.get(key, {}) or {}, value)
        else:
            out[key] = value
    return out


def flatten_tensors(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(dotted path, tensor) for every tensor leaf, in insertion order."""
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from flatten_tensors(value, path + ".")
        elif _is_tensor(value):
            yield path, value


class TrainingState:
    """A model, its optimizer and any extra stateful objects, as one checkpointable unit.

    Model and optimizer go through ``torch.distributed.checkpoint.state_dict`` so that sharded
    (FSDP2/DTensor) and plain modules are handled alike and optimizer state is keyed by
    parameter name, which is what makes checkpoints loadable at another world size.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        extra: Mapping[str, Stateful] | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.extra: dict[str, Stateful] = dict(extra or {})

    def _full(self) -> dict[str, Any]:
        if self.optimizer is not None:
            msd, osd = get_state_dict(self.model, self.optimizer)
        else:
            msd, osd = get_model_state_dict(self.model), {}
        return {"model": msd, "optim": osd, "extra": {k: v.state_dict() for k, v in self.extra.items()}}

    def capture(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(tensor tree, JSON tree) of the current state. Tensors may alias live parameters."""
        return split_tensors(self._full())

    def restore(self, tensors: Mapping[str, Any], meta: Mapping[str, Any]) -> None:
        """Apply a loaded (tensor tree, JSON tree) pair to the model, optimizer and extras."""
        full = merge_trees(meta, tensors)
        if self.optimizer is not None:
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=full["model"],
                optim_state_dict=full.get("optim", {}),
                options=StateDictOptions(strict=True),
            )
        else:
            set_model_state_dict(self.model, full["model"], options=StateDictOptions(strict=True))
        for name, obj in self.extra.items():
            if name in full.get("extra", {}):
                obj.load_state_dict(full["extra"][name])


def state_digest(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> str:
    """SHA-256 of every model and optimizer tensor (full, unsharded values), by parameter name.

    Comparable across runs and world sizes: two digests are equal exactly when the weights and
    optimizer state are bit-identical.
    """
    tensors, _ = TrainingState(model, optimizer).capture()
    h = hashlib.sha256()
    for path, t in sorted(flatten_tensors(tensors), key=lambda p: p[0]):
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        data = full.detach().cpu().contiguous().reshape(-1)
        h.update(f"{path}|{data.dtype}|{tuple(full.shape)}|".encode())
        h.update(data.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
