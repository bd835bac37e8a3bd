"""Keep-rules of ``ckptkeeper prune``, by table: a checkpoint stays if any rule keeps it, and the
newest always stays."""

from __future__ import annotations

import pytest

from ckptkeeper import ConfigurationError
from ckptkeeper.policy import PruneCandidate, PruneRules, RetentionRules, plan_prune

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


# Retention beyond the seed: the same planner with metrics, ages and protected steps.
def _cands(metrics: dict[int, float] | None = None, ages: dict[int, float] | None = None) -> list[PruneCandidate]:
    now = 10_000.0
    return [
        PruneCandidate(
            s,
            created_unix=None if ages is None else now - ages[s],
            metrics={} if metrics is None or s not in metrics else {"val_loss": metrics[s]},
        )
        for s in STEPS
    ]


LOSSES = {100: 0.9, 200: 0.5, 250: 0.7, 300: 0.4, 400: 0.6}  # step 500 saved without the metric


@pytest.mark.parametrize(
    ("rules", "removed"),
    [
        (RetentionRules(keep_best=2, best_metric="val_loss"), [100, 250, 400]),
        (RetentionRules(keep_best=2, best_metric="val_loss", best_mode="max"), [200, 300, 400]),
        (RetentionRules(keep_best=1, best_metric="val_loss", keep_last=2), [100, 200, 250]),
        # No checkpoint has the metric (a typo?): ranking by it removes nothing.
        (RetentionRules(keep_best=3, best_metric="accuracy"), []),
        (RetentionRules(keep_best=3, best_metric="accuracy", keep_last=1), []),
        (RetentionRules(keep_best=1, best_metric="val_loss", keep_every=250), [100, 200, 400]),
    ],
)
def test_keep_best_by_metric(rules: RetentionRules, removed: list[int]) -> None:
    plan = plan_prune(_cands(metrics=LOSSES), rules)
    assert plan.remove == removed


def test_keep_best_ties_go_to_the_newer_checkpoint() -> None:
    plan = plan_prune(_cands(metrics=dict.fromkeys(STEPS, 0.5)), RetentionRules(keep_best=1, best_metric="val_loss"))
    assert plan.remove == [100, 200, 250, 300, 400]


AGES = {100: 9000.0, 200: 5000.0, 250: 3601.0, 300: 3599.0, 400: 10.0, 500: 1.0}


@pytest.mark.parametrize(
    ("rules", "removed"),
    [
        (RetentionRules(keep_younger_than=3600), [100, 200, 250]),
        (RetentionRules(keep_younger_than=3600, keep_every=100), [250]),
        (RetentionRules(keep_younger_than=1e9), []),
        (RetentionRules(keep_younger_than=5), [100, 200, 250, 300, 400]),
    ],
)
def test_keep_younger_than(rules: RetentionRules, removed: list[int]) -> None:
    assert plan_prune(_cands(ages=AGES), rules, now=10_000.0).remove == removed


def test_unknown_age_is_kept_and_protected_steps_stay() -> None:
    cands = [PruneCandidate(1), PruneCandidate(2, created_unix=0.0), PruneCandidate(3, created_unix=0.0)]
    assert plan_prune(cands, RetentionRules(keep_younger_than=60), now=1e6).remove == [2]
    plan = plan_prune(STEPS, RetentionRules(keep_last=1), protected={200})
    assert plan.remove == [100, 250, 300, 400] and plan.keep[200] == ["in use"]


@pytest.mark.parametrize(
    "bad",
    [
        {"keep_best": 2},
        {"best_metric": "loss"},
        {"keep_best": 0, "best_metric": "loss"},
        {"keep_best": 1, "best_metric": "loss", "best_mode": "lowest"},
        {"keep_younger_than": 0},
        {"keep_younger_than": float("nan")},
        {"keep_last": True},
    ],
)
def test_bad_retention_rules_name_the_setting(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError) as err:
        RetentionRules(**bad)  # type: ignore[arg-type]
    assert any(k in str(err.value) for k in bad)
