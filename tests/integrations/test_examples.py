"""The plain-loop example, run as a user would: crash, resume, and checkpoints that never change training."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ..helpers import EXAMPLES, example_report, run_cli

EXAMPLE = EXAMPLES / "plain_loop.py"


def _report(tmp_path: Path, name: str, *args: str) -> dict[str, Any]:
    """Run the example in this process (the runs that end normally) and read its report."""
    return example_report("plain_loop", tmp_path, name, *args)


def test_crash_then_resume_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    folder = str(tmp_path / "run")
    common = ["--save-folder", folder, "--steps", "40"]
    crashed = subprocess.run(
        [sys.executable, str(EXAMPLE), *common, "--crash-at-step", "27"], capture_output=True, text=True, timeout=300
    )
    assert crashed.returncode == 3, crashed.stderr
    resumed_report = tmp_path / "resumed.json"
    resumed = subprocess.run(
        [sys.executable, str(EXAMPLE), *common, "--report", str(resumed_report)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr
    got = json.loads(resumed_report.read_text())
    # The newest checkpoint the crash left complete: step 25's async save may still have been in
    # flight two (fast) steps later, when the process died; then step 20's is the newest.
    assert got["start_step"] in (20, 25)
    assert got["final_step"] == 40
    whole = _report(tmp_path, "whole", "--save-folder", str(tmp_path / "whole"), "--steps", "40")
    assert whole["start_step"] == 0 and got["state_digest"] == whole["state_digest"]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_saving_at_every_step_leaves_training_bit_identical(tmp_path: Path, mode: str) -> None:
    plain = _report(tmp_path, "plain", "--save-folder", str(tmp_path / "unused"), "--steps", "23", "--no-ckptkeeper")
    assert not (tmp_path / "unused").exists()
    every = _report(
        tmp_path,
        "every",
        *("--save-folder", str(tmp_path / "every"), "--steps", "23"),
        *("--save-interval", "1", "--ephemeral-save-interval", "none", "--save-mode", mode),
    )
    assert (tmp_path / "every" / "step0").is_dir() and (tmp_path / "every" / "step23").is_dir()
    assert every["state_digest"] == plain["state_digest"]


def test_the_builtin_trainer_is_just_as_invisible(tmp_path: Path) -> None:
    def train(folder: str, *flags: str) -> str:
        # In this process, like the example's runs that end normally.
        report = tmp_path / (Path(folder).name + ".json")
        cmd = ["train", "--save-folder", folder, "--steps", "12", "--hidden", "16", *flags, "--report", str(report)]
        out = run_cli(*cmd, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        return str(json.loads(report.read_text())["state_digest"])

    rare = train(str(tmp_path / "rare"), "--save-interval", "none", "--pre-train-checkpoint", "false")
    every = train(str(tmp_path / "every"), "--save-interval", "1", "--pre-train-checkpoint", "true")
    assert every == rare
