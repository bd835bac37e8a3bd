"""The deleter's own thread: removals are invisible at once, the files go later on a thread that
is neither training's nor the save's, and a deletion that fails loses nothing and kills nothing."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from ckptkeeper import Checkpointer, CheckpointManager, CheckpointPolicyConfig
from ckptkeeper.engine import deleter as deleter_mod

from ..helpers import small_state


def _blocking_rmtree(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, list[str]]:
    """rmtree waits for a go-ahead and records which thread ran it."""
    go, threads = threading.Event(), []
    real = deleter_mod.shutil.rmtree

    def slow(path: str, *args: Any, **kwargs: Any) -> None:
        threads.append(threading.current_thread().name)
        assert go.wait(30), "the test never let the deletion go on"
        real(path, *args, **kwargs)

    monkeypatch.setattr(deleter_mod.shutil, "rmtree", slow)
    return go, threads


def test_background_removal_is_invisible_at_once_and_deletes_on_the_deleter_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = Checkpointer()
    folder = str(tmp_path)
    for step in (1, 2):
        ckpt.save(folder, step, small_state())
    go, threads = _blocking_rmtree(monkeypatch)
    ckpt.remove(os.path.join(folder, "step1"), background=True)
    # Returned while the deletion is still held: the checkpoint is already gone from every listing.
    assert not (tmp_path / "step1").exists()
    assert [s for s, _ in ckpt.find_checkpoints(folder)] == [2]
    assert ckpt.deleter.pending == 1
    trash = [p for p in os.listdir(folder) if p.startswith(".trash-step1-")]
    assert len(trash) == 1  # files not deleted yet
    go.set()
    assert ckpt.wait_for_removals() == []
    assert threads and threads[0].startswith("ckptkeeper-delete")
    assert not [p for p in os.listdir(folder) if p.startswith(".trash-")]
    ckpt.close()


def test_synchronous_removal_is_the_default(tmp_path: Path) -> None:
    ckpt = Checkpointer()
    ckpt.save(str(tmp_path), 1, small_state())
    ckpt.remove(str(tmp_path / "step1"))
    assert os.listdir(tmp_path) == []
    assert ckpt.deleter.pending == 0


def test_a_failing_deletion_is_reported_not_raised_and_cleaned_at_the_next_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = Checkpointer()
    folder = str(tmp_path)
    for step in (1, 2):
        ckpt.save(folder, step, small_state())

    def broken(path: str, *args: Any, **kwargs: Any) -> None:
        raise OSError(5, "Input/output error", path)

    monkeypatch.setattr(deleter_mod.shutil, "rmtree", broken)
    ckpt.remove(str(tmp_path / "step1"), background=True)  # never raises into the caller
    failures = ckpt.wait_for_removals()
    assert [p for p, _ in failures] == [str(tmp_path / "step1")]
    assert isinstance(failures[0][1], OSError)
    assert "already invisible" in caplog.text
    assert ckpt.wait_for_removals() == []  # reported once
    assert [s for s, _ in ckpt.find_checkpoints(folder)] == [2]
    ckpt.close()
    monkeypatch.undo()
    # The leftover is trash that no listing shows; opening the folder again finishes the job.
    assert [p for p in os.listdir(folder) if p.startswith(".trash-step1-")]
    cleaned = Checkpointer().clean_scratch(folder)
    assert len(cleaned) == 1 and ".trash-step1-" in cleaned[0]
    assert sorted(os.listdir(folder)) == ["step2"]


def test_the_manager_removes_on_the_deleter_thread_and_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = str(tmp_path)
    cfg = CheckpointPolicyConfig(save_interval=100, ephemeral_save_interval=1, pre_train_checkpoint=False)
    mgr = CheckpointManager(folder, model=nn.Linear(2, 2), config=cfg)
    mgr.restore()
    go, threads = _blocking_rmtree(monkeypatch)
    mgr.save_if_due(1)
    mgr.save_if_due(2)  # supersedes the ephemeral step 1 once it is complete...
    mgr.save_if_due(3)  # ...which this save waits for first, then removes step 1
    assert not (tmp_path / "step1").exists()
    released = threading.Timer(0.2, go.set)
    released.start()
    mgr.wait_for_bookkeeping()  # returns only once the held deletion went through
    assert threads and all(t.startswith("ckptkeeper-delete") for t in threads)
    assert not [p for p in os.listdir(folder) if p.startswith(".trash-")]
    mgr.close(final_save=False)
    released.join()
