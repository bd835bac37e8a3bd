"""Replays the specification's 60 recorded multi-run scenarios through the real Trainer and
CheckpointerCallback on real disk, and compares every save, every removal (and the step it
happened at), the checkpoint each run resumed from, and the complete checkpoints left after
each run.

The one intended difference (see the data file's "about"): removals the specification left
pending when a run finished normally are carried out by ckptkeeper at the end of that run, so
those steps are gone afterwards and later runs neither find nor remove them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ckptkeeper import Checkpointer, CheckpointerCallback, storage_for

from ..helpers import events_of, run_to_end, tiny_trainer

DATA = json.loads((Path(__file__).parent.parent / "data" / "scenarios.json").read_text())
CASES: list[dict[str, Any]] = DATA["cases"]


def _callback(cfg: dict[str, Any]) -> CheckpointerCallback:
    return CheckpointerCallback(save_async=False, **cfg)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"case{i}" for i in range(len(CASES))])
def test_scenario(index: int, tmp_path: Path) -> None:
    folder = str(tmp_path / "run")
    gone_early: set[int] = set()
    for r, run in enumerate(CASES[index]["runs"]):
        where = f"case {index} run {r}"
        cb = _callback(run["cfg"])
        trainer = tiny_trainer(folder, cb, run["steps"], crash_at=run.get("crash_at"))
        finished = run_to_end(trainer)
        assert finished == (run.get("crash_at") is None), where

        resumed = None if trainer.loaded_from is None else storage_for(folder).join(trainer.loaded_from)
        expected_resume = run["resumed_from"]
        got_resume = None if resumed is None else int(resumed.rstrip("/").rsplit("step", 1)[-1])
        assert got_resume == expected_resume, where

        expected: list[dict[str, Any]] = []
        for e in run["events"]:
            if e["event"] == "save":
                gone_early.discard(e["step"])
                expected.append(e)
            elif e["step"] not in gone_early:
                expected.append(e)
        if finished:
            expected += [{"event": "remove", "step": s, "at_step": run["steps"]} for s in run["pending_removal_at_end"]]
        assert events_of(cb) == expected, where

        complete = {s for s, _ in Checkpointer().find_checkpoints(folder)}
        want = set(run["complete_after"]) - gone_early
        if finished:
            want -= set(run["pending_removal_at_end"])
            gone_early |= set(run["pending_removal_at_end"])
        assert complete == want, where
