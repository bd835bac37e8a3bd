"""Regression tests for what an outside attack on the trust guarantees found (2026-12-01)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ckptkeeper import (
    Checkpointer,
    CheckpointerCallback,
    CheckpointSaveError,
    CkptkeeperError,
    ConfigurationError,
    CorruptCheckpointError,
    state_digest,
    storage_for,
)
from ckptkeeper.cli import main
from ckptkeeper.storage.layout import COMMIT_RECORD, is_scratch_name, parse_step

from ..helpers import tiny_trainer
from .test_hostile_files import _state


def _cb() -> CheckpointerCallback:
    return CheckpointerCallback(save_interval=3, save_async=False, remove="all_non_permanent")


@pytest.mark.parametrize("root", ["local", "memory://decoy"])
def test_a_user_folder_with_a_metadata_json_is_never_deleted_or_overwritten(tmp_path: Path, root: str) -> None:
    folder = str(tmp_path / "run") if root == "local" else root
    st = storage_for(folder)
    st.write_bytes(st.join(folder, "step9", COMMIT_RECORD), b'{"tool": "mine"}')
    st.write_bytes(st.join(folder, "step9", "results.csv"), b"a,b\n1,2\n")
    t = tiny_trainer(folder, _cb(), 12)
    with pytest.raises(CheckpointSaveError, match="step9"):
        t.fit()  # saving step 9 would overwrite the user's folder: refused
    assert st.read_bytes(st.join(folder, "step9", "results.csv")) == b"a,b\n1,2\n"
    assert st.read_bytes(st.join(folder, "step9", COMMIT_RECORD)) == b'{"tool": "mine"}'
    with pytest.raises(ConfigurationError, match="refusing to remove"):
        Checkpointer().remove(st.join(folder, "step9"))
    # A run that never needs step 9 trains on beside it and does not count it as a broken checkpoint.
    tiny_trainer(folder, CheckpointerCallback(save_interval=4, save_async=False), 8).fit()
    assert st.read_bytes(st.join(folder, "step9", "results.csv")) == b"a,b\n1,2\n"


def test_names_with_a_trailing_newline_are_not_ours(tmp_path: Path) -> None:
    assert parse_step("step8\n") is None and not is_scratch_name(".tmp-step4-deadbeef\n")
    (tmp_path / ".tmp-step4-deadbeef\n").mkdir()
    Checkpointer().clean_scratch(str(tmp_path))
    assert (tmp_path / ".tmp-step4-deadbeef\n").is_dir()


def test_corrupt_data_is_caught_when_loading_into_another_dtype(tmp_path: Path) -> None:
    ckpt = Checkpointer()
    ckpt.save(str(tmp_path), 1, _state())
    data = tmp_path / "step1" / "model_and_optim" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 3] ^= 0x01
    data.write_bytes(bytes(raw))
    dst = _state(2)
    dst.model.double()
    before = state_digest(dst.model)
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        ckpt.load(str(tmp_path / "step1"), dst)
    assert state_digest(dst.model) == before


@pytest.mark.timeout(60)
def test_a_pathological_record_is_rejected_in_linear_time(tmp_path: Path) -> None:
    Checkpointer().save(str(tmp_path), 3, _state())
    (tmp_path / "step3" / COMMIT_RECORD).write_bytes(b'"' + b'\\"' * 60_000)
    assert Checkpointer().list_checkpoints(str(tmp_path))[0].complete is False


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_odd_files_at_canonical_names_fail_cleanly_without_hanging(tmp_path: Path, kind: str) -> None:
    ckpt = Checkpointer()
    ckpt.save(str(tmp_path), 1, _state())
    ckpt.save(str(tmp_path), 2, _state())
    record = tmp_path / "step2" / COMMIT_RECORD
    record.unlink()
    if kind == "folder":
        record.mkdir()
    else:
        os.mkfifo(record)
    infos = ckpt.list_checkpoints(str(tmp_path))
    assert [i.complete for i in infos] == [True, False]
    with pytest.raises(CkptkeeperError):
        ckpt.load(str(tmp_path / "step2"), _state())
    with pytest.raises(CkptkeeperError):
        ckpt.verify(str(tmp_path / "step2"))
    lease = tmp_path / "run" / ".ckptkeeper-lease.json"
    lease.parent.mkdir()
    lease.mkdir() if kind == "folder" else os.mkfifo(lease)
    with pytest.raises(CkptkeeperError, match="lease"):
        tiny_trainer(str(tmp_path / "run"), _cb(), 2).fit()


def test_a_checkpoint_copied_to_another_step_name_is_not_complete(tmp_path: Path) -> None:
    import shutil

    ckpt = Checkpointer()
    ckpt.save(str(tmp_path), 2, _state())
    shutil.copytree(tmp_path / "step2", tmp_path / "step100")
    info = {i.step: i for i in ckpt.list_checkpoints(str(tmp_path))}
    assert info[2].complete and not info[100].complete
    assert "for step 2, not 100" in (info[100].problem or "")


def test_dotdot_paths_are_refused_by_remove(tmp_path: Path) -> None:
    Checkpointer().save(str(tmp_path / "a"), 5, _state())
    (tmp_path / "link").symlink_to(tmp_path / "a")
    with pytest.raises(ConfigurationError, match=r"\.\."):
        Checkpointer().remove(str(tmp_path / "link" / ".." / "a" / "step5"))
    assert (tmp_path / "a" / "step5").is_dir()


def test_object_store_records_list_only_checkpoint_files() -> None:
    Checkpointer().save("memory://spool-marker", 1, _state())
    rec = json.loads(storage_for("memory://x").read_bytes(f"memory://spool-marker/step1/{COMMIT_RECORD}"))
    assert not [f for f in rec["files"] if "owner" in f]


def test_cli_checks_the_report_path_and_crash_step_before_training(tmp_path: Path) -> None:
    base = ["train", "--save-folder", str(tmp_path / "run"), "--steps", "3"]
    with pytest.raises(SystemExit) as missing:
        main([*base, "--report", str(tmp_path / "nowhere" / "r.json")])
    assert missing.value.code == 2
    with pytest.raises(SystemExit) as zero:
        main([*base, "--crash-at-step", "0"])
    assert zero.value.code == 2
    assert not (tmp_path / "run").exists()


def test_ls_of_a_checkpoint_points_to_inspect(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    Checkpointer().save(str(tmp_path), 4, _state())
    assert main(["ls", str(tmp_path / "step4")]) == 1
    assert "inspect" in capsys.readouterr().err
