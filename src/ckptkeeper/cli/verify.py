"""``ckptkeeper verify``: prove checkpoints intact (every file's size and checksum), one line each."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..errors import CkptkeeperError
from ..storage import parse_step, storage_for
from ._common import human, plain, progress
from .ls import local_problem

__all__ = ["add_parser", "checkpoints_under", "run"]


def add_parser(sub: Any) -> None:
    """Register the ``verify`` sub-command."""
    p = sub.add_parser(
        "verify",
        help="check every file of checkpoints against their commit records (sizes and checksums)",
        description="Read every file of each checkpoint and compare its size and xxh3 checksum with the commit "
        "record; decode the small files safely and check the data layout. Each PATH is a checkpoint (a step{N} "
        "folder, or any folder holding a commit record) or a save folder (then every checkpoint in it). One line "
        "per checkpoint; exit 1 if any fails.",
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="a checkpoint or a save folder (path or URL)")
    p.add_argument("--json", action="store_true", help="print a JSON list of {path, step, ok, problem, bytes, note}")
    p.set_defaults(func=run)


def checkpoints_under(path: str) -> list[str]:
    """``path`` itself when it is a step folder or holds a commit record (a checkpoint copied to a
    folder of another name), else the step folders inside it (complete or not)."""
    from ..engine import discovery
    from ..storage.layout import COMMIT_RECORD

    path = path.rstrip("/") or path
    if parse_step(path.rsplit("/", 1)[-1]) is not None:
        return [path]
    storage = storage_for(path)
    if storage.exists(storage.join(path, COMMIT_RECORD)):
        return [path]
    return [i.path for i in discovery.list_checkpoints(path)]


def _row(path: str, step: int | None, problem: str | None, nbytes: int = 0, note: str | None = None) -> dict[str, Any]:
    """One checkpoint's line of the report (``--json``: every row with the same keys); OK when no ``problem``."""
    return {"path": path, "step": step, "ok": problem is None, "problem": problem, "bytes": nbytes, "note": note}


def run(args: argparse.Namespace) -> int:
    """Run ``ckptkeeper verify``; returns the exit code."""
    rows: list[dict[str, Any]] = []
    for path in args.paths:
        problem = local_problem(path)
        if problem is not None:
            rows.append(_row(path, None, problem))
            continue
        # The engine is imported once a path exists (verifying a folder may import torch).
        from ..engine import discovery

        found = checkpoints_under(path)
        if not found:
            rows.append(_row(path, None, "no checkpoints here"))
        for ckpt in found:
            step = parse_step(ckpt.rsplit("/", 1)[-1])
            stored = sum(f.size for f in storage_for(ckpt).walk(ckpt))
            with progress(f"verifying step {step}", stored) as advance:
                try:
                    record = discovery.verify(ckpt)
                    if step is None:  # a checkpoint in a folder not named step{N}: its record says
                        step = record.step
                    rows.append(_row(ckpt, step, None, stored, discovery.verify_note(ckpt)))
                except CkptkeeperError as exc:
                    rows.append(_row(ckpt, step, str(exc), stored))
                advance(stored)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            if r["ok"]:
                extra = f" ({r['note']})" if r.get("note") else ", sizes and checksums match"
                print(plain(f"OK      {r['path']}: {human(r['bytes'])}{extra}"))
            else:
                print(plain(f"FAILED  {r['path']}: {r['problem']}"))  # (the checkpoint's words: see plain)
    return 0 if rows and all(r["ok"] for r in rows) else 1
