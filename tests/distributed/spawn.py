"""Run a function on N real processes joined in a gloo group, with a hard deadline (never a hang).

The ranks are forked from a forkserver that has imported torch and ckptkeeper once: a spawned
rank spent about 4 s of this 2-core machine importing them, for every rank of every test. Each
rank still starts from a process that has only imported modules (no state, no process group,
no threads of ours), and gets the caller's environment as it is at the call, as a spawned one
did (the forkserver's own environment dates from its start).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from ..servers import free_port

# Imported once by the forkserver, before its first fork (set before it starts; a no-op after).
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "ckptkeeper",
    "tests.distributed.workers",
]


def _entry(
    rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...], out: str, env: dict[str, str]
) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    per_rank = env.get(f"RANK{rank}_ENV")
    if per_rank:
        os.environ.update(json.loads(per_rank))
    import warnings

    import torch.distributed as dist

    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    try:
        result: dict[str, Any] = {"ok": True, "value": fn(rank, *args)}
    except BaseException as exc:
        result = {"ok": False, "type": type(exc).__name__, "error": str(exc), "tb": traceback.format_exc()}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        pass


def run_ranks(
    world: int,
    fn: Callable[..., Any],
    *args: Any,
    out: Path,
    env: dict[str, str] | None = None,
    per_rank_env: dict[int, dict[str, str]] | None = None,
    timeout: float = 180,
    expect_dead: frozenset[int] = frozenset(),
) -> list[dict[str, Any]]:
    """Run ``fn(rank, *args)`` on ``world`` spawned processes; returns each rank's outcome.

    Ranks in ``expect_dead`` are allowed to vanish without a result (their outcome reads ``dead``).
    """
    out.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **(env or {})}
    for r, e in (per_rank_env or {}).items():
        full_env[f"RANK{r}_ENV"] = json.dumps(e)
    multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    ctx = mp.start_processes(
        _entry,
        args=(world, free_port(), fn, args, str(out), full_env),
        nprocs=world,
        join=False,
        start_method="forkserver",
    )
    import time

    deadline = time.monotonic() + timeout
    try:
        while any(p.is_alive() for p in ctx.processes):
            if time.monotonic() > deadline:
                raise AssertionError(f"ranks still running after {timeout}s: a hang")
            time.sleep(0.2)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    outcomes = []
    for r in range(world):
        result = out / f"rank{r}.json"
        if not result.exists():
            code = ctx.processes[r].exitcode
            assert r in expect_dead, f"rank {r} died (exit code {code}) without reporting"
            outcomes.append({"ok": False, "type": "dead", "exitcode": code})
            continue
        outcomes.append(json.loads(result.read_text()))
    return outcomes
