"""ckptkeeper: checkpoints for PyTorch training runs that are saved on time, committed atomically,
verified on load, and pruned by rules you can read.

Quick use, in your own training loop::

    from ckptkeeper import CheckpointManager, CheckpointPolicyConfig
    mgr = CheckpointManager("runs/a", model=model, optimizer=opt,
                            config=CheckpointPolicyConfig(save_interval=1000, ephemeral_save_interval=100))
    step = mgr.restore()                  # newest good checkpoint, else 0
    for batch in mgr.data(loader):        # resumes the data position
        ...; step += 1
        mgr.save_if_due(step)
        if step == max_steps:
            break
    mgr.close()
"""

from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    CkptkeeperError,
    ConfigurationError,
    CorruptCheckpointError,
    DiskFullError,
    NewerFormatError,
    SaveFolderInUseError,
    StorageAccessError,
    StorageError,
    UnsafeCheckpointError,
)

if TYPE_CHECKING:
    from .engine import (
        Checkpointer,
        CheckpointInfo,
        CommitRecord,
        SaveFolderLease,
        SaveResult,
        Stateful,
        TrainingState,
        state_digest,
    )
    from .integrations import Callback, CheckpointerCallback, CheckpointEvent, Trainer
    from .manager import CheckpointManager, JsonStateful
    from .policy import CheckpointPolicyConfig, RemovalStrategy, RetentionRules
    from .storage import Storage, storage_for

# Names are imported on first use (PEP 562): `ckptkeeper --help` and `ckptkeeper ls` must not pay
# for importing torch before they know whether they need it.
_LAZY = {
    **dict.fromkeys(
        ("Checkpointer", "CheckpointInfo", "CommitRecord", "SaveFolderLease", "SaveResult", "Stateful",
         "TrainingState", "state_digest"),
        "engine",
    ),
    **dict.fromkeys(("Callback", "CheckpointerCallback", "CheckpointEvent", "Trainer"), "integrations"),
    **dict.fromkeys(("CheckpointManager", "JsonStateful"), "manager"),
    **dict.fromkeys(("CheckpointPolicyConfig", "RemovalStrategy", "RetentionRules"), "policy"),
    **dict.fromkeys(("Storage", "storage_for"), "storage"),
}  # fmt: skip


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptkeeper' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "Callback",
    "CheckpointError",
    "CheckpointEvent",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointPolicyConfig",
    "CheckpointSaveError",
    "Checkpointer",
    "CheckpointerCallback",
    "CkptkeeperError",
    "CommitRecord",
    "ConfigurationError",
    "CorruptCheckpointError",
    "DiskFullError",
    "JsonStateful",
    "NewerFormatError",
    "RemovalStrategy",
    "RetentionRules",
    "SaveFolderInUseError",
    "SaveFolderLease",
    "SaveResult",
    "Stateful",
    "Storage",
    "StorageAccessError",
    "StorageError",
    "Trainer",
    "TrainingState",
    "UnsafeCheckpointError",
    "__version__",
    "state_digest",
    "storage_for",
]
