"""The commit record grows with files (ranks), not with tensors: the scale simulation, small."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _simulation() -> Any:
    spec = importlib.util.spec_from_file_location("simulate_scale", ROOT / "benchmarks" / "simulate_scale.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_record_and_the_gather_do_not_grow_with_tensors() -> None:
    sim = _simulation()
    few = sim.simulate(ranks=64, tensors=10, checkpoints=2)
    many = sim.simulate(ranks=64, tensors=10_000, checkpoints=2)
    # The same files whatever they hold: 1,000x the tensors only lengthen each size by 3 digits.
    assert many["record_bytes"] - few["record_bytes"] <= 3 * many["files_in_record"]
    assert many["bytes_rank0_gathers"] - few["bytes_rank0_gathers"] <= 8 * many["files_in_record"]
    # Per rank: data file, segment table, trainer state; rank 0: DCP's .metadata, the shared index.
    assert many["files_in_record"] == 3 * 64 + 2
    # A load at the saved world size reads its own table and the shared index, not every table.
    assert many["table_bytes_each_rank_reads_per_load"] * 8 < many["table_bytes_each_rank_reads_per_resharding_load"]
    # ~90 bytes per file: 1,024 ranks stay far below the 1 MB target.
    assert many["record_bytes"] / many["files_in_record"] < 120
