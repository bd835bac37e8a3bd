"""The ``ckptkeeper`` command, run as a user would: a real process, a real crash, a real resume.

Checks of a command's output on a finished run call ``main()`` in this process (``run_cli``): a fresh
interpreter would spend seconds importing torch for each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..helpers import run_cli


def ck(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, "-m", "ckptkeeper", "-q", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=240
    )


TRAIN = ["--steps", "30", "--save-interval", "10", "--ephemeral-save-interval", "4"]


# Async only: the sync CLI path crashes and resumes in tests/trust/test_fallback.py, and sync
# saves equal async ones bit for bit in tests/integrations/test_examples.py.
@pytest.mark.parametrize("mode", ["--save-async"])
def test_crash_resume_and_uninterrupted_runs_agree(tmp_path: Path, mode: str) -> None:
    crashed = ck("train", "--save-folder", "run", *TRAIN, mode, "--crash-at-step", "23", cwd=tmp_path)
    assert crashed.returncode == 75, crashed.stderr
    assert "simulated crash right after step 23" in crashed.stderr
    resumed = ck("train", "--save-folder", "run", *TRAIN, mode, "--report", "resumed.json", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    clean = ck("train", "--save-folder", "clean", *TRAIN, mode, "--report", "clean.json", cwd=tmp_path)
    assert clean.returncode == 0, clean.stderr
    r = json.loads((tmp_path / "resumed.json").read_text())
    c = json.loads((tmp_path / "clean.json").read_text())
    assert r["start_step"] in (16, 20) and r["final_step"] == 30 == c["final_step"]
    assert c["start_step"] == 0 and len(c["losses"]) == 30
    assert r["state_digest"] == c["state_digest"]
    assert all(r["losses"][k] == c["losses"][k] for k in r["losses"])
    assert len(r["state_digest"]) == 64


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 30-step CLI run (trained once; each test works on its own copy)."""
    d = tmp_path_factory.mktemp("finished")
    assert ck("train", "--save-folder", "run", *TRAIN, cwd=d).returncode == 0
    return d / "run"


def _copy_of(run: Path, tmp_path: Path) -> None:
    import shutil

    shutil.copytree(run, tmp_path / "run", symlinks=True)
    for lease in (tmp_path / "run").glob(".ckptkeeper-lease*"):
        lease.unlink()  # the copy is nobody's run yet


def test_ls_table_and_json(tmp_path: Path, finished_run: Path) -> None:
    _copy_of(finished_run, tmp_path)
    (tmp_path / "run" / "step31").mkdir()  # an incomplete leftover
    table = run_cli("-q", "ls", "run", cwd=tmp_path)
    assert table.returncode == 0
    assert "permanent" in table.stdout and "ephemeral" in table.stdout and "NO" in table.stdout
    rows = json.loads(run_cli("-q", "ls", "run", "--json", cwd=tmp_path).stdout)
    by_step = {row["step"]: row for row in rows}
    assert sorted(by_step) == [0, 10, 20, 28, 30, 31]
    assert by_step[28]["ephemeral"] is True and by_step[30]["ephemeral"] is False
    assert by_step[31]["complete"] is False and by_step[0]["complete"] is True
    assert all(row["bytes"] > 0 for row in rows if row["complete"])
    assert by_step[10]["path"].endswith("step10")


def test_a_finished_folder_says_so_and_exits_zero(tmp_path: Path, finished_run: Path) -> None:
    _copy_of(finished_run, tmp_path)
    before = sorted(os.listdir(tmp_path / "run"))
    again = run_cli("-q", "train", "--save-folder", "run", "--steps", "25", "--report", "r.json", cwd=tmp_path)
    assert again.returncode == 0
    assert "already holds step 30" in again.stdout
    assert "trained no step" in again.stdout and "trained steps" not in again.stdout  # not "30..30"
    assert sorted(os.listdir(tmp_path / "run")) == before
    assert json.loads((tmp_path / "r.json").read_text())["losses"] == {}


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--save-interval", "5", "--ephemeral-save-interval", "10"], "'ephemeral_save_interval'"),
        (["--save-interval", "0"], "--save-interval"),
        (["--remove", "sometimes"], "--remove"),
    ],
)
def test_bad_settings_exit_2_and_name_the_field(tmp_path: Path, args: list[str], needle: str) -> None:
    res = ck("train", "--save-folder", "run", "--steps", "3", *args, cwd=tmp_path)
    assert res.returncode == 2
    assert needle in res.stderr
    assert not (tmp_path / "run").exists()


def test_unparseable_values_are_rejected(tmp_path: Path) -> None:
    res = ck("train", "--save-folder", "run", "--steps", "3", "--fixed-steps", "a,b", cwd=tmp_path)
    assert res.returncode == 2 and "comma-separated" in res.stderr


def test_console_script_is_installed(tmp_path: Path) -> None:
    exe = Path(sys.executable).parent / "ckptkeeper"
    (tmp_path / "empty").mkdir()
    res = subprocess.run([str(exe), "ls", "empty"], capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0 and "no checkpoint folders" in res.stdout
