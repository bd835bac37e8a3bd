"""``ckptkeeper bench`` runs end to end and reports every figure the issue names (no timing asserts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

RATIOS = {
    "async_blocked_vs_floor",
    "async_blocked_vs_dcp",
    "slowdown_vs_dcp",
    "save_vs_raw_write",
    "save_vs_torch_save",
    "load_vs_raw_read",
    "load_vs_dcp",
    "load_vs_unguarded",
    "peak_extra_mem_vs_state",
}


def test_bench_json_has_every_ratio(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "ckptkeeper", "bench", "--model-mib", "4", "--repeats", "1", "--json",
         "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=dict(os.environ),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert set(report["ratios"]) == RATIOS
    assert all(v >= 0 for v in report["ratios"].values())
    assert len(report["peak_extra_mem_bytes_per_save"]) == 10
    keys = ["floor", "raw_write", "raw_read_cold", "torch_save", "torch_load_cold", "dcp_save", "dcp_load_cold"]
    keys += ["dcp_async_blocked", "ours_save", "ours_load_cold", "ours_async_blocked"]
    for key in (f"{k}_s" for k in keys):
        assert report["medians_s"][key] > 0, key
    assert report["state_bytes"] >= 3 * (4 << 20) * 0.9
    assert os.listdir(tmp_path) == []  # everything it wrote is gone


def test_bench_on_cuda_skips_with_a_reason_without_a_gpu() -> None:
    import torch

    if torch.cuda.is_available():
        return  # covered by running the benchmark itself on a GPU machine
    res = subprocess.run(
        [sys.executable, "-m", "ckptkeeper", "bench", "--device", "cuda", "--model-mib", "4"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0 and "skipped" in res.stdout and "CUDA" in res.stdout
