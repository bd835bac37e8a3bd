"""The machine probe behind the benchmark notes (``benchmarks/page_cost.py``) runs, reports both
conditions and leaves nothing behind, so the figures quoted from it can be reproduced."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "benchmarks" / "page_cost.py")


def test_the_page_cost_probe_reports_both_conditions_and_cleans_up(tmp_path: Path) -> None:
    cmd = [sys.executable, SCRIPT, "--mib", "4", "--churn-mib", "8", "--wait", "0", "--rounds", "2",
           "--folder", str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["mib"] == 4 and report["rounds"] == 2
    for key in ("fresh_wall_s", "reused_wall_s"):
        assert report[key] > 0, report
    # The ratio is of the unrounded medians: equal to the rounded ones' within rounding.
    ratio = report["fresh_wall_s"] / report["reused_wall_s"]
    assert abs(report["fresh_vs_reused_wall"] - ratio) <= 0.01 + 0.05 * ratio, report
    assert list(tmp_path.iterdir()) == []  # its file and folder are gone


def test_the_page_cost_probe_refuses_bad_arguments(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, SCRIPT, "--rounds", "0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--rounds" in done.stderr
