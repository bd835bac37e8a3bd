"""``ckptkeeper train``: train the built-in model with the Trainer and CheckpointerCallback.

Only the command line lives here (cheap to import); the training itself is in ``train_run``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any

from ..errors import ConfigurationError
from ..policy.config import CheckpointPolicyConfig, RemovalStrategy

__all__ = ["CRASH_EXIT_CODE", "add_parser", "add_policy_arguments", "int_in_range", "policy_settings", "run"]

CRASH_EXIT_CODE = 75
MAX_SEED = 2**31 - 1  # numpy's seeds stop at 2**32 - 1, and each rank reseeds with seed + 1000 * rank


def int_in_range(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse ``type=``: an integer from ``minimum`` (to ``maximum``); its error names the rule."""
    rule = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer {rule}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {value}")
        return value

    parse.__name__ = f"integer {rule}"  # what argparse calls the type in its own messages
    return parse


def _interval(text: str) -> int | None:
    """A step count of at least 1, or ``none`` (off), as CheckpointPolicyConfig accepts."""
    if text.lower() == "none":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 or 'none', got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}; use 'none' to turn it off")
    return value


def _steps_list(text: str) -> list[int]:
    try:
        steps = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated steps like 3,7,12, got {text!r}") from None
    negative = [s for s in steps if s < 0]
    if negative:
        raise argparse.ArgumentTypeError(f"steps must be at least 0, got {negative[0]}")
    return steps


def _tri(text: str) -> bool | None:
    table = {"auto": None, "true": True, "false": False}
    if text.lower() not in table:
        raise argparse.ArgumentTypeError(f"expected auto, true or false, got {text!r}")
    return table[text.lower()]


def _report_path(text: str) -> str:
    """An argparse ``type=``: a file path whose folder exists (checked before training, not after)."""
    folder = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file name such as {text}/report.json")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"folder {folder} does not exist; create it first")
    return text


def add_policy_arguments(p: argparse.ArgumentParser) -> None:
    """One option per :class:`~ckptkeeper.CheckpointPolicyConfig` field that has a ``cli`` kind.

    Generated from the config's fields (and their defaults and help), so a new setting reaches the
    command line without being listed again.
    """
    for f in dataclasses.fields(CheckpointPolicyConfig):
        kind, text = f.metadata.get("cli"), f.metadata.get("help", "")
        if kind is None:
            continue
        opt = "--" + f.name.replace("_", "-")
        if kind == "interval":
            p.add_argument(opt, type=_interval, default=f.default, metavar="K|none", help=text)
        elif kind == "steps":
            p.add_argument(opt, type=_steps_list, default=f.default, metavar="A,B", help=text)
        elif kind == "tri":
            p.add_argument(opt, type=_tri, default=f.default, metavar="auto|true|false", help=text)
        elif kind == "choice":
            choices = [s.value for s in RemovalStrategy]
            p.add_argument(opt, default=str(f.default), choices=choices, help=text)
        elif kind == "flag":
            p.add_argument(opt, dest=f.name, action="store_true", default=f.default, help=text)
            p.add_argument("--no-" + opt[2:], dest=f.name, action="store_false", help=f"the opposite of {opt}")
        else:  # pragma: no cover - a new kind in the config without a parser here
            raise AssertionError(f"no command-line form for {f.name} ({kind})")


def policy_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields :func:`add_policy_arguments` offered, as parsed."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(CheckpointPolicyConfig) if f.metadata.get("cli")}


def add_parser(sub: Any) -> None:
    """Register the ``train`` sub-command."""
    p = sub.add_parser("train", help="train the built-in model with checkpointing (rehearse crashes and resumes)")
    p.add_argument("--save-folder", required=True, help="path or URL of the save folder")
    p.add_argument("--steps", type=int_in_range(0), required=True, help="train until this global step")
    add_policy_arguments(p)
    p.add_argument("--crash-at-step", type=int_in_range(1), default=None, help="exit abruptly right after this step")
    p.add_argument("--seed", type=int_in_range(0, MAX_SEED), default=0, help="seed of the model, data and RNGs")
    p.add_argument("--hidden", type=int_in_range(1), default=64, help="width of the built-in model")
    p.add_argument("--report", type=_report_path, default=None, help="write a JSON report here (rank 0)")
    p.add_argument(
        "--start-fresh-if-unloadable",
        action="store_true",
        help="when the save folder holds checkpoints and none of them loads, train from scratch instead of "
        "stopping; on a local disk those checkpoints are first moved aside to unloadable-step{N}-<hex> "
        "(kept for a post-mortem, never listed or removed), so this run's checkpoints do not replace them",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``ckptkeeper train``; returns the exit code."""
    # The settings are checked here, before train_run imports torch (seconds), so that a bad one fails
    # at once; train_run checks them again as the callback's (the same config, the same message).
    try:
        CheckpointPolicyConfig(**policy_settings(args))
    except ConfigurationError as exc:
        print(f"ckptkeeper train: error: invalid setting: {exc}", file=sys.stderr)
        return 2
    from .train_run import run as run_training

    return run_training(args)
