"""ckptkeeper: checkpoints for PyTorch training runs that are saved on time, committed atomically,
verified on load, and pruned by rules you can read.

Quick use::

    from ckptkeeper import Trainer, CheckpointerCallback
    cb = CheckpointerCallback(save_interval=1000, ephemeral_save_interval=100)
    Trainer(model=m, optimizer=opt, loss_fn=loss, data_loader=dl, save_folder="runs/a",
            max_steps=10_000, callbacks=[cb]).fit()
"""

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
from .integrations import Callback, CheckpointerCallback, CheckpointEvent, Trainer
from .policy import CheckpointPolicyConfig, RemovalStrategy
from .storage import Storage, storage_for

__version__ = "0.1.0"

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
