"""Turning training state into checkpoint files and back: staging, writing, the commit protocol, loading.

Names are imported on first use, so that light tools (``ckptkeeper ls``, discovery) do not import
torch before they need it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .checkpointer import Checkpointer, CheckpointInfo, SaveResult, SaveStage
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
    "SaveStage",
    "Stager",
    "Stateful",
    "TrainingState",
    "state_digest",
]

_WHERE = {
    "CheckpointInfo": "discovery",
    "Checkpointer": "checkpointer",
    "SaveResult": "checkpointer",
    "SaveStage": "checkpointer",
    "SaveFolderLease": "lease",
    "CommitRecord": "record",
    "FileEntry": "record",
    "Stager": "staging",
    "Stateful": "state",
    "TrainingState": "state",
    "state_digest": "state",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptkeeper.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
