"""Turning training state into checkpoint files and back: staging, writing, the commit protocol, loading."""

from .checkpointer import Checkpointer, CheckpointInfo, SaveResult
from .lease import SaveFolderLease
from .record import CommitRecord, FileEntry
from .staging import Stager
from .state import Stateful, TrainingState, state_digest

__all__ = [
    "CheckpointInfo",
    "Checkpointer",
    "CommitRecord",
    "FileEntry",
    "SaveFolderLease",
    "SaveResult",
    "Stager",
    "Stateful",
    "TrainingState",
    "state_digest",
]
