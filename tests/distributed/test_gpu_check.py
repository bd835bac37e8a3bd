"""The prepared GPU check (``benchmarks/gpu_check.py``) runs end to end, so that a session lent a GPU
only has to run it; here on the CPU, where it takes the same steps."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

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


def _script() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_step_that_raises_is_a_named_failure_and_the_next_steps_still_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Found by an outside attack: a checksum error inside the round trip escaped, and the report
    # (stdout and --out) named no failure.
    gpu_check = _script()
    ran: list[str] = []

    def broken(*args: Any) -> dict[str, Any]:
        raise RuntimeError("checkpoint x is corrupt: a planted error")

    def bench(cmd: list[str], workdir: str, failures: list[str], name: str) -> dict[str, Any]:
        ran.append(name)
        return {"ratios": {}}

    monkeypatch.setattr(gpu_check, "_round_trip", broken)
    monkeypatch.setattr(gpu_check, "_bench", bench)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    out = tmp_path / "r.json"
    code = gpu_check.main(["--device", "cpu", "--model-mib", "1", "--repeats", "1", "--out", str(out)])
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and json.loads(out.read_text()) == report
    assert report["failures"] == ["the round trip raised RuntimeError: checkpoint x is corrupt: a planted error"]
    assert ran == ["bench", "bench (FSDP2, torchrun)"] and report["floor"]["d2h_pinned_s"] > 0
    assert "ratios" not in report and not any(tmp_path.glob("ckptkeeper-gpu-check-*"))


def test_an_out_file_that_cannot_be_written_is_refused_before_any_work(tmp_path: Path) -> None:
    started = time.monotonic()
    done = _run(tmp_path, "--device", "cpu", "--out", str(tmp_path / "missing" / "r.json"))
    assert done.returncode == 2 and "--out" in done.stderr and "cannot be written" in done.stderr
    assert time.monotonic() - started < 60 and done.stdout == ""  # no model was built for it


def test_sigterm_removes_the_temporary_folder(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    proc = subprocess.Popen(
        [sys.executable, SCRIPT, "--device", "cpu", "--model-mib", "64", "--repeats", "3"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not any(tmp_path.glob("ckptkeeper-gpu-check-*")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any(tmp_path.glob("ckptkeeper-gpu-check-*"))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()
    assert not any(tmp_path.glob("ckptkeeper-gpu-check-*"))
