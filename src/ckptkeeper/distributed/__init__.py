"""Who does what across processes: rank, world size, broadcasts, barriers, filesystem-local rank.

The only module that talks to ``torch.distributed``. Every helper works in a single process with
no process group (rank 0 of 1), so the rest of the library never needs to ask.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

__all__ = [
    "all_agree",
    "all_gather_object",
    "backend_name",
    "backend_supports_cpu",
    "barrier",
    "broadcast_object",
    "gather_object",
    "get_fs_local_rank",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_from_env",
    "init_group",
    "is_distributed",
    "lost_peer",
    "new_cpu_group",
    "on_rank0",
    "peer_lost",
    "shutdown",
    "shutdown_abruptly",
]

T = TypeVar("T")

SHARED_FS_ENV = ("CKPTKEEPER_SHARED_FS", "OLMO_SHARED_FS")

# What gloo (and NCCL) say when a collective fails because another process vanished or went silent,
# as opposed to a failure of this process's own: lower-case fragments of their messages.
_PEER_LOST_MARKERS = (
    "connection reset",
    "connection closed",
    "closed by peer",
    "connection refused",
    "broken pipe",
    "socket closed",
    "timed out",
    "remote process exited",
)
# The peer's address in gloo's message, e.g. "Read error [127.0.0.1]:41659: Connection reset by peer".
_PEER_ADDRESS = re.compile(r"\[([0-9A-Fa-f.:]+)\]:(\d+)")


def is_distributed() -> bool:
    """Whether a default process group is up."""
    return dist.is_available() and dist.is_initialized()


def get_rank(group: Any = None) -> int:
    """Global rank (0 without a process group)."""
    return dist.get_rank(group) if is_distributed() else 0


def get_world_size(group: Any = None) -> int:
    """Number of processes (1 without a process group)."""
    return dist.get_world_size(group) if is_distributed() else 1


def get_local_rank() -> int:
    """Rank within this node, from torchrun's ``LOCAL_RANK`` (0 when unset)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_fs_local_rank() -> int:
    """Rank among the processes that share this process's filesystem.

    ``FS_LOCAL_RANK`` wins when set. Otherwise a shared filesystem (``CKPTKEEPER_SHARED_FS=1`` or
    ``OLMO_SHARED_FS=1``) makes it the global rank (one process in the whole job does the filesystem's
    bookkeeping), and node-local disks make it the node-local rank.
    """
    if "FS_LOCAL_RANK" in os.environ:
        return int(os.environ["FS_LOCAL_RANK"])
    if any(os.environ.get(name, "").lower() in ("1", "true", "yes") for name in SHARED_FS_ENV):
        return get_rank()
    return get_local_rank()


def backend_supports_cpu() -> bool:
    """Whether collectives can run on CPU tensors (always true without a process group)."""
    if not is_distributed():
        return True
    backend = str(dist.get_backend()).lower()
    return "gloo" in backend or "cpu" in backend


def barrier(group: Any = None) -> None:
    """Wait for every rank (a no-op in one process)."""
    if is_distributed():
        dist.barrier(group=group)


def broadcast_object(obj: T, src: int = 0, group: Any = None) -> T:
    """The ``obj`` of ``group``'s rank ``src`` on every rank of it (identity in one process).

    ``src`` is a rank within ``group``: torch wants a global one, which is not 0 for a group that
    leaves out global rank 0 (a checkpointer given a sub-group of a larger job).
    """
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src if group is None else dist.get_global_rank(group, src), group=group)
    return box[0]  # type: ignore[no-any-return]


def all_gather_object(obj: T, group: Any = None) -> list[T]:
    """Every rank's ``obj``, in rank order (``[obj]`` in one process)."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_object(obj: T, group: Any = None) -> list[T] | None:
    """Every rank's ``obj`` on the group's rank 0, in rank order (None on the others; ``[obj]`` alone)."""
    if not is_distributed():
        return [obj]
    rank = get_rank(group)
    out: list[Any] | None = [None] * get_world_size(group) if rank == 0 else None
    # dst is a global rank (group_dst only exists in newer torch).
    dist.gather_object(obj, out, dst=0 if group is None else dist.get_global_rank(group, 0), group=group)
    return out


def init_from_env() -> bool:
    """Join the process group that torchrun describes in the environment (gloo on CPU, NCCL on GPUs).

    Returns True when this call created the group; False when there is nothing to join (a single
    process) or a group is already up.
    """
    if is_distributed() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    import torch

    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT", "RANK") if not os.environ.get(name)]
    if missing:
        from ..errors import ConfigurationError

        raise ConfigurationError(
            f"WORLD_SIZE={os.environ.get('WORLD_SIZE')} asks for several processes but {', '.join(missing)} "
            "is not set; start the job with torchrun (which sets them), or unset WORLD_SIZE"
        )
    use_cuda = torch.cuda.is_available() and os.environ.get("CKPTKEEPER_BACKEND", "") != "gloo"
    if use_cuda:
        torch.cuda.set_device(get_local_rank())
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return True


def init_group(backend: str, alone: bool = False) -> None:
    """Create the default group with ``backend`` ("gloo", or "cpu:gloo,cuda:nccl"): from torchrun's
    environment, or with ``alone`` as a one-process group on an in-memory store (no port needed)."""
    if alone:
        from torch._C._distributed_c10d import HashStore

        dist.init_process_group(backend=backend, store=HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group(backend=backend)


def backend_name() -> str:
    """The default group's backend, as torch names it ("" without a group)."""
    return str(dist.get_backend()) if is_distributed() else ""


def shutdown() -> None:
    """Wait for every rank, then tear the default group down (a no-op without one)."""
    if is_distributed():
        dist.barrier()
        dist.destroy_process_group()


def on_rank0(fn: Callable[[], T], group: Any = None) -> T:
    """Run ``fn`` on rank 0 only; every rank returns its result, or raises its error.

    For the specification's "rank 0 lists and decides" steps: a failure on rank 0 must reach the
    other ranks, or they would wait for a broadcast that never comes.
    """
    if not is_distributed():
        return fn()
    payload: tuple[str, Any] | None = None
    if get_rank(group) == 0:
        try:
            payload = ("ok", fn())
        except Exception as exc:
            try:
                pickle.dumps(exc)
                payload = ("error", exc)
            except Exception:
                payload = ("error", RuntimeError(f"{type(exc).__name__} on rank 0: {exc}"))
    payload = broadcast_object(payload, group=group)
    assert payload is not None
    if payload[0] == "error":
        raise payload[1]
    return payload[1]  # type: ignore[no-any-return]


def all_agree(flag: bool, group: Any = None) -> bool:
    """True only when ``flag`` is true on every rank (``flag`` itself in one process)."""
    if not is_distributed():
        return flag
    return all(all_gather_object(bool(flag), group=group))


def peer_lost(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that failed because another rank died or stopped answering."""
    if not isinstance(exc, RuntimeError):  # gloo and NCCL raise DistBackendError, a RuntimeError
        return False
    text = str(exc).lower()
    return any(marker in text for marker in _PEER_LOST_MARKERS)


def lost_peer(exc: BaseException, group: Any = None) -> tuple[int | None, str | None]:
    """For a :func:`peer_lost` failure: the rank (in ``group``) that stopped answering, and its address.

    Either may be None when it cannot be told: the rank is known for certain only in a group of two
    (the other one); gloo's message usually names the address of the peer whose connection failed.
    """
    rank: int | None = None
    if is_distributed() and get_world_size(group) == 2:
        rank = 1 - get_rank(group)
    address = None
    match = _PEER_ADDRESS.search(str(exc))
    if match:
        host, port = match.groups()
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return rank, address


def shutdown_abruptly() -> None:
    """Tear the default group down without waiting for other ranks (after an error)."""
    if is_distributed():
        # The group may already be broken by the error being raised.
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def new_cpu_group(timeout_minutes: float = 30) -> Any:
    """A new gloo group for checkpoint traffic, so async saves never share a queue with training."""
    return dist.new_group(backend="gloo", timeout=timedelta(minutes=timeout_minutes))
