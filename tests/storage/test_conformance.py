"""One conformance suite every storage backend must pass, plus the checkpointer on each backend."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptkeeper import Checkpointer, TrainingState, state_digest, storage_for
from ckptkeeper.storage import Storage

from ..helpers import stepped_linear
from .servers import BACKENDS, backend_root


@pytest.fixture(params=BACKENDS)
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    yield from backend_root(request, tmp_path)


def test_write_read_exists_size(root: str) -> None:
    st: Storage = storage_for(root)
    p = st.join(root, "a", "b.bin")
    assert not st.exists(p)
    st.write_bytes(p, b"hello")
    assert st.exists(p) and st.read_bytes(p) == b"hello" and st.size(p) == 5
    st.write_bytes(p, b"bye")
    assert st.read_bytes(p) == b"bye"
    with pytest.raises(FileNotFoundError):
        st.read_bytes(st.join(root, "missing"))


def test_create_exclusive_refuses_an_existing_file(root: str) -> None:
    st = storage_for(root)
    p = st.join(root, "rec.json")
    st.create_exclusive(p, b"first")
    with pytest.raises(FileExistsError):
        st.create_exclusive(p, b"second")
    assert st.read_bytes(p) == b"first"


def test_list_and_walk_with_many_files(root: str) -> None:
    st = storage_for(root)
    for i in range(23):  # more than one page where the server pages listings
        st.write_bytes(st.join(root, "step5", "model_and_optim", f"f{i:02d}"), bytes([i]) * (i + 1))
    st.write_bytes(st.join(root, "step7", "x"), b"x")
    st.write_bytes(st.join(root, "top.txt"), b"t")
    assert st.list_dir(root) == ["step5", "step7", "top.txt"]
    files = list(st.walk(st.join(root, "step5")))
    assert len(files) == 23
    assert {f.relpath for f in files} == {f"model_and_optim/f{i:02d}" for i in range(23)}
    assert sum(f.size for f in files) == sum(range(1, 24))
    assert st.list_dir(st.join(root, "nothing")) == [] and list(st.walk(st.join(root, "nothing"))) == []


def test_upload_download_and_remove(root: str, tmp_path: Path) -> None:
    st = storage_for(root)
    src = tmp_path / "src.bin"
    src.write_bytes(b"\x00\x01" * 5000)
    p = st.join(root, "d", "blob")
    st.upload(str(src), p)
    dst = tmp_path / "dst.bin"
    st.download(p, str(dst))
    assert dst.read_bytes() == src.read_bytes()
    for i in range(12):
        st.write_bytes(st.join(root, "d", f"n{i}"), b"1")
    assert st.remove_tree(st.join(root, "d")) == 13
    assert st.list_dir(root) == [] or "d" not in st.list_dir(root)
    st.remove_file(st.join(root, "never-existed"))


def _state(seed: int) -> TrainingState:
    return stepped_linear(seed, 32, 16, batch=3)


def test_checkpointer_commit_discover_load_remove(root: str) -> None:
    ckpt = Checkpointer()
    st = _state(0)
    ckpt.save(root, 3, st, train_state={"k": 1})
    _, fut = ckpt.save_async(root, 6, st, train_state={"k": 2}, ephemeral=True)
    fut.result()
    assert [s for s, _ in ckpt.find_checkpoints(root)] == [3, 6]
    infos = ckpt.list_checkpoints(root)
    assert [i.ephemeral for i in infos] == [False, True] and all(i.complete for i in infos)
    other = _state(1)
    assert ckpt.load(ckpt.latest_checkpoint(root) or "", other) == {"k": 2}
    assert state_digest(other.model, other.optimizer) == state_digest(st.model, st.optimizer)
    ckpt.remove(storage_for(root).join(root, "step3"))
    assert [s for s, _ in ckpt.find_checkpoints(root)] == [6]
    assert "step3" not in storage_for(root).list_dir(root)
    ckpt.close()
