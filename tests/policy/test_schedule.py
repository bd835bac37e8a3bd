"""Table-driven tests of the pure decisions, one table per rule of the specification."""

from __future__ import annotations

from typing import Any

import pytest

from ckptkeeper.policy import (
    CheckpointPolicyConfig,
    RetentionBook,
    SaveKind,
    decide_save,
    decide_timed_save,
    needs_final_save,
    removable_from_earlier_runs,
    wants_pre_train_save,
)

P, E = SaveKind.permanent, SaveKind.ephemeral


@pytest.mark.parametrize(
    ("cfg", "step", "latest", "blocked", "want"),
    [
        # permanent interval
        ({"save_interval": 10}, 10, -1, False, P),
        ({"save_interval": 10}, 11, -1, False, None),
        ({"save_interval": None}, 10, -1, False, None),
        # ephemeral interval
        ({"save_interval": 10, "ephemeral_save_interval": 3}, 3, -1, False, E),
        ({"save_interval": 10, "ephemeral_save_interval": 3}, 4, -1, False, None),
        # a step on both intervals is permanent
        ({"save_interval": 6, "ephemeral_save_interval": 3}, 6, -1, False, P),
        # fixed steps off the intervals are permanent
        ({"save_interval": 10, "fixed_steps": (7,)}, 7, -1, False, P),
        ({"save_interval": 10, "ephemeral_save_interval": 4, "fixed_steps": (8,)}, 8, -1, False, P),
        ({"save_interval": None, "fixed_steps": (0, 5)}, 5, -1, False, P),
        # blocked ephemerals: skipped, permanents unaffected
        ({"save_interval": 10, "ephemeral_save_interval": 3}, 3, -1, True, None),
        ({"save_interval": 10, "ephemeral_save_interval": 5}, 10, -1, True, P),
        ({"save_interval": 10, "fixed_steps": (3,), "ephemeral_save_interval": 3}, 3, -1, True, P),
        # cooldown counts from the latest save of this run; strictly less than blocks
        ({"save_interval": 10, "ephemeral_save_interval": 2, "ephemeral_cooldown": 3}, 12, 10, False, None),
        ({"save_interval": 10, "ephemeral_save_interval": 2, "ephemeral_cooldown": 3}, 14, 10, False, E),
        ({"save_interval": 10, "ephemeral_save_interval": 3, "ephemeral_cooldown": 3}, 3, 0, False, E),
        ({"save_interval": 10, "ephemeral_save_interval": 2, "ephemeral_cooldown": 5}, 2, -1, False, None),
        ({"save_interval": 10, "ephemeral_save_interval": 2, "ephemeral_cooldown": 3}, 2, -1, False, E),
        # cooldown never blocks a permanent save
        ({"save_interval": 10, "ephemeral_save_interval": 2, "ephemeral_cooldown": 50}, 20, 18, False, P),
    ],
)
def test_decide_save(cfg: dict[str, Any], step: int, latest: int, blocked: bool, want: SaveKind | None) -> None:
    assert decide_save(CheckpointPolicyConfig(**cfg), step, latest, blocked) == want


@pytest.mark.parametrize(
    ("pre_train", "step", "loaded", "want"),
    [
        (None, 0, False, True),  # fresh start: default saves at step 0
        (None, 0, True, False),  # resumed from step 0: default does not
        (None, 7, True, False),  # resumed later: never
        (True, 0, True, True),  # forced
        (True, 7, True, False),  # forced, but only at step 0
        (False, 0, False, False),  # off
    ],
)
def test_pre_train(pre_train: bool | None, step: int, loaded: bool, want: bool) -> None:
    cfg = CheckpointPolicyConfig(pre_train_checkpoint=pre_train)
    assert wants_pre_train_save(cfg, step, loaded) is want


@pytest.mark.parametrize(("step", "latest", "want"), [(10, 10, False), (11, 10, True), (0, -1, True), (5, 7, False)])
def test_final_save(step: int, latest: int, want: bool) -> None:
    assert needs_final_save(step, latest) is want


FOUND = [(0, "s0"), (3, "s3"), (5, "s5"), (6, "s6"), (10, "s10"), (12, "s12"), (25, "s25")]


@pytest.mark.parametrize(
    ("cfg", "current", "want"),
    [
        # ephemeral_only: multiples of the *current* ephemeral interval, not permanent, not 0, not ahead
        ({"save_interval": 10, "ephemeral_save_interval": 3, "remove": "ephemeral_only"}, 20, ["s3", "s6", "s12"]),
        ({"save_interval": 10, "ephemeral_save_interval": 5, "remove": "ephemeral_only"}, 20, ["s5"]),
        ({"save_interval": 10, "remove": "ephemeral_only"}, 20, []),  # no ephemeral interval: nothing
        # all_non_permanent: everything not permanent now
        ({"save_interval": 10, "remove": "all_non_permanent"}, 20, ["s3", "s5", "s6", "s12"]),
        ({"save_interval": 5, "remove": "all_non_permanent"}, 30, ["s3", "s6", "s12"]),
        ({"save_interval": None, "remove": "all_non_permanent"}, 30, ["s3", "s5", "s6", "s10", "s12", "s25"]),
        # fixed steps are kept
        ({"save_interval": 10, "fixed_steps": (6,), "remove": "all_non_permanent"}, 20, ["s3", "s5", "s12"]),
        # beyond the current step: kept
        ({"save_interval": 100, "remove": "all_non_permanent"}, 5, ["s3", "s5"]),
        # never
        ({"save_interval": 10, "ephemeral_save_interval": 3, "remove": "never"}, 20, []),
    ],
)
def test_removable_from_earlier_runs(cfg: dict[str, Any], current: int, want: list[str]) -> None:
    assert removable_from_earlier_runs(CheckpointPolicyConfig(**cfg), FOUND, current) == want


def test_found_checkpoints_come_out_oldest_first() -> None:
    cfg = CheckpointPolicyConfig(save_interval=None, remove="all_non_permanent")
    assert removable_from_earlier_runs(cfg, [(9, "c"), (2, "a"), (5, "b")], 10) == ["a", "b", "c"]


def test_retention_book_supersedes_only_on_ephemeral_saves() -> None:
    book: RetentionBook[str] = RetentionBook()
    book.adopt_found(["old1", "old2"])
    assert book.record_save("p10", P) == []
    assert book.take_due() == []
    assert book.record_save("e13", E) == ["old1", "old2"]
    assert book.record_save("e16", E) == ["e13"]
    assert book.take_due() == ["old1", "old2", "e13"]
    assert book.take_due() == []
    assert book.ephemerals == ["e16"]
    assert book.permanents == ["p10"]


@pytest.mark.parametrize(
    ("scheduled", "every", "elapsed", "blocked", "want"),
    [
        (None, None, 1e9, False, None),  # no timer
        (None, 60.0, 59.9, False, None),  # not yet
        (None, 60.0, 60.0, False, SaveKind.ephemeral),  # due
        (None, 60.0, 600.0, True, None),  # ephemerals blocked at this step
        (SaveKind.permanent, 60.0, 600.0, False, SaveKind.permanent),  # the schedule's save stands
        (SaveKind.ephemeral, 60.0, 1.0, False, SaveKind.ephemeral),
    ],
)
def test_the_wall_clock_trigger(
    scheduled: SaveKind | None, every: float | None, elapsed: float, blocked: bool, want: SaveKind | None
) -> None:
    assert decide_timed_save(scheduled, every, elapsed, blocked) == want


def test_a_book_puts_back_a_failed_save_and_keeps_what_a_vanished_one_superseded() -> None:
    book: RetentionBook[str] = RetentionBook()
    book.record_save("e2", SaveKind.ephemeral)
    book.record_save("p3", SaveKind.permanent)
    snap = book.snapshot()
    assert book.record_save("e4", SaveKind.ephemeral) == ["e2"]
    book.restore(snap)  # e4's save failed: it superseded nothing
    assert (book.ephemerals, book.to_remove, book.permanents) == (["e2"], [], ["p3"])
    book.record_save("e4", SaveKind.ephemeral)
    book.withdraw("e4")  # e4 is gone: e2 stays until the next ephemeral save
    assert (book.ephemerals, book.to_remove) == (["e2"], [])
    assert book.record_save("e6", SaveKind.ephemeral) == ["e2"] and book.take_due() == ["e2"]
    book.withdraw("p3")
    assert book.permanents == [] and book.ephemerals == ["e6"]
