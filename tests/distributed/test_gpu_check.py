"""The prepared GPU check (``benchmarks/gpu_check.py``) runs end to end, so that a session lent a GPU
only has to run it; here on the CPU, where it takes the same steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "benchmarks" / "gpu_check.py")


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    return subprocess.run(
        [sys.executable, SCRIPT, *args], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path
    )


def test_the_gpu_check_runs_every_step_and_reports_exact_round_trips(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    done = _run(tmp_path, "--device", "cpu", "--model-mib", "2", "--repeats", "1", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert json.loads(out.read_text()) == report
    assert report["failures"] == []
    trip = report["round_trip"]
    # The weights were changed right after save_async returned: the checkpoint must not see it.
    assert trip["async_exact"] is True and trip["sync_exact"] is True
    assert trip["load_stays_on_device"] is True and trip["staging_buffers"] > 0
    assert report["floor"]["d2h_pinned_s"] > 0 and report["ratios"]["async_blocked_vs_d2h_pinned_floor"] > 0
    for name in ("bench", "bench_fsdp2"):
        assert report[name]["device"] == "cpu" and report[name]["ratios"], name
    assert report["bench_fsdp2"]["world_size"] == 1
    assert not any(tmp_path.glob("ckptkeeper-*"))  # every checkpoint it wrote is gone


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with a GPU runs the check instead of refusing it")
def test_the_gpu_check_says_when_there_is_no_gpu(tmp_path: Path) -> None:
    done = _run(tmp_path, "--device", "cuda", "--model-mib", "1")
    assert done.returncode == 2
    assert "needs a CUDA device" in done.stderr and done.stdout == ""
