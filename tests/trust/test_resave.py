"""Saving a step again where a checkpoint of that step already is (a forced re-save, a resumed run
saving the step it resumed from): the checkpoint there stays whole until the new one has replaced
it, whatever happens in between, and files somebody else put in its folder are never lost."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptkeeper import Checkpointer, CheckpointSaveError, TrainingState, state_digest
from ckptkeeper.engine.deleter import clean_save_folder
from ckptkeeper.storage import local as local_mod

_CHILD = r"""
import os, sys, torch
from ckptkeeper import Checkpointer, TrainingState
from ckptkeeper.storage import local as local_mod
folder, where = sys.argv[1], sys.argv[2]
final = os.path.join(folder, "step5")
real_rename, real_exchange = os.rename, local_mod.exchange_paths

def rename(src, dst, *args, **kwargs):
    # Killed as the new checkpoint is about to be renamed into place: any old one moved away.
    if where == "hand-over" and os.fspath(dst) == final:
        os._exit(9)
    return real_rename(src, dst, *args, **kwargs)

def exchange(a, b):
    done = real_exchange(a, b)
    if where == "after the swap" and done:
        os._exit(9)  # the new checkpoint in place, the old one not yet deleted
    return done

os.rename = rename
local_mod.exchange_paths = exchange
torch.manual_seed(1)
Checkpointer().save(folder, 5, TrainingState(torch.nn.Linear(3, 3)))
"""


def _model(seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 3)


def _loaded(path: Path) -> str:
    model = torch.nn.Linear(3, 3)
    Checkpointer().load(str(path), TrainingState(model))
    return state_digest(model)


@pytest.mark.parametrize("where", ["hand-over", "after the swap"])
def test_a_kill_while_a_step_is_saved_again_leaves_a_complete_checkpoint_of_that_step(
    tmp_path: Path, where: str
) -> None:
    old, new = state_digest(_model(0)), state_digest(_model(1))
    Checkpointer().save(str(tmp_path), 5, TrainingState(_model(0)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2] / "src"), *sys.path])}
    argv = [sys.executable, "-c", _CHILD, str(tmp_path), where]
    child = subprocess.run(argv, env=env, capture_output=True, timeout=120)
    assert child.returncode in (0, 9), child.stderr.decode()[-2000:]
    # step5 holds a complete checkpoint: the old one, or the new one once it was in place.
    assert _loaded(tmp_path / "step5") in ({old, new} if where == "hand-over" else {new})
    clean_save_folder(str(tmp_path))  # what the next run does when it opens the folder
    assert sorted(os.listdir(tmp_path)) == ["step5"]
    assert _loaded(tmp_path / "step5") in {old, new}


@pytest.mark.parametrize("swap", [True, False], ids=["swapped", "without a swap"])
def test_saving_a_step_again_replaces_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, swap: bool) -> None:
    if not swap:  # a system or filesystem without an atomic swap of two folders
        monkeypatch.setattr(local_mod, "exchange_paths", lambda a, b: False)
    ck = Checkpointer()
    ck.save(str(tmp_path), 5, TrainingState(_model(0)))
    ck.save(str(tmp_path), 5, TrainingState(_model(1)))
    assert _loaded(tmp_path / "step5") == state_digest(_model(1))
    assert sorted(os.listdir(tmp_path)) == ["step5"]  # nothing left behind


@pytest.mark.parametrize("swap", [True, False], ids=["swapped", "without a swap"])
@pytest.mark.parametrize("when", ["before the save", "during the save"])
def test_a_step_folder_holding_somebodys_files_is_not_saved_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, swap: bool, when: str
) -> None:
    # Found here: eval outputs written into a checkpoint's folder, then the same step saved again.
    # The old checkpoint's files were deleted (its record first), the rename of the new one onto
    # the folder still holding the eval outputs failed, and the step had no checkpoint at all.
    if not swap:
        monkeypatch.setattr(local_mod, "exchange_paths", lambda a, b: False)
    ck = Checkpointer()
    ck.save(str(tmp_path), 5, TrainingState(_model(0)))
    notes = tmp_path / "step5" / "eval" / "notes.txt"

    def write_notes() -> None:
        notes.parent.mkdir()
        notes.write_text("mine")

    if when == "before the save":
        write_notes()
        state = TrainingState(_model(1))
    else:
        state = TrainingState(_model(1), extra={"x": _Hook(write_notes)})  # runs while the save is under way
    with pytest.raises(CheckpointSaveError, match=r"eval/notes\.txt.*move") as err:
        ck.save(str(tmp_path), 5, state)
    assert "unchanged" in str(err.value)
    assert notes.read_text() == "mine"
    assert _loaded(tmp_path / "step5") == state_digest(_model(0))
    clean_save_folder(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["step5"]


class _Hook:
    """An extra whose state_dict() runs ``fn`` (while the save it belongs to is under way)."""

    def __init__(self, fn: object) -> None:
        self.fn = fn

    def state_dict(self) -> dict[str, int]:
        self.fn()  # type: ignore[operator]
        return {"n": 1}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        pass
