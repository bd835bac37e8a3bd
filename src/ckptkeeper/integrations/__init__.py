"""Where ckptkeeper meets a training loop: the Trainer, its callbacks, and the checkpointer callback."""

from .builtin import BuiltinSetup, build_builtin
from .callback import Callback
from .checkpointer_callback import CheckpointerCallback, CheckpointEvent
from .trainer import Trainer, TrainStep

__all__ = [
    "BuiltinSetup",
    "Callback",
    "CheckpointEvent",
    "CheckpointerCallback",
    "TrainStep",
    "Trainer",
    "build_builtin",
]
