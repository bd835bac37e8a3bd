"""Per-tensor cost: the same bytes as a few large tensors and as many small ones, saved and loaded.

One process, plain CPU tensors (the fast single-process path), against ``dcp.save``/``dcp.load``
on the same trees. Each measurement is the median over ``--repeats``; loads are cold (the page
cache of the checkpoint's files dropped first). The ratios are the many-tensor time over the
few-tensor time, for ours and for DCP (the issue's target for ours: <= 2).

    python benchmarks/many_tensors.py [--mib 256] [--few 10] [--many 10000] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from ckptkeeper.cli.bench_run import _evict, _FixedState
from ckptkeeper.engine import Checkpointer


def _tree(mib: int, count: int) -> dict[str, Any]:
    per = (mib << 20) // 4 // count
    g = torch.Generator().manual_seed(count)
    return {"model": {f"t{i}": torch.randn(per, generator=g) for i in range(count)}}


def _measure(root: str, mib: int, count: int, repeats: int) -> dict[str, float]:
    tree = _tree(mib, count)
    template = {"model": {k: torch.zeros_like(v) for k, v in tree["model"].items()}}
    ours = Checkpointer()
    out: dict[str, list[float]] = {}
    mine, theirs = os.path.join(root, "ours"), os.path.join(root, "dcp")
    for _ in range(repeats):
        t0 = time.perf_counter()
        ours.save(mine, 1, _FixedState(tree))
        out.setdefault("ours_save_s", []).append(time.perf_counter() - t0)
        _evict(mine)
        t0 = time.perf_counter()
        ours.load(os.path.join(mine, "step1"), _FixedState(template))
        out.setdefault("ours_load_cold_s", []).append(time.perf_counter() - t0)
        shutil.rmtree(mine)
        t0 = time.perf_counter()
        dcp_save(tree, checkpoint_id=theirs, no_dist=True)
        out.setdefault("dcp_save_s", []).append(time.perf_counter() - t0)
        _evict(theirs)
        t0 = time.perf_counter()
        dcp_load(template, checkpoint_id=theirs, no_dist=True)
        out.setdefault("dcp_load_cold_s", []).append(time.perf_counter() - t0)
        shutil.rmtree(theirs)
    ours.close()
    times = {k: statistics.median(v) for k, v in out.items()}
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--few", type=int, default=10)
    p.add_argument("--many", type=int, default=10_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    root = tempfile.mkdtemp(prefix="ckptkeeper-many-", dir=args.dir)
    try:
        few = _measure(root, args.mib, args.few, args.repeats)
        many = _measure(root, args.mib, args.many, args.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ratios = {f"{k[:-2]}_many_vs_few": many[k] / few[k] for k in few}
    report = {"mib": args.mib, "few": args.few, "many": args.many, "repeats": args.repeats,
              "few_s": few, "many_s": many, "ratios": ratios}  # fmt: skip
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"{args.mib} MiB as {args.few} and as {args.many} tensors, medians of {args.repeats}")
    for k in few:
        print(f"  {k:<18}{few[k]:>8.3f} s {many[k]:>8.3f} s  x{many[k] / few[k]:.1f}")


if __name__ == "__main__":
    main()
