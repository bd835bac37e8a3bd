"""The PyTorch Lightning adapter: crash and resume in another process, fallback past corruption, encoding."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")

from ckptkeeper import ConfigurationError
from ckptkeeper.lightning import CkptkeeperCallback, ResumableLoader, decode_checkpoint, encode_checkpoint

from ..helpers import EXAMPLES, example_report

EXAMPLE = EXAMPLES / "lightning.py"


def _run(tmp: Path, name: str, *flags: str) -> dict[str, Any]:
    return example_report("lightning", tmp, name, *flags)


def test_crash_then_resume_in_another_process_matches_uninterrupted_and_plain_lightning(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    common = ["--steps", "15", "--save-interval", "4", "--ephemeral-save-interval", "3"]
    crashed = subprocess.run(
        [sys.executable, str(EXAMPLE), "--save-folder", str(folder), *common, "--crash-at-step", "10"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert crashed.returncode == 75, crashed.stderr[-2000:]
    resumed = _run(tmp_path, "resumed", "--save-folder", str(folder), *common)
    assert 0 < resumed["start_step"] <= 10  # continued from a checkpoint of the crashed process
    assert resumed["final_step"] == 15
    straight = _run(tmp_path, "straight", "--save-folder", str(tmp_path / "straight"), *common)
    plain = _run(tmp_path, "plain", "--save-folder", str(tmp_path / "plain"), *common, "--no-ckptkeeper")
    assert straight["start_step"] == 0
    assert resumed["state_digest"] == straight["state_digest"] == plain["state_digest"]
    assert not list((tmp_path / "plain").glob("step*"))  # --no-ckptkeeper really left ckptkeeper out


def test_resume_falls_back_past_a_corrupt_newest_checkpoint(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "run"
    first = _run(tmp_path, "first", "--save-folder", str(folder), "--steps", "8", "--save-interval", "4")
    assert first["final_step"] == 8
    data = folder / "step8" / "model_and_optim" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING):
        resumed = _run(tmp_path, "resumed", "--save-folder", str(folder), "--steps", "12", "--save-interval", "4")
    assert resumed["start_step"] == 4
    assert any("skipping checkpoint" in r.getMessage() and "step8" in r.getMessage() for r in caplog.records)
    straight = _run(tmp_path, "straight", "--save-folder", str(tmp_path / "s"), "--steps", "12", "--save-interval", "4")
    assert resumed["state_digest"] == straight["state_digest"]


def test_checkpoint_dict_round_trips_losslessly_and_refuses_what_json_cannot_hold() -> None:
    t = torch.arange(6.0).reshape(2, 3)
    ckpt = {
        "state_dict": {"net.0.weight": t, "net.0.bias": torch.zeros(3)},
        "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0), "exp_avg": t + 1}}, "param_groups": [
            {"params": [0], "betas": (0.9, 0.999), "lr": 0.1}]}],
        "loops": {"fit_loop": {"a": 1, "weird": {"__ckptkeeper_tuple__": 5}}},
        "epoch": 2,
        "hyper_parameters": {"nan": float("nan"), "k": None},
    }  # fmt: skip
    tensors, doc = encode_checkpoint(ckpt)
    assert set(tensors["model"]) == {"net.0.weight", "net.0.bias"}
    json.dumps(doc)  # all JSON
    back = decode_checkpoint(json.loads(json.dumps(doc)), tensors)
    state = back["optimizer_states"][0]
    assert list(state["state"]) == [0]  # int keys stay int (optimizer.load_state_dict needs them)
    assert state["param_groups"][0]["betas"] == (0.9, 0.999)
    assert torch.equal(state["state"][0]["exp_avg"], t + 1)
    assert back["loops"] == ckpt["loops"]
    with pytest.raises(ConfigurationError, match=r"hyper_parameters.*pickle"):
        encode_checkpoint({"hyper_parameters": {"cls": torch.nn.Linear}})


def test_configuration_errors() -> None:
    with pytest.raises(ConfigurationError, match="unknown settings"):
        CkptkeeperCallback("runs/x", save_intervall=3)
    with pytest.raises(ConfigurationError, match="save_interval"):
        CkptkeeperCallback("runs/x", save_interval=0)
    with pytest.raises(ConfigurationError, match="length"):
        ResumableLoader(iter([1, 2, 3]))
