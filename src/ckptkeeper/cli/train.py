"""``ckptkeeper train``: train the built-in model with the Trainer and CheckpointerCallback."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from .. import distributed as D
from ..engine import Checkpointer, state_digest
from ..errors import ConfigurationError
from ..integrations import Callback, CheckpointerCallback, Trainer, build_builtin
from ..policy.config import RemovalStrategy

__all__ = ["add_parser", "int_in_range", "run"]

log = logging.getLogger("ckptkeeper.train")

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


def add_parser(sub: Any) -> None:
    """Register the ``train`` sub-command."""
    p = sub.add_parser("train", help="train the built-in model with checkpointing (rehearse crashes and resumes)")
    p.add_argument("--save-folder", required=True, help="path or URL of the save folder")
    p.add_argument("--steps", type=int_in_range(0), required=True, help="train until this global step")
    p.add_argument("--save-interval", type=_interval, default=250, help="permanent checkpoint interval, or none")
    p.add_argument("--ephemeral-save-interval", type=_interval, default=None, help="ephemeral interval, or none")
    p.add_argument("--ephemeral-cooldown", type=_interval, default=None, help="steps between a save and an ephemeral")
    p.add_argument("--fixed-steps", type=_steps_list, default=None, help="extra permanent steps, e.g. 3,7,12")
    p.add_argument(
        "--remove",
        default=RemovalStrategy.ephemeral_only.value,
        choices=[s.value for s in RemovalStrategy],
        help="which checkpoints of earlier runs may be removed",
    )
    p.add_argument("--pre-train-checkpoint", type=_tri, default=None, help="auto | true | false")
    p.add_argument("--save-async", dest="save_async", action="store_true", default=None)
    p.add_argument("--no-save-async", dest="save_async", action="store_false")
    p.add_argument("--crash-at-step", type=int_in_range(0), default=None, help="exit abruptly right after this step")
    p.add_argument("--seed", type=int_in_range(0, MAX_SEED), default=0, help="seed of the model, data and RNGs")
    p.add_argument("--hidden", type=int_in_range(1), default=64, help="width of the built-in model")
    p.add_argument("--report", default=None, help="write a JSON report here (rank 0)")
    p.add_argument(
        "--start-fresh-if-unloadable",
        action="store_true",
        help="when the save folder holds checkpoints and none of them loads, train from scratch instead of "
        "stopping (the broken checkpoints are left where they are)",
    )
    p.set_defaults(func=run)


class _CrashAt(Callback):
    """Ends the process like a power cut right after a step: no clean-up, no final save."""

    priority = -1000

    def __init__(self, step: int) -> None:
        self.crash_step = step

    def post_train_batch(self) -> None:
        if self.step == self.crash_step:
            log.warning("simulated crash right after step %d", self.step)
            for h in logging.getLogger().handlers:
                h.flush()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(CRASH_EXIT_CODE)


def run(args: argparse.Namespace) -> int:
    """Run ``ckptkeeper train``; returns the exit code."""
    try:
        cb = CheckpointerCallback(
            save_interval=args.save_interval,
            ephemeral_save_interval=args.ephemeral_save_interval,
            pre_train_checkpoint=args.pre_train_checkpoint,
            save_async=args.save_async,
            remove=args.remove,
            ephemeral_cooldown=args.ephemeral_cooldown,
            fixed_steps=args.fixed_steps,
        )
    except ConfigurationError as exc:
        print(f"ckptkeeper train: error: invalid setting: {exc}", file=sys.stderr)
        return 2
    started_group = D.init_from_env()
    try:
        code = _train(args, cb)
    except BaseException:
        if started_group:
            D.shutdown_abruptly()
        raise
    if started_group:
        D.shutdown()
        # Interpreter teardown after a finished gloo run sometimes aborts in a gloo thread
        # ("terminate called without an active exception"), turning a good run into a failed
        # one; everything is flushed and every rank is past the barrier, so leave directly.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _train(args: argparse.Namespace, cb: CheckpointerCallback) -> int:
    setup = build_builtin(seed=args.seed, hidden=args.hidden)
    callbacks: list[Callback] = [cb]
    if args.crash_at_step is not None:
        callbacks.append(_CrashAt(args.crash_at_step))
    trainer = Trainer(
        model=setup.model,
        optimizer=setup.optimizer,
        loss_fn=setup.loss_fn,
        data_loader=setup.data_loader,
        save_folder=args.save_folder,
        max_steps=args.steps,
        callbacks=callbacks,
        checkpointer=Checkpointer(),
        start_fresh_if_unloadable=args.start_fresh_if_unloadable,
    )
    trainer.fit()
    if trainer.checkpoint_loaded and trainer.start_step >= args.steps and D.get_rank() == 0:
        print(f"{args.save_folder} already holds step {trainer.start_step} (>= --steps {args.steps}); nothing to do")
    digest = state_digest(setup.model, setup.optimizer)
    if args.report and D.get_rank() == 0:
        report = {
            "start_step": trainer.start_step,
            "final_step": trainer.global_step,
            "resumed_from": trainer.loaded_from,
            "losses": {str(k): v for k, v in sorted(trainer.losses.items())},
            "state_digest": digest,
            "events": [{"event": e.event, "step": e.step, "at_step": e.at_step, "kind": e.kind} for e in cb.history],
        }
        with open(args.report, "w") as f:
            json.dump(report, f, indent=1)
    if D.get_rank() == 0:
        print(f"trained steps {trainer.start_step}..{trainer.global_step}; state digest {digest[:16]}")
    return 0
