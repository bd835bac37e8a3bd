"""ckptkeeper: checkpoints for PyTorch training runs that are saved on time, committed atomically,
verified on load, and pruned by rules you can read.

Quick use::

    from ckptkeeper import Trainer, CheckpointerCallback
    cb = CheckpointerCallback(save_interval=1000, ephemeral_save_interval=100)
    Trainer(model=m, optimizer=opt, loss_fn=loss, data_loader=dl, save_folder="runs/a",
            max_steps=10_000, callbacks=[cb]).fit()
"""

from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    CkptkeeperError,
    ConfigurationError,
    CorruptCheckpointError,
    DiskFullError,
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
    from .policy import CheckpointPolicyConfig, RemovalStrategy
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
    **dict.fromkeys(("CheckpointPolicyConfig", "RemovalStrategy"), "policy"),
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
    "RemovalStrategy",
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
