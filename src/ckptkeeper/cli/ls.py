"""``ckptkeeper ls``: the checkpoints in a save folder, as a table or JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from ..errors import CkptkeeperError
from ..storage import storage_for
from ._common import human, shown

__all__ = ["add_parser", "local_problem", "run"]


def add_parser(sub: Any) -> None:
    """Register the ``ls`` sub-command."""
    p = sub.add_parser(
        "ls",
        help="list the checkpoints in a save folder",
        description="List every step{N} folder in a save folder: step, kind (permanent or ephemeral), whether "
        "it is complete, size, creation time, format (ckptkeeper or OLMo-core) and what is wrong with an "
        "incomplete one. Exit 1 when PATH does not exist or is not a folder.",
    )
    p.add_argument(
        "path", help="save folder: a local path, file://, s3://BUCKET/PREFIX, gs://BUCKET/PREFIX or memory://"
    )
    p.add_argument("--json", action="store_true", help="print a JSON list of objects instead of a table")
    p.add_argument(
        "--verify",
        action="store_true",
        help="also read every file of each complete checkpoint and check its checksum (slow: reads everything)",
    )
    p.set_defaults(func=run)


def local_problem(path: str, want_folder: bool = True) -> str | None:
    """Why a local path cannot be used (None when it can, or when ``path`` is a URL).

    Object-store prefixes are not folders: an empty listing of one is an answer, not an error.
    """
    local = storage_for(path).local_path(path)
    if local is None:
        return None
    if not os.path.exists(local):
        return f"{path} does not exist"
    if want_folder and not os.path.isdir(local):
        return f"{path} is not a folder"
    try:
        if want_folder:
            os.listdir(local)
    except PermissionError:
        return f"{path} cannot be read (permission denied)"
    return None


def run(args: argparse.Namespace) -> int:
    """Run ``ckptkeeper ls``; returns the exit code."""
    problem = local_problem(args.path)
    if problem is not None:
        print(f"ckptkeeper ls: error: {problem}", file=sys.stderr)
        return 1
    # The engine is imported once the path is known good: a mistyped path fails at once.
    from ..engine import discovery
    from ..storage import parse_step

    if parse_step(args.path.rstrip("/").rsplit("/", 1)[-1]) is not None and not discovery.list_checkpoints(args.path):
        parent = args.path.rstrip("/").rsplit("/", 1)[0] if "/" in args.path.rstrip("/") else "."
        print(
            f"ckptkeeper ls: error: {args.path} is a checkpoint, not a save folder; use `ckptkeeper inspect "
            f"{args.path}` or `ckptkeeper ls {parent}`",
            file=sys.stderr,
        )
        return 1
    infos = discovery.list_checkpoints(args.path)
    verified: dict[int, str] = {}
    if args.verify:
        for i in infos:
            if i.complete:
                try:
                    discovery.verify(i.path)
                    verified[i.step] = "ok"
                except CkptkeeperError as exc:
                    verified[i.step] = f"FAILED: {exc}"
    if args.json:
        rows = []
        for i in infos:
            row: dict[str, Any] = {
                "step": i.step,
                "ephemeral": i.ephemeral,
                "complete": i.complete,
                "path": i.path,
                "bytes": i.bytes,
                "created_unix": i.created_unix,
                "format": getattr(i, "flavor", "ckptkeeper"),
                "problem": i.problem,
            }
            if args.verify:
                row["verified"] = verified.get(i.step)
            rows.append(row)
        print(json.dumps(rows, indent=1))
        return 0 if all(v == "ok" for v in verified.values()) else 1
    from rich.console import Console
    from rich.table import Table

    # Written to a log or a pipe, the table keeps its columns instead of folding into 80.
    console = Console() if sys.stdout.isatty() else Console(width=200)
    if not infos:
        console.print(shown(f"no checkpoint folders in {args.path}"))
        return 0
    # The path and problems are shown as text (shown()), never read as Rich markup: a folder named
    # "a[/]b" crashed the command (found by an outside attack).
    table = Table(title=shown(f"checkpoints in {args.path}"))
    columns = ["step", "kind", "complete", "size", "created (UTC)", "format", "problem"]
    if args.verify:
        columns.insert(3, "verified")
    for col in columns:
        table.add_column(col, justify="right" if col in ("step", "size") else "left")
    for i in infos:
        kind = "?" if i.ephemeral is None else ("ephemeral" if i.ephemeral else "permanent")
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(i.created_unix)) if i.created_unix else "-"
        cells = [str(i.step), kind, "yes" if i.complete else "NO", human(i.bytes), created,
                 getattr(i, "flavor", "ckptkeeper"), i.problem or ""]  # fmt: skip
        if args.verify:
            cells.insert(3, verified.get(i.step, "-"))
        table.add_row(*map(shown, cells))
    console.print(table)
    return 0 if all(v == "ok" for v in verified.values()) else 1
