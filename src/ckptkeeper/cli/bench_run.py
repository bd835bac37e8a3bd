"""``ckptkeeper bench``: ckptkeeper's saves and loads measured beside the alternatives, in one run.

A synthetic state of M MiB of "model" (a few large tensors and a couple of hundred small ones)
plus twice that of optimizer state is saved and loaded by every contender, interleaved, and the
medians over the repeats are compared:

- the memory-copy floor (one copy into buffers that already exist), raw ``write``+``fsync`` and a
  cold raw read of the same bytes (page cache evicted with ``posix_fadvise(DONTNEED)``);
- ``torch.save``+``fsync`` and ``torch.load``; ``dcp.save`` and ``dcp.load``; ``dcp.async_save``;
- ckptkeeper's sync save, load and async save.

For the two async saves it measures the time the caller is blocked and how much a loop of matmul
steps on all cores slows down while the background write runs (from the loop's own step times),
and for ckptkeeper the peak extra host memory over 10 consecutive async saves.

Under torchrun (``WORLD_SIZE`` > 1), or with --tensors, --compare-tensors or --store, :func:`run` hands over to
``bench_ranks`` instead: an FSDP2-sharded model and optimizer, ckptkeeper beside DCP at that world size.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, cast

import torch

from ..engine import Checkpointer, TrainingState
from ..engine.fastio import _bytes_of
from ..engine.state import flatten_tensors

__all__ = ["run"]

_PAGE = os.sysconf("SC_PAGE_SIZE")


class _FixedState(TrainingState):
    """A ready-made tensor tree in TrainingState's clothes (no module or optimizer needed)."""

    def __init__(self, tree: dict[str, Any]) -> None:
        self.tree = tree

    def capture(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return self.tree, {}

    def restore(self, tensors: Any, meta: Any) -> None:
        pass


def _make_state(model_mib: int, device: str) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    total = model_mib << 20
    small = [(256 * (1 + i % 8),) for i in range(200)]  # biases, norms: a couple of hundred small tensors
    small_bytes = sum(s[0] * 4 for s in small)
    large_elems = max(1, (total - small_bytes) // 4 // 4)
    shapes = [(large_elems // 1024, 1024)] * 4 + small
    model = {f"layer{i}.weight": torch.randn(*s, generator=g) for i, s in enumerate(shapes)}
    optim = {
        name: {"exp_avg": torch.randn(*t.shape, generator=g), "exp_avg_sq": torch.rand(*t.shape, generator=g)}
        for name, t in model.items()
    }
    tree: dict[str, Any] = {"model": model, "optim": {"state": optim}}
    if device == "cuda":
        tree = _map(tree, lambda t: t.cuda())
    return tree


def _map(tree: dict[str, Any], fn: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, Any]:
    return {k: _map(v, fn) if isinstance(v, dict) else fn(v) for k, v in tree.items()}


def _nbytes(tree: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for _, t in flatten_tensors(tree))


def _evict(path: str) -> None:
    """Drop a folder's files from the page cache, so the next read comes from the disk."""
    for dirpath, _, names in os.walk(path):
        for name in names:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class _PeakRss:
    def __init__(self) -> None:
        self.peak = _rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss())

    def __enter__(self) -> _PeakRss:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss())


class _Loop:
    """A loop of matmul steps on all cores; measures its step time alone and beside a save."""

    def __init__(self, device: str) -> None:
        self.a = torch.randn(768, 768, device=device)
        self.b = torch.randn(768, 768, device=device)
        self.device = device
        for _ in range(5):
            self.step()
        times = []
        for _ in range(40):
            t = time.perf_counter()
            self.step()
            times.append(time.perf_counter() - t)
        self.base = statistics.median(times)

    def step(self) -> None:
        for _ in range(4):
            self.a = torch.tanh(self.a @ self.b) * 0.5
        if self.device == "cuda":
            torch.cuda.synchronize()

    def slowdown_while(self, done: Callable[[], bool]) -> float:
        """Seconds the loop lost while ``done()`` was false, against its undisturbed pace."""
        steps, t0 = 0, time.perf_counter()
        while not done():
            self.step()
            steps += 1
        return max(0.0, (time.perf_counter() - t0) - steps * self.base)


def _time(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _sharded_wanted(args: argparse.Namespace) -> bool:
    """Whether this run is the sharded benchmark (several ranks, or a flag only it has)."""
    try:
        several = int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        several = True  # a malformed WORLD_SIZE is reported where the process group is joined
    flags = ("tensors", "compare_tensors", "store")
    return several or any(getattr(args, flag, None) is not None for flag in flags)


def run(args: argparse.Namespace) -> int:
    """Run ``ckptkeeper bench``; returns the exit code."""
    if _sharded_wanted(args):
        from .bench_ranks import run as run_ranks

        return run_ranks(args)
    warnings.filterwarnings("ignore")
    logging.getLogger("ckptkeeper").setLevel(logging.WARNING)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("skipped: --device cuda needs a CUDA device, and torch sees none here")
        return 0
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    root = tempfile.mkdtemp(prefix="ckptkeeper-bench-", dir=args.dir)
    try:
        tree = _make_state(args.model_mib, args.device)
        state_bytes = _nbytes(tree)
        leaves = [t for _, t in flatten_tensors(tree)]
        floor_buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda) for t in leaves]
        cpu_tree = tree if args.device == "cpu" else _map(tree, lambda t: t.cpu())
        template = _map(cpu_tree, torch.empty_like)
        for t in flatten_tensors(template):
            t[1].zero_()  # fault the pages in, as a real model's tensors would be
        loop = _Loop(args.device)
        state = _FixedState(tree)
        results: dict[str, list[float]] = {}
        raw = os.path.join(root, "raw")
        blob = os.path.join(raw, "blob")
        ts = os.path.join(root, "ts.pt")
        d = os.path.join(root, "dcp")
        o = os.path.join(root, "ours")

        # Peak extra host memory over 10 consecutive async saves, measured first, from a baseline
        # taken before ckptkeeper allocated anything: staging buffers count, and must not grow.
        base = _rss()
        peaks = []
        mem = Checkpointer()
        for i in range(10):
            with _PeakRss() as p:
                mem.save_async(os.path.join(root, "mem"), i, state)[1].result()
            peaks.append(p.peak - base)
            shutil.rmtree(os.path.join(root, "mem"))
        mem.close()
        mem._stager.release()
        del mem
        ours = Checkpointer()

        def add(name: str, value: float) -> None:
            results.setdefault(name, []).append(value)

        def floor() -> None:
            for src, dst in zip(leaves, floor_buffers, strict=True):
                dst.copy_(src, non_blocking=src.is_cuda)
            if args.device == "cuda":
                torch.cuda.synchronize()

        # Warm-up: first-time allocation of staging buffers and skeletons is reported apart.
        first = ours.save_async(os.path.join(root, "warm"), 0, state)[1].result()
        add("ours_async_first_blocked_s", first.blocked_s)
        shutil.rmtree(os.path.join(root, "warm"))

        for rep in range(args.repeats):
            add("floor_s", _time(floor))

            os.makedirs(raw)

            def raw_write() -> None:
                fd = os.open(blob, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    for buf in floor_buffers:
                        view = _bytes_of(buf)
                        while view:
                            view = view[os.write(fd, view) :]
                    os.fsync(fd)
                finally:
                    os.close(fd)

            add("raw_write_s", _time(raw_write))
            _evict(raw)

            def raw_read() -> None:
                with open(blob, "rb", buffering=0) as f:
                    for buf in floor_buffers:
                        view = _bytes_of(buf)
                        while view:
                            view = view[f.readinto(view) :]

            add("raw_read_cold_s", _time(raw_read))
            shutil.rmtree(raw)

            def torch_save() -> None:
                with open(ts, "wb") as f:
                    torch.save(cpu_tree, f)
                    f.flush()
                    os.fsync(f.fileno())

            add("torch_save_s", _time(torch_save))
            _evict(root)
            add("torch_load_cold_s", _time(lambda: torch.load(ts, weights_only=True)))
            os.unlink(ts)

            add("dcp_save_s", _time(lambda: dcp_save(cpu_tree, checkpoint_id=d, no_dist=True)))
            _evict(d)
            add("dcp_load_cold_s", _time(lambda: dcp_load(template, checkpoint_id=d, no_dist=True)))
            shutil.rmtree(d)

            t0 = time.perf_counter()
            fut = cast(Future[Any], dcp_async_save(tree, checkpoint_id=d, no_dist=True))
            add("dcp_async_blocked_s", time.perf_counter() - t0)
            add("dcp_async_slowdown_s", loop.slowdown_while(fut.done))
            fut.result()
            shutil.rmtree(d)

            res = ours.save(o, 1, _FixedState(cpu_tree))
            add("ours_save_s", res.durable_s)
            _evict(o)
            # The same load without the backup that makes a failed load change nothing: its cost,
            # in alternating order so that neither always reads first.
            for guarded in (True, False) if rep % 2 == 0 else (False, True):
                _evict(o)
                ours._rollback_loads = guarded
                took = _time(lambda: ours.load(os.path.join(o, "step1"), _FixedState(template)))
                add("ours_load_cold_s" if guarded else "ours_load_unguarded_cold_s", took)
            ours._rollback_loads = True
            shutil.rmtree(o)

            t0 = time.perf_counter()
            _, ofut = ours.save_async(o, 2, state)
            add("ours_async_blocked_s", time.perf_counter() - t0)
            add("ours_async_slowdown_s", loop.slowdown_while(ofut.done))
            ofut.result()
            shutil.rmtree(o)

        ours.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in results.items()}
    gbps = {k[:-2]: state_bytes / med[k] / 1e9 for k in med if k.endswith("_s") and "slowdown" not in k}
    ratios = {
        "async_blocked_vs_floor": med["ours_async_blocked_s"] / med["floor_s"],
        "async_blocked_vs_dcp": med["ours_async_blocked_s"] / med["dcp_async_blocked_s"],
        "slowdown_vs_dcp": med["ours_async_slowdown_s"] / max(med["dcp_async_slowdown_s"], 1e-9),
        "save_vs_raw_write": med["raw_write_s"] / med["ours_save_s"],
        "save_vs_torch_save": med["torch_save_s"] / med["ours_save_s"],
        "load_vs_raw_read": med["raw_read_cold_s"] / med["ours_load_cold_s"],
        "load_vs_dcp": med["dcp_load_cold_s"] / med["ours_load_cold_s"],
        "load_vs_unguarded": med["ours_load_unguarded_cold_s"] / med["ours_load_cold_s"],
        "peak_extra_mem_vs_state": max(peaks) / state_bytes,
    }
    report = {
        "state_bytes": state_bytes,
        "repeats": args.repeats,
        "device": args.device,
        "medians_s": med,
        "throughput_gb_s": gbps,
        "peak_extra_mem_bytes_per_save": peaks,
        "loop_step_s": loop.base,
        "ratios": ratios,
    }
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"state: {state_bytes / 1e9:.2f} GB ({args.model_mib} MiB model + 2x optimizer), {args.repeats} repeats")
    print(f"{'measurement':<30}{'median s':>10}{'GB/s':>8}")
    for k, v in med.items():
        rate = gbps.get(k[:-2])
        print(f"{k:<30}{v:>10.3f}{'' if rate is None or 'blocked' in k else f'{rate:>8.2f}'}")
    print("peak extra RSS per async save (GB):", " ".join(f"{p / 1e9:.2f}" for p in peaks))
    print("ratios (ours / theirs):")
    for k, v in ratios.items():
        print(f"  {k:<26}{v:>7.2f}")
    return 0
