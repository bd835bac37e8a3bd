"""The Hugging Face adapter: crash and resume in another process, fallback past corruption, refusals."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from ckptkeeper import ConfigurationError
from ckptkeeper.hf import CkptkeeperTrainer

from ..helpers import EXAMPLES, example_report

EXAMPLE = EXAMPLES / "hf_trainer.py"


def _run(tmp: Path, name: str, *flags: str) -> dict[str, Any]:
    return example_report("hf_trainer", tmp, name, *flags)


def test_crash_then_resume_in_another_process_matches_uninterrupted_and_plain_trainer(tmp_path: Path) -> None:
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
    assert 0 < resumed["start_step"] <= 10
    assert resumed["final_step"] == 15
    straight = _run(tmp_path, "straight", "--save-folder", str(tmp_path / "straight"), *common)
    plain = _run(tmp_path, "plain", "--save-folder", str(tmp_path / "plain"), *common, "--no-ckptkeeper")
    assert straight["start_step"] == 0
    assert resumed["state_digest"] == straight["state_digest"] == plain["state_digest"]
    # Nothing of HF's own format beside the checkpoints: all of it is inside them.
    assert not list((tmp_path / "straight").glob("checkpoint-*"))


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


def test_refusals(tmp_path: Path) -> None:
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8))
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=1)
    with pytest.raises(ConfigurationError, match="CheckpointPolicyConfig"):
        CkptkeeperTrainer(model=model, args=args, checkpoint_config={"save_interval": 3})  # type: ignore[arg-type]
    trainer = CkptkeeperTrainer(model=model, args=args)
    with pytest.raises(ConfigurationError, match="load_path"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-5"))
