"""A user's mistake on the ``ckptkeeper`` command line ends it with one clear line, never a traceback.

Each bad invocation runs through the real entry point (``python -m ckptkeeper``) and fails before any
training starts: the exit code is non-zero, stderr holds exactly one non-empty line naming the flag,
variable or path at fault, and no traceback.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptkeeper.cli import main

from ..helpers import run_cli


def ck(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "ckptkeeper", "-q", *args],
        capture_output=True, text=True, cwd=cwd, env=full_env, timeout=120,
    )  # fmt: skip


def one_error_line(res: subprocess.CompletedProcess[str], needle: str) -> str:
    """Assert ``res`` failed with exactly one stderr line that contains ``needle``; returns that line."""
    assert res.returncode != 0, (res.stdout, res.stderr)
    assert "Traceback" not in res.stderr, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    assert needle in lines[0], lines[0]
    return lines[0]


TRAIN = ["train", "--save-folder", "run", "--steps", "3"]

# Every bad flag value, checked in-process (fast); a representative few also run as real processes.
BAD_FLAGS = [
    (["--hidden", "-5"], "--hidden"),
    (["--hidden", "0"], "--hidden"),
    (["--hidden", "wide"], "--hidden"),
    (["--crash-at-step", "-1"], "--crash-at-step"),
    (["--seed", "-1"], "--seed"),
    (["--seed", str(2**40)], "--seed"),
    (["--save-interval", "0"], "--save-interval"),
    (["--save-interval", "-3"], "--save-interval"),
    (["--ephemeral-save-interval", "0"], "--ephemeral-save-interval"),
    (["--ephemeral-cooldown", "-1"], "--ephemeral-cooldown"),
    (["--ephemeral-cooldown", "soon"], "--ephemeral-cooldown"),
    (["--remove", "sometimes"], "--remove"),
    (["--fixed-steps", "3,-7"], "--fixed-steps"),
    (["--steps", "-1"], "--steps"),
]
BAD_BENCH_FLAGS = [
    (["--repeats", "0"], "--repeats"),
    (["--repeats", "-2"], "--repeats"),
    (["--model-mib", "-1"], "--model-mib"),
    (["--model-mib", "0"], "--model-mib"),
    (["--model-mib", "big"], "--model-mib"),
    (["--dir", "/no/such/folder"], "--dir"),
    (["--dir", "a-file"], "--dir"),
]


@pytest.mark.parametrize(
    ("args", "needle"),
    [(TRAIN + a, n) for a, n in BAD_FLAGS] + [(["bench", *a], n) for a, n in BAD_BENCH_FLAGS],
)
def test_every_bad_flag_is_one_line_naming_it(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    needle: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("not a folder")
    with pytest.raises(SystemExit) as exit_info:
        main(["-q", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"ckptkeeper {args[0]}: error: argument {needle}"), err
    assert not (tmp_path / "run").exists()  # nothing started


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ([*TRAIN, "--hidden", "-5"], "--hidden"),
        ([*TRAIN, "--hidden", "0"], "--hidden"),
        ([*TRAIN, "--crash-at-step", "-1"], "--crash-at-step"),
        ([*TRAIN, "--save-interval", "0"], "--save-interval"),
        ([*TRAIN, "--remove", "sometimes"], "--remove"),
        (["bench", "--repeats", "0"], "--repeats"),
        (["bench", "--model-mib", "-1"], "--model-mib"),
        (["bench", "--dir", "/no/such/folder"], "--dir"),
    ],
)
def test_bad_flags_through_the_real_command(tmp_path: Path, args: list[str], needle: str) -> None:
    res = ck(*args, cwd=tmp_path)
    line = one_error_line(res, needle)
    assert line.startswith(f"ckptkeeper {args[0]}: error: argument {needle}"), line
    assert res.returncode == 2
    assert not (tmp_path / "run").exists()  # nothing started


def test_the_remove_flag_lists_the_strategies(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([*TRAIN, "--remove", "sometimes"])
    err = capsys.readouterr().err
    assert all(s in err for s in ("ephemeral_only", "all_non_permanent", "never")), err


def test_a_missing_bench_folder_says_it_does_not_exist(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--dir", str(tmp_path / "gone")])
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("env", "folder"),
    [
        ({"CKPTKEEPER_RETRIES": "abc"}, "s3://some-bucket/run"),
        ({"CKPTKEEPER_STAGING_BUDGET": "abc"}, "run"),
    ],
)
def test_bad_environment_variables_are_one_line_naming_the_variable(
    tmp_path: Path, env: dict[str, str], folder: str
) -> None:
    if folder.startswith("s3://"):
        pytest.importorskip("boto3")
    name = next(iter(env))
    # No server is needed: the value is checked before any request (the endpoint would refuse anyway).
    env = {**env, "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y"}
    res = ck("train", "--save-folder", folder, "--steps", "3", cwd=tmp_path, env=env)
    line = one_error_line(res, name)
    assert res.returncode == 1
    assert line.startswith("ckptkeeper train: error: ") and "'abc'" in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value", ["abc", "0", "-4", "2.5"])
def test_bad_retries_name_the_variable_the_value_and_the_rule(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    from ckptkeeper.errors import ConfigurationError
    from ckptkeeper.storage.s3 import retries_from_env

    monkeypatch.setenv("CKPTKEEPER_RETRIES", value)
    with pytest.raises(ConfigurationError, match="CKPTKEEPER_RETRIES") as info:
        retries_from_env()
    assert repr(value) in str(info.value) and "positive integer" in str(info.value)


@pytest.mark.parametrize(("value", "want"), [(None, 10), ("", 10), ("3", 3), (" 1 ", 1)])
def test_good_retries_are_read(monkeypatch: pytest.MonkeyPatch, value: str | None, want: int) -> None:
    from ckptkeeper.storage.s3 import retries_from_env

    if value is None:
        monkeypatch.delenv("CKPTKEEPER_RETRIES", raising=False)
    else:
        monkeypatch.setenv("CKPTKEEPER_RETRIES", value)
    assert retries_from_env() == want


# ---------------------------------------------------------------- ls


def test_ls_of_a_missing_path_fails(tmp_path: Path) -> None:
    res = ck("ls", str(tmp_path / "nowhere"), cwd=tmp_path)
    line = one_error_line(res, "nowhere")
    assert res.returncode == 1
    assert line == f"ckptkeeper ls: error: {tmp_path / 'nowhere'} does not exist"


def test_ls_of_a_regular_file_fails(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    res = ck("ls", "notes.txt", cwd=tmp_path)
    assert one_error_line(res, "notes.txt") == "ckptkeeper ls: error: notes.txt is not a folder"
    assert res.returncode == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any folder, so a chmod 000 folder is readable here")
def test_ls_of_an_unreadable_folder_fails(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0)
    try:
        res = ck("ls", "locked", cwd=tmp_path)
    finally:
        locked.chmod(0o755)
    assert one_error_line(res, "locked") == "ckptkeeper ls: error: locked cannot be read (permission denied)"
    assert res.returncode == 1


def test_ls_reports_permission_denied_in_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The same check as above, without needing a non-root user: listing this one folder is refused.
    locked = tmp_path / "locked"
    locked.mkdir()
    real_listdir = os.listdir

    def listdir(path: str | os.PathLike[str] = ".") -> list[str]:
        if os.fspath(path) == str(locked):
            raise PermissionError(13, "Permission denied", str(path))
        return real_listdir(path)

    monkeypatch.setattr(os, "listdir", listdir)
    monkeypatch.setattr(logging, "basicConfig", lambda **_: None)  # leave pytest's logging alone
    assert main(["-q", "ls", str(locked)]) == 1
    assert capsys.readouterr().err == f"ckptkeeper ls: error: {locked} cannot be read (permission denied)\n"


@pytest.mark.parametrize("where", ["empty", "memory://nothing/here"])
def test_ls_of_an_empty_folder_or_prefix_is_fine(tmp_path: Path, where: str) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "not-a-checkpoint").mkdir()
    # Not a mistake, so in this process: listing imports torch, seconds in a fresh interpreter.
    res = run_cli("ls", where, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "no checkpoint folders" in res.stdout


# ---------------------------------------------------------------- Ctrl-C


def test_ctrl_c_is_exit_130_and_one_line(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "ckptkeeper", "-q", "train", "--save-folder", "run", "--steps", "100000000",
           "--save-interval", "none"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "run" / "step0").is_dir():  # the pre-train checkpoint: training is under way
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "training did not start within 60 s"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err
    assert [line for line in err.splitlines() if line.strip()] == ["ckptkeeper train: interrupted"]
