"""Saving a step again where a checkpoint of that step already is (a forced re-save, a resumed run
saving the step it resumed from): the checkpoint there stays whole until the new one has replaced
it, whatever happens in between, and files somebody else put in its folder are never lost."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
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
folder, where, swap = sys.argv[1], sys.argv[2], sys.argv[3] == "swap"
final = os.path.join(folder, "step5")
real_rename, real_exchange = os.rename, local_mod.exchange_paths

def rename(src, dst, *args, **kwargs):
    # Killed as the new checkpoint is about to be renamed into place: any old one moved away.
    if where == "hand-over" and os.fspath(dst) == final:
        os._exit(9)
    return real_rename(src, dst, *args, **kwargs)

def exchange(a, b):
    done = real_exchange(a, b) if swap else False  # False: a filesystem without the swap
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


def _saved_once(folder: Path) -> tuple[Checkpointer, Callable[[str, str], bool]]:
    """A checkpointer that saved step 5 of _model(0) in ``folder``, and the real folder swap."""
    ck = Checkpointer()
    ck.save(str(folder), 5, TrainingState(_model(0)))
    return ck, local_mod.exchange_paths


def _around_swaps(
    real: Callable[[str, str], bool],
    before: Callable[[], object] | None = None,
    after: Callable[[str], object] | None = None,
    back: Callable[[], object] | None = None,
) -> Callable[[str, str], bool]:
    """An exchange_paths that runs ``before`` / ``after(work path)`` around the save's swap (its
    first call) and ``back`` (which may raise) before any later call (the swap back)."""
    calls: list[str] = []

    def exchange(a: str, b: str) -> bool:
        calls.append(a)
        if len(calls) > 1:
            if back is not None:
                back()
            return real(a, b)
        if before is not None:
            before()
        done = real(a, b)
        if after is not None:
            after(a)
        return done

    return exchange


def _loaded(path: Path) -> str:
    model = torch.nn.Linear(3, 3)
    Checkpointer().load(str(path), TrainingState(model))
    return state_digest(model)


@pytest.mark.parametrize(("where", "swap"), [("hand-over", "swap"), ("after the swap", "swap")])
def test_a_kill_while_a_step_is_saved_again_leaves_a_complete_checkpoint_of_that_step(
    tmp_path: Path, where: str, swap: str
) -> None:
    old, new = state_digest(_model(0)), state_digest(_model(1))
    Checkpointer().save(str(tmp_path), 5, TrainingState(_model(0)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2] / "src"), *sys.path])}
    argv = [sys.executable, "-c", _CHILD, str(tmp_path), where, swap]
    child = subprocess.run(argv, env=env, capture_output=True, timeout=120)
    assert child.returncode in (0, 9), child.stderr.decode()[-2000:]
    # step5 holds a complete checkpoint at every moment: the old one, or the new one once in place.
    assert _loaded(tmp_path / "step5") in ({old, new} if where == "hand-over" else {new})
    clean_save_folder(str(tmp_path))  # what the next run does when it opens the folder
    assert sorted(os.listdir(tmp_path)) == ["step5"]
    assert _loaded(tmp_path / "step5") in ({old, new} if where == "hand-over" else {new})


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


@pytest.mark.parametrize("change", ["a file appears", "its record goes"])
def test_a_step_folder_changed_just_before_the_swap_is_put_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    # Found by an outside attack: a file put in the folder (or its record removed by another
    # process's retention) between the last check and the swap went out with the old checkpoint
    # and was deleted with it.
    ck, real = _saved_once(tmp_path)
    notes = tmp_path / "step5" / "eval.json"

    def late() -> None:
        notes.write_text("{}")
        if change == "its record goes":
            (tmp_path / "step5" / ".metadata.json").unlink()

    monkeypatch.setattr(local_mod, "exchange_paths", _around_swaps(real, before=late))
    why = "eval.json" if change == "a file appears" else "removed by something"
    with pytest.raises(CheckpointSaveError, match=why):
        ck.save(str(tmp_path), 5, TrainingState(_model(1)))
    assert notes.read_text() == "{}"
    if change == "a file appears":
        assert _loaded(tmp_path / "step5") == state_digest(_model(0))
    clean_save_folder(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["step5"]


def test_a_replaced_checkpoint_is_removed_as_removals_are(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Found by an outside attack: the replaced checkpoint was deleted silently (no remove event, a
    # failed deletion neither logged nor returned by wait_for_removals).
    import json

    from ckptkeeper.engine import deleter as deleter_mod

    sink = tmp_path / "events.jsonl"
    monkeypatch.setenv("CKPTKEEPER_METRICS", str(sink))
    folder = tmp_path / "run"
    ck = Checkpointer()
    ck.save(str(folder), 5, TrainingState(_model(0)))
    ck.save(str(folder), 5, TrainingState(_model(1)))
    events = [json.loads(line) for line in sink.read_text().splitlines()]
    assert [e["event"] for e in events] == ["save", "remove", "save"]
    assert events[1]["path"] == str(folder / "step5") and events[1]["step"] == 5
    assert ck.wait_for_removals() == []
    monkeypatch.setattr(deleter_mod, "_rmtree_collecting", lambda folder: [f"{folder}/x (Operation not permitted)"])
    ck.save(str(folder), 5, TrainingState(_model(0)))  # succeeds: the new checkpoint is in place
    assert _loaded(folder / "step5") == state_digest(_model(0))
    failures = ck.wait_for_removals()
    assert [p for p, _ in failures] == [str(folder / "step5")] and "Operation not permitted" in str(failures[0][1])
    monkeypatch.undo()
    clean_save_folder(str(folder))  # the trash left behind
    assert sorted(os.listdir(folder)) == ["step5"]


def test_a_subclass_that_removes_its_own_way_is_asked_for_the_replaced_checkpoint(tmp_path: Path) -> None:
    removed: list[str] = []

    class Archiving(Checkpointer):
        def remove(self, path: str, *args: object, **kwargs: object) -> None:  # type: ignore[override]
            removed.append(os.path.basename(path))
            super().remove(path)

    ck = Archiving()
    ck.save(str(tmp_path), 5, TrainingState(_model(0)))
    ck.save(str(tmp_path), 5, TrainingState(_model(1)))
    assert removed == ["step5"]
    assert _loaded(tmp_path / "step5") == state_digest(_model(1))


def test_a_step_folder_that_is_a_link_is_named_as_a_link(tmp_path: Path) -> None:
    # Found by an outside attack: a step5 linking to a real checkpoint was called "not a ckptkeeper
    # checkpoint (no commit record)", which sent its owner looking for the wrong problem.
    real = tmp_path / "elsewhere"
    Checkpointer().save(str(real), 5, TrainingState(_model(0)))
    run = tmp_path / "run"
    run.mkdir()
    (run / "step5").symlink_to(real / "step5")
    with pytest.raises(CheckpointSaveError, match=r"is a symbolic link.*remove the link"):
        Checkpointer().save(str(run), 5, TrainingState(_model(1)))
    assert (run / "step5").is_symlink() and _loaded(real / "step5") == state_digest(_model(0))


def test_a_step_put_in_place_by_another_process_meanwhile_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found by an outside attack: without a swap, two processes saving step 5 at once failed with
    # a bare "[Errno 39] Directory not empty".
    monkeypatch.setattr(local_mod, "exchange_paths", lambda a, b: False)
    ck = Checkpointer()
    ck.save(str(tmp_path), 5, TrainingState(_model(0)))
    real = local_mod.LocalStorage.rename_dir

    def other_process_first(self: local_mod.LocalStorage, src: str, dst: str) -> None:
        monkeypatch.setattr(local_mod.LocalStorage, "rename_dir", real)
        Checkpointer().save(str(tmp_path), 5, TrainingState(_model(2)))  # lands between removal and rename
        real(self, src, dst)

    monkeypatch.setattr(local_mod.LocalStorage, "rename_dir", other_process_first)
    with pytest.raises(CheckpointSaveError, match="another save of the same step"):
        ck.save(str(tmp_path), 5, TrainingState(_model(1)))
    monkeypatch.undo()
    assert _loaded(tmp_path / "step5") == state_digest(_model(2))
    clean_save_folder(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["step5"]


@pytest.mark.parametrize("kept", ["moved aside", "left hidden"])
def test_a_swap_that_cannot_go_back_keeps_somebodys_files_and_says_where(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kept: str
) -> None:
    # Found by an outside attack: when the swap back failed too, the failed save's clean-up deleted
    # the swapped-out folder (the old checkpoint and the files somebody had just put there) and the
    # error named a folder that did not exist.
    from ckptkeeper.engine import commit as commit_mod

    ck, real = _saved_once(tmp_path)
    notes = tmp_path / "step5" / "eval.json"

    def refused() -> None:
        raise OSError(5, "Input/output error", "the swap back")

    swaps = _around_swaps(real, before=lambda: notes.write_text("{}"), back=refused)
    monkeypatch.setattr(local_mod, "exchange_paths", swaps)
    if kept == "left hidden":
        real_rename = os.rename

        def no_aside(src: str, dst: str) -> None:
            if "replaced-" in os.path.basename(dst):
                raise OSError(5, "Input/output error", dst)
            real_rename(src, dst)

        monkeypatch.setattr(commit_mod.os, "rename", no_aside)
    with pytest.raises(CheckpointSaveError, match="now holds what this save wrote") as err:
        ck.save(str(tmp_path), 5, TrainingState(_model(1)))
    monkeypatch.undo()
    assert _loaded(tmp_path / "step5") == state_digest(_model(1))
    (aside,) = [p for p in tmp_path.iterdir() if p.name != "step5"]
    assert str(aside) in str(err.value) and (aside / "eval.json").read_text() == "{}"
    assert aside.name.startswith(".tmp-step5-" if kept == "left hidden" else "replaced-step5-")
    assert _loaded(aside) == state_digest(_model(0)) if kept == "moved aside" else True


def test_files_written_into_both_folders_around_the_swap_are_all_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found by an outside attack: one file landed in step5 just before the swap (so in the old
    # folder) and one just after (in the new one); the swap back took the new folder, with the
    # second file, into the work folder the failed save then deleted.
    ck, real = _saved_once(tmp_path)

    eval_job = _around_swaps(
        real,
        before=lambda: (tmp_path / "step5" / "eval_a.json").write_text("a"),
        after=lambda _: (tmp_path / "step5" / "eval_b.json").write_text("b"),
    )
    monkeypatch.setattr(local_mod, "exchange_paths", eval_job)
    with pytest.raises(CheckpointSaveError, match=r"eval_a\.json.*changed meanwhile too \(eval_b\.json\)") as err:
        ck.save(str(tmp_path), 5, TrainingState(_model(1)))
    monkeypatch.undo()
    # The old checkpoint is back in step5 with the file written into it; the new one is set aside
    # with the file written into it after the swap, under a name no clean-up deletes.
    assert (tmp_path / "step5" / "eval_a.json").read_text() == "a"
    assert _loaded(tmp_path / "step5") == state_digest(_model(0))
    (aside,) = tmp_path.glob("unpublished-step5-*")
    assert str(aside) in str(err.value) and (aside / "eval_b.json").read_text() == "b"
    assert _loaded(aside) == state_digest(_model(1))
    clean_save_folder(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step5", aside.name]


def test_a_new_folder_whose_record_went_after_the_swap_does_not_cost_the_step_its_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found by an outside attack: after the swap, a file landed in the old folder and the new
    # folder's record was removed; the folders were not swapped back, so step5 had no complete
    # checkpoint, and the error said it held the new one.
    ck, real = _saved_once(tmp_path)

    def meddle(work: str) -> None:
        (Path(work) / "late.txt").write_text("late")  # the old folder, under the work name now
        (tmp_path / "step5" / ".metadata.json").unlink()  # the new one's record

    monkeypatch.setattr(local_mod, "exchange_paths", _around_swaps(real, after=meddle))
    with pytest.raises(CheckpointSaveError, match=r"late\.txt.*its record is gone"):
        ck.save(str(tmp_path), 5, TrainingState(_model(1)))
    monkeypatch.undo()
    assert (tmp_path / "step5" / "late.txt").read_text() == "late"
    assert _loaded(tmp_path / "step5") == state_digest(_model(0))
    assert len(list(tmp_path.glob("unpublished-step5-*"))) == 1


def test_an_old_checkpoint_goes_back_alone_when_the_new_one_was_removed_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found by an outside attack: a file landed in the old folder, then something removed the new
    # step5; the swap back failed (nothing to swap with), the old checkpoint went to replaced-*,
    # step5 stayed missing, and the error said step5 held this save's checkpoint.
    import shutil

    ck, real = _saved_once(tmp_path)
    swaps = _around_swaps(
        real,
        before=lambda: (tmp_path / "step5" / "eval.json").write_text("{}"),
        after=lambda _: shutil.rmtree(tmp_path / "step5"),  # the new one, removed by something else
    )
    monkeypatch.setattr(local_mod, "exchange_paths", swaps)
    with pytest.raises(CheckpointSaveError, match=r"eval\.json"):
        ck.save(str(tmp_path), 5, TrainingState(_model(1)))
    monkeypatch.undo()
    assert (tmp_path / "step5" / "eval.json").read_text() == "{}"
    assert _loaded(tmp_path / "step5") == state_digest(_model(0))
    assert sorted(os.listdir(tmp_path)) == ["step5"]
