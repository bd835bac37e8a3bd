"""A checkpoint written by a newer ckptkeeper is intact, not corrupt: an older ckptkeeper that
resumes refuses to fall back past it (the older checkpoint's run would save its step again and
replace it), and says to upgrade. A record whose version field was damaged still counts as
corrupt: its own checksum tells the two apart."""

from __future__ import annotations

import logging
import re
import shutil
import tempfile
from pathlib import Path

import pytest

from ckptkeeper import (
    Checkpointer,
    CheckpointerCallback,
    CheckpointManager,
    CheckpointPolicyConfig,
    CheckpointSaveError,
    CorruptCheckpointError,
    NewerFormatError,
    TrainingState,
    state_digest,
    storage_for,
)
from ckptkeeper.engine.record import _BLANK, _SELF_HEAD, FORMAT_VERSION, digest_bytes
from ckptkeeper.storage.layout import COMMIT_RECORD

from ..helpers import run_cli, tiny_trainer


def _cb() -> CheckpointerCallback:
    return CheckpointerCallback(save_interval=3, save_async=False, pre_train_checkpoint=False)


def _as_newer(step_folder: Path, version: int = FORMAT_VERSION + 1, sealed: bool = True) -> bytes:
    """Rewrite the record's version as a newer ckptkeeper would have written it (``sealed``: its own
    checksum made to match again, as that ckptkeeper's would; else as a damaged byte leaves it)."""
    path = step_folder / COMMIT_RECORD
    data = re.sub(rb'"version": \d+', b'"version": %d' % version, path.read_bytes(), count=1)
    if sealed:
        head = len(_SELF_HEAD)
        data = data[:head] + digest_bytes(data[:head] + _BLANK + data[head + 16 :]).encode() + data[head + 16 :]
    path.write_bytes(data)
    return data


def _listing(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("fresh", [False, True], ids=["fallback", "start-fresh"])
def test_resume_never_falls_back_past_a_newer_checkpoint(tmp_path: Path, fresh: bool) -> None:
    folder = tmp_path / "run"
    tiny_trainer(str(folder), _cb(), 6).fit()
    _as_newer(folder / "step6")
    if fresh:  # with nothing else loadable, a fresh start would have saved step3 and step6 over them
        (folder / "step3" / COMMIT_RECORD).write_text("{")
    before = _listing(folder)
    t = tiny_trainer(str(folder), _cb(), 9)
    t.start_fresh_if_unloadable = fresh
    untouched = state_digest(t.model, t.optimizer)
    with pytest.raises(NewerFormatError) as info:
        t.fit()
    msg = str(info.value)
    assert "step6" in msg and f"format version {FORMAT_VERSION + 1}" in msg and "upgrade ckptkeeper" in msg, msg
    assert "move" in msg  # the other way out: take it out of the save folder
    assert isinstance(info.value, CorruptCheckpointError)  # older handlers that skip unreadable ones still do
    assert _listing(folder) == before  # nothing saved over, moved aside or deleted
    assert state_digest(t.model, t.optimizer) == untouched and t.global_step == 0


def test_a_newer_checkpoint_older_than_the_one_resumed_from_is_no_obstacle(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    tiny_trainer(str(folder), _cb(), 6).fit()
    kept = _as_newer(folder / "step3")
    t = tiny_trainer(str(folder), _cb(), 9)
    t.fit()
    assert t.start_step == 6 and (folder / "step3" / COMMIT_RECORD).read_bytes() == kept


def test_a_damaged_version_field_is_corruption_and_falls_back(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "run"
    tiny_trainer(str(folder), _cb(), 6).fit()
    _as_newer(folder / "step6", version=FORMAT_VERSION + 1, sealed=False)
    t = tiny_trainer(str(folder), _cb(), 9)
    with caplog.at_level(logging.WARNING):
        t.fit()
    assert t.start_step == 3
    said = [r.getMessage() for r in caplog.records]
    assert any("skipping checkpoint" in m and "step6" in m and "checksum" in m for m in said), said


def test_pick_and_restore_refuse_alike_and_a_direct_load_says_upgrade(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    tiny_trainer(str(folder), _cb(), 6).fit()
    _as_newer(folder / "step6")
    t = tiny_trainer(str(tmp_path / "other"), None, 1)
    state = TrainingState(t.model, t.optimizer)
    for how in ("pick", "restore"):
        mgr = CheckpointManager(str(folder), state=state, take_lease=False)
        with pytest.raises(NewerFormatError, match="step6"):
            getattr(mgr, how)()
        mgr.close()
    with pytest.raises(NewerFormatError, match=r"upgrade ckptkeeper") as info:
        Checkpointer().load(str(folder / "step6"), state)
    assert "corrupt" not in str(info.value)
    with pytest.raises(NewerFormatError, match=r"upgrade ckptkeeper"):
        Checkpointer().verify(str(folder / "step6"))


def test_ls_and_verify_say_it_needs_a_newer_ckptkeeper_not_that_it_is_corrupt(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    tiny_trainer(str(folder), _cb(), 6).fit()
    _as_newer(folder / "step6")
    ls = run_cli("ls", str(folder), "--json", cwd=tmp_path)
    assert "newer ckptkeeper" in ls.stdout and "upgrade ckptkeeper" in ls.stdout, ls.stdout
    verify = run_cli("verify", str(folder / "step6"), cwd=tmp_path)
    assert verify.returncode != 0
    out = verify.stdout + verify.stderr
    assert "newer ckptkeeper" in out and "upgrade ckptkeeper" in out and "corrupt" not in out, out


def _deepen(step_folder: Path) -> None:
    """A newer format's record may break this version's other rules (here: nesting in 'extra')."""
    path = step_folder / COMMIT_RECORD
    deep = b'{"a": ' * 20 + b"1" + b"}" * 20
    data = path.read_bytes()
    assert b'"extra": {}' in data
    path.write_bytes(data.replace(b'"extra": {}', b'"extra": {"deep": ' + deep + b"}", 1))


def test_a_newer_record_is_recognised_before_this_versions_other_rules(tmp_path: Path) -> None:
    # Found by an outside attack: a newer record nesting 'extra' deeper than this version allows
    # was "malformed", and the resumed run saved step6 over it.
    folder = tmp_path / "run"
    tiny_trainer(str(folder), _cb(), 6).fit()
    _deepen(folder / "step6")
    kept = _as_newer(folder / "step6")
    with pytest.raises(NewerFormatError, match="step6"):
        tiny_trainer(str(folder), _cb(), 9).fit()
    assert (folder / "step6" / COMMIT_RECORD).read_bytes() == kept


def test_a_version_beyond_any_format_is_damage_not_a_newer_ckptkeeper(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    tiny_trainer(str(folder), _cb(), 6).fit()
    _as_newer(folder / "step6", version=1 << 31)
    t = tiny_trainer(str(folder), _cb(), 9)
    t.fit()
    assert t.start_step == 3


@pytest.mark.parametrize("fresh", [False, True], ids=["plain", "start-fresh"])
def test_a_load_path_run_never_moves_a_newer_checkpoint_and_stops_before_one_ahead(tmp_path: Path, fresh: bool) -> None:
    # Found by an outside attack: with start_fresh_if_unloadable and a load_path, the newer step6
    # counted as unloadable and was renamed aside; without it, the error offered that fresh start.
    folder, other = tmp_path / "run", tmp_path / "other"
    tiny_trainer(str(folder), _cb(), 6).fit()
    tiny_trainer(str(other), _cb(), 6).fit()
    shutil.rmtree(folder / "step3")
    kept = _as_newer(folder / "step6")
    behind = tiny_trainer(str(folder), _cb(), 9)
    behind.load_path, behind.start_fresh_if_unloadable = str(other / "step3"), fresh
    with pytest.raises(NewerFormatError, match=r"step6.*upgrade ckptkeeper"):
        behind.fit()
    tiny_trainer(str(other), _cb(), 9).fit()  # a load_path later than the newer checkpoint
    ahead = tiny_trainer(str(folder), _cb(), 12)
    ahead.load_path, ahead.start_fresh_if_unloadable = str(other / "step9"), fresh
    ahead.fit()  # step6 is behind the load_path's step 9: nothing of this run lands on it
    assert ahead.start_step == 9
    assert (folder / "step6" / COMMIT_RECORD).read_bytes() == kept
    assert not [p for p in folder.iterdir() if p.name.startswith("unloadable")]


def test_no_save_replaces_a_newer_checkpoint_whatever_led_to_it(tmp_path: Path) -> None:
    # Found by an outside attack: a manual load() of step3 before restore() skipped the check,
    # and the run's save of step 6 replaced the newer checkpoint; so did a direct save.
    folder = tmp_path / "run"
    tiny_trainer(str(folder), _cb(), 6).fit()
    kept = _as_newer(folder / "step6")
    t = tiny_trainer(str(tmp_path / "other"), None, 1)
    state = TrainingState(t.model, t.optimizer)
    with pytest.raises(CheckpointSaveError, match=r"step6 holds a checkpoint written by a newer ckptkeeper"):
        Checkpointer().save(str(folder), 6, state)
    mgr = CheckpointManager(
        str(folder), state=state, take_lease=False,
        config=CheckpointPolicyConfig(save_interval=3, save_async=False, pre_train_checkpoint=False),
    )  # fmt: skip
    mgr.load(str(folder / "step3"))
    mgr.restore()
    mgr.save_if_due(4)
    mgr.save_if_due(5)
    with pytest.raises(CheckpointSaveError, match="upgrade ckptkeeper"):
        mgr.save_if_due(6)
    with pytest.raises(CheckpointSaveError, match="upgrade ckptkeeper"):
        mgr.close()  # its final save of step 6 refuses alike
    assert (folder / "step6" / COMMIT_RECORD).read_bytes() == kept


def test_no_save_replaces_a_newer_checkpoint_on_an_object_store(s3_root: str) -> None:
    t = tiny_trainer(s3_root, _cb(), 3)
    t.fit()
    storage = storage_for(s3_root)
    record = storage.join(s3_root, "step3", COMMIT_RECORD)
    local = Path(tempfile.mkdtemp()) / "step3"
    local.mkdir()
    (local / COMMIT_RECORD).write_bytes(storage.read_bytes(record))
    kept = _as_newer(local)
    storage.write_bytes(record, kept)
    before = sorted((f.relpath, f.size) for f in storage.walk(s3_root))
    with pytest.raises(CheckpointSaveError, match="newer ckptkeeper"):
        Checkpointer().save(s3_root, 3, TrainingState(t.model, t.optimizer))
    assert storage.read_bytes(record) == kept
    assert sorted((f.relpath, f.size) for f in storage.walk(s3_root)) == before  # nothing removed or added
    shutil.rmtree(local.parent)


def test_copying_a_folder_with_a_newer_checkpoint_fails_and_names_it(tmp_path: Path) -> None:
    # Found by an outside attack: cp skipped it as "incomplete" and exited 0, and an older
    # ckptkeeper resuming from the copy went back past it without a word.
    folder = tmp_path / "run"
    tiny_trainer(str(folder), _cb(), 6).fit()
    _as_newer(folder / "step6")
    out = run_cli("cp", str(folder), str(tmp_path / "copy"), cwd=tmp_path)
    assert out.returncode == 1, out
    assert "step6 not copied" in out.stderr and "upgrade ckptkeeper" in out.stderr, out.stderr
    assert [s for s, _ in Checkpointer().find_checkpoints(str(tmp_path / "copy"))] == [3]


def test_a_newer_record_outside_this_versions_json_rules_is_still_newer(tmp_path: Path) -> None:
    # Found by an outside attack: NaN metrics (which this version's parser refuses) had a newer
    # record counted as damaged; resume fell back and saved step6 over it.
    folder = tmp_path / "run"
    tiny_trainer(str(folder), _cb(), 6).fit()
    path = folder / "step6" / COMMIT_RECORD
    path.write_bytes(path.read_bytes().replace(b'"extra": {}', b'"extra": {"metrics": {"loss": NaN}}', 1))
    kept = _as_newer(folder / "step6")
    with pytest.raises(NewerFormatError, match="step6"):
        tiny_trainer(str(folder), _cb(), 9).fit()
    with pytest.raises(CheckpointSaveError, match="newer ckptkeeper"):
        t = tiny_trainer(str(tmp_path / "other"), None, 1)
        Checkpointer().save(str(folder), 6, TrainingState(t.model, t.optimizer))
    assert path.read_bytes() == kept
    # The same record at this version's own format number is damage: NaN is not JSON it writes.
    _as_newer(folder / "step6", version=FORMAT_VERSION)
    t = tiny_trainer(str(folder), _cb(), 9)
    t.fit()
    assert t.start_step == 3
