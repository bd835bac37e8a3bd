"""One writer per save folder: a second run fails at start naming the holder; a lease whose
holder is gone is taken over with a warning; a run that loses its lease stops."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptkeeper import Checkpointer, CheckpointerCallback, SaveFolderInUseError, SaveFolderLease, storage_for
from ckptkeeper.storage.layout import LEASE_FILE

from ..helpers import run_cli, tiny_trainer


def _cb() -> CheckpointerCallback:
    return CheckpointerCallback(save_interval=2, save_async=False)


@pytest.mark.parametrize("scheme", ["local", "memory"])
def test_second_trainer_fails_naming_the_holder_and_overwrites_nothing(tmp_path: Path, scheme: str) -> None:
    folder = str(tmp_path / "run") if scheme == "local" else "memory://run"
    first = tiny_trainer(folder, _cb(), 4)
    first.fit()
    before = {s: Checkpointer().read_record(p).created_unix for s, p in Checkpointer().find_checkpoints(folder)}
    holder = SaveFolderLease(folder)
    holder.acquire()  # a live run holds the folder now
    try:
        second = tiny_trainer(folder, _cb(), 8)
        with pytest.raises(SaveFolderInUseError, match=rf"pid {os.getpid()} on host {socket.gethostname()}"):
            second.fit()
        assert second.global_step == 0
        after = {s: Checkpointer().read_record(p).created_unix for s, p in Checkpointer().find_checkpoints(folder)}
        assert after == before
    finally:
        holder.release()
    assert not storage_for(folder).exists(storage_for(folder).join(folder, LEASE_FILE))


def test_two_cli_runs_at_once(tmp_path: Path) -> None:
    train = ["-q", "train", "--save-folder", "run", "--save-interval", "50"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    first = subprocess.Popen([sys.executable, "-m", "ckptkeeper", *train, "--steps", "100000"], cwd=tmp_path, env=env,
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.time() + 120
        while not (tmp_path / "run" / LEASE_FILE).exists():
            assert time.time() < deadline and first.poll() is None, "the first run never took the lease"
            time.sleep(0.2)
        # The second run in this process: a fresh interpreter would spend seconds importing torch.
        second = run_cli(*train, "--steps", "10", cwd=tmp_path)
        assert second.returncode == 1
        assert f"pid {first.pid}" in second.stderr and "in use by another run" in second.stderr
        assert "Traceback" not in second.stderr
    finally:
        first.kill()
        first.wait()


def test_a_lease_whose_process_is_gone_is_taken_over(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    folder = tmp_path / "run"
    folder.mkdir()
    doc = {"format": "ckptkeeper-lease", "owner": "feedface", "host": socket.gethostname(), "pid": int(dead.stdout),
           "started": None, "renewed_unix": time.time(), "expires_unix": time.time() + 3600}  # fmt: skip
    (folder / LEASE_FILE).write_text(json.dumps(doc))
    with caplog.at_level(logging.WARNING):
        tiny_trainer(str(folder), _cb(), 2).fit()
    assert "taking over the lease" in caplog.text and "feedface" in caplog.text


def test_an_expired_lease_of_another_host_is_taken_over(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    doc = {"format": "ckptkeeper-lease", "owner": "0ther", "host": "elsewhere", "pid": 1,
           "renewed_unix": time.time() - 900, "expires_unix": time.time() - 600}  # fmt: skip
    (folder / LEASE_FILE).write_text(json.dumps(doc))
    t = tiny_trainer(str(folder), _cb(), 2)
    t.fit()
    assert t.global_step == 2
    fresh = dict(doc, expires_unix=time.time() + 600)
    (folder / LEASE_FILE).write_text(json.dumps(fresh))
    with pytest.raises(SaveFolderInUseError, match="host elsewhere"):
        tiny_trainer(str(folder), _cb(), 4).fit()


def test_a_run_that_loses_its_lease_stops(tmp_path: Path) -> None:
    from ckptkeeper import Callback

    folder = tmp_path / "run"

    class Thief(Callback):
        def post_train_batch(self) -> None:
            if self.step == 3:
                lease = self.trainer.lease
                assert lease is not None
                (folder / LEASE_FILE).write_text(json.dumps({"owner": "thief", "host": "h", "pid": 1}))
                lease.renew()

    t = tiny_trainer(str(folder), _cb(), 10, extra_callbacks=[Thief()])
    with pytest.raises(SaveFolderInUseError, match="took over the lease"):
        t.fit()
    assert t.global_step == 3
