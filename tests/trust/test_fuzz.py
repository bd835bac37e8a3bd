"""Fuzzing the three files a load trusts least: the commit record, DCP's ``.metadata`` and the
trainer state. Every mutated load either restores exactly the saved state or raises a
CkptkeeperError, never anything else, never a side effect, and a failed load changes nothing."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ckptkeeper import Checkpointer, CkptkeeperError, TrainingState, state_digest
from ckptkeeper.engine.record import CommitRecord, FileEntry, digest_bytes
from ckptkeeper.storage.layout import COMMIT_RECORD

TARGETS = [COMMIT_RECORD, "model_and_optim/.metadata", "train/rank0.json"]
MUTATIONS = ["flip", "truncate", "extend", "zero", "replace", "forged"]
N = 1000


class Counter:
    """A stateful extra with a non-tensor value, so the trainer-state JSON matters."""

    def __init__(self, n: int = 0) -> None:
        self.n = n

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "t": torch.arange(3.0) * self.n}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = int(sd["n"])


def _state(seed: int) -> TrainingState:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return TrainingState(model, opt, extra={"counter": Counter(seed + 1)})


def _fingerprint(st: TrainingState) -> tuple[Any, ...]:
    assert st.optimizer is not None
    groups = json.dumps([{k: v for k, v in g.items() if k != "params"} for g in st.optimizer.param_groups])
    counter = st.extra["counter"]
    assert isinstance(counter, Counter)
    return state_digest(st.model, st.optimizer), groups, counter.n


def _random_json(rng: random.Random, depth: int = 0) -> Any:
    makers = [
        lambda: None,
        lambda: True,
        lambda: rng.randint(-(2**70), 2**70),
        lambda: float(f"{rng.random()}e{rng.randint(-5, 400)}"),
        lambda: "x" * rng.randint(0, 40),
        lambda: "../" * rng.randint(1, 5) + "etc/passwd",
        lambda: [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))],
        lambda: {f"k{i}": _random_json(rng, depth + 1) for i in range(rng.randint(0, 3))},
        lambda: {"bytes": rng.randint(-5, 10**6), "xxh3_64": f"{rng.getrandbits(64):016x}"},
    ]
    return makers[rng.randrange(len(makers) if depth < 3 else 6)]()


def _forge_json(rng: random.Random, data: bytes) -> bytes:
    doc = json.loads(data)
    node = doc
    path: list[Any] = []
    while isinstance(node, (dict, list)) and node and rng.random() < 0.7:
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        path.append(key)
        node = node[key]
    if not path:
        return json.dumps(_random_json(rng)).encode()
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = _random_json(rng)
    return json.dumps(doc).encode()


def _mutate(rng: random.Random, data: bytes, how: str) -> bytes:
    raw = bytearray(data)
    if how == "flip":
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(raw))
            raw[i] ^= 1 << rng.randrange(8)
    elif how == "truncate":
        del raw[rng.randrange(len(raw)) :]
    elif how == "extend":
        raw += os.urandom(rng.randint(1, 64)) if rng.random() < 0.5 else b"}" * rng.randint(1, 8)
    elif how == "zero":
        i = rng.randrange(len(raw))
        raw[i : i + rng.randint(1, 32)] = b"\x00" * len(raw[i : i + 32])
    elif how == "replace":
        i = rng.randrange(len(raw))
        n = rng.randint(1, 16)
        raw[i : i + n] = os.urandom(n)
    return bytes(raw)


def _resign(folder: Path, rel: str, data: bytes) -> None:
    """What an attacker with write access does after editing a file: fix the record to match."""
    rec = CommitRecord.from_json((folder / COMMIT_RECORD).read_bytes(), "fuzz")
    files = dict(rec.files)
    files[rel] = FileEntry(len(data), digest_bytes(data))
    new = CommitRecord(rec.step, rec.ephemeral, rec.world_size, files, rec.created_unix, extra=dict(rec.extra))
    (folder / COMMIT_RECORD).write_bytes(new.to_json())


@pytest.mark.timeout(300)
def test_fuzzed_small_files_load_exactly_or_fail_cleanly(tmp_path: Path) -> None:
    rng = random.Random(20261201)
    pristine = tmp_path / "pristine"
    saved = _state(0)
    Checkpointer().save(str(pristine), 1, saved, train_state={"epoch": 1, "note": "ok"})
    want = _fingerprint(saved)
    work = tmp_path / "work"
    outside_before = sorted(os.listdir(tmp_path))
    ckpt = Checkpointer()
    outcomes = {"loaded": 0, "refused": 0}
    for i in range(N):
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(pristine, work)
        folder = work / "step1"
        target = rng.choice(TARGETS)
        how = rng.choice(MUTATIONS)
        original = (folder / target).read_bytes()
        if how == "forged" and target != "model_and_optim/.metadata":
            mutated = _forge_json(rng, original)
        else:
            mutated = _mutate(rng, original, "replace" if how == "forged" else how)
        (folder / target).write_bytes(mutated)
        if how == "forged" and target != COMMIT_RECORD:
            _resign(folder, target, mutated)
        dst = _state(100 + i % 7)
        before = _fingerprint(dst)
        try:
            ckpt.list_checkpoints(str(work))
            ts = ckpt.load(str(folder), dst)
        except CkptkeeperError:
            outcomes["refused"] += 1
            assert _fingerprint(dst) == before, (i, target, how)
        except Exception as exc:  # pragma: no cover - the failure this test exists to catch
            pytest.fail(f"mutation {i} ({how} of {target}) raised {type(exc).__name__}: {exc}")
        else:
            outcomes["loaded"] += 1
            if how == "forged":
                # A re-signed file is what the checkpoint now says was saved: its tensors are untouched.
                assert _fingerprint(dst)[0] == want[0], (i, target, how)
            else:
                assert _fingerprint(dst) == want and ts == {"epoch": 1, "note": "ok"}, (i, target, how)
        with contextlib.suppress(CkptkeeperError):
            ckpt.verify(str(folder))
    assert sorted(set(os.listdir(tmp_path)) - {"work"}) == outside_before
    print(outcomes)
    assert outcomes["refused"] > N // 2 and outcomes["loaded"] > 0, outcomes
