"""``ckptkeeper rm``: remove one checkpoint the safe way (invisible first, then its files)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..errors import ConfigurationError
from ._common import confirm

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Register the ``rm`` sub-command."""
    p = sub.add_parser(
        "rm",
        help="remove a checkpoint (commit record first, then its files)",
        description="Remove one checkpoint: it becomes invisible at once (local disk: renamed to .trash-*; "
        "object stores: commit record deleted first), then exactly the files it lists are deleted. Only "
        "checkpoints ckptkeeper can prove it wrote are removed; a step{N} symlink is unlinked, never followed. "
        "Takes the save folder's lease, so it refuses while a training run uses the folder.",
    )
    p.add_argument("path", help="the checkpoint: a step{N} folder (path or URL)")
    p.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``ckptkeeper rm``; returns the exit code."""
    from ..engine.deleter import remove_checkpoint, step_path
    from ..engine.lease import SaveFolderLease

    _, canon, parent, step = step_path(args.path)
    if not confirm(f"remove checkpoint {canon} (step {step})?", args.yes):
        print("nothing removed", file=sys.stderr)
        return 1
    with SaveFolderLease(parent):
        if not remove_checkpoint(canon):
            raise ConfigurationError(f"{canon} does not exist; `ckptkeeper ls {parent}` lists the checkpoints")
    print(f"removed {canon}")
    return 0
