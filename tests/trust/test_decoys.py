"""User files named like ckptkeeper's survive every removal strategy, on local disk (save folder
``.``) and on S3 (bucket root and a prefix); removal judges normalised paths and never follows links."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckptkeeper import Checkpointer, CheckpointerCallback, ConfigurationError, storage_for

from ..helpers import run_to_end, tiny_trainer

STRATEGIES = ["ephemeral_only", "all_non_permanent", "never"]


def _plant_local(root: Path, target: Path) -> dict[str, bytes]:
    files = {
        "step7/weights.bin": b"user step7",
        "step05/notes.txt": b"user step05",
        ".tmp-backup/db.sqlite": b"user tmp",
        ".trash-can/old.txt": b"user trash",
        ".tmp-step3-notours/x": b"almost our name",
        "target13/keep.txt": b"behind a symlink",
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    (root / "step13").symlink_to(target)
    return files


def _runs(folder: str, strategy: str) -> None:
    # Two runs (a crash and a resume) with ephemerals to remove; steps avoid the decoys' numbers.
    def cb() -> CheckpointerCallback:
        return CheckpointerCallback(save_interval=10, ephemeral_save_interval=4, remove=strategy, save_async=False)

    assert run_to_end(tiny_trainer(folder, cb(), 18, crash_at=17)) is False
    run_to_end(tiny_trainer(folder, cb(), 24))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_local_decoys_survive_with_save_folder_dot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    work = tmp_path / "cwd"
    work.mkdir()
    target = tmp_path / "linked"
    target.mkdir()
    (target / "precious.txt").write_bytes(b"linked")
    files = _plant_local(work, target)
    monkeypatch.chdir(work)
    _runs(".", strategy)
    for rel, data in files.items():
        assert (work / rel).read_bytes() == data, rel
    assert (work / "step13").is_symlink() and (target / "precious.txt").read_bytes() == b"linked"
    steps = [s for s, _ in Checkpointer().find_checkpoints(".")]
    assert 24 in steps and 20 in steps and 7 not in steps


def _plant_s3(root: str) -> dict[str, bytes]:
    st = storage_for(root)
    files = {
        "step7/weights.bin": b"user step7",
        "step05/notes.txt": b"user step05",
        ".tmp-backup/db": b"user tmp",
        ".trash-can/old": b"user trash",
        "step13/model_and_optim/__0_0.distcp": b"named exactly like ours",
    }
    for rel, data in files.items():
        st.write_bytes(st.join(root, rel), data)
    return files


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("where", ["bucket-root", "prefix"])
def test_s3_decoys_survive(s3_root: str, strategy: str, where: str) -> None:
    root = s3_root.rsplit("/", 1)[0] if where == "bucket-root" else s3_root
    files = _plant_s3(root)
    _runs(root, strategy)
    st = storage_for(root)
    for rel, data in files.items():
        assert st.read_bytes(st.join(root, rel)) == data, rel
    infos = {i.step: i for i in Checkpointer().list_checkpoints(root)}
    assert infos[7].complete is False and infos[13].complete is False and 5 not in infos
    assert infos[24].complete


@pytest.mark.parametrize("path", ["//step5", "/./step5", "file:///step5", "/step5", "s3://step5", "s3://b/"])
def test_removal_judges_the_normalised_path(path: str) -> None:
    with pytest.raises(ConfigurationError, match="refusing to remove"):
        Checkpointer().remove(path)


def test_a_refused_removal_gives_its_own_reason(tmp_path: Path) -> None:
    # An ordinary folder was refused "(never a filesystem or bucket root)": true, and beside the point.
    with pytest.raises(ConfigurationError, match="'notckpt' is not a step") as plain:
        Checkpointer().remove(str(tmp_path / "notckpt"))
    assert "bucket root" not in str(plain.value)
    with pytest.raises(ConfigurationError, match="directly in a filesystem or bucket root"):
        Checkpointer().remove("/step5")


def test_remove_refuses_a_folder_without_a_commit_record(tmp_path: Path) -> None:
    (tmp_path / "step5").mkdir()
    (tmp_path / "step5" / "mine.txt").write_text("x")
    with pytest.raises(ConfigurationError, match="no ckptkeeper commit record"):
        Checkpointer().remove(str(tmp_path / "step5"))
    assert (tmp_path / "step5" / "mine.txt").read_text() == "x"


def test_removing_a_symlinked_checkpoint_removes_only_the_link(tmp_path: Path) -> None:
    from .test_hostile_files import _state

    real = tmp_path / "archive"
    Checkpointer().save(str(real), 3, _state())
    run = tmp_path / "run"
    run.mkdir()
    (run / "step3").symlink_to(real / "step3")
    ckpt = Checkpointer()
    assert [s for s, _ in ckpt.find_checkpoints(str(run))] == [3]
    ckpt.remove(str(run / "step3"))
    assert not os.path.lexists(run / "step3") and os.listdir(run) == []
    ckpt.verify(str(real / "step3"))  # the target is whole


def test_a_kill_during_local_removal_never_leaves_a_recordless_step_folder(tmp_path: Path) -> None:
    from .test_hostile_files import _state

    ckpt = Checkpointer()
    ckpt.save(str(tmp_path), 1, _state())
    ckpt.save(str(tmp_path), 2, _state())
    never_run: list[object] = []
    ckpt.remove(str(tmp_path / "step1"), run_in_background=never_run.append)  # "killed" before deleting
    names = sorted(os.listdir(tmp_path))
    assert names[0].startswith(".trash-step1-") and names[1:] == ["step2"]
    assert ckpt.clean_scratch(str(tmp_path)) == [str(tmp_path / names[0])]
    assert os.listdir(tmp_path) == ["step2"]


def test_spools_of_dead_processes_are_swept(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    from ckptkeeper.engine.deleter import new_spool, sweep_dead_spools

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    orphan = tmp_path / f"ckptkeeper-spool-{pid}-load-abcd1234"
    orphan.mkdir()
    (orphan / ".owner.json").write_text(json.dumps({"pid": pid, "started": "1"}))
    (orphan / "big.bin").write_bytes(b"x" * 1000)
    unmarked = tmp_path / f"ckptkeeper-spool-{pid}-load-ffff0000"  # no owner file: not provably ours
    unmarked.mkdir()
    mine = new_spool(str(tmp_path), "load")  # this live process's spool stays
    assert sweep_dead_spools(str(tmp_path)) == []  # new_spool already swept the orphan
    assert not orphan.exists() and unmarked.exists() and os.path.isdir(mine)


def test_an_object_store_removal_cut_short_is_finished_by_the_next_clean_up(monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptkeeper.engine.deleter import clean_save_folder, remove_checkpoint
    from ckptkeeper.storage.memory import MemoryStorage

    from ..helpers import small_state

    folder = "memory://cut-short"
    Checkpointer().save(folder, 6, small_state())
    storage = storage_for(folder)
    real = MemoryStorage.remove_files
    calls: list[list[str]] = []

    def crash_after_first_batch(self: MemoryStorage, paths: list[str]) -> int:
        calls.append(paths)
        if len(calls) > 1:
            raise RuntimeError("killed")  # the process dies between the data and the intents
        return real(self, paths)

    monkeypatch.setattr(MemoryStorage, "remove_files", crash_after_first_batch)
    with pytest.raises(RuntimeError):
        remove_checkpoint(storage.join(folder, "step6"))
    assert all("/.ckptkeeper/" not in p for p in calls[0])  # data first, the intents last
    monkeypatch.setattr(MemoryStorage, "remove_files", real)
    left = [f.relpath for f in storage.walk(storage.join(folder, "step6"))]
    assert left and all(rel.startswith(".ckptkeeper/") for rel in left)  # only the intents are left...
    clean_save_folder(folder)  # ...and they prove the rest ours: the next start finishes the job
    assert not list(storage.walk(storage.join(folder, "step6")))
