"""``ckptkeeper rm``: remove one checkpoint the safe way (invisible first, then its files)."""

from __future__ import annotations

import argparse
import os
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
            # A plain file of that name was said not to exist (found by an outside attack).
            what = "is not a folder" if os.path.lexists(canon) and not os.path.isdir(canon) else "does not exist"
            raise ConfigurationError(f"{canon} {what}; `ckptkeeper ls {parent}` lists the checkpoints")
    print(f"removed {canon}")
    return 0
