"""The ``ckptkeeper`` command: ``train`` (the built-in model, for demos and rehearsals), ``ls`` and ``bench``.

A user's mistake (a bad flag, a bad environment variable, a missing folder) ends the command with
one line on stderr that names it, and a non-zero exit code; a traceback means a bug in ckptkeeper.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import NoReturn

from ..errors import CkptkeeperError
from . import bench, ls, train

__all__ = ["main"]

INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, as shells report a command stopped by Ctrl-C


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the flag and the rule broken), then exit code 2.

    Sub-command parsers are made of the same class (``add_subparsers`` uses the parent's type).
    """

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ckptkeeper`` command; returns the exit code."""
    parser = _Parser(prog="ckptkeeper", description="Keep the checkpoints of PyTorch training runs.")
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
    # Only ckptkeeper's own errors (which name the problem and the fix) and Ctrl-C become one line:
    # anything else is a bug, and its traceback is what a bug report needs.
    try:
        code: int = args.func(args)
    except CkptkeeperError as exc:
        text = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())  # one line, always
        print(f"ckptkeeper {args.command}: error: {text}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"ckptkeeper {args.command}: interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE
    return code
