"""The ``ckptkeeper`` command: ``train`` (the built-in model, for demos and rehearsals), ``ls`` and ``bench``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from ..errors import CkptkeeperError
from . import bench, ls, train

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ckptkeeper`` command; returns the exit code."""
    parser = argparse.ArgumentParser(prog="ckptkeeper", description="Keep the checkpoints of PyTorch training runs.")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors")
    sub = parser.add_subparsers(dest="command", required=True)
    train.add_parser(sub)
    ls.add_parser(sub)
    bench.add_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        code: int = args.func(args)
    except CkptkeeperError as exc:
        print(f"ckptkeeper {args.command}: error: {exc}", file=sys.stderr)
        return 1
    return code
