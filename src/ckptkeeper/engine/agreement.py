"""Agreement rounds: how ranks fail together instead of waiting in a collective one of them skipped.

Every step of a multi-rank save or load is one call to :func:`agree`: each rank runs its part,
then all ranks exchange outcomes in exactly one collective, whatever happened locally. A failure
anywhere therefore becomes an error on every rank, naming the rank that failed. A rank that dies
or hangs cannot report anything: the exchange itself fails on the others, and they say which rank
stopped answering (see :func:`lost_rank_error`) rather than relaying the transport's complaint.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
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
from .async_runner import ctrl_c_held

__all__ = ["agree", "ctrl_c_after", "load_error", "lost_rank_error", "save_error", "unwrap"]

log = logging.getLogger("ckptkeeper.engine.agreement")

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


def lost_rank_error(exc: BaseException, step: int | None, group: Any, loading: bool = False) -> CheckpointError:
    """The error a rank raises when the exchange failed because another rank stopped answering.

    ``exc`` is the collective's own failure (kept as the cause). With two ranks the silent one is
    the other one; with more, the message says so when it cannot be told which.
    """
    lost, address = D.lost_peer(exc, group)
    who = f"rank {lost}" if lost is not None else f"another rank (not this rank {D.get_rank(group)})"
    if "timed out" in str(exc).lower():
        seen = "this rank timed out waiting for it"
    else:
        seen = f"this rank lost its connection to {address}" if address else "this rank lost its connection to it"
    what = "the load" if loading else "the save"
    logs = f"rank {lost}'s log" if lost is not None else "the other ranks' logs"
    problem = f"{who} stopped answering during {what} (it crashed, was killed or hangs; {seen})"
    if loading:
        return CheckpointError(f"{problem}; see {logs} for why, then restart the job")
    return CheckpointSaveError(
        f"step {step}: {problem}, so the checkpoint was not committed; see {logs} for why, then restart "
        "the job: it resumes from the last complete checkpoint"
    )


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
    except BaseException as exc:
        # A KeyboardInterrupt or SystemExit too: raised past the exchange, it left the other
        # ranks waiting in it (until the process group's timeout, or an abort when this rank
        # reached its next collective first). It is reported like any failure, then raised as
        # itself below.
        error = exc
    if D.get_world_size(group) == 1:
        if error is not None:
            raise error
        return [cast(T, result)]
    failure = None
    if error is not None:
        inner = unwrap(error)
        text = str(inner)
        if not isinstance(inner, Exception):  # SystemExit(3) says "3", a bare KeyboardInterrupt nothing
            text = f"{type(inner).__name__}({text})" if text else type(inner).__name__
        failure = (type(inner).__name__, text)
    outcomes: list[Any] = []
    try:
        outcomes = D.all_gather_object((failure, None if error is not None else result), group=group)
    except RuntimeError as exc:
        if not D.peer_lost(exc):
            raise
        if error is None or D.peer_lost(unwrap(error)):
            raise lost_rank_error(exc, step, group, loading=make_error is load_error) from exc
        # Otherwise this rank's own failure is the news, whatever became of the others: raised below.
    failed = [(r, fail) for r, (fail, _) in enumerate(outcomes) if fail is not None]
    if make_error is load_error and failed:
        # Every rank raises the same class when any rank found the checkpoint corrupt or unsafe
        # (the gravest failure, the first rank's among equals): callers that fall back to an
        # earlier checkpoint on those (restore) must all fall back, or the ranks part ways and
        # wait on each other forever (outside attacks: a rank that reported a mismatch, or that
        # had succeeded, raised another class than the ranks that found corruption).
        r, fail = max(failed, key=lambda f: (_GRAVITY.get(f[1][0], 0), -f[0]))
        own = -1 if error is None else _GRAVITY.get(type(unwrap(error)).__name__, 0)
        if _GRAVITY.get(fail[0], 0) > own:
            raise make_error(r, fail[0], fail[1], step) from error
    if error is not None:
        raise error
    if failed:
        r, fail = failed[0]
        raise make_error(r, fail[0], fail[1], step)
    return cast(list[T], [res for _, res in outcomes])


_GRAVITY = {"CorruptCheckpointError": 1, "UnsafeCheckpointError": 2}


@contextlib.contextmanager
def ctrl_c_after(what: str, group: Any) -> Iterator[list[int]]:
    """With several ranks, a first Ctrl-C inside the block is raised when the block ends; a
    second one at once (see :func:`~ckptkeeper.engine.async_runner.ctrl_c_held`).

    A multi-rank save or load is a fixed sequence of exchanges every rank must enter: a Ctrl-C
    raised on one rank while it waited in one left the exchange half done and the other ranks
    waiting in it until the process group's timeout, or aborting on a mismatched collective
    (found by an outside attack; a rank that finished its part first waits there most of the
    time). Held, the save or load ends the same way on every rank, then the interrupt is
    raised; a second Ctrl-C is for a rank that really hangs.
    """
    if D.get_world_size(group) == 1:
        yield []
        return

    def told() -> None:
        log.warning("Ctrl-C: %s finishes on every rank first, then stops; press Ctrl-C again to stop now", what)

    with ctrl_c_held(told) as caught:
        yield caught
