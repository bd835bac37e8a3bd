"""``ckptkeeper prune``: free space by removing checkpoints no keep-rule keeps (never the newest)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from ._common import UsageError, confirm, human, plain, require_local
from .train import int_in_range

__all__ = ["add_parser", "run"]


def _steps(text: str) -> list[int]:
    try:
        steps = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated steps like 1000,5000, got {text!r}") from None
    if any(s < 0 for s in steps):
        raise argparse.ArgumentTypeError(f"steps must be >= 0, got {text!r}")
    return steps


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def _duration(text: str) -> float:
    """A duration like ``90s``, ``30m``, ``12h``, ``7d``, ``2w`` (a bare number is seconds)."""
    t = text.strip().lower()
    unit = _UNITS.get(t[-1:])
    number = t[:-1] if unit is not None else t
    try:
        value = float(number) * (unit or 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a duration like 12h or 7d, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive duration like 12h or 7d, got {text!r}")
    return value


def add_parser(sub: Any) -> None:
    """Register the ``prune`` sub-command."""
    p = sub.add_parser(
        "prune",
        help="remove the complete checkpoints that no --keep-* rule keeps (never the newest)",
        description="Remove complete checkpoints of a save folder that no keep-rule keeps. A checkpoint stays "
        "if any rule keeps it; the newest complete checkpoint always stays; incomplete folders are never "
        "touched. Prints what it removes (and why each kept one stays). Give at least one --keep-* rule. "
        "Takes the save folder's lease, so it refuses while a training run uses the folder.",
    )
    p.add_argument("folder", help="the save folder (path or URL)")
    p.add_argument("--keep-last", type=int_in_range(1), metavar="N", help="keep the newest N checkpoints")
    p.add_argument("--keep-every", type=int_in_range(1), metavar="K", help="keep steps that are multiples of K")
    p.add_argument("--keep-steps", type=_steps, default=[], metavar="A,B", help="keep these steps, e.g. 1000,5000")
    p.add_argument(
        "--keep-best", type=int_in_range(1), metavar="K", help="keep the K best by --metric (saved with the checkpoint)"
    )
    p.add_argument("--metric", metavar="NAME", help="the metric --keep-best ranks by, e.g. val_loss")
    p.add_argument("--mode", choices=("min", "max"), default="min", help="lower (min) or higher (max) is better")
    p.add_argument(
        "--keep-younger-than", type=_duration, metavar="AGE", help="keep checkpoints younger than AGE, e.g. 12h, 7d"
    )
    p.add_argument("--dry-run", action="store_true", help="print what would be removed; remove nothing")
    p.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``ckptkeeper prune``; returns the exit code."""
    from ..policy import PruneCandidate, PruneRules, plan_prune

    if (args.keep_best is None) != (args.metric is None):
        raise UsageError("--keep-best and --metric go together: --keep-best 3 --metric val_loss")
    rules_given = (args.keep_last, args.keep_every, args.keep_best, args.keep_younger_than)
    if all(r is None for r in rules_given) and not args.keep_steps:
        raise UsageError(
            "give at least one of --keep-last, --keep-every, --keep-steps, --keep-best or --keep-younger-than; "
            "pruning with none would remove every checkpoint but the newest"
        )
    rules = PruneRules(
        keep_last=args.keep_last,
        keep_every=args.keep_every,
        keep_steps=tuple(args.keep_steps),
        keep_best=args.keep_best,
        best_metric=args.metric,
        best_mode=args.mode,
        keep_younger_than=args.keep_younger_than,
    )
    require_local(args.folder)
    # The engine is imported once the rules and the folder are known good.
    from ..engine import discovery
    from ..engine.deleter import remove_checkpoint
    from ..engine.lease import SaveFolderLease

    infos = discovery.list_checkpoints(args.folder)
    complete = {i.step: i for i in infos if i.complete and i.flavor == "ckptkeeper"}
    plan = plan_prune(
        [PruneCandidate(i.step, i.created_unix, i.metrics) for i in complete.values()], rules, now=time.time()
    )
    for i in infos:
        if i.complete and i.flavor != "ckptkeeper":
            print(f"keep    step {i.step} ({i.flavor}: not ckptkeeper's, never removed)")
    for step, why in plan.keep.items():
        print(f"keep    step {step} ({', '.join(why)})")
    freed = sum(complete[s].bytes for s in plan.remove)
    verb = "would remove" if args.dry_run else "remove"
    for step in plan.remove:
        print(plain(f"{verb:<7} step {step} ({human(complete[step].bytes)}) {complete[step].path}"))
    if not plan.remove:
        print("nothing to remove")
        return 0
    if args.dry_run:
        print(f"dry run: {len(plan.remove)} checkpoints, {human(freed)} would be freed; nothing was removed")
        return 0
    if not confirm(f"remove {len(plan.remove)} checkpoints ({human(freed)})?", args.yes):
        print("nothing removed", file=sys.stderr)
        return 1
    with SaveFolderLease(args.folder):
        for step in plan.remove:
            remove_checkpoint(complete[step].path)
    print(f"removed {len(plan.remove)} checkpoints, freed {human(freed)}")
    return 0
