"""The checkpoint format and commit protocol on local disk: what is written, what counts as
complete, what is refused, and which errors name which problem."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from ckptkeeper import (
    Checkpointer,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    ConfigurationError,
    CorruptCheckpointError,
    DiskFullError,
    TrainingState,
    UnsafeCheckpointError,
    state_digest,
)
from ckptkeeper.storage.layout import COMMIT_RECORD

from ..helpers import forge


def _state(seed: int = 0, width: int = 8) -> TrainingState:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return TrainingState(model, opt)


def test_commit_record_lists_every_file_with_size_and_checksum(tmp_path: Path) -> None:
    ckpt = Checkpointer()
    res = ckpt.save(str(tmp_path), 7, _state(), train_state={"note": "x"}, ephemeral=True)
    folder = tmp_path / "step7"
    assert res.path == str(folder)
    doc = json.loads((folder / COMMIT_RECORD).read_text())
    assert doc["step"] == 7 and doc["ephemeral"] is True and doc["world_size"] == 1 and doc["version"] == 2
    assert doc["checksum"] == "xxh3_64" and doc["created_unix"] > 0
    on_disk = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != COMMIT_RECORD}
    assert set(doc["files"]) == on_disk
    assert {"model_and_optim/.metadata", "train/rank0.json"} <= on_disk
    for rel, entry in doc["files"].items():
        assert (folder / rel).stat().st_size == entry["bytes"]
    assert res.bytes == sum(e["bytes"] for e in doc["files"].values())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.parametrize("bad", [123, [1, 2], "epoch", lambda: 7])
def test_a_train_state_that_is_not_a_mapping_is_a_configuration_error(tmp_path: Path, bad: object) -> None:
    # A bare TypeError/ValueError came out of the JSON encoding (found by an outside attack).
    with pytest.raises(ConfigurationError, match="train_state must be a mapping"):
        Checkpointer().save(str(tmp_path), 3, _state(0), train_state=bad)  # type: ignore[arg-type]
    assert not [p for p in tmp_path.iterdir() if not p.name.startswith(".")]  # nothing saved


def test_train_state_keys_json_would_merge_are_refused_and_odd_mappings_are_kept_whole(tmp_path: Path) -> None:
    # Found by an outside attack: {1: "a", "1": "b"} came back as {"1": "b"}, and a mapping whose
    # len() said 0 was saved as {}.
    from collections.abc import Mapping

    with pytest.raises(CheckpointSaveError, match="JSON"):  # an int key too long to write: no bare ValueError
        Checkpointer().save(str(tmp_path / "bad"), 3, _state(0), train_state={10**5000: 1})  # type: ignore[dict-item]
    for bad in ({1: "a", "1": "b"}, {"nested": [{None: 1, "null": 2}]}):
        with pytest.raises(CheckpointSaveError, match="one value would be lost"):
            Checkpointer().save(str(tmp_path / "bad"), 3, _state(0), train_state=bad)  # type: ignore[arg-type]

    class Odd(Mapping[str, int]):
        def __getitem__(self, key: str) -> int:
            return {"epoch": 4}[key]

        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(["epoch"])

        def __len__(self) -> int:
            return 0

    ckpt = Checkpointer()
    ckpt.save(str(tmp_path / "ok"), 3, _state(0), train_state=Odd())
    assert ckpt.load(str(tmp_path / "ok" / "step3"), _state(1)) == {"epoch": 4}


def test_round_trip_restores_model_optimizer_and_train_state(tmp_path: Path) -> None:
    src = _state(0)
    ckpt = Checkpointer()
    ckpt.save(str(tmp_path), 3, src, train_state={"epoch": 2, "name": "a"})
    dst = _state(1)
    assert state_digest(dst.model, dst.optimizer) != state_digest(src.model, src.optimizer)
    ts = ckpt.load(str(tmp_path / "step3"), dst)
    assert ts == {"epoch": 2, "name": "a"}
    assert state_digest(dst.model, dst.optimizer) == state_digest(src.model, src.optimizer)
    assert dst.optimizer is not None and src.optimizer is not None
    assert dst.optimizer.param_groups[0]["lr"] == src.optimizer.param_groups[0]["lr"]


def test_stock_dcp_loads_a_checkpoint_in_a_process_without_ckptkeeper(tmp_path: Path) -> None:
    st = _state(0)
    Checkpointer().save(str(tmp_path), 5, st)
    expected = {k: v.clone() for k, v in st.model.state_dict().items()}
    torch.save(expected, tmp_path / "expected.pt")
    script = textwrap.dedent(
        f"""
        import sys, warnings
        warnings.simplefilter("ignore")
        import torch, torch.distributed.checkpoint as dcp
        from torch import nn
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        sd = {{"model": model.state_dict()}}
        dcp.load(sd, checkpoint_id={str(tmp_path / "step5" / "model_and_optim")!r})
        model.load_state_dict(sd["model"])
        exp = torch.load({str(tmp_path / "expected.pt")!r})
        assert all(torch.equal(model.state_dict()[k], v) for k, v in exp.items()), "tensors differ"
        assert not any(m.startswith("ckptkeeper") for m in sys.modules), "ckptkeeper was imported"
        print("STOCK-DCP-OK")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    assert "STOCK-DCP-OK" in out.stdout


@pytest.mark.parametrize("writer", ["dcp", "auto"])
def test_tampered_dcp_metadata_is_refused_not_executed(tmp_path: Path, writer: str) -> None:
    ckpt = Checkpointer(verify_checksums=False, writer=writer)
    ckpt.save(str(tmp_path), 1, _state())
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    # Keep the commit record consistent so only the pickle guard stands between us and os.system.
    forge(tmp_path / "step1", "model_and_optim/.metadata", pickle.dumps(Evil()))
    if writer == "dcp":
        with pytest.raises(UnsafeCheckpointError, match=r"posix\.system|os\.system"):
            ckpt.load(str(tmp_path / "step1"), _state())
    else:
        # The fast path's loads take shapes from the segment table and never open DCP's metadata:
        # the tensors are intact, so the load succeeds, and nothing was unpickled.
        ckpt.load(str(tmp_path / "step1"), _state())
    assert not marker.exists()
    # verify decodes every file through the allow-list: the planted pickle is named either way.
    with pytest.raises(UnsafeCheckpointError, match=r"posix\.system|os\.system"):
        ckpt.verify(str(tmp_path / "step1"))
    assert not marker.exists()


def test_incomplete_step_folder_is_ignored_and_never_overwritten(tmp_path: Path) -> None:
    ckpt = Checkpointer()
    ckpt.save(str(tmp_path), 2, _state())
    leftover = tmp_path / "step4"
    (leftover / "model_and_optim").mkdir(parents=True)
    (leftover / "model_and_optim" / "__0_0.distcp").write_bytes(b"half a write")
    assert [s for s, _ in ckpt.find_checkpoints(str(tmp_path))] == [2]
    assert ckpt.latest_checkpoint(str(tmp_path)) == str(tmp_path / "step2")
    assert not ckpt.dir_is_checkpoint(str(leftover))
    infos = {i.step: i for i in ckpt.list_checkpoints(str(tmp_path))}
    assert infos[4].complete is False and infos[4].problem == "no commit record"
    with pytest.raises(CheckpointNotFoundError, match="commit record"):
        ckpt.load(str(leftover), _state())
    # ckptkeeper never leaves a step folder without a record (saves are renamed into place with
    # their record), so this one is somebody else's: a save of step 4 refuses to touch it.
    with pytest.raises(CheckpointSaveError, match="not a ckptkeeper checkpoint"):
        ckpt.save(str(tmp_path), 4, _state())
    assert (leftover / "model_and_optim" / "__0_0.distcp").read_bytes() == b"half a write"
    assert [s for s, _ in ckpt.find_checkpoints(str(tmp_path))] == [2]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def _saved(tmp_path: Path) -> tuple[Checkpointer, Path, dict[str, dict[str, object]]]:
    ckpt = Checkpointer()
    ckpt.save(str(tmp_path), 9, _state())
    folder = tmp_path / "step9"
    return ckpt, folder, json.loads((folder / COMMIT_RECORD).read_text())["files"]


def test_wrong_size_is_incomplete_and_named(tmp_path: Path) -> None:
    ckpt, folder, _ = _saved(tmp_path)
    data = folder / "model_and_optim" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-10])
    assert not ckpt.dir_is_checkpoint(str(folder))
    with pytest.raises(CorruptCheckpointError, match=r"__0_0\.distcp has \d+ bytes"):
        ckpt.verify(str(folder))


def test_flipped_byte_fails_the_checksum(tmp_path: Path) -> None:
    ckpt, folder, _ = _saved(tmp_path)
    data = folder / "model_and_optim" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    assert ckpt.dir_is_checkpoint(str(folder))  # sizes still match: completeness is cheap
    with pytest.raises(CorruptCheckpointError, match=r"__0_0\.distcp is corrupt: the bytes of .* have checksum"):
        ckpt.load(str(folder), _state(5))
    # Verification happens while reading straight into the model, so an explicit verify (which
    # reads every file once) is what checks a checkpoint without loading it.
    with pytest.raises(CorruptCheckpointError, match=r"__0_0\.distcp has checksum"):
        ckpt.verify(str(folder))


def test_missing_file(tmp_path: Path) -> None:
    ckpt, folder, _ = _saved(tmp_path)
    (folder / "train" / "rank0.json").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"missing file train/rank0\.json"):
        ckpt.load(str(folder), _state())


def test_malformed_commit_record(tmp_path: Path) -> None:
    ckpt, folder, _ = _saved(tmp_path)
    (folder / COMMIT_RECORD).write_text("{not json")
    assert not ckpt.dir_is_checkpoint(str(folder))
    with pytest.raises(CorruptCheckpointError, match="malformed"):
        ckpt.load(str(folder), _state())


def test_missing_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="no complete checkpoint"):
        Checkpointer().load(str(tmp_path / "step123"), _state())


def test_checkpoint_of_another_model(tmp_path: Path) -> None:
    ckpt, folder, _ = _saved(tmp_path)
    with pytest.raises(CheckpointError, match="does not fit this model"):
        ckpt.load(str(folder), _state(width=16))


def test_disk_full_gives_a_clear_error_and_loses_nothing(full_disk: Path) -> None:
    ckpt = Checkpointer()
    small = _state(0)
    ckpt.save(str(full_disk), 1, small)
    big = _state(0, width=20000)  # ~1.3 MB of weights and optimizer state: more than the disk holds
    with pytest.raises(DiskFullError, match="disk is full") as info:
        ckpt.save(str(full_disk), 2, big)
    assert "step 2" in str(info.value)
    assert [s for s, _ in ckpt.find_checkpoints(str(full_disk))] == [1]
    assert sorted(os.listdir(full_disk)) == ["step1"]  # no partial folder left
    ckpt.verify(str(full_disk / "step1"))


def test_removal_invalidates_first_and_cleans_scratch(tmp_path: Path) -> None:
    ckpt = Checkpointer()
    ckpt.save(str(tmp_path), 1, _state())
    ckpt.save(str(tmp_path), 2, _state())
    deferred = []
    ckpt.remove(str(tmp_path / "step1"), run_in_background=deferred.append)
    # Before the background deletion runs, the checkpoint is already gone from discovery.
    assert [s for s, _ in ckpt.find_checkpoints(str(tmp_path))] == [2]
    trash = [p for p in tmp_path.iterdir() if p.name.startswith(".trash-step1")]
    assert len(trash) == 1 and not (trash[0] / COMMIT_RECORD).exists()
    deferred[0]()
    assert not trash[0].exists()
    (tmp_path / ".tmp-step3-deadbeef").mkdir()
    (tmp_path / ".trash-step0-cafe0123").mkdir()
    (tmp_path / ".trash-step0-cafe").mkdir()  # not a name ckptkeeper writes: somebody else's
    gone = ckpt.clean_scratch(str(tmp_path))
    assert len(gone) == 2 and sorted(os.listdir(tmp_path)) == [".trash-step0-cafe", "step2"]


@pytest.mark.parametrize("bad", ["/", "s3://bucket", "s3://bucket/", "runs/not-a-step"])
def test_removal_refuses_anything_but_a_step_folder(bad: str) -> None:
    from ckptkeeper import ConfigurationError

    with pytest.raises(ConfigurationError, match="refusing to remove"):
        Checkpointer().remove(bad)


def test_a_segment_table_is_the_json_of_its_document_save_after_save() -> None:
    # The layout's part is encoded once and reused: each save's bytes must still be plain JSON.
    from ckptkeeper.engine.sharded import TABLE_FORMAT, ShardLayout, _encode_table

    kinds = ((torch.float32, (4, 2), (0, 0), (2, 2)), (torch.int64, (), (), ()))
    layout = ShardLayout(("a.null}", 'b"x', "c"), kinds, (0, 1, 0), ())
    for sums in (["1", "2", "3"], ["4", "5", "6"]):
        doc = {
            "format": TABLE_FORMAT,
            "file": "model_and_optim/__0_0.distcp",
            "kinds": [["torch.float32", [4, 2], [0, 0], [2, 2]], ["torch.int64", [], [], []]],
            "names": list(layout.names),
            "kind": list(layout.kind),
            "sums": sums,
        }
        encoded = _encode_table("model_and_optim/__0_0.distcp", layout, sums)
        assert encoded == json.dumps(doc, separators=(",", ":")).encode()
