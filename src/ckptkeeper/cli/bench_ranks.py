"""``ckptkeeper bench`` across ranks: ckptkeeper beside DCP on an FSDP2-sharded model and optimizer.

Run by torchrun (``torchrun --standalone --nproc-per-node N -m ckptkeeper bench``), or in one
process (a one-rank group) when --tensors, --compare-tensors or --store is given. Every rank builds the same model of
about M MiB of ``Linear`` layers in up to 100 blocks, shards each block and then the root with
``fully_shard``, and
takes one AdamW step so that the optimizer state (2x the model) exists. Then, interleaved per repeat
(the order alternates), on that same state:

- ckptkeeper: ``Checkpointer.save``, a cold ``Checkpointer.load`` and ``Checkpointer.save_async`` of
  ``TrainingState(model, optimizer)``, as a training script calls them;
- DCP: ``dcp.save``, a cold ``dcp.load`` and ``dcp.async_save`` of ``get_state_dict(model, optimizer)``
  with the default process group (the load also applies the state with ``set_state_dict``, as
  ckptkeeper's load does; the async save gets a gloo group of its own, as ckptkeeper's does).

Each timed region starts and ends with a barrier, so every rank measures the same span. Rank 0
prints the report: per measurement, the median over the repeats of the slowest rank's time (the
slowest rank is what the job waits for). With --store ckptkeeper saves to and loads from an object
store instead of --dir, and each rank's bytes fetched per load are compared with its share of the
checkpoint; DCP, whose writer needs a filesystem, is left out then.

With --compare-tensors F the per-tensor cost is measured too, before those repeats: ckptkeeper
alone saves and cold-loads the main state and a second state of the same bytes in about F
tensors, in turn (which goes first alternates; one unrecorded round first), and ``save_vs_few_tensors`` /
``load_vs_few_tensors`` are the time ratios per byte (main / F tensors). Each such save follows a
load (new optimizer tensors); ``save_again_vs_few_tensors`` times a second save of the same
tensors right after it, as every periodic save of a run after its first (it reuses the plan). Not in the rounds
beside DCP, and not from two separate runs: on a VM whose balloon driver reports free memory to
the host, the first write into page cache after a long DCP round (tens of seconds at 10,000
tensors, one at 10) faults that memory in on the host again, up to 4x slower
(``benchmarks/page_cost.py``); in separate runs only the many-tensor run paid that, and in
the rounds whichever state came first after DCP's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, cast

import torch
from torch import nn

from .. import distributed as D
from ..engine import Checkpointer, TrainingState
from ..engine.state import flatten_tensors
from ..errors import ConfigurationError
from ..storage import storage_for
from .bench import DEFAULT_TENSORS
from .bench_run import _evict

__all__ = ["build_state", "run"]

DCP_SKIPPED = "skipped: --store names an object store, and DCP's own writer saves to filesystem folders only"


# ---------------------------------------------------------------- process group


def _join_group(device: str) -> bool:
    """Join torchrun's process group, or make a one-rank group; True when this call made one."""
    if D.is_distributed():
        return False
    # gloo for CPU state; NCCL for CUDA tensors with gloo beside it for the CPU collectives both
    # checkpointers run. (D.init_from_env picks NCCL whenever a GPU exists, even for --device cpu.)
    backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ConfigurationError(f"WORLD_SIZE must be a whole number, got {os.environ['WORLD_SIZE']!r}") from None
    if device == "cuda":
        torch.cuda.set_device(D.get_local_rank())
    if all(os.environ.get(name) for name in ("RANK", "MASTER_ADDR", "MASTER_PORT")):
        D.init_group(backend)  # torchrun's rendezvous (also with one process)
    elif world > 1:
        raise ConfigurationError(
            f"WORLD_SIZE={world} asks for several processes but RANK, MASTER_ADDR or MASTER_PORT is not set; "
            "start the benchmark with torchrun (which sets them), or unset WORLD_SIZE"
        )
    else:
        # One process without torchrun: FSDP2 and DCP still want a group.
        D.init_group(backend, alone=True)
    return True


# ---------------------------------------------------------------- the state


def _layout(model_mib: int, tensors: int, world: int) -> tuple[int, int]:
    """(layers, width): ``Linear(width, width)`` layers, a weight and a bias each, of about ``model_mib`` in all."""
    layers = max(1, tensors // 2)
    width = math.sqrt((model_mib << 20) / 4 / layers)
    # A multiple of the world size, as real models' widths are: every rank holds an equal shard of dim 0.
    return layers, max(world, round(width / world) * world)


def _model_bytes(model_mib: int, tensors: int, world: int) -> int:
    """The bytes of the model :func:`build_state` makes (float32 weights and biases)."""
    layers, width = _layout(model_mib, tensors, world)
    return layers * (width * width + width) * 4


def _check_size(model_mib: int, tensors: int, world: int) -> None:
    """ConfigurationError unless ``tensors`` tensors can hold about ``model_mib`` MiB (within 10%):
    layers of whole columns cannot split a small model very finely (1 MiB in 10**9 tensors
    would be built as 5 * 10**8 layers of the narrowest width, and never finish building)."""
    built, asked = _model_bytes(model_mib, tensors, world), model_mib << 20
    if abs(built - asked) > 0.1 * asked:
        raise ConfigurationError(
            f"--model-mib {model_mib} in {tensors} tensors gives a model of {built / 2**20:.2f} MiB (layers of whole "
            "columns cannot split so few bytes so finely): raise --model-mib or use fewer tensors"
        )


def _check_comparison(model_mib: int, tensors: int, few: int, world: int) -> None:
    """ConfigurationError unless --compare-tensors ``few`` makes a fair comparison state: fewer
    tensors than the main state's, of about the same bytes (very many tensors of a small model
    round to layers too narrow to keep the size)."""
    # Compared as built: layers of a weight and a bias each (3 and 2 tensors both make one layer).
    if _layout(model_mib, few, world)[0] >= _layout(model_mib, tensors, world)[0]:
        raise ConfigurationError(
            f"--compare-tensors {few} is not fewer tensors than the state's {tensors} (--tensors; both are built as "
            "layers of a weight and a bias); it is the few-tensor side of the comparison: give fewer "
            "(e.g. --compare-tensors 10)"
        )
    sizes = {n: _model_bytes(model_mib, n, world) for n in (tensors, few)}
    if abs(sizes[few] - sizes[tensors]) > 0.1 * sizes[tensors]:
        raise ConfigurationError(
            f"--model-mib {model_mib} in {tensors} and in {few} tensors gives models of {sizes[tensors] / 2**20:.2f} "
            f"and {sizes[few] / 2**20:.2f} MiB (layers of whole columns cannot split so few bytes so finely): raise "
            "--model-mib or use fewer tensors"
        )


def build_state(
    model_mib: int, tensors: int, device: str = "cpu"
) -> tuple[nn.Module, torch.optim.Optimizer, dict[str, int]]:
    """An FSDP2-sharded model of about ``model_mib`` MiB in about ``tensors`` tensors, and its AdamW after one step.

    Needs the default process group (every rank calls it, with the same arguments). Returns the
    model, the optimizer and a description (``tensors``, ``layers``, ``width``, ``model_bytes``).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = D.get_world_size()
    layers, width = _layout(model_mib, tensors, world)
    mesh = init_device_mesh(device, (world,))
    # The model is made on the meta device and each rank then fills in its own shards only, as large
    # FSDP2 jobs do: no rank ever holds the whole model (N ranks x M MiB would be the peak otherwise).
    # --tensors splits the same bytes into more, smaller Linear layers. They are grouped into at
    # most 100 blocks, each sharded on its own and then the root, as FSDP2 jobs wrap transformer
    # blocks (the saved state is the same as with one fully_shard of the whole model: every
    # parameter a DTensor sharded on dim 0). A flat Sequential of thousands of layers made
    # torch's load_state_dict quadratic (each child filters every key) and building the model
    # and taking its first step with a unit per layer took minutes with gloo, for both sides.
    per_block = max(1, math.ceil(layers / 100))
    with torch.device("meta"):
        model = nn.Sequential(
            *(
                nn.Sequential(*(nn.Linear(width, width) for _ in range(min(per_block, layers - i))))
                for i in range(0, layers, per_block)
            )
        )
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(D.get_rank())
    with torch.no_grad():
        for p in model.parameters():
            local = cast(torch.Tensor, p.to_local() if hasattr(p, "to_local") else p)
            local.uniform_(-1 / math.sqrt(width), 1 / math.sqrt(width), generator=g)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # One real step (forward, backward, update), so that exp_avg and exp_avg_sq exist for every parameter.
    model(torch.randn(2, width, device=device)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    count = sum(1 for _ in model.parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # DTensor numel() is global
    return model, optimizer, {"tensors": count, "layers": layers, "width": width, "model_bytes": model_bytes}


def _global_bytes(state: TrainingState) -> tuple[int, int]:
    """(bytes, tensors) of everything a checkpoint of ``state`` holds (DTensors counted whole, once)."""
    tensors, _ = state.capture()
    leaves = [t for _, t in flatten_tensors(tensors)]
    return sum(t.numel() * t.element_size() for t in leaves), len(leaves)


# ---------------------------------------------------------------- measuring


class _Times:
    """Each rank's times per measurement, one per repeat; every region is fenced by barriers."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}

    def add(self, name: str, seconds: float) -> None:
        self.times.setdefault(name, []).append(seconds)

    def region(self, name: str | None, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on every rank between two barriers; records this rank's time under ``name``
        (a warm-up when None: not recorded); returns its result."""
        _quiet_disk()
        D.barrier()
        t0 = time.perf_counter()
        out = fn()
        if name is not None:
            self.add(name, time.perf_counter() - t0)
        D.barrier()
        return out

    def async_region(self, prefix: str, start: Callable[[], Future[Any]]) -> None:
        """Time ``start()`` (the caller's blocked time) and until its future is done (``_durable_s``)."""
        _quiet_disk()
        D.barrier()
        t0 = time.perf_counter()
        fut = start()
        self.add(f"{prefix}_blocked_s", time.perf_counter() - t0)
        fut.result()
        self.add(f"{prefix}_durable_s", time.perf_counter() - t0)
        D.barrier()


def _quiet_disk() -> None:
    """Write back every dirty page (once per node) before a timed region starts.

    Without it a measurement paid for the writeback its predecessor left behind (a sync save
    right after DCP's async one waited on DCP's bytes in its fsync: 0.18 s one round, 0.49 s the
    next); both checkpointers get the same quiet disk.
    """
    if D.get_local_rank() == 0 and hasattr(os, "sync"):
        os.sync()


_SETTLE_S = 1.0
"""Seconds between a save and the same tensors' next save in the per-tensor rounds."""


def _cold(folder: str) -> None:
    """Evict a checkpoint's files from the page cache (once per node), then let every rank go on."""
    if D.get_local_rank() == 0:
        _evict(folder)
    D.barrier()


def _gone(path: str, store: bool) -> None:
    """Remove a checkpoint once every rank is done with it (rank 0 removes, the others wait)."""
    D.barrier()
    if D.get_rank() == 0:
        if store:
            storage_for(path).remove_tree(path)
        else:
            shutil.rmtree(path)
    D.barrier()


def _measure(args: argparse.Namespace, root: str, base: str) -> dict[str, Any]:
    """Every measurement, on every rank; returns rank 0's report (other ranks: an empty dict)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    store = args.store is not None
    tensors = DEFAULT_TENSORS if args.tensors is None else args.tensors
    _check_size(args.model_mib, tensors, D.get_world_size())
    if args.compare_tensors is not None:
        _check_comparison(args.model_mib, tensors, args.compare_tensors, D.get_world_size())
    model, optimizer, shape = build_state(args.model_mib, tensors, args.device)
    state = TrainingState(model, optimizer)
    state_bytes, shape["checkpoint_tensors"] = _global_bytes(state)
    few: TrainingState | None = None
    if args.compare_tensors is not None:
        few_model, few_optimizer, few_shape = build_state(args.model_mib, args.compare_tensors, args.device)
        few = TrainingState(few_model, few_optimizer)
        shape["compare_tensors"] = few_shape["tensors"]
        shape["compare_state_bytes"], shape["compare_checkpoint_tensors"] = _global_bytes(few)
    # Object-store spools (uploads and downloads) go under the benchmark's own folder, so that
    # nothing is left behind in the system temp folder.
    ours = Checkpointer(spool_dir=root)
    # The comparison state has a checkpointer of its own, warmed up the same way (an async save
    # first), so that each state's loads back up into its own staging buffers, as in a training job.
    ours_few = Checkpointer(spool_dir=root) if few is not None else None
    # DCP's async save gets a gloo group of its own, as ckptkeeper's does (Checkpointer.save_async
    # makes one), so that its background collectives never share a queue with the caller's.
    dcp_group = D.new_cpu_group()
    storage = storage_for(base)
    times = _Times()
    fetched: list[int] = []
    checkpoint_bytes = 0

    def dcp_state() -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def dcp_load_and_apply(folder: str) -> None:
        sd = dcp_state()
        dcp_load(sd, checkpoint_id=folder)
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    def save_and_load(name: str, ck: Checkpointer, st: TrainingState, rep: int) -> None:
        warm_up = rep < 0
        folder = storage.join(base, f"{name}-{rep}")
        # The first save follows a load (new optimizer tensors): its plan is made anew.
        times.region(None if warm_up else f"{name}_save_s", lambda: ck.save(folder, 1, st))
        _gone(folder, store)
        # The same tensors saved again, as every periodic save of a run after its first: it
        # reuses the plan (save_memo). A run's next save comes after some training: right after
        # this one's fsync this VM's disk was still absorbing it (the 10-tensor save took 0.29 s
        # instead of 0.15), and with the first checkpoint kept its page cache had to be fresh
        # memory, which the host faults in again (benchmarks/page_cost.py): the first is removed,
        # as the previous round's was before the first save.
        time.sleep(_SETTLE_S)
        folder = storage.join(base, f"{name}-{rep}-again")
        res = times.region(None if warm_up else f"{name}_save_again_s", lambda: ck.save(folder, 2, st))
        if not store:
            _cold(folder)
        times.region(None if warm_up else f"{name}_load_cold_s", lambda: ck.load(res.path, st))
        _gone(folder, store)

    def dcp_round(rep: int) -> None:
        d = os.path.join(root, f"dcp-{rep}")
        times.region("dcp_save_s", lambda: dcp_save(dcp_state(), checkpoint_id=d))
        _cold(d)
        times.region("dcp_load_cold_s", lambda: dcp_load_and_apply(d))
        _gone(d, store=False)
        times.async_region(
            "dcp_async",
            lambda: cast(Future[Any], dcp_async_save(dcp_state(), checkpoint_id=d, process_group=dcp_group)),
        )
        _gone(d, store=False)

    def ours_round(rep: int) -> None:
        nonlocal checkpoint_bytes
        folder = storage.join(base, f"ours-{rep}")
        res = times.region("ours_save_s", lambda: ours.save(folder, 1, state))
        if not checkpoint_bytes:
            # What a rank would fetch if it read the whole checkpoint: its files, as listed.
            listed = D.on_rank0(lambda: sum(f.size for f in storage.walk(res.path)))
            checkpoint_bytes = int(listed)
        if not store:
            _cold(folder)
        before = storage.bytes_fetched
        times.region("ours_load_cold_s", lambda: ours.load(res.path, state))
        fetched.append(storage.bytes_fetched - before)
        _gone(folder, store)
        folder = storage.join(base, f"ours-{rep}-async")
        times.async_region("ours_async", lambda: ours.save_async(folder, 2, state)[1])
        _gone(folder, store)

    try:
        # Warm-up: the first async save of a layout allocates staging buffers (both checkpointers),
        # reported apart and left out of the repeats.
        warm = storage.join(base, "warm")
        times.async_region("ours_async_first", lambda: ours.save_async(warm, 0, state)[1])
        _gone(warm, store)
        if few is not None and ours_few is not None:
            warm = storage.join(base, "warm-few")
            times.async_region("few_async_first", lambda: ours_few.save_async(warm, 0, few)[1])
            _gone(warm, store)
            # One round more than measured, first: the first writes after building the states (and
            # the first loads) ran 2x slower for both, which hid the per-tensor cost.
            for rep in range(-1, args.repeats):
                pair = [("many", ours, state), ("few", ours_few, few)]
                for name, ck, st in pair if rep % 2 == 0 else pair[::-1]:
                    save_and_load(name, ck, st, rep)
        if not store:
            warm = os.path.join(root, "dcp-warm")
            times.async_region(
                "dcp_async_first",
                lambda: cast(Future[Any], dcp_async_save(dcp_state(), checkpoint_id=warm, process_group=dcp_group)),
            )
            _gone(warm, store=False)
        for rep in range(args.repeats):
            # Interleaved, in alternating order, so that neither always runs first (disk regimes drift).
            rounds = [ours_round] if store else [dcp_round, ours_round]
            for one in rounds if rep % 2 == 0 else rounds[::-1]:
                one(rep)
    finally:
        ours.close()
        if ours_few is not None:
            ours_few.close()
    D.barrier()  # every rank is done with the files before rank 0 removes the folders

    gathered = D.all_gather_object((times.times, fetched))
    if D.get_rank() != 0:
        return {}
    return _report(args, shape, state_bytes, checkpoint_bytes, gathered)


def _report(
    args: argparse.Namespace,
    shape: dict[str, int],
    state_bytes: int,
    checkpoint_bytes: int,
    gathered: list[tuple[dict[str, list[float]], list[int]]],
) -> dict[str, Any]:
    """Rank 0's report from every rank's times: per repeat the slowest rank, then the median."""
    world = len(gathered)
    med = {
        name: statistics.median(max(rank_times[name][i] for rank_times, _ in gathered) for i in range(len(values)))
        for name, values in gathered[0][0].items()
    }
    few_bytes = shape.get("compare_state_bytes", state_bytes)  # about the same (widths are rounded)
    gbps = {
        k[:-2]: (few_bytes if k.startswith("few_") else state_bytes) / med[k] / 1e9 for k in med if "blocked" not in k
    }
    store = args.store is not None
    ratios: dict[str, float | None] = {
        # Throughput ratios (DCP's time / ours: > 1 means ckptkeeper is faster) and a time ratio
        # (ours / DCP: < 1 means ckptkeeper blocks the caller less). None when DCP was not run.
        "save_vs_dcp": None if store else med["dcp_save_s"] / med["ours_save_s"],
        "load_vs_dcp": None if store else med["dcp_load_cold_s"] / med["ours_load_cold_s"],
        "async_blocked_vs_dcp": None if store else med["ours_async_blocked_s"] / med["dcp_async_blocked_s"],
    }
    report: dict[str, Any] = {
        "world_size": world,
        "backend": D.backend_name(),
        "device": args.device,
        "repeats": args.repeats,
        **shape,
        "state_bytes": state_bytes,
        "checkpoint_bytes": checkpoint_bytes,
        "medians_s": med,
        "throughput_gb_s": gbps,
        "ratios": ratios,
    }
    if "few_save_s" in med:
        # Time ratios per byte (the main state's / the comparison state's, whose byte counts differ
        # a little): the per-tensor cost, 1 when tensors cost nothing beyond their bytes.
        per_byte = few_bytes / state_bytes
        ratios["save_vs_few_tensors"] = med["many_save_s"] / med["few_save_s"] * per_byte
        ratios["load_vs_few_tensors"] = med["many_load_cold_s"] / med["few_load_cold_s"] * per_byte
        ratios["save_again_vs_few_tensors"] = med["many_save_again_s"] / med["few_save_again_s"] * per_byte
    if store:
        share = checkpoint_bytes / world
        # Per rank, the most any of its loads fetched, against its share of the checkpoint.
        per_rank = [max(rank_fetched) / share for _, rank_fetched in gathered]
        ratios["fetched_vs_share"] = max(per_rank)
        report["fetched_vs_share_per_rank"] = per_rank
        report["store"] = args.store
        report["dcp"] = DCP_SKIPPED
    return report


def _print(report: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(report, indent=1))
        return
    print(
        f"state: {report['state_bytes'] / 1e9:.2f} GB ({report['model_bytes'] / 2**20:.0f} MiB model in "
        f"{report['tensors']} tensors + 2x AdamW state; {report['checkpoint_tensors']} tensors in all), "
        f"FSDP2 over {report['world_size']} ranks "
        f"({report['backend']}), {report['repeats']} repeats; times are the slowest rank's"
    )
    if "compare_tensors" in report:
        print(
            f"compared with the same bytes in {report['compare_tensors']} tensors "
            f"({report['compare_checkpoint_tensors']} in all), ckptkeeper alone: many_* and few_* below"
        )
    if "dcp" in report:
        print(f"DCP: {report['dcp']}")
    print(f"{'measurement':<30}{'median s':>10}{'GB/s':>8}")
    for k, v in report["medians_s"].items():
        rate = report["throughput_gb_s"].get(k[:-2])
        print(f"{k:<30}{v:>10.3f}{'' if rate is None else f'{rate:>8.2f}'}")
    if "fetched_vs_share_per_rank" in report:
        print(
            "bytes fetched per load / rank's share:", " ".join(f"{r:.2f}" for r in report["fetched_vs_share_per_rank"])
        )
    print("ratios:")
    for k, v in report["ratios"].items():
        print(f"  {k:<26}{'-' if v is None else f'{v:.2f}':>7}")


# ---------------------------------------------------------------- the command


def _bench(args: argparse.Namespace) -> dict[str, Any]:
    """Make the folders, measure, remove everything written; rank 0's report (others: empty)."""
    rank0 = D.get_rank() == 0
    root = D.broadcast_object(tempfile.mkdtemp(prefix="ckptkeeper-bench-", dir=args.dir) if rank0 else "")
    base = root
    if args.store is not None:
        # A prefix of its own under the URL: the end removes exactly what this run wrote.
        base = D.broadcast_object(f"{args.store.rstrip('/')}/ckptkeeper-bench-{uuid.uuid4().hex[:12]}")
    try:
        return _measure(args, root, base)
    finally:
        if rank0:
            shutil.rmtree(root, ignore_errors=True)
            if args.store is not None:
                with contextlib.suppress(Exception):  # after a failure, the failure is the news
                    storage_for(base).remove_tree(base)


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def run(args: argparse.Namespace) -> int:
    """Run the sharded ``ckptkeeper bench`` on this rank; returns the exit code (0 on every rank, or an error)."""
    warnings.filterwarnings("ignore")
    logging.getLogger("ckptkeeper").setLevel(logging.WARNING)
    if args.device == "cuda" and not torch.cuda.is_available():
        if os.environ.get("RANK", "0") == "0":
            print("skipped: --device cuda needs a CUDA device, and torch sees none here")
        return 0
    previous: Any = None
    if threading.current_thread() is threading.main_thread():
        # torchrun stops the other ranks with SIGTERM when one fails: exit through the finally
        # clauses, which remove the temporary folder and what was written to --store.
        previous = signal.signal(signal.SIGTERM, _terminated)
    started = False
    ok = False
    try:
        started = _join_group(args.device)
        report = _bench(args)
        if report:
            _print(report, args.json)
            sys.stdout.flush()
        ok = True
    finally:
        if started:
            if ok:
                D.shutdown()  # a barrier first: no rank leaves while another still needs the group
            else:
                # Leave at once: the ranks still waiting on this one see its connections close and
                # fail too (torchrun also stops them), instead of waiting for a collective's timeout.
                D.shutdown_abruptly()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if started and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # As in ``ckptkeeper train``: interpreter teardown after a finished gloo run sometimes aborts
        # in a gloo thread, turning a good run into a failed one; everything is flushed, so leave now.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0
