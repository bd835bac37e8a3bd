"""Names inside a save folder: where each part of a checkpoint lives, and which names are ours.

```
<save_folder>/
  step{N}/                      one checkpoint (N in canonical form: step7, never step07)
    model_and_optim/            stock torch.distributed.checkpoint (DCP) files
      .metadata  __0_0.distcp ...
    train/rank{R}.json          trainer state of rank R (step, RNG, data position, ...), JSON
    .ckptkeeper/intent-rank{R}.json   object stores: the files rank R is about to upload, written first
    .metadata.json              the commit record, written last
  .tmp-step{N}-{8 hex}/         a save in progress (local disk); never read
  .trash-step{N}-{8 hex}/       a checkpoint being deleted in the background; never read
  .ckptkeeper-lease.json        the save folder's writer lease
```

ckptkeeper deletes only names it can prove it wrote, so every scratch name is matched exactly
(:func:`is_scratch_name`) and every path read from a checkpoint is checked by
:func:`check_relpath` before it is used.
"""

from __future__ import annotations

import functools
import re

__all__ = [
    "COMMIT_RECORD",
    "INTENT_DIR",
    "LEASE_FILE",
    "MAX_STEP",
    "MODEL_DIR",
    "TMP_PREFIX",
    "TRAIN_DIR",
    "TRASH_PREFIX",
    "check_relpath",
    "intent_name",
    "is_scratch_name",
    "parse_step",
    "scratch_name",
    "step_dir_name",
    "train_state_name",
]

COMMIT_RECORD = ".metadata.json"
MODEL_DIR = "model_and_optim"
TRAIN_DIR = "train"
INTENT_DIR = ".ckptkeeper"
LEASE_FILE = ".ckptkeeper-lease.json"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"

# Canonical step names only: "step05" is somebody else's folder (ckptkeeper would write "step5").
_STEP_RE = re.compile(r"step(0|[1-9][0-9]{0,18})")
_SCRATCH_RE = re.compile(r"\.(tmp|trash)-step(0|[1-9][0-9]{0,18})-[0-9a-f]{8}")
_SEGMENT_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}|\.[A-Za-z0-9_][A-Za-z0-9._-]{0,253}")
_MAX_DEPTH = 8


MAX_STEP = 1 << 62
"""The largest step a checkpoint may have (what commit records accept)."""


def step_dir_name(step: int) -> str:
    """The folder name of the checkpoint of ``step``."""
    return f"step{step}"


def parse_step(name: str) -> int | None:
    """The step of a checkpoint folder name (``step42`` -> 42), or None for any other name.

    Only the canonical spelling counts: ``step042`` or ``step 42`` are not ckptkeeper's.
    """
    m = _STEP_RE.fullmatch(name.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def scratch_name(kind: str, step: int, token: str) -> str:
    """``.tmp-step{N}-{token}`` or ``.trash-step{N}-{token}`` (``token``: 8 lowercase hex digits)."""
    name = f".{kind}-{step_dir_name(step)}-{token}"
    if not _SCRATCH_RE.fullmatch(name):
        raise ValueError(f"not a valid scratch name: {name!r}")
    return name


def is_scratch_name(name: str) -> bool:
    """Whether ``name`` is exactly a scratch folder name ckptkeeper writes (never just any ``.tmp-*``)."""
    return _SCRATCH_RE.fullmatch(name) is not None


def train_state_name(rank: int) -> str:
    """Relative path of rank ``rank``'s trainer state inside a checkpoint."""
    return f"{TRAIN_DIR}/rank{rank}.json"


def intent_name(rank: int) -> str:
    """Relative path of rank ``rank``'s upload intent inside an object-store checkpoint."""
    return f"{INTENT_DIR}/intent-rank{rank}.json"


def check_relpath(rel: object) -> str | None:
    """Why ``rel`` is not a safe file name inside a step folder, or None when it is.

    (Answers for strings are cached: ``ls`` checks the same few thousand names in every record.)

    Safe: a plain relative path of at most 8 ``/``-separated parts, each made of letters, digits,
    ``.``, ``_`` and ``-``, none empty, ``.`` or ``..``; no backslash, drive or absolute path.
    Checkpoint files are data, so a name that could reach outside the folder makes it invalid.
    """
    if not isinstance(rel, str):
        return f"file name {rel!r} is not a string"
    return _check_name(rel)


@functools.lru_cache(maxsize=1 << 16)
def _check_name(rel: str) -> str | None:
    if not rel or len(rel) > 1024:
        return "empty or overlong file name"
    parts = rel.split("/")
    if len(parts) > _MAX_DEPTH:
        return f"file name {rel[:80]!r} is nested too deeply"
    for part in parts:
        if part in ("", ".", "..") or not _SEGMENT_RE.fullmatch(part):
            return f"file name {rel[:80]!r} is not a plain relative path inside the checkpoint"
    return None
