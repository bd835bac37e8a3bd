"""The work behind ``ckptkeeper train``: build the built-in model, train, rehearse crashes, report."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from .. import distributed as D
from ..engine import Checkpointer, state_digest
from ..errors import ConfigurationError
from ..integrations import Callback, CheckpointerCallback, Trainer, build_builtin
from .train import CRASH_EXIT_CODE, policy_settings

__all__ = ["run"]

log = logging.getLogger("ckptkeeper.train")


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
        cb = CheckpointerCallback(**policy_settings(args))
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
    nothing_to_do = trainer.checkpoint_loaded and trainer.start_step >= args.steps
    if nothing_to_do and D.get_rank() == 0:
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
        # (Not "trained steps 60..60" after "nothing to do": found by a newcomer.)
        done = "trained no step" if nothing_to_do else f"trained steps {trainer.start_step}..{trainer.global_step}"
        print(f"{done}; state digest {digest[:16]}")
    return 0
