"""The ``ckptkeeper`` command: look after checkpoints without writing Python.

``ls``, ``inspect``, ``verify``, ``rm``, ``prune``, ``cp`` and ``export`` operate on save folders
and checkpoints on any store; ``train`` (the built-in model, for demos and rehearsals) and
``bench`` (measurements) exercise the library. Every command module imports only what its
parser needs; heavy imports (torch) happen when a command runs, so ``--help`` is instant.

A user's mistake (a bad flag, a bad environment variable, a missing folder) ends the command with
one line on stderr that names it, and a non-zero exit code; a traceback means a bug in ckptkeeper.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from .._version import __version__
from ..errors import CkptkeeperError
from . import bench, cp, export, inspect, ls, prune, rm, train, verify
from ._common import UsageError, plain

__all__ = ["main"]

INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, as shells report a command stopped by Ctrl-C


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the flag and the rule broken), then exit code 2.

    Sub-command parsers are made of the same class (``add_subparsers`` uses the parent's type).
    """

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _verbosity(parser: argparse.ArgumentParser, default: object) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("-q", "--quiet", action="store_true", default=default, help="only warnings and errors")
    group.add_argument("-v", "--verbose", action="store_true", default=default, help="debug messages too")


def build_parser() -> argparse.ArgumentParser:
    """The whole command line (every sub-command with its flags)."""
    parser = _Parser(
        prog="ckptkeeper",
        description="Keep the checkpoints of PyTorch training runs: list, inspect, verify, copy, prune and "
        "export them on local disk, S3 (s3://) and GCS (gs://).",
        epilog="Run 'ckptkeeper COMMAND --help' for a command's flags. Exit codes: 0 success, 1 failure "
        "(a user error or a failed check), 2 bad arguments, 130 interrupted.",
    )
    parser.add_argument("--version", action="version", version=f"ckptkeeper {__version__}")
    _verbosity(parser, False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (ls, inspect, verify, rm, prune, cp, export, train, bench):
        module.add_parser(sub)
    for p in sub.choices.values():
        # -q/-v also after the sub-command; SUPPRESS keeps the value given before it.
        _verbosity(p, argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ckptkeeper`` command; returns the exit code."""
    args = build_parser().parse_args(argv)
    level = logging.WARNING if args.quiet else logging.DEBUG if args.verbose else logging.INFO
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if not args.verbose:
        # Client libraries are chatty at INFO (every retry, every connection); -v shows them. So is
        # our own metrics logger (a line of JSON per save, beside the line saying it happened):
        # CKPTKEEPER_METRICS=FILE still gets every event.
        for noisy in ("botocore", "boto3", "urllib3", "s3transfer", "gcsfs", "fsspec", "aiohttp", "ckptkeeper.metrics"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    # Only ckptkeeper's own errors (which name the problem and the fix) and Ctrl-C become one line:
    # anything else is a bug, and its traceback is what a bug report needs.
    try:
        code: int = args.func(args)
    except CkptkeeperError as exc:
        # One line, always, and the checkpoint's words in it written out (a tensor name holding
        # terminal escapes or a newline and a forged "OK" line: found by an outside attack).
        text = plain("; ".join(line.strip() for line in str(exc).splitlines() if line.strip()))
        print(f"ckptkeeper {args.command}: error: {text}", file=sys.stderr)
        return 2 if isinstance(exc, UsageError) else 1
    except KeyboardInterrupt:
        print(f"ckptkeeper {args.command}: interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE
    except BrokenPipeError:
        # The reader went away (`ckptkeeper ls --json | head`): not an error of ours.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return code
