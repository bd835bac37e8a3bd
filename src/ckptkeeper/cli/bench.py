"""``ckptkeeper bench``: ckptkeeper's saves and loads measured beside the alternatives, in one run.

Only the command line lives here (cheap to import); the measurements are in ``bench_run``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from .train import int_in_range

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Register the ``bench`` sub-command."""
    p = sub.add_parser("bench", help="measure saves and loads beside torch.save and DCP")
    p.add_argument(
        "--model-mib", type=int_in_range(1), default=1024, help="model size in MiB (optimizer state is 2x more)"
    )
    p.add_argument("--repeats", type=int_in_range(1), default=3, help="repeats per measurement (medians are reported)")
    p.add_argument(
        "--dir", type=_writable_folder, default=None, help="an existing folder to write in (default: a temporary one)"
    )
    p.add_argument("--json", action="store_true", help="print a JSON object instead of a table")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the state lives")
    p.set_defaults(func=run)


def _writable_folder(text: str) -> str:
    """An argparse ``type=``: an existing folder this process may create files in."""
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"{text} does not exist; create it first or leave --dir out")
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is not a folder")
    if not os.access(text, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text} is not writable (permission denied)")
    return text


def run(args: argparse.Namespace) -> int:
    """Run ``ckptkeeper bench``; returns the exit code."""
    from .bench_run import run as run_bench

    return run_bench(args)
