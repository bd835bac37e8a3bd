"""One structured event per save, load and removal: in the log and, with CKPTKEEPER_METRICS, as
JSON lines that the TensorBoard example turns into scalars."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from ckptkeeper import Checkpointer, TrainingState

ROOT = Path(__file__).resolve().parents[2]


def _state() -> TrainingState:
    model = nn.Linear(8, 4)
    return TrainingState(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_save_load_remove_events(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    sink = tmp_path / "metrics.jsonl"
    monkeypatch.setenv("CKPTKEEPER_METRICS", str(sink))
    ckpt = Checkpointer()
    with caplog.at_level(logging.INFO, logger="ckptkeeper.metrics"):
        ckpt.save(str(tmp_path / "run"), 1, _state())
        _, fut = ckpt.save_async(str(tmp_path / "run"), 2, _state(), ephemeral=True)
        res = fut.result()
        ckpt.load(str(tmp_path / "run" / "step2"), _state())
        ckpt.remove(str(tmp_path / "run" / "step1"))
    events = [json.loads(line) for line in sink.read_text().splitlines()]
    assert [e["event"] for e in events] == ["save", "save", "load", "remove"]
    sync, asyn, load, remove = events
    assert sync["async"] is False and asyn["async"] is True and asyn["ephemeral"] is True
    for e in (sync, asyn):
        assert e["bytes"] > 0 and e["files"] >= 3 and e["durable_s"] > 0 and e["gb_s"] > 0 and e["retries"] == 0
    assert asyn["blocked_s"] == pytest.approx(res.blocked_s) and asyn["bytes"] == res.bytes
    assert load["step"] == 2 and load["bytes"] == asyn["bytes"] and load["seconds"] > 0
    assert remove["step"] == 1 and remove["files"] >= 3
    logged = [r.ckptkeeper_event for r in caplog.records if hasattr(r, "ckptkeeper_event")]
    assert [e["event"] for e in logged] == ["save", "save", "load", "remove"]
    ckpt.close()
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "metrics_to_tensorboard.py"), str(sink), "--print"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "checkpoint/save/durable_s\t1\t" in out.stdout and "checkpoint/load/gb_s\t2\t" in out.stdout


def test_an_unwritable_metrics_file_never_fails_a_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTKEEPER_METRICS", str(tmp_path / "missing-dir" / "m.jsonl"))
    Checkpointer().save(str(tmp_path / "run"), 1, _state())
    assert Checkpointer().latest_checkpoint(str(tmp_path / "run"))
