"""Hostile and careless checkpoint files: nothing runs, nothing outside is written, every problem
is a CkptkeeperError, and a failed load leaves the destination exactly as it was."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ckptkeeper import (
    Checkpointer,
    CheckpointError,
    CorruptCheckpointError,
    TrainingState,
    UnsafeCheckpointError,
    state_digest,
)
from ckptkeeper.engine.record import CommitRecord
from ckptkeeper.storage.layout import COMMIT_RECORD

from ..helpers import forge
from ..helpers import small_state as _state


def _fingerprint(st: TrainingState) -> tuple[str, list[Any]]:
    assert st.optimizer is not None
    groups = [{k: v for k, v in g.items() if k != "params"} for g in st.optimizer.param_groups]
    return state_digest(st.model, st.optimizer), groups


class _Dotted:
    """A pickle GLOBAL for ``module`` + a dotted ``name``: the way past an any-name-in-module list."""

    def __init__(self, module: str, name: str, arg: str) -> None:
        self.module, self.name, self.arg = module, name, arg

    def dumps(self) -> bytes:
        mod, name, arg = (s.encode() for s in (self.module, self.name, self.arg))
        # PROTO 2; GLOBAL module\nname\n; the argument; TUPLE1; REDUCE; STOP
        return b"\x80\x02c" + mod + b"\n" + name + b"\n" + b"X" + len(arg).to_bytes(4, "little") + arg + b"\x85R."


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("torch.distributed.checkpoint.filesystem", "os.system"),
        ("torch.distributed.checkpoint.metadata", "pickle.loads"),
        ("torch.distributed.checkpoint.planner", "subprocess.getoutput"),
        ("torch", "os.system"),
        ("builtins", "eval"),
        ("posix", "system"),
    ],
)
def test_dotted_names_in_dcp_metadata_never_run(tmp_path: Path, module: str, name: str) -> None:
    ckpt = Checkpointer(writer="dcp")  # loads of DCP-written files decode .metadata (fast-path ones never do)
    ckpt.save(str(tmp_path), 1, _state())
    marker = tmp_path / "pwned"
    payload = _Dotted(module, name, f"touch {marker}").dumps()
    forge(tmp_path / "step1", "model_and_optim/.metadata", payload)  # sizes and checksums all match
    dst = _state(3)
    before = _fingerprint(dst)
    with pytest.raises(UnsafeCheckpointError):
        ckpt.load(str(tmp_path / "step1"), dst)
    with pytest.raises(UnsafeCheckpointError):
        ckpt.verify(str(tmp_path / "step1"))
    assert not marker.exists()
    assert _fingerprint(dst) == before


def test_a_same_size_metadata_swap_is_caught_by_its_checksum_before_parsing(tmp_path: Path) -> None:
    ckpt = Checkpointer(verify_checksums=False)  # even with checksums of data files off
    ckpt.save(str(tmp_path), 1, _state())
    meta = tmp_path / "step1" / "model_and_optim" / ".metadata"
    marker = tmp_path / "pwned"
    payload = _Dotted("torch.distributed.checkpoint.filesystem", "os.system", f"touch {marker}").dumps()
    meta.write_bytes(payload + b"\x00" * (meta.stat().st_size - len(payload)))  # padded to the original size
    with pytest.raises(CorruptCheckpointError, match=r"\.metadata has checksum"):
        ckpt.load(str(tmp_path / "step1"), _state())
    assert not marker.exists()


def test_metadata_pointing_outside_the_checkpoint_is_refused(tmp_path: Path) -> None:
    ckpt = Checkpointer(writer="dcp")
    st = _state()
    ckpt.save(str(tmp_path), 1, st)
    meta_path = tmp_path / "step1" / "model_and_optim" / ".metadata"
    md = pickle.loads(meta_path.read_bytes())  # our own file, read by the test
    (tmp_path / "secret.distcp").write_bytes(b"x" * 100)
    for info in md.storage_data.values():
        info.relative_path = "../../secret.distcp"
    forge(tmp_path / "step1", "model_and_optim/.metadata", pickle.dumps(md))
    with pytest.raises(CorruptCheckpointError, match=r"not a plain file name|not a plain relative path"):
        ckpt.load(str(tmp_path / "step1"), _state(2))


@pytest.mark.parametrize("bad", ["../../outside.txt", "/tmp/abs.txt", "a//b", "./x", "a\\b", "C:x", "", "a/../../b"])
def test_record_file_names_must_be_plain_relative_paths(tmp_path: Path, bad: str) -> None:
    Checkpointer().save(str(tmp_path), 1, _state())
    rec = CommitRecord.from_json((tmp_path / "step1" / COMMIT_RECORD).read_bytes(), "x")
    files = dict(rec.files)
    files[bad] = files["train/rank0.json"]
    forge(tmp_path / "step1", files=files)
    ckpt = Checkpointer()
    assert not ckpt.dir_is_checkpoint(str(tmp_path / "step1"))
    with pytest.raises(CorruptCheckpointError):
        ckpt.load(str(tmp_path / "step1"), _state())


def test_downloads_never_write_outside_the_spool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptkeeper import storage_for

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    root = "memory://run"
    ckpt = Checkpointer(spool_dir=str(tmp_path / "spools"))
    os.makedirs(tmp_path / "spools")
    ckpt.save(root, 2, _state())
    st = storage_for(root)
    raw = st.read_bytes(f"{root}/step2/{COMMIT_RECORD}")
    doc = json.loads(raw)
    rel = os.path.relpath(victim, tmp_path / "spools" / "ckptkeeper-spool-x")
    doc["files"][rel] = {"bytes": 5, "xxh3_64": "0" * 16}
    st.write_bytes(f"{root}/step2/{rel}", b"owned")
    st.write_bytes(f"{root}/step2/{COMMIT_RECORD}", json.dumps(doc).encode())
    assert not ckpt.dir_is_checkpoint(f"{root}/step2")
    [info] = ckpt.list_checkpoints(root)
    assert info.complete is False
    with pytest.raises(CorruptCheckpointError):
        ckpt.load(f"{root}/step2", _state())
    assert victim.read_text() == "precious"
    assert os.listdir(tmp_path / "spools") == []  # the load's spool was removed


@pytest.mark.parametrize(
    "doc",
    [
        "[" * 100000 + "]" * 100000,
        '{"format": "ckptkeeper", "version": 1, "step": 1, "ephemeral": false, "world_size": 1,'
        ' "created_unix": 1, "files": {"a": {"bytes": 1e400, "xxh3_64": "0000000000000000"}}}',
        '{"format": "ckptkeeper", "version": 1, "step": 1, "ephemeral": false, "world_size": 1,'
        ' "created_unix": 1, "files": {}, "extra": {"layout": "a string"}}',
        '{"format": "ckptkeeper", "version": 1, "step": 1e999, "ephemeral": 1, "world_size": -1,'
        ' "created_unix": NaN, "files": []}',
        '{"format": "ckptkeeper", "version": 99999999999999999999999999, "files": {}}',
        "\xff\xfe not utf-8",
        '{"format": "ckptkeeper", "version": 1, "files": {"x": {"bytes": ' + "9" * 5000 + "}}}",
    ],
)
def test_hostile_commit_records_never_break_listing_or_resume(
    tmp_path: Path, doc: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from ckptkeeper.cli import main

    ckpt = Checkpointer()
    ckpt.save(str(tmp_path), 1, _state())
    ckpt.save(str(tmp_path), 2, _state())
    (tmp_path / "step2" / COMMIT_RECORD).write_bytes(doc.encode("utf-8", "surrogateescape"))
    infos = ckpt.list_checkpoints(str(tmp_path))
    assert [i.complete for i in infos] == [True, False]
    with pytest.raises(CorruptCheckpointError):
        ckpt.verify(str(tmp_path / "step2"))
    capsys.readouterr()
    assert main(["ls", str(tmp_path), "--json"]) == 0
    assert [r["complete"] for r in json.loads(capsys.readouterr().out)] == [True, False]
    with pytest.raises(CorruptCheckpointError):
        ckpt.load(str(tmp_path / "step2"), _state(5))
    ckpt.load(str(tmp_path / "step1"), _state(5))


def test_a_flip_inside_the_segment_layout_fails_verify(tmp_path: Path) -> None:
    import json

    from ckptkeeper.engine.discovery import LAYOUT_FILE

    ckpt = Checkpointer()
    ckpt.save(str(tmp_path), 1, _state())
    table = tmp_path / "step1" / LAYOUT_FILE
    raw = bytearray(table.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    table.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError):
        ckpt.verify(str(tmp_path / "step1"))
    # A forged layout (file rewritten, record re-signed) is caught by comparing it with DCP's
    # checksummed metadata.
    Checkpointer().save(str(tmp_path), 2, _state())
    doc = json.loads((tmp_path / "step2" / LAYOUT_FILE).read_bytes())
    rows = [list(r) for r in doc["model_and_optim/__0_0.distcp"]]
    rows[1][3] -= 4
    rows[2][2] -= 4
    rows[2][3] += 4
    forge(tmp_path / "step2", LAYOUT_FILE, json.dumps({"model_and_optim/__0_0.distcp": rows}).encode())
    with pytest.raises(CorruptCheckpointError, match=r"disagrees with the DCP metadata|shape needs"):
        ckpt.verify(str(tmp_path / "step2"))
    dst = _state(9)
    before = _fingerprint(dst)
    with pytest.raises(CorruptCheckpointError):
        ckpt.load(str(tmp_path / "step2"), dst)
    assert _fingerprint(dst) == before


def test_edited_trainer_state_is_caught_by_its_checksum(tmp_path: Path) -> None:
    ckpt = Checkpointer()
    ckpt.save(str(tmp_path), 4, _state(), train_state={"global_step": 4})
    ts = tmp_path / "step4" / "train" / "rank0.json"
    ts.write_text(ts.read_text().replace('"global_step": 4', '"global_step": 9'))
    with pytest.raises(CorruptCheckpointError, match=r"train/rank0\.json has"):
        ckpt.load(str(tmp_path / "step4"), _state())


def test_a_corrupt_tensor_midway_leaves_model_and_optimizer_untouched(tmp_path: Path) -> None:
    ckpt = Checkpointer()
    ckpt.save(str(tmp_path), 1, _state(0))
    data = tmp_path / "step1" / "model_and_optim" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[-200] ^= 0x10  # late in the file: earlier tensors are read (and overwritten) first
    data.write_bytes(bytes(raw))
    dst = _state(7)
    before = _fingerprint(dst)
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        ckpt.load(str(tmp_path / "step1"), dst)
    assert _fingerprint(dst) == before
    # The same with the staging budget too small for a backup: verified first, then loaded.
    tight = Checkpointer(staging_budget_bytes=16)
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        tight.load(str(tmp_path / "step1"), dst)
    assert _fingerprint(dst) == before


def test_another_model_names_the_key_and_both_shapes_and_changes_nothing(tmp_path: Path) -> None:
    ckpt = Checkpointer()
    ckpt.save(str(tmp_path), 1, _state(0))
    torch.manual_seed(1)
    other = TrainingState(nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3)))
    before = state_digest(other.model)
    with pytest.raises(CheckpointError, match=r"model\.0\.weight has shape \[8, 4\] in the checkpoint and \[16, 4\]"):
        ckpt.load(str(tmp_path / "step1"), other)
    assert state_digest(other.model) == before


def test_symlinked_files_inside_a_checkpoint_are_not_followed(tmp_path: Path) -> None:
    ckpt = Checkpointer()
    ckpt.save(str(tmp_path), 1, _state())
    ts = tmp_path / "step1" / "train" / "rank0.json"
    shutil.copy(ts, tmp_path / "elsewhere.json")
    ts.unlink()
    ts.symlink_to(tmp_path / "elsewhere.json")
    assert not ckpt.dir_is_checkpoint(str(tmp_path / "step1"))
    with pytest.raises(CorruptCheckpointError, match=r"missing file train/rank0\.json"):
        ckpt.load(str(tmp_path / "step1"), _state())


def _plant_bytes_item(step: Path, marker: Path, disguise: bool) -> None:
    """Swap a model tensor's DCP entry for a pickled "bytes" item that runs a command when read."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    md = pickle.loads((step / "model_and_optim" / ".metadata").read_bytes())  # our own file, read by the test
    fqn = "model.0.weight"
    entry = BytesStorageMetadata()
    if disguise:  # attributes added by BUILD so that a shape check would pass
        entry.__dict__["size"] = md.state_dict_metadata[fqn].size
        entry.__dict__["properties"] = md.state_dict_metadata[fqn].properties
    md.state_dict_metadata[fqn] = entry
    for k in [k for k in md.storage_data if k.fqn == fqn]:
        del md.storage_data[k]

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    payload = pickle.dumps(Evil())
    md.storage_data[MetadataIndex(fqn)] = _StorageInfo("evil.distcp", 0, len(payload))
    forge(step, "model_and_optim/evil.distcp", payload)
    rec = CommitRecord.from_json((step / COMMIT_RECORD).read_bytes(), "x")
    extra = {k: v for k, v in rec.extra.items() if k != "layout"}  # force DCP's own reader
    forge(step, "model_and_optim/.metadata", pickle.dumps(md), extra=extra)


@pytest.mark.parametrize("disguise", [True, False], ids=["disguised", "plain"])
def test_a_pickled_bytes_item_in_a_data_file_never_runs(tmp_path: Path, disguise: bool) -> None:
    # Found by an outside attack: DCP reads non-tensor items with torch.load(weights_only=False).
    ckpt = Checkpointer(writer="dcp")  # loads of DCP-written files decode .metadata (fast-path ones never do)
    ckpt.save(str(tmp_path), 1, _state())
    marker = tmp_path / "pwned"
    _plant_bytes_item(tmp_path / "step1", marker, disguise)
    dst = _state(4)
    before = _fingerprint(dst)
    with pytest.raises(CorruptCheckpointError):
        ckpt.load(str(tmp_path / "step1"), dst)
    with pytest.raises(CorruptCheckpointError):
        ckpt.verify(str(tmp_path / "step1"))
    assert not marker.exists() and _fingerprint(dst) == before


def test_the_load_planner_refuses_to_unpickle_any_bytes_item() -> None:
    import io

    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    from ckptkeeper.engine.safe_metadata import SafeLoadPlanner

    item = ReadItem(LoadItemType.BYTE_IO, MetadataIndex("x"), torch.Size([0]), MetadataIndex("x"),
                    torch.Size([0]), torch.Size([0]))  # fmt: skip
    with pytest.raises(UnsafeCheckpointError, match="non-tensor item"):
        SafeLoadPlanner().load_bytes(item, io.BytesIO(pickle.dumps(os.getpid)))


def _build_on_class(cls_mod: str, cls_name: str, attr: str, fn_mod: str, fn_name: str) -> bytes:
    """GLOBAL cls; BUILD (None, {attr: fn}): pickle then does setattr(cls, attr, fn) on the class itself."""
    p = b"\x80\x02c" + cls_mod.encode() + b"\n" + cls_name.encode() + b"\nN}"
    p += b"X" + len(attr).to_bytes(4, "little") + attr.encode()
    p += b"c" + fn_mod.encode() + b"\n" + fn_name.encode() + b"\ns\x86b."
    return p


@pytest.mark.parametrize(
    ("cls_mod", "cls_name", "attr"),
    [
        ("pathlib", "PurePosixPath", "__truediv__"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo", "__eq__"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex", "__hash__"),
        ("torch.serialization", "_get_layout", "cache"),
    ],
)
def test_a_refused_pickle_cannot_patch_allowed_classes_for_the_process(
    tmp_path: Path, cls_mod: str, cls_name: str, attr: str
) -> None:
    # Found by an outside attack: BUILD on an allowed class changed it for every later caller.
    import pathlib

    import torch.serialization
    from torch.distributed.checkpoint import filesystem, metadata

    before = {
        "path": str(pathlib.PurePosixPath("/tmp") / "x"),
        "eq": filesystem._StorageInfo.__eq__,
        "hash": metadata.MetadataIndex.__hash__,
        "layout_attrs": dict(vars(torch.serialization._get_layout)),
    }
    ckpt = Checkpointer(writer="dcp")  # loads of DCP-written files decode .metadata (fast-path ones never do)
    ckpt.save(str(tmp_path), 1, _state())
    Checkpointer().save(str(tmp_path / "b"), 2, _state(1))
    forge(tmp_path / "step1", "model_and_optim/.metadata",
          _build_on_class(cls_mod, cls_name, attr, "torch.serialization", "_get_layout"))  # fmt: skip
    with pytest.raises(CorruptCheckpointError):
        ckpt.load(str(tmp_path / "step1"), _state(3))
    assert str(pathlib.PurePosixPath("/tmp") / "x") == before["path"]
    assert filesystem._StorageInfo.__eq__ is before["eq"]
    assert metadata.MetadataIndex.__hash__ is before["hash"]
    assert dict(vars(torch.serialization._get_layout)) == before["layout_attrs"]
    ckpt.load(str(tmp_path / "b" / "step2"), _state(3))  # later loads are unaffected


def test_rollback_restores_exactly_the_pieces_it_backed_up() -> None:
    from ckptkeeper.engine.loader import Rollback
    from ckptkeeper.engine.staging import Stager

    t = torch.arange(8, dtype=torch.float32)
    tree = {"model": {"w": t}}
    guard = Rollback(Stager(), tree, incremental=True)
    guard.before_write("model.w", 0, 16)  # the first four floats are about to be overwritten
    t[:8] = -1.0  # the load writes them (and, here, more than it announced)
    guard.restore()
    assert t[:4].tolist() == [0.0, 1.0, 2.0, 3.0] and t[4:].tolist() == [-1.0] * 4
    full = Rollback(Stager(), tree)  # up front: everything
    t.fill_(7.0)
    full.restore()
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0, -1.0, -1.0, -1.0, -1.0]


@pytest.mark.parametrize("staged", [False, True], ids=["fresh backups", "stager buffers"])
def test_rollback_backs_up_overlapping_tensors_of_different_storages_before_any_is_written(staged: bool) -> None:
    # Found by an outside attack: tensors whose bytes overlap without sharing a storage (two
    # torch.from_numpy views of one array) were backed up one at a time, so the second backup
    # was taken after the first tensor's read had overwritten their common bytes, and a failed
    # load put those bytes back wrong. They are backed up up front, as tensors sharing a storage are.
    import numpy as np

    from ckptkeeper.engine.loader import Rollback
    from ckptkeeper.engine.staging import Stager

    base = np.arange(20, dtype=np.float32)
    a, b = torch.from_numpy(base[0:12]), torch.from_numpy(base[6:18])
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()  # two storages
    tree = {"model": {"a": a, "b": b, "c": torch.arange(4, dtype=torch.float32)}}
    before = base.copy()
    stager = Stager()
    if staged:
        stager.buffers_for(tree)
    guard = Rollback(stager, tree, incremental=True)
    guard.back_up_whole(["model.a"])  # as the reader does, just before reading each run
    a.fill_(-1.0)  # the read of a, which also writes b's first six floats
    guard.before_write("model.b", 0, b.nbytes)
    b.fill_(-2.0)
    guard.restore()  # the load failed after that
    assert base.tolist() == before.tolist()
