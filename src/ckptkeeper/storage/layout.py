"""Names inside a save folder: where each part of a checkpoint lives.

```
<save_folder>/
  step{N}/                      one checkpoint
    model_and_optim/            stock torch.distributed.checkpoint (DCP) files
      .metadata  __0_0.distcp ...
    train/rank{R}.json          trainer state of rank R (step, RNG, data position, ...), JSON
    .metadata.json              the commit record, written last
  .tmp-step{N}-<id>/            a save in progress (local disk); never read
  .trash-step{N}-<id>/          a checkpoint being deleted in the background; never read
```
"""

from __future__ import annotations

import re

__all__ = [
    "COMMIT_RECORD",
    "MODEL_DIR",
    "TMP_PREFIX",
    "TRAIN_DIR",
    "TRASH_PREFIX",
    "parse_step",
    "step_dir_name",
    "train_state_name",
]

COMMIT_RECORD = ".metadata.json"
MODEL_DIR = "model_and_optim"
TRAIN_DIR = "train"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"

_STEP_RE = re.compile(r"^step(\d+)$")


def step_dir_name(step: int) -> str:
    """The folder name of the checkpoint of ``step``."""
    return f"step{step}"


def parse_step(name: str) -> int | None:
    """The step of a checkpoint folder name (``step42`` -> 42), or None for any other name."""
    m = _STEP_RE.match(name.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def train_state_name(rank: int) -> str:
    """Relative path of rank ``rank``'s trainer state inside a checkpoint."""
    return f"{TRAIN_DIR}/rank{rank}.json"
