"""The deleter's own thread: removals are invisible at once, the files go later on a thread that
is neither training's nor the save's, and a deletion that fails loses nothing and kills nothing."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from ckptkeeper import Checkpointer, CheckpointManager, CheckpointPolicyConfig, StorageError
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

    def broken(path: str, *args: Any, onerror: Any = None, onexc: Any = None, **kwargs: Any) -> None:
        # rmtree's way of telling about a file it could not delete.
        err = OSError(5, "Input/output error", os.path.join(path, "model_and_optim"))
        if onexc is not None:
            onexc(os.unlink, err.filename, err)
        else:
            onerror(os.unlink, err.filename, (OSError, err, None))

    monkeypatch.setattr(deleter_mod.shutil, "rmtree", broken)
    ckpt.remove(str(tmp_path / "step1"), background=True)  # never raises into the caller
    failures = ckpt.wait_for_removals()
    assert [p for p, _ in failures] == [str(tmp_path / "step1")]
    assert isinstance(failures[0][1], StorageError)
    assert "Input/output error" in str(failures[0][1]) and "already invisible" in caplog.text
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


def _manager(folder: str) -> CheckpointManager:
    cfg = CheckpointPolicyConfig(
        save_interval=100, ephemeral_save_interval=1, pre_train_checkpoint=False, save_async=False
    )
    mgr = CheckpointManager(folder, model=nn.Linear(2, 2), config=cfg)
    mgr.restore()
    return mgr


def test_a_removal_the_os_refuses_does_not_stop_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Found by an outside attack: an OSError from making a checkpoint invisible (rename refused)
    # escaped into save_if_due.
    real = os.rename

    def refusing(src: str, dst: str, *args: Any, **kwargs: Any) -> None:
        if ".trash-" in str(dst):
            raise PermissionError(13, "Permission denied", str(src))
        real(src, dst, *args, **kwargs)

    mgr = _manager(str(tmp_path))
    monkeypatch.setattr(deleter_mod.os, "rename", refusing)
    for step in range(1, 5):
        mgr.save_if_due(step)
    mgr.close(final_save=False)
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("step")) == ["step1", "step2", "step3", "step4"]


def test_the_manager_keeps_failed_deletions_for_its_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mgr = _manager(str(tmp_path))
    mgr.save_if_due(1)
    (tmp_path / "step1" / "notes.txt").write_text("mine")  # somebody's file: only ours are deleted
    real = os.unlink

    def refusing(path: Any, *args: Any, **kwargs: Any) -> None:
        if "__0_0.distcp" in str(path):
            raise PermissionError(13, "Permission denied", str(path))
        real(path, *args, **kwargs)

    monkeypatch.setattr(deleter_mod.os, "unlink", refusing)
    mgr.save_if_due(2)
    mgr.save_if_due(3)
    mgr.wait_for_bookkeeping()
    assert [p for p, _ in mgr.removal_failures] == [str(tmp_path / "step1")]
    message = str(mgr.removal_failures[0][1])
    assert "__0_0.distcp" in message and "by hand" in message
    assert (tmp_path / "step1" / "notes.txt").read_text() == "mine"
    mgr.close(final_save=False)


def test_a_listed_name_behind_somebodys_link_is_never_reached(tmp_path: Path) -> None:
    # Found by an outside attack: the listed-files-only removal unlinked folder/rel, following a
    # link in the middle of the path to delete a file outside the checkpoint.
    from ckptkeeper.engine.record import CommitRecord, FileEntry, digest_bytes
    from ckptkeeper.storage.layout import COMMIT_RECORD

    from ..helpers import forge

    precious = tmp_path / "precious"
    precious.mkdir()
    body = b"the user's data"
    (precious / "victim.txt").write_bytes(body)
    ckpt = Checkpointer()
    ckpt.save(str(tmp_path / "run"), 1, small_state())
    folder = tmp_path / "run" / "step1"
    os.symlink(precious, folder / "x")
    files = dict(CommitRecord.from_json((folder / COMMIT_RECORD).read_bytes(), "t").files)
    files["x/victim.txt"] = FileEntry(len(body), digest_bytes(body))
    forge(folder, files=files)
    ckpt.remove(str(folder), background=True)
    ckpt.wait_for_removals()
    assert (precious / "victim.txt").read_bytes() == body
    assert os.path.islink(folder / "x")  # somebody's link stays; the checkpoint's own files went
    assert not (folder / "model_and_optim").exists()


def test_a_second_remover_arriving_late_leaves_the_first_ones_work_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found by an outside attack: a remover that saw the record, then found it gone (another
    # remover deleted it first), took the folder for ours as a whole, user files included.
    first, second = Checkpointer(), Checkpointer()
    first.save(str(tmp_path), 1, small_state())
    folder = str(tmp_path / "step1")
    (tmp_path / "step1" / "eval_results.json").write_text("{}")
    real = deleter_mod.local_record_is_ours

    def checks_then_first_runs(path: str) -> bool:
        ours = real(path)
        monkeypatch.setattr(deleter_mod, "local_record_is_ours", real)
        first.remove(folder)  # in between: record unlinked, listed files deleted
        return ours

    monkeypatch.setattr(deleter_mod, "local_record_is_ours", checks_then_first_runs)
    second.remove(folder, background=True)
    assert second.wait_for_removals() == []
    assert (tmp_path / "step1" / "eval_results.json").read_text() == "{}"


class _OldRemove(Checkpointer):
    """A subclass written against remove(path) alone."""

    def __init__(self) -> None:
        super().__init__()
        self.removed: list[str] = []

    def remove(self, path: str) -> None:  # type: ignore[override]
        self.removed.append(os.path.basename(path))
        super().remove(path)


def test_a_subclass_overriding_remove_with_the_path_alone_still_removes(tmp_path: Path) -> None:
    # Found by an outside attack: the manager passed the background hook to it and crashed training.
    cfg = CheckpointPolicyConfig(
        save_interval=100, ephemeral_save_interval=1, pre_train_checkpoint=False, save_async=False
    )
    ckpt = _OldRemove()
    mgr = CheckpointManager(str(tmp_path), model=nn.Linear(2, 2), config=cfg, checkpointer=ckpt)
    mgr.restore()
    for step in range(1, 4):
        mgr.save_if_due(step)
    mgr.close(final_save=False)
    assert ckpt.removed and ckpt.removed == sorted(ckpt.removed)  # superseded ones, oldest first
    left = sorted(p for p in os.listdir(tmp_path) if p.startswith("step"))
    assert not set(left) & set(ckpt.removed) and "step3" in left
