"""Agreement rounds: how ranks fail together instead of waiting in a collective one of them skipped.

Every step of a multi-rank save or load is one call to :func:`agree`: each rank runs its part,
then all ranks exchange outcomes in exactly one collective, whatever happened locally. A failure
anywhere therefore becomes an error on every rank, naming the rank that failed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

from torch.distributed.checkpoint.api import CheckpointException

from .. import distributed as D
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)

__all__ = ["agree", "load_error", "save_error", "unwrap"]

T = TypeVar("T")


def unwrap(exc: BaseException) -> BaseException:
    """The real error inside DCP's CheckpointException (a BaseException wrapping each rank's failure)."""
    while isinstance(exc, CheckpointException) and exc.failures:
        inner = next(iter(exc.failures.values()))
        exc = inner[0] if isinstance(inner, tuple) else inner
    return exc


def save_error(rank: int, kind: str, msg: str, step: int | None) -> BaseException:
    """The error other ranks raise when ``rank`` failed during a save."""
    return CheckpointSaveError(f"step {step} failed on rank {rank}: {msg}")


def load_error(rank: int, kind: str, msg: str, step: int | None) -> BaseException:
    """The error other ranks raise when ``rank`` failed during a load (same class as the original)."""
    cls = {
        "CheckpointNotFoundError": CheckpointNotFoundError,
        "UnsafeCheckpointError": UnsafeCheckpointError,
        "CorruptCheckpointError": CorruptCheckpointError,
    }.get(kind, CheckpointError)
    return cls(f"on rank {rank}: {msg}")


def agree(
    fn: Callable[[], T],
    step: int | None,
    group: Any,
    make_error: Callable[[int, str, str, int | None], BaseException] = save_error,
) -> list[T]:
    """Run ``fn`` on every rank, then exchange outcomes; returns every rank's result, in rank order.

    In one process this is just ``[fn()]`` and an error keeps its type.
    """
    result: T | None = None
    error: BaseException | None = None
    try:
        result = fn()
    except (Exception, CheckpointException) as exc:
        error = exc
    if D.get_world_size(group) == 1:
        if error is not None:
            raise error
        return [cast(T, result)]
    failure = None if error is None else (type(unwrap(error)).__name__, str(unwrap(error)))
    outcomes = D.all_gather_object((failure, None if error is not None else result), group=group)
    if error is not None:
        raise error
    for r, (fail, _) in enumerate(outcomes):
        if fail is not None:
            raise make_error(r, fail[0], fail[1], step)
    return cast(list[T], [res for _, res in outcomes])
