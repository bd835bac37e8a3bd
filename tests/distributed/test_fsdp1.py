"""FSDP1 models (their sharded state dicts hold ShardedTensors, which answer almost no torch
function): async saves snapshot them, loads back them up, and both keep their promises."""

from __future__ import annotations

from pathlib import Path

from . import workers
from .spawn import run_ranks


def test_fsdp1_async_saves_and_loads_keep_their_promises_at_two_ranks(tmp_path: Path) -> None:
    results = run_ranks(2, workers.fsdp1_async_save_and_load, str(tmp_path / "run"), out=tmp_path / "out")
    for r in results:
        assert r["ok"], r.get("tb")
        v = r["value"]
        assert v["training_moved_on"] and v["pieces"] >= 4, v
        assert v["loaded_equals_call"], v  # the async save wrote the state at its call
        assert v["failed"] == "CheckpointMismatchError", v
        assert v["failed_load_changed_nothing"], v
