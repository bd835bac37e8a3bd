"""Resume falls back past any corrupt checkpoint, stops with a listing when none loads (starting
fresh is an explicit opt-in), never trains on from a half-loaded model, and reports a failed
async save once."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from ckptkeeper import Checkpointer, CheckpointerCallback, CorruptCheckpointError, state_digest
from ckptkeeper.storage.layout import COMMIT_RECORD

from ..helpers import forge, run_cli, run_to_end, tiny_trainer


def _cb() -> CheckpointerCallback:
    return CheckpointerCallback(save_interval=3, save_async=False, pre_train_checkpoint=False)


def _flip(path: Path, at: int = -50) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x04
    path.write_bytes(bytes(raw))


def test_every_checkpoint_bad_stops_with_a_listing_and_leaves_the_model_alone(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    assert run_to_end(tiny_trainer(str(folder), _cb(), 7, crash_at=6)) is False
    _flip(folder / "step3" / "model_and_optim" / "__0_0.distcp")
    _flip(folder / "step6" / "train" / "rank0.json", at=10)
    t = tiny_trainer(str(folder), _cb(), 9)
    fresh = state_digest(t.model, t.optimizer)
    with pytest.raises(CorruptCheckpointError, match=r"none of the 2 checkpoints .*step3.*checksum.*step6.*rank0"):
        t.fit()
    assert state_digest(t.model, t.optimizer) == fresh and t.global_step == 0
    assert [s for s, _ in Checkpointer().find_checkpoints(str(folder))] == [3, 6]  # nothing deleted
    # Opting in trains from scratch: from the model's own initial state, not a half-loaded one.
    clean = tiny_trainer(str(tmp_path / "clean"), _cb(), 2)
    clean.fit()
    again = tiny_trainer(str(folder), _cb(), 2)
    again.start_fresh_if_unloadable = True
    again.fit()
    assert again.start_step == 0 and state_digest(again.model, again.optimizer) == state_digest(
        clean.model, clean.optimizer
    )


def test_starting_fresh_sets_the_broken_checkpoints_aside_instead_of_saving_over_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Found by a newcomer: the fresh run saved step3 and step6 again, replacing the broken ones the
    # error had said would stay where they are (the evidence of what broke was gone).
    folder = tmp_path / "run"
    assert run_to_end(tiny_trainer(str(folder), _cb(), 7, crash_at=6)) is False
    _flip(folder / "step3" / "model_and_optim" / "__0_0.distcp")
    _flip(folder / "step6" / "train" / "rank0.json", at=10)
    broken = {
        step: {p.relative_to(folder / step): p.read_bytes() for p in (folder / step).rglob("*") if p.is_file()}
        for step in ("step3", "step6")
    }
    again = tiny_trainer(str(folder), _cb(), 9)
    again.start_fresh_if_unloadable = True
    with caplog.at_level(logging.WARNING, logger="ckptkeeper"):
        again.fit()
    assert again.start_step == 0
    # The fresh run's own checkpoints, and nothing else, are listed and resumed from.
    assert [s for s, _ in Checkpointer().find_checkpoints(str(folder))] == [3, 6, 9]
    for step in ("step3", "step6"):
        Checkpointer().verify(str(folder / step))  # raises unless every file checks out
        aside = sorted(folder.glob(f"unloadable-{step}-*"))
        assert len(aside) == 1, sorted(p.name for p in folder.iterdir())
        kept = {p.relative_to(aside[0]): p.read_bytes() for p in aside[0].rglob("*") if p.is_file()}
        assert kept == broken[step]  # byte for byte, for a post-mortem
        assert str(aside[0]) in caplog.text
    resumed = tiny_trainer(str(folder), _cb(), 12)
    resumed.fit()
    assert resumed.start_step == 9


def test_a_broken_checkpoint_on_an_object_store_stays_in_place_and_listings_go_in_step_order() -> None:
    from ckptkeeper.engine.deleter import set_aside_unloadable
    from ckptkeeper.manager import _step_order
    from ckptkeeper.storage import storage_for

    url = "memory://bucket/run/step3"
    storage = storage_for(url)
    storage.write_bytes(storage.join(url, "a.bin"), b"broken")
    assert set_aside_unloadable(url) is None  # no rename on an object store: nothing copied or deleted
    assert storage.read_bytes(storage.join(url, "a.bin")) == b"broken"
    paths = ["/r/step10", "/r/step5", "s3://b/r/step0", "/r/step100"]
    assert sorted(paths, key=_step_order) == ["s3://b/r/step0", "/r/step5", "/r/step10", "/r/step100"]


def test_whatever_could_not_be_loaded_is_set_aside_whole_never_saved_over(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Found by outside attacks: moving only the provably damaged ones left the rest (intact but
    # unusable, a newer format's, an emptied record) to be saved over, or to stop the run at
    # their step; a symlinked one must move as a link.
    folder = tmp_path / "run"
    outside = tmp_path / "elsewhere"
    tiny_trainer(str(outside), _cb(), 3).fit()
    tiny_trainer(str(folder), _cb(), 12).fit()
    _flip(folder / "step3" / "model_and_optim" / "__0_0.distcp")  # damaged
    record = folder / "step6" / COMMIT_RECORD  # written by a "newer" ckptkeeper
    record.write_text(record.read_text().replace('"version": 2', '"version": 3', 1))
    ts = folder / "step9" / "train" / "rank0.json"  # intact, checksums and all, but not usable
    doc = json.loads(ts.read_text())
    doc["train_state"]["global_step"] = "nine"
    forge(folder / "step9", "train/rank0.json", json.dumps(doc).encode())
    (folder / "step12" / COMMIT_RECORD).write_bytes(b"")  # an emptied record
    _flip(outside / "step3" / "model_and_optim" / "__0_0.distcp")
    (folder / "step15").symlink_to(outside / "step3")
    before = {
        step: {p.relative_to(folder / step): p.read_bytes() for p in (folder / step).rglob("*") if p.is_file()}
        for step in ("step3", "step6", "step9", "step12")
    }

    def files_of(root: Path) -> dict[Path, bytes]:
        return {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}

    target = files_of(outside / "step3")
    again = tiny_trainer(str(folder), _cb(), 15)
    again.start_fresh_if_unloadable = True
    with caplog.at_level(logging.WARNING, logger="ckptkeeper"):
        again.fit()  # saves steps 3..15 again: none collides with what was there
    assert again.start_step == 0
    assert [s for s, _ in Checkpointer().find_checkpoints(str(folder))] == [3, 6, 9, 12, 15]
    for step, files in before.items():
        (aside,) = sorted(folder.glob(f"unloadable-{step}-*"))
        assert {p.relative_to(aside): p.read_bytes() for p in aside.rglob("*") if p.is_file()} == files
        assert str(aside) in caplog.text
    (link,) = sorted(folder.glob("unloadable-step15-*"))
    assert link.is_symlink() and link.resolve() == (outside / "step3").resolve()
    assert files_of(outside / "step3") == target  # the link's target is never touched
    assert "rename it back" in caplog.text


def test_a_move_whose_fsync_fails_is_still_reported_as_moved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptkeeper.engine import deleter

    folder = tmp_path / "run"
    tiny_trainer(str(folder), _cb(), 3).fit()

    def no_fsync(path: str) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(deleter, "fsync_dir", no_fsync)
    moved = deleter.set_aside_unloadable(str(folder / "step3"))
    assert moved is not None and Path(moved).is_dir() and not (folder / "step3").exists()


def test_a_run_that_stops_on_its_load_path_moves_nothing(tmp_path: Path) -> None:
    # Found by an outside attack: the broken checkpoints were moved, then the load_path typo failed.
    from ckptkeeper import CheckpointNotFoundError

    folder = tmp_path / "run"
    assert run_to_end(tiny_trainer(str(folder), _cb(), 7, crash_at=6)) is False
    _flip(folder / "step3" / "model_and_optim" / "__0_0.distcp")
    _flip(folder / "step6" / "model_and_optim" / "__0_0.distcp")
    again = tiny_trainer(str(folder), _cb(), 9)
    again.start_fresh_if_unloadable = True
    again.load_path = str(tmp_path / "typo")
    with pytest.raises(CheckpointNotFoundError, match="typo"):
        again.fit()
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == ["step3", "step6"]


def test_a_fallback_moves_nothing_and_a_fresh_start_never_moves_what_it_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fallback leaves the newer ones it skipped in place: moving them by default hid intact
    # checkpoints that failed for a moment (an outside attack). And a fresh start whose load_path
    # is the save folder itself renamed the very checkpoint it had just loaded from there.
    folder = tmp_path / "run"
    assert run_to_end(tiny_trainer(str(folder), _cb(), 7, crash_at=6)) is False
    _flip(folder / "step6" / "model_and_optim" / "__0_0.distcp")
    t = tiny_trainer(str(folder), _cb(), 9)
    t.fit()
    assert t.start_step == 3 and not list(folder.glob("unloadable-*"))

    other = tmp_path / "other"
    assert run_to_end(tiny_trainer(str(other), _cb(), 4, crash_at=3)) is False
    real_load = Checkpointer.load
    calls: list[str] = []

    def flaky(self: Checkpointer, path: str, *args: object, **kwargs: object) -> object:
        calls.append(path)
        if len(calls) == 1:
            raise CorruptCheckpointError(f"{path}: could not be read (a moment's I/O error)")
        return real_load(self, path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Checkpointer, "load", flaky)
    again = tiny_trainer(str(other), _cb(), 6)
    again.start_fresh_if_unloadable = True
    again.load_path = str(other)
    again.fit()
    assert again.start_step == 3 and (other / "step3").is_dir() and not list(other.glob("unloadable-*"))


def test_set_aside_stays_beside_the_folder_the_kernel_finds(tmp_path: Path) -> None:
    # Found by an outside attack: normpath turned "link/../run" into a different "run" than the
    # kernel reaches through the link, and the checkpoint left its save folder.
    from ckptkeeper.engine.deleter import set_aside_unloadable

    (tmp_path / "B" / "deep").mkdir(parents=True)
    (tmp_path / "A" / "run").mkdir(parents=True)
    (tmp_path / "A" / "link").symlink_to(tmp_path / "B" / "deep")
    tiny_trainer(str(tmp_path / "B" / "run"), _cb(), 3).fit()
    moved = set_aside_unloadable(str(tmp_path / "A" / "link" / ".." / "run" / "step3"))
    assert moved is not None
    assert [p.name.startswith("unloadable-step3-") for p in (tmp_path / "B" / "run").iterdir()].count(True) == 1
    assert list((tmp_path / "A" / "run").iterdir()) == []


def test_a_record_that_no_longer_parses_counts_as_a_broken_checkpoint(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    tiny_trainer(str(folder), _cb(), 3).fit()
    (folder / "step3" / COMMIT_RECORD).write_text("{")
    with pytest.raises(CorruptCheckpointError, match="none of the 1 checkpoints"):
        tiny_trainer(str(folder), _cb(), 6).fit()


def test_forged_trainer_state_falls_back_without_touching_the_model(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    clean = tiny_trainer(str(tmp_path / "clean"), _cb(), 9)
    clean.fit()
    assert run_to_end(tiny_trainer(str(folder), _cb(), 9, crash_at=7)) is False
    ts_path = folder / "step6" / "train" / "rank0.json"
    doc = json.loads(ts_path.read_text())
    doc["train_state"]["global_step"] = "six"
    forge(folder / "step6", "train/rank0.json", json.dumps(doc).encode())  # checksums match: only checks stop it
    t = tiny_trainer(str(folder), _cb(), 9)
    t.fit()
    assert t.start_step == 3 and state_digest(t.model, t.optimizer) == state_digest(clean.model, clean.optimizer)


def test_cli_resume_never_runs_a_planted_pickle_and_verify_names_it(tmp_path: Path) -> None:
    from .test_hostile_files import _Dotted

    args = [sys.executable, "-m", "ckptkeeper", "-q", "train", "--save-folder", "run", "--save-interval", "5",
            "--no-save-async", "--steps", "12"]  # fmt: skip
    crashed = subprocess.run([*args, "--crash-at-step", "11"], cwd=tmp_path, capture_output=True, text=True)
    assert crashed.returncode == 75
    marker = tmp_path / "pwned"
    payload = _Dotted("torch.distributed.checkpoint.filesystem", "os.system", f"touch {marker}").dumps()
    forge(tmp_path / "run" / "step10", "model_and_optim/.metadata", payload)
    # Resume reads shapes from the segment table (DCP's .metadata is for DCP): step 10's tensors are
    # intact and load; the pickle is never decoded. `verify` decodes it and refuses it by name.
    resumed = subprocess.run([*args, "--report", "r.json"], cwd=tmp_path, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((tmp_path / "r.json").read_text())["start_step"] == 10
    assert not marker.exists() and "Traceback" not in resumed.stderr
    # In this process (a fresh interpreter would spend seconds importing torch): were the pickle run,
    # the marker would appear all the same.
    checked = run_cli("verify", "run/step10", cwd=tmp_path)
    assert checked.returncode != 0 and "system" in checked.stdout + checked.stderr
    assert not marker.exists()


def test_a_failed_async_save_is_reported_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from ckptkeeper import CheckpointSaveError
    from ckptkeeper.engine import SaveStage

    def fail(stage: SaveStage) -> None:
        if stage.name == "writing tensors":
            raise OSError(5, "Input/output error", "simulated")

    t = tiny_trainer(
        str(tmp_path / "run"),
        CheckpointerCallback(save_interval=2, save_async=True, pre_train_checkpoint=False),
        6,
        checkpointer=Checkpointer(on_stage=fail),
    )
    with caplog.at_level(logging.INFO), pytest.raises(CheckpointSaveError, match="step 2"):
        t.fit()
    assert "nothing raised it earlier" not in caplog.text
    assert caplog.text.count("Input/output error") <= 1
