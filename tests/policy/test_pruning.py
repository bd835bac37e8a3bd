"""Keep-rules of ``ckptkeeper prune``, by table: a checkpoint stays if any rule keeps it, and the
newest always stays."""

from __future__ import annotations

import pytest

from ckptkeeper import ConfigurationError
from ckptkeeper.policy import PruneRules, plan_prune

STEPS = [100, 200, 250, 300, 400, 500]


@pytest.mark.parametrize(
    ("rules", "removed"),
    [
        (PruneRules(keep_last=2), [100, 200, 250, 300]),
        (PruneRules(keep_last=10), []),
        (PruneRules(keep_every=200), [100, 250, 300, 500][:3]),
        (PruneRules(keep_steps=(250,)), [100, 200, 300, 400]),
        (PruneRules(keep_last=1, keep_every=250), [100, 200, 300, 400]),
        (PruneRules(keep_every=1000), [100, 200, 250, 300, 400]),
    ],
)
def test_rules_compose_and_the_newest_stays(rules: PruneRules, removed: list[int]) -> None:
    plan = plan_prune(STEPS, rules)
    assert plan.remove == removed
    assert 500 in plan.keep and "newest" in plan.keep[500]
    assert sorted([*plan.keep, *plan.remove]) == STEPS


def test_empty_folder_and_bad_rules() -> None:
    assert plan_prune([], PruneRules(keep_last=1)).remove == []
    for bad in ({}, {"keep_last": 0}, {"keep_every": -1}, {"keep_steps": (-3,)}):
        with pytest.raises(ConfigurationError):
            PruneRules(**bad)  # type: ignore[arg-type]
