"""Save folders written by OLMo-core: recognised, verified as far as they can be, loaded bit-exactly.

The fixture ``tests/data/olmo_core/run`` was written by the real ``ai2-olmo-core`` 3.0.0 package
(``tests/data/make_olmo_core_folder.py`` says how): ``step1`` permanent (optimizer state as
OLMo-core's ``BasicTrainModule`` saves it), ``step2`` ephemeral (flattened, as its
``TransformerTrainModule`` saves it). ``expected.json`` holds the sha256 of every tensor it saved.
Every test works on a copy; the committed files are never changed.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ckptkeeper import (
    Checkpointer,
    CheckpointError,
    CkptkeeperError,
    CorruptCheckpointError,
    Trainer,
    TrainingState,
    UnsafeCheckpointError,
    storage_for,
)
from ckptkeeper.engine import discovery
from ckptkeeper.engine.reader import read_dcp_metadata, read_tensors, read_train_state
from ckptkeeper.engine.state import flatten_tensors

DATA = Path(__file__).resolve().parent.parent / "data" / "olmo_core"
EXPECTED: dict[str, Any] = json.loads((DATA / "expected.json").read_text())["checkpoints"]


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A private copy of the OLMo-core save folder."""
    shutil.copytree(DATA / "run", tmp_path / "run")
    return tmp_path / "run"


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _state(seed: int = 7) -> TrainingState:
    # The fixture's shape (nn.Sequential(Linear(4, 8), ReLU, Linear(8, 3)) + AdamW), other values.
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    return TrainingState(model, torch.optim.AdamW(model.parameters(), lr=1e-2))


def _tensors(state: TrainingState) -> dict[str, torch.Tensor]:
    tensors, _ = state.capture()
    return {k: v.detach().clone() for k, v in flatten_tensors(tensors)}


def _matches(tensors: dict[str, torch.Tensor], step: str) -> None:
    want = EXPECTED[step]["tensors"]
    assert set(tensors) == set(want)
    for key, t in tensors.items():
        assert str(t.dtype).removeprefix("torch.") == want[key]["dtype"], key
        assert list(t.shape) == want[key]["shape"], key
        assert _digest(t) == want[key]["sha256"], key


def _flip_inside_a_tensor(run: Path, step: str, fqn: str) -> None:
    """Change one byte of ``fqn``'s values in its data file (sizes stay as they are)."""
    metadata = read_dcp_metadata(str(run / step))
    info = next(s for i, s in metadata.storage_data.items() if i.fqn == fqn)
    path = run / step / "model_and_optim" / info.relative_path
    blob = bytearray(path.read_bytes())
    values = read_tensors(str(run / step), [fqn])[fqn].numpy().tobytes()
    at = blob.find(values, info.offset, info.offset + info.length)
    assert at > 0
    blob[at + 1] ^= 0x40
    path.write_bytes(bytes(blob))


# ---------------------------------------------------------------------- recognised


def test_listed_complete_as_olmo_core_with_their_kinds(run: Path) -> None:
    infos = discovery.list_checkpoints(str(run))
    assert [(i.step, i.complete, i.ephemeral, i.flavor, i.problem) for i in infos] == [
        (1, True, False, "olmo-core", None),
        (2, True, True, "olmo-core", None),
    ]
    assert all(i.bytes > 0 and i.created_unix is None for i in infos)
    ckpt = Checkpointer()
    assert ckpt.find_checkpoints(str(run)) == [(1, str(run / "step1")), (2, str(run / "step2"))]
    assert ckpt.latest_checkpoint(str(run)) == str(run / "step2")
    assert ckpt.dir_is_checkpoint(str(run / "step1"))


def test_read_record_says_olmo_core_not_malformed(run: Path) -> None:
    with pytest.raises(CheckpointError, match="OLMo-core checkpoint") as err:
        discovery.read_record(str(run / "step1"))
    assert not isinstance(err.value, CorruptCheckpointError)
    record = discovery.read_any_record(str(run / "step2"))
    assert isinstance(record, discovery.OlmoCoreRecord)
    assert (record.step, record.ephemeral, record.world_size, record.olmo_core_version) == (2, True, 1, "3.0.0")
    assert "model_and_optim/.metadata" in record.files and "train/rank0.pt" in record.files
    with pytest.raises(CheckpointError):
        record.to_json()  # never written as if it were a ckptkeeper record


def test_a_marker_with_anything_more_is_not_olmo_core(run: Path) -> None:
    marker = run / "step1" / ".metadata.json"
    marker.write_text(json.dumps({"ephemeral": False, "version": "3.0.0", "files": {}}))
    info = discovery.list_checkpoints(str(run))[0]
    assert (info.complete, info.flavor) == (False, "ckptkeeper")
    assert discovery.parse_olmo_marker(b'{"ephemeral": 1, "version": "3.0.0"}') is None
    assert discovery.parse_olmo_marker(b'{"ephemeral": true, "version": "3.0.0"}') == (True, "3.0.0")


def test_ckptkeeper_checkpoints_keep_their_flavor_and_checksums(tmp_path: Path) -> None:
    ckpt = Checkpointer()
    ckpt.save(str(tmp_path), 3, _state())
    (info,) = discovery.list_checkpoints(str(tmp_path))
    assert (info.flavor, info.complete) == ("ckptkeeper", True)
    assert discovery.verify_note(str(tmp_path / "step3")) is None
    assert not isinstance(ckpt.verify(str(tmp_path / "step3")), discovery.OlmoCoreRecord)


# ---------------------------------------------------------------------- verified


def test_verify_passes_and_says_there_are_no_checksums(run: Path) -> None:
    for step in ("step1", "step2"):
        record = Checkpointer().verify(str(run / step))
        assert isinstance(record, discovery.OlmoCoreRecord)
        assert record.flavor == "olmo-core"
        assert "no checksums" in record.note
        assert discovery.flavor_of(record) == "olmo-core"
        note = discovery.verify_note(str(run / step))
        assert note is not None and "no checksums recorded" in note


def test_a_truncated_data_file_makes_it_incomplete_and_verify_fail(run: Path) -> None:
    metadata = read_dcp_metadata(str(run / "step2"))
    info = max(metadata.storage_data.values(), key=lambda s: s.offset + s.length)
    data = run / "step2" / "model_and_optim" / info.relative_path
    data.write_bytes(data.read_bytes()[: info.offset + info.length - 10])
    infos = discovery.list_checkpoints(str(run))
    assert [(i.step, i.complete, i.flavor) for i in infos] == [(1, True, "olmo-core"), (2, False, "olmo-core")]
    problem = infos[1].problem or ""
    assert info.relative_path in problem and "incomplete" in problem
    assert "delete" not in problem.lower() and "malformed" not in problem.lower()
    with pytest.raises(CorruptCheckpointError, match=info.relative_path):
        Checkpointer().verify(str(run / "step2"))
    assert Checkpointer().latest_checkpoint(str(run)) == str(run / "step1")
    state = _state()
    before = _tensors(state)
    with pytest.raises(CorruptCheckpointError):
        Checkpointer().load(str(run / "step2"), state)
    assert all(torch.equal(before[k], v) for k, v in _tensors(state).items())


def test_a_flipped_tensor_byte_fails_the_crc_and_changes_nothing(run: Path) -> None:
    _flip_inside_a_tensor(run, "step1", "model.2.weight")
    assert discovery.list_checkpoints(str(run))[0].complete  # sizes alone cannot tell
    with pytest.raises(CorruptCheckpointError, match=r"model\.2\.weight.*CRC|CRC.*model\.2\.weight|Bad CRC"):
        Checkpointer().verify(str(run / "step1"))
    Checkpointer().verify(str(run / "step1"), checksums=False)  # structure and sizes are fine
    state = _state()
    before = _tensors(state)
    with pytest.raises(CorruptCheckpointError):
        Checkpointer().load(str(run / "step1"), state)
    assert all(torch.equal(before[k], v) for k, v in _tensors(state).items())


def test_a_missing_trainer_state_makes_it_incomplete(run: Path) -> None:
    (run / "step1" / "train" / "rank0.pt").unlink()
    info = discovery.list_checkpoints(str(run))[0]
    assert (info.complete, info.flavor) == (False, "olmo-core")
    assert "train/rank0.pt" in (info.problem or "")


# ---------------------------------------------------------------------- loaded


@pytest.mark.parametrize("step", ["step1", "step2"])
def test_loaded_bit_exactly_with_its_trainer_state(run: Path, step: str) -> None:
    state = _state()
    lr = state.optimizer.param_groups[0]["lr"] if state.optimizer else None
    train_state = Checkpointer().load(str(run / step), state)
    _matches(_tensors(state), step)
    assert train_state["global_step"] == EXPECTED[step]["global_step"]
    assert train_state["world_size"] == 1 and train_state["epoch"] == 1
    rng = train_state["rng"]
    assert rng["python"]["state"][0] == 3 and len(rng["python"]["state"][1]) == 625
    assert rng["numpy"]["state"][0] == "MT19937" and len(rng["numpy"]["state"][1]) == 624
    assert all(type(b) is int for b in rng["torch"]["state"])  # the RNG tensor, as a list
    json.dumps(train_state)  # plain data only
    assert state.optimizer is not None and state.optimizer.param_groups[0]["lr"] == lr
    # The loaded optimizer takes the next step from where OLMo-core left it.
    x = torch.randn(3, 4)
    state.model(x).sum().backward()
    state.optimizer.step()


def test_loading_into_another_shape_names_the_key_and_changes_nothing(run: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 9), nn.ReLU(), nn.Linear(9, 3))
    state = TrainingState(model, torch.optim.AdamW(model.parameters()))
    before = _tensors(state)
    with pytest.raises(CheckpointError, match=r"model\.0\.(weight|bias)"):
        Checkpointer().load(str(run / "step1"), state)
    assert all(torch.equal(before[k], v) for k, v in _tensors(state).items())


def test_reader_helpers(run: Path) -> None:
    for step in ("step1", "step2"):
        _matches(read_tensors(str(run / step)), step)
        assert read_train_state(str(run / step))["global_step"] == EXPECTED[step]["global_step"]
        assert read_train_state(str(run / step), rank=3)["global_step"] == EXPECTED[step]["global_step"]
    metadata = read_dcp_metadata(str(run / "step1"))
    assert set(EXPECTED["step1"]["tensors"]) <= set(metadata.state_dict_metadata)
    assert {type(s).__module__ for s in metadata.storage_data.values()} == {"torch.distributed.checkpoint.filesystem"}
    only = read_tensors(str(run / "step2"), ["model.0.weight"])
    assert list(only) == ["model.0.weight"]
    with pytest.raises(CheckpointError, match=r"optim\.param_groups"):
        read_tensors(str(run / "step1"), ["optim.param_groups.0.lr"])  # a pickled value, not a tensor
    with pytest.raises(CheckpointError, match="no tensor"):
        read_tensors(str(run / "step1"), ["model.9.weight"])


def test_reader_helpers_on_a_ckptkeeper_checkpoint(tmp_path: Path) -> None:
    state = _state(seed=3)
    Checkpointer().save(str(tmp_path), 4, state, train_state={"epoch": 2})
    got = read_tensors(str(tmp_path / "step4"))
    want = _tensors(state)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    doc = read_train_state(str(tmp_path / "step4"))
    assert doc["step"] == 4 and doc["train_state"] == {"epoch": 2} and "optim" in doc["state_meta"]
    assert set(want) <= set(read_dcp_metadata(str(tmp_path / "step4")).state_dict_metadata)


def test_trainer_resumes_from_an_olmo_core_load_path(run: Path, tmp_path: Path) -> None:
    state = _state()
    assert state.optimizer is not None
    batches = [(torch.randn(16, 4), torch.randn(16, 3)) for _ in range(3)]
    trainer = Trainer(model=state.model, optimizer=state.optimizer, loss_fn=nn.functional.mse_loss,
                      data_loader=batches, save_folder=str(tmp_path / "mine"), max_steps=4,
                      load_path=str(run))  # fmt: skip
    trainer.fit()
    assert trainer.loaded_from == str(run / "step2")
    assert trainer.start_step == 2 and trainer.global_step == 4
    # The OLMo-core folder was read, never written or pruned.
    assert sorted(p.name for p in run.iterdir()) == ["step1", "step2"]


# ---------------------------------------------------------------------- refused


def _pickle_asking_for(module: str, name: str, sentinel: Path) -> bytes:
    # protocol 2: GLOBAL module\nname\n, then call it with one string argument.
    arg = f"touch {sentinel}".encode()
    return (
        b"\x80\x02c" + module.encode() + b"\n" + name.encode() + b"\n"
        b"X" + len(arg).to_bytes(4, "little") + arg + b"\x85R."
    )


@pytest.mark.parametrize(
    "module,name",
    [
        ("os", "system"),
        ("olmo_core.distributed.checkpoint.filesystem", "_StoragePrefix"),
        ("olmo_core.distributed.checkpoint.filesystem", "os.system"),
        ("olmo_core.distributed.checkpoint.filesystem", "_StorageInfo.__init__"),
        ("builtins", "eval"),
    ],
)
def test_a_metadata_pickle_asking_for_anything_else_is_refused(
    run: Path, tmp_path: Path, module: str, name: str
) -> None:
    sentinel = tmp_path / "ran"
    (run / "step1" / "model_and_optim" / ".metadata").write_bytes(_pickle_asking_for(module, name, sentinel))
    info = discovery.list_checkpoints(str(run))[0]
    assert (info.complete, info.flavor) == (False, "olmo-core")
    assert "not plain checkpoint data" in (info.problem or "")
    with pytest.raises(UnsafeCheckpointError):
        Checkpointer().verify(str(run / "step1"))
    with pytest.raises(UnsafeCheckpointError):
        read_tensors(str(run / "step1"))
    state = _state()
    before = _tensors(state)
    with pytest.raises(CkptkeeperError):
        Checkpointer().load(str(run / "step1"), state)
    assert all(torch.equal(before[k], v) for k, v in _tensors(state).items())
    assert not sentinel.exists()


class _RunsCode:
    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        import os

        return os.system, (f"touch {self.sentinel}",)


def test_a_trainer_state_asking_for_code_is_refused(run: Path, tmp_path: Path) -> None:
    sentinel = tmp_path / "ran"
    buf = io.BytesIO()
    torch.save({"global_step": 1, "callbacks": _RunsCode(sentinel)}, buf)
    target = run / "step1" / "train" / "rank0.pt"
    target.write_bytes(buf.getvalue())
    with pytest.raises(UnsafeCheckpointError):
        Checkpointer().verify(str(run / "step1"))
    state = _state()
    before = _tensors(state)
    with pytest.raises(UnsafeCheckpointError):
        Checkpointer().load(str(run / "step1"), state)
    assert all(torch.equal(before[k], v) for k, v in _tensors(state).items())
    assert not sentinel.exists()


# ---------------------------------------------------------------------- other stores


def test_loaded_from_memory_after_copying_the_folder_there(run: Path) -> None:
    root = f"memory://olmo-{uuid.uuid4().hex[:8]}/run"
    store = storage_for(root)
    for f in sorted(run.rglob("*")):
        if f.is_file():
            store.write_bytes(f"{root}/{f.relative_to(run).as_posix()}", f.read_bytes())
    infos = discovery.list_checkpoints(root)
    assert [(i.step, i.complete, i.ephemeral, i.flavor) for i in infos] == [
        (1, True, False, "olmo-core"),
        (2, True, True, "olmo-core"),
    ]
    ckpt = Checkpointer()
    latest = ckpt.latest_checkpoint(root)
    assert latest == f"{root}/step2"
    assert isinstance(ckpt.verify(latest), discovery.OlmoCoreRecord)
    state = _state()
    assert ckpt.load(latest, state)["global_step"] == 2
    _matches(_tensors(state), "step2")
    _matches(read_tensors(f"{root}/step1"), "step1")
    assert read_train_state(f"{root}/step1")["global_step"] == 1


def test_a_truncated_file_in_memory_fails_the_load(run: Path) -> None:
    root = f"memory://olmo-{uuid.uuid4().hex[:8]}/run"
    store = storage_for(root)
    for f in sorted((run / "step2").rglob("*")):
        if f.is_file():
            data = f.read_bytes()
            if f.name == "__0_3.distcp":
                data = data[:-100]
            store.write_bytes(f"{root}/step2/{f.relative_to(run / 'step2').as_posix()}", data)
    state = _state()
    before = _tensors(state)
    with pytest.raises(CorruptCheckpointError, match=r"__0_3\.distcp"):
        Checkpointer().load(f"{root}/step2", state)
    assert all(torch.equal(before[k], v) for k, v in _tensors(state).items())


# ---------------------------------------------------------------------- sharded ckptkeeper checkpoints


def save_sharded_and_digest(rank: int, folder: str) -> dict[str, str]:
    """Runs on each of 2 ranks: an FSDP2-sharded model and optimizer after one step, saved; full digests."""
    from tests.distributed.workers import _sharded

    model, opt = _sharded()
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    state = TrainingState(model, opt)
    Checkpointer().save(folder, 1, state)
    tensors, _ = state.capture()
    out = {}
    for key, t in flatten_tensors(tensors):
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[key] = _digest(full)
    return out


def test_read_tensors_puts_a_two_rank_sharded_checkpoint_together(tmp_path: Path) -> None:
    from tests.distributed.spawn import run_ranks

    results = run_ranks(2, save_sharded_and_digest, str(tmp_path / "run"), out=tmp_path / "ranks")
    assert all(r["ok"] for r in results), results
    want = results[0]["value"]
    record = Checkpointer().verify(str(tmp_path / "run" / "step1"))
    assert record.world_size == 2
    got = read_tensors(str(tmp_path / "run" / "step1"))
    assert {k: _digest(v) for k, v in got.items()} == want
