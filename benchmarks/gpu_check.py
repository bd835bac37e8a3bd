"""The GPU check of the scale work (issue 11, item 7), prepared to run in one call where a CUDA device is lent.

What it runs, in order, on ``--device`` (``cuda``; ``cpu`` runs the same steps, which is how the test
suite keeps this script working on machines without a GPU):

1. **The copy floor**: the state's bytes copied device-to-host into pinned memory (the least any
   async save can block for) and into pageable memory, and host-to-device (the least a load into the
   device can take once the bytes are in memory).
2. **A round trip of a training state on the device**: Linear layers of about ``--model-mib`` and their
   AdamW after one step, all on the device.

   - ``save_async``: the caller's blocked time and the time until durable; the staging buffers must be
     pinned host memory; the weights are changed on the device as soon as it returns, and the
     checkpoint must still hold the values from before.
   - a load into a new model and optimizer on the device: its time; every parameter and optimizer
     tensor must still be on the device, and the state bit-identical to the saved one
     (``ckptkeeper.state_digest``).
   - a synchronous save from the device and a load of it, bit-identical too.
3. ``ckptkeeper bench --device D --json`` (one process) and ``python -m torch.distributed.run
   --nproc-per-node 1 -m ckptkeeper bench --device D --tensors 200 --json`` (an FSDP2-sharded state,
   NCCL on CUDA), their reports embedded.

    python benchmarks/gpu_check.py [--device cuda] [--model-mib 512] [--repeats 3] [--out report.json]

It needs only ckptkeeper's own dependencies (torch, numpy, xxhash, rich): from a checkout,
``PYTHONPATH=src python3 benchmarks/gpu_check.py`` runs it on any machine whose Python has a CUDA torch.

Prints one JSON object (also written to ``--out``, after every step, so that a run stopped by a time
limit leaves what it measured): the environment, the floor, the round trip, both
bench reports, ``ratios`` (the async save's blocked time over the pinned copy floor; the load's time
over the host-to-device floor) and ``failures``, each check that did not hold (a step that raised is
one, named with its error; the steps after it still run). Exits 1 when any check failed, 2 on bad
arguments (an ``--out`` that cannot be written is found before any work) or when ``--device cuda``
finds no CUDA device. SIGTERM and Ctrl-C remove its temporary folder and stop a running benchmark.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ckptkeeper import state_digest
from ckptkeeper.engine import Checkpointer, TrainingState


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _median_time(fn: Callable[[], Any], device: str, repeats: int) -> float:
    fn()  # once untimed: first-time costs (allocation, page faults, kernel set-up) are not the floor
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _build(model_mib: int, device: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Eight Linear layers of about ``model_mib`` MiB in all and their AdamW after one step, on ``device``."""
    layers = 8
    width = max(8, round(math.sqrt((model_mib << 20) / 4 / layers)))
    torch.manual_seed(seed)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers))).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, width, device=device)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def _state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    found = [p.detach() for p in model.parameters()]
    for slots in optimizer.state.values():
        found += [v for v in slots.values() if isinstance(v, torch.Tensor)]
    return found


def _floor(tensors: list[torch.Tensor], device: str, repeats: int) -> dict[str, float]:
    """Device-to-host into pinned and pageable memory, and host-to-device, of ``tensors``' bytes."""
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=device == "cuda") for t in tensors]
    pageable = [torch.empty(t.shape, dtype=t.dtype) for t in tensors]
    back = [torch.empty_like(t) for t in tensors]
    for dst in (*pinned, *pageable):
        dst.zero_()  # pages faulted in: the floor is the copy, not the first touch

    def into(dsts: list[torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            for src, dst in zip(tensors, dsts, strict=True):
                dst.copy_(src, non_blocking=device == "cuda")

        return run

    def to_device() -> None:
        for src, dst in zip(pinned, back, strict=True):
            dst.copy_(src, non_blocking=device == "cuda")

    return {
        "d2h_pinned_s": _median_time(into(pinned), device, repeats),
        "d2h_pageable_s": _median_time(into(pageable), device, repeats),
        "h2d_s": _median_time(to_device, device, repeats),
    }


def _round_trip(root: str, model_mib: int, device: str, failures: list[str]) -> dict[str, Any]:
    model, optimizer = _build(model_mib, device, seed=1)
    state = TrainingState(model, optimizer)
    saved = state_digest(model, optimizer)
    ck = Checkpointer()
    out: dict[str, Any] = {}
    try:
        _sync(device)
        t0 = time.perf_counter()
        path, future = ck.save_async(root, 1, state)
        out["async_blocked_s"] = time.perf_counter() - t0
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # on the device, while the save is still being written
        result = future.result()
        out["async_durable_s"] = result.durable_s
        buffers = list(getattr(ck._stager, "_buffers", {}).values())
        out["staging_buffers"] = len(buffers)
        # One pinned buffer per tensor on the device; AdamW's steps are CPU scalars, staged as they are.
        on_device = sum(t.device.type == "cuda" for t in _state_tensors(model, optimizer))
        out["staging_pinned"] = sum(b.is_pinned() for b in buffers)
        if device == "cuda" and out["staging_pinned"] != on_device:
            failures.append(f"{out['staging_pinned']} staging buffers are pinned for {on_device} CUDA tensors")

        fresh_model, fresh_opt = _build(model_mib, device, seed=2)
        _sync(device)
        t0 = time.perf_counter()
        ck.load(path, TrainingState(fresh_model, fresh_opt))
        _sync(device)
        out["load_s"] = time.perf_counter() - t0
        # Each loaded tensor where the saved one was (AdamW keeps its steps on the CPU).
        where = sorted(t.device.type for t in _state_tensors(fresh_model, fresh_opt))
        out["load_stays_on_device"] = where == sorted(t.device.type for t in _state_tensors(model, optimizer))
        if not out["load_stays_on_device"]:
            failures.append(f"the loaded tensors are not where the saved ones were ({where.count(device)} on {device})")
        out["async_exact"] = state_digest(fresh_model, fresh_opt) == saved
        if not out["async_exact"]:
            failures.append("the async save's checkpoint does not load bit-identical to the state it was taken from")

        changed = state_digest(model, optimizer)
        _sync(device)
        t0 = time.perf_counter()
        sync_result = ck.save(root, 2, state)
        out["sync_save_s"] = time.perf_counter() - t0
        again_model, again_opt = _build(model_mib, device, seed=3)
        ck.load(sync_result.path, TrainingState(again_model, again_opt))
        out["sync_exact"] = state_digest(again_model, again_opt) == changed
        if not out["sync_exact"]:
            failures.append("the synchronous save from the device does not load bit-identical")
    finally:
        ck.close()
    return out


def _bench(cmd: list[str], workdir: str, failures: list[str], name: str) -> dict[str, Any] | None:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), TMPDIR=workdir)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=workdir, timeout=1200)
    if done.returncode != 0:
        failures.append(f"{name} exited {done.returncode}: {done.stderr.strip()[-500:]}")
        return None
    text = done.stdout
    try:
        report: dict[str, Any] = json.loads(text[text.index("{") :])
    except ValueError:
        failures.append(f"{name} printed no JSON report: {text.strip()[-300:]}")
        return None
    return report


def _stopped(signum: int, frame: object) -> None:
    # SIGTERM (a machine's time limit, a job scheduler) unwinds like Ctrl-C: the temporary folder is
    # removed and a running benchmark child is killed by subprocess.run on the way out.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """Run every step; prints (and with ``--out`` writes) the JSON report; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--model-mib", type=int, default=512, help="model size in MiB (AdamW's state is 2x more)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of each timed copy and of the benchmarks")
    parser.add_argument("--out", default=None, help="also write the report to this file")
    args = parser.parse_args(argv)
    if args.model_mib < 1 or args.repeats < 1:
        parser.error("--model-mib and --repeats must be at least 1")
    if args.out:
        try:  # before any work: a report that cannot be written would waste a lent machine's time
            Path(args.out).write_text("{}\n")
        except OSError as exc:
            parser.error(f"--out {args.out} cannot be written ({exc.strerror}); give a file in an existing folder")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda needs a CUDA device, and torch sees none here", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _stopped)

    failures: list[str] = []
    report: dict[str, Any] = {
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "model_mib": args.model_mib,
        "failures": failures,
    }

    def keep() -> None:
        # Written after every step: a run cut short (a machine's time limit) still leaves what it measured.
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")

    def step(name: str, fn: Callable[[], Any]) -> Any:
        # A step that raises is a failed check, named with its error; the steps after it still run.
        try:
            return fn()
        except Exception as exc:
            failures.append(f"{name} raised {type(exc).__name__}: {str(exc)[:500]}")
            return None
        finally:
            keep()

    def floor_step() -> dict[str, float]:
        model, optimizer = _build(args.model_mib, args.device, seed=0)
        tensors = _state_tensors(model, optimizer)
        report["state_bytes"] = sum(t.numel() * t.element_size() for t in tensors)
        return _floor(tensors, args.device, args.repeats)

    root = tempfile.mkdtemp(prefix="ckptkeeper-gpu-check-")
    try:
        report["floor"] = step("the copy floor", floor_step)
        report["round_trip"] = step(
            "the round trip", lambda: _round_trip(os.path.join(root, "ckpt"), args.model_mib, args.device, failures)
        )
        py = sys.executable
        common = ["--device", args.device, "--model-mib", str(args.model_mib), "--repeats", str(args.repeats)]
        one = [py, "-m", "ckptkeeper", "bench", *common, "--json"]
        report["bench"] = step("bench", lambda: _bench(one, root, failures, "bench"))
        fsdp2 = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
        fsdp2 += ["-m", "ckptkeeper", "bench", *common, "--tensors", "200", "--json"]
        report["bench_fsdp2"] = step("bench (FSDP2)", lambda: _bench(fsdp2, root, failures, "bench (FSDP2, torchrun)"))
        floor, trip = report["floor"], report["round_trip"]
        if floor and trip and "load_s" in trip:
            report["ratios"] = {
                "async_blocked_vs_d2h_pinned_floor": trip["async_blocked_s"] / floor["d2h_pinned_s"],
                "load_vs_h2d_floor": trip["load_s"] / floor["h2d_s"],
            }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    keep()
    print(json.dumps(report, indent=1, sort_keys=True))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
