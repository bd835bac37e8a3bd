"""The load-floor benchmark (``benchmarks/load_floor.py``) still loads exactly, so its figures mean something."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def test_the_load_floor_benchmark_leaves_both_loads_bit_exact_at_two_ranks(tmp_path: Path) -> None:
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "2", str(ROOT / "benchmarks" / "load_floor.py"),
           "--model-mib", "1", "--tensors", "3", "--repeats", "1"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    three = report["params"]["3"]
    assert three["exact"] == {"ours": True, "bare": True}, report
    assert three["ours"]["wall_s"] > 0 and three["bare"]["wall_s"] > 0
    assert not any(tmp_path.glob("ckptkeeper-floor-*"))  # its checkpoints are gone
