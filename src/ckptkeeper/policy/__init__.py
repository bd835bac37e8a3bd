"""Pure checkpoint policy: configuration and decisions, with no I/O, clock or torch."""

from .config import CheckpointPolicyConfig, RemovalStrategy
from .pruning import PruneCandidate, PrunePlan, PruneRules, RetentionRules, plan_prune
from .schedule import (
    RetentionBook,
    SaveKind,
    decide_save,
    decide_timed_save,
    is_permanent_step,
    needs_final_save,
    removable_from_earlier_runs,
    wants_pre_train_save,
)

__all__ = [
    "CheckpointPolicyConfig",
    "PruneCandidate",
    "PrunePlan",
    "PruneRules",
    "RemovalStrategy",
    "RetentionBook",
    "RetentionRules",
    "SaveKind",
    "decide_save",
    "decide_timed_save",
    "is_permanent_step",
    "needs_final_save",
    "plan_prune",
    "removable_from_earlier_runs",
    "wants_pre_train_save",
]
