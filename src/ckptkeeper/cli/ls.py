"""``ckptkeeper ls``: the checkpoints in a save folder, as a table or JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from ..engine import Checkpointer
from ..storage import storage_for

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Register the ``ls`` sub-command."""
    p = sub.add_parser("ls", help="list the checkpoints in a save folder")
    p.add_argument("path", help="save folder (path or URL)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _local_problem(path: str) -> str | None:
    """Why a local save folder cannot be listed (None when it can, or when ``path`` is a URL).

    Object-store prefixes are not folders: an empty listing of one is an answer, not an error.
    """
    local = storage_for(path).local_path(path)
    if local is None:
        return None
    if not os.path.exists(local):
        return f"{path} does not exist"
    if not os.path.isdir(local):
        return f"{path} is not a folder"
    try:
        os.listdir(local)
    except PermissionError:
        return f"{path} cannot be read (permission denied)"
    return None


def run(args: argparse.Namespace) -> int:
    """Run ``ckptkeeper ls``; returns the exit code."""
    problem = _local_problem(args.path)
    if problem is not None:
        print(f"ckptkeeper ls: error: {problem}", file=sys.stderr)
        return 1
    infos = Checkpointer().list_checkpoints(args.path)
    if args.json:
        rows = [
            {
                "step": i.step,
                "ephemeral": i.ephemeral,
                "complete": i.complete,
                "path": i.path,
                "bytes": i.bytes,
                "created_unix": i.created_unix,
                "problem": i.problem,
            }
            for i in infos
        ]
        print(json.dumps(rows, indent=1))
        return 0
    table = Table(title=f"checkpoints in {args.path}")
    for col in ("step", "kind", "complete", "size", "created (UTC)", "note"):
        table.add_column(col, justify="right" if col in ("step", "size") else "left")
    for i in infos:
        kind = "?" if i.ephemeral is None else ("ephemeral" if i.ephemeral else "permanent")
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(i.created_unix)) if i.created_unix else "-"
        table.add_row(str(i.step), kind, "yes" if i.complete else "NO", _human(i.bytes), created, i.problem or "")
    console = Console()
    if not infos:
        console.print(f"no checkpoint folders in {args.path}")
        return 0
    console.print(table)
    return 0
