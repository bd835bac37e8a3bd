"""How fast a multi-rank load of many small tensors could be: ckptkeeper's load against a bare one.

A measuring tool for the per-tensor load target (10,000 tensors within 2x of the time for 10),
not a loader. The bare load reads a checkpoint that ckptkeeper saved from an FSDP2 model and its
AdamW (the benchmark's state, see ``ckptkeeper.cli.bench_ranks.build_state``) at the world size
it was saved at, doing only the work no load can skip: read the record, the trainer state, this
rank's segment table and the shared index; make the optimizer's new slots (DTensors like their
parameters); back up the model's shards in one copy; read every piece with one scatter read per
run of neighbours, with the rank's own data file read ahead; check every head, data and tail
checksum; hand the optimizer its new state. It leaves out what makes ckptkeeper's load general
and safe (strict fit checks naming each key, other world sizes and layouts, validation of every
table entry, putting the backup back on failure, the ranks' agreement rounds), so it is a floor:
what is between the two times is what a leaner load could win. Both must leave the state
bit-identical to what was saved (checked before timing).

    torchrun --nproc-per-node 2 benchmarks/load_floor.py [--model-mib 86] [--tensors 10 2500] [--repeats 5]

Rank 0 prints one JSON object: per parameter count, the medians (slowest rank) of both loads'
wall and CPU time, cold (the checkpoint's pages dropped before each load), interleaved.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ckptkeeper import state_digest
from ckptkeeper.cli.bench_ranks import build_state
from ckptkeeper.cli.bench_run import _evict
from ckptkeeper.engine import Checkpointer, TrainingState, discovery
from ckptkeeper.engine.fastio import (
    _DTYPE_NAMES,
    _borrowed_view,
    _open_data_file,
    check_segments,
    preadv_full,
    skeleton_layout,
)
from ckptkeeper.engine.gcpause import paused_gc
from ckptkeeper.engine.loader import read_train_state
from ckptkeeper.engine.loading import _ReadAhead
from ckptkeeper.engine.sharded import shard_name
from ckptkeeper.engine.state import _canonical_fqn, _names_of, _param_fqns
from ckptkeeper.storage.layout import MODEL_DIR

_IOV = 900  # buffers per scatter read (three per piece), under the kernel's IOV_MAX


class _Sum:
    """What check_segments reads of a segment: its checksum."""

    __slots__ = ("xxh3_64",)

    def __init__(self, digest: str) -> None:
        self.xxh3_64 = digest


def _kinds(entries: list[list[Any]]) -> list[tuple[torch.dtype, int, int, int, str, str]]:
    # (dtype, head bytes, data bytes, tail bytes, head sum, tail sum) of each kind of piece.
    out = []
    for entry in entries:
        dtype = _DTYPE_NAMES[entry[0]]
        sizes = tuple(entry[-1])
        head, tail, head_sum, tail_sum = skeleton_layout(sizes, dtype)
        out.append((dtype, head, math.prod(sizes) * dtype.itemsize, tail, head_sum, tail_sum))
    return out


def bare_load(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> None:
    """Load ``path`` (saved by ckptkeeper at this world size) into ``model`` and ``optimizer``, barely."""
    ahead = _ReadAhead.start(os.path.join(path, MODEL_DIR, shard_name(rank)), 1 << 30)
    try:
        record = (
            discovery.verify(path, checksums=False, structure=False) if rank == 0 else discovery.read_any_record(path)
        )
        read_train_state(path, rank, record, path)
        found = discovery.read_table_doc(path, record, shard_name(rank), path)
        assert found is not None
        table, index = found[1], discovery.read_index_doc(path, record, path)
        where: dict[str, tuple[str, int, tuple[Any, ...], str]] = {}
        kinds, pos = _kinds(table["kinds"]), 0
        for fqn, k, digest in zip(table["names"], table["kind"], table["sums"], strict=True):
            where[fqn] = (shard_name(rank), pos, kinds[k], digest)
            pos += kinds[k][1] + kinds[k][2] + kinds[k][3]
        whole = index["whole"]
        kinds = _kinds(whole["kinds"])
        for fqn, k, r, start, digest in zip(
            whole["names"], whole["kind"], whole["rank"], whole["start"], whole["sums"], strict=True
        ):
            where.setdefault(fqn, (shard_name(r), start, kinds[k], digest))

        dests: list[tuple[str, torch.Tensor]] = []
        names = _names_of(model)
        shards = []
        for key, p in model.state_dict(keep_vars=True).items():
            shard = p._local_tensor if isinstance(p, DTensor) else p.detach()
            dests.append(("model." + _canonical_fqn(model, key, names), shard))
            shards.append(shard)
        fqn_of = _param_fqns(model)
        state: dict[Any, dict[str, Any]] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                local, spec = p._local_tensor, p._spec
                slots = {"exp_avg": torch.empty_like(local), "exp_avg_sq": torch.empty_like(local)}
                step = torch.empty((), dtype=torch.float32)
                state[p] = {
                    "step": step,
                    **{k: DTensor.__new__(DTensor, t, spec, requires_grad=False) for k, t in slots.items()},
                }
                prefix = f"optim.state.{fqn_of[id(p)]}."
                dests += [(prefix + "step", step), *((prefix + k, t) for k, t in slots.items())]
        reads = []
        for fqn, dest in dests:
            file, at, kind, digest = where[fqn]
            if kind[0] != dest.dtype or kind[2] != dest.nbytes:
                raise ValueError(f"{fqn} does not fit")
            reads.append((file, at, fqn, kind, digest, dest))
        reads.sort(key=lambda r: (r[0], r[1]))

        backup = torch._C._nn.flatten_dense_tensors(shards)
        fds = {file: _open_data_file(os.path.join(path, MODEL_DIR, file)) for file in {r[0] for r in reads}}
        try:
            run: list[Any] = []
            bufs: list[memoryview] = []
            sums: list[tuple[str, dict[str, _Sum]]] = []
            end = -1
            for file, at, fqn, kind, digest, dest in [*reads, (None, -1, "", None, "", None)]:
                if run and (file != run[0][0] or at != end or len(bufs) >= _IOV):
                    preadv_full(fds[run[0][0]], list(bufs), run[0][1], run[0][0])
                    check_segments(run[0][0], sums, bufs)
                    run, bufs, sums = [], [], []
                if file is None:
                    break
                if not run:
                    run.append((file, at))
                bufs += (memoryview(bytearray(kind[1])), _borrowed_view(dest), memoryview(bytearray(kind[3])))
                sums.append((fqn, {"head": _Sum(kind[4]), "data": _Sum(digest), "tail": _Sum(kind[5])}))
                end = at + kind[1] + kind[2] + kind[3]
        finally:
            for fd in fds.values():
                os.close(fd)
        optimizer.__setstate__({"state": state, "param_groups": optimizer.param_groups})
        del backup
    finally:
        if ahead is not None:
            ahead.stop()


def _timed(fn: Any) -> tuple[float, float]:
    c0, t0 = time.process_time(), time.perf_counter()
    with paused_gc():
        fn()
    return time.perf_counter() - t0, time.process_time() - c0


def _measure(root: str, model_mib: int, params: int, repeats: int) -> dict[str, Any]:
    rank = dist.get_rank()
    model, optimizer, _ = build_state(model_mib, params)
    state = TrainingState(model, optimizer)
    ours = Checkpointer()
    path = ours.save(os.path.join(root, f"p{params}"), 1, state).path
    saved = state_digest(model, optimizer)
    exact = {}
    for name, load in (
        ("ours", lambda: ours.load(path, state)),
        ("bare", lambda: bare_load(path, model, optimizer, rank)),
    ):
        # Everything the load must fill is changed first: parameters and optimizer state alike.
        with torch.no_grad():
            for p in model.parameters():
                p._local_tensor.fill_(0.5)  # type: ignore[attr-defined]
            for slots in optimizer.state.values():
                for t in slots.values():
                    (t._local_tensor if isinstance(t, DTensor) else t).fill_(0.5)
        load()
        exact[name] = state_digest(model, optimizer) == saved
    times: dict[str, list[tuple[float, float]]] = {"ours": [], "bare": []}
    for rep in range(repeats):
        order = ["ours", "bare"] if rep % 2 == 0 else ["bare", "ours"]
        for name in order:
            if rank == 0:
                _evict(path)
            dist.barrier()
            fn = (
                (lambda: ours.load(path, state))
                if name == "ours"
                else (lambda: bare_load(path, model, optimizer, rank))
            )
            times[name].append(_timed(fn))
            dist.barrier()
    ours.close()
    slowest = [None] * dist.get_world_size()
    dist.all_gather_object(slowest, times)
    out: dict[str, Any] = {"exact": exact}
    for name in times:
        walls = [max(t[name][i][0] for t in slowest) for i in range(repeats)]  # type: ignore[index]
        cpus = [max(t[name][i][1] for t in slowest) for i in range(repeats)]  # type: ignore[index]
        out[name] = {"wall_s": round(statistics.median(walls), 4), "cpu_s": round(statistics.median(cpus), 4)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-mib", type=int, default=86)
    parser.add_argument(
        "--tensors", type=int, nargs="+", default=[10, 2500], help="parameter counts (about 4 checkpoint tensors each)"
    )
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    root = tempfile.mkdtemp(prefix="ckptkeeper-floor-") if dist.get_rank() == 0 else ""
    box = [root]
    dist.broadcast_object_list(box)
    root = box[0]
    try:
        report = {str(n): _measure(root, args.model_mib, n, args.repeats) for n in args.tensors}
        if dist.get_rank() == 0:
            print(json.dumps({"world_size": dist.get_world_size(), "model_mib": args.model_mib, "params": report}))
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # As `ckptkeeper bench` and `train` do: interpreter teardown after a finished gloo run sometimes
    # aborts in a gloo thread ("terminate called without an active exception", seen once in the
    # suite under load), turning a good run into a failed one; everything is printed, so leave now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
