"""What the many-tensor speed-ups must not break: scatter reads of runs of small tensors (short
reads, empty tensors, damaged headers), and the collector pause (nested, across threads, after
errors, and never turning on a collector the user turned off)."""

from __future__ import annotations

import gc
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptkeeper import Checkpointer, CorruptCheckpointError
from ckptkeeper.cli.bench_run import _FixedState
from ckptkeeper.engine import discovery, fastio
from ckptkeeper.engine.gcpause import paused_gc


def _tree(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    model: dict[str, torch.Tensor] = {}
    for i in range(1500):
        kind = i % 5
        if kind == 0:
            model[f"t{i}"] = torch.empty(0)  # empty tensors sit inside runs too
        elif kind == 1:
            model[f"t{i}"] = torch.randint(-100, 100, (i % 9 + 1,), generator=g, dtype=torch.int64)
        elif kind == 2:
            model[f"t{i}"] = torch.randn(3, i % 4 + 1, generator=g).to(torch.bfloat16)
        else:
            model[f"t{i}"] = torch.randn(i % 11 + 1, generator=g)
    return {"model": model}


def _like(tree: dict[str, Any], fill: float) -> dict[str, Any]:
    return {"model": {k: torch.full_like(v, fill) for k, v in tree["model"].items()}}


def test_runs_of_small_tensors_survive_short_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tree = _tree(0)
    Checkpointer().save(str(tmp_path), 1, _FixedState(tree))
    real = os.preadv
    calls = []

    def short(fd: int, buffers: list[Any], offset: int) -> int:
        # The kernel may return fewer bytes than asked, ending anywhere, even inside a buffer.
        calls.append(len(buffers))
        total = sum(len(b) for b in buffers)
        if total <= 1:
            return real(fd, buffers, offset)
        want = max(1, total // 3 + 1)
        bufs, left = [], want
        for b in buffers:
            if left <= 0:
                break
            view = memoryview(b)
            bufs.append(view[: min(len(view), left)])
            left -= len(view)
        return real(fd, bufs, offset)

    monkeypatch.setattr(fastio.os, "preadv", short)
    back = _like(tree, 3.0)
    Checkpointer().load(str(tmp_path / "step1"), _FixedState(back))
    assert max(calls) <= fastio._IOV_MAX and len(calls) > 10
    for k, v in tree["model"].items():
        assert torch.equal(back["model"][k], v), k


def test_a_damaged_header_in_a_run_fails_the_load_and_changes_nothing(tmp_path: Path) -> None:
    tree = _tree(1)
    Checkpointer().save(str(tmp_path), 1, _FixedState(tree))
    folder = tmp_path / "step1"
    rows = discovery.read_layout(str(folder), Checkpointer().read_record(str(folder)))["model_and_optim/__0_0.distcp"]
    head = next(r for r in rows if r[0] == "head" and r[1] == "model.t1203")
    data_file = folder / "model_and_optim" / "__0_0.distcp"
    raw = bytearray(data_file.read_bytes())
    raw[head[2] + head[3] // 2] ^= 0x01
    data_file.write_bytes(bytes(raw))
    fresh = _like(tree, 5.0)
    with pytest.raises(CorruptCheckpointError, match=r"model\.t1203 \(head\)"):
        Checkpointer().load(str(folder), _FixedState(fresh))
    assert all(bool((v == 5).all()) for v in fresh["model"].values())


def test_a_truncated_run_is_refused_before_anything_changes(tmp_path: Path) -> None:
    bufs = [memoryview(bytearray(4)), memoryview(bytearray(0)), memoryview(bytearray(8))]
    path = tmp_path / "short"
    path.write_bytes(b"x" * 10)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(CorruptCheckpointError, match="ends early"):
            fastio.preadv_full(fd, list(bufs), 0, str(path))
    finally:
        os.close(fd)


def test_the_collector_pause_nests_spans_threads_and_restores_what_was() -> None:
    assert gc.isenabled()
    entered, leave = threading.Event(), threading.Event()

    def other() -> None:
        with paused_gc():
            entered.set()
            leave.wait(10)

    t = threading.Thread(target=other)
    with paused_gc():
        assert not gc.isenabled()
        t.start()
        assert entered.wait(10)
        with paused_gc():
            assert not gc.isenabled()
    assert not gc.isenabled()  # the other thread still holds it
    leave.set()
    t.join()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), paused_gc():
        raise RuntimeError("boom")
    assert gc.isenabled()
    gc.disable()  # the user's own choice is kept
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_saves_and_loads_leave_the_collector_on_even_when_they_fail(tmp_path: Path) -> None:
    tree = _tree(2)
    ck = Checkpointer()
    ck.save(str(tmp_path), 1, _FixedState(tree))
    assert gc.isenabled()
    _, fut = ck.save_async(str(tmp_path), 2, _FixedState(tree))
    fut.result()
    ck.wait()
    assert gc.isenabled()
    with pytest.raises(CorruptCheckpointError):
        (tmp_path / "step1" / "model_and_optim" / "__0_0.distcp").write_bytes(b"")
        ck.load(str(tmp_path / "step1"), _FixedState(_like(tree, 0.0)))
    assert gc.isenabled()
    ck.close()
