"""``ckptkeeper cp``: copy a checkpoint or a whole save folder to another save folder, on any store."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..errors import CkptkeeperError
from ._common import human, plain, progress, require_local

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Register the ``cp`` sub-command."""
    p = sub.add_parser(
        "cp",
        help="copy a checkpoint (or every complete checkpoint of a save folder) to a save folder",
        description="Copy SRC to the save folder DST (created if missing), on any store (local, s3://, gs://). "
        "SRC is a checkpoint (a step{N} folder: it keeps its name under DST) or a save folder (then every "
        "complete checkpoint in it). Every file's checksum is checked on the way, the commit record is "
        "written last at the destination, and the copy is verified there. A checkpoint already at DST is "
        "left alone when identical and refused when different.",
    )
    p.add_argument("src", help="a step folder or a save folder (path or URL)")
    p.add_argument("dst", help="the destination save folder (path or URL)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``ckptkeeper cp``; returns the exit code."""
    require_local(args.src)
    # After the source is checked: the transfer imports torch (seconds).
    from ..engine import discovery
    from ..engine.deleter import clean_save_folder
    from ..engine.lease import SaveFolderLease
    from ..engine.transfer import copy_checkpoint
    from ..storage import parse_step, storage_for

    src = args.src.rstrip("/")
    failed = 0
    if parse_step(src.rsplit("/", 1)[-1]) is not None:
        sources = [src]
    else:
        infos = discovery.list_checkpoints(src)
        sources = [i.path for i in infos if i.complete]
        for i in infos:
            if i.newer_format:
                # Not copied, and the copy fails: an older ckptkeeper resuming from the copy
                # would go back past it without a word (an outside attack).
                failed += 1
                print(plain(f"ckptkeeper cp: error: {i.path} not copied: {i.problem}"), file=sys.stderr)
            elif not i.complete:
                print(plain(f"skipping incomplete {i.path}: {i.problem}"), file=sys.stderr)
        if not sources:
            print(f"ckptkeeper cp: error: no complete checkpoint in {src}", file=sys.stderr)
            return 1
    storage_for(args.dst).check_access(args.dst)
    with SaveFolderLease(args.dst):
        # Leftovers of an earlier, interrupted copy into this folder (provably ours) go first.
        clean_save_folder(args.dst)
        for s in sources:
            total = sum(f.size for f in storage_for(s).walk(s))
            try:
                with progress(f"copying {s.rsplit('/', 1)[-1]}", total) as advance:
                    out, copied = copy_checkpoint(s, args.dst, advance)
            except CkptkeeperError as exc:
                if len(sources) == 1:
                    raise
                # Rescuing a run: carry on with the other checkpoints, and fail at the end.
                failed += 1
                print(plain(f"ckptkeeper cp: error: {s}: {exc}"), file=sys.stderr)
                continue
            if copied:
                print(plain(f"copied {s} -> {out} ({human(total)}, verified)"))
            else:
                print(plain(f"{out} already holds {s} (the same commit record): nothing copied"))
    return 1 if failed else 0
