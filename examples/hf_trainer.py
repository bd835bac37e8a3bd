"""Train a tiny GPT-2 with transformers.Trainer and ckptkeeper checkpoints; rehearse a crash and an exact resume.

    python examples/hf_trainer.py --save-folder F --steps N [--save-interval K|none]
        [--ephemeral-save-interval K|none] [--crash-at-step S] [--report FILE] [--no-ckptkeeper]

The model is built from a config (2 layers, 32 wide; nothing is downloaded). A second run with the
same ``--save-folder`` resumes from the newest good checkpoint. The report holds ``start_step``,
``final_step`` and ``state_digest`` (``ckptkeeper.state_digest``: SHA-256 of every model and
optimizer tensor); ``--no-ckptkeeper`` runs the same training with plain ``transformers.Trainer``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

CRASH_EXIT_CODE = 75


def interval(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, 64, (48, 16), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class CrashAt(TrainerCallback):
    """Ends the process like a power cut right after a step: no clean-up, no final save."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            print(f"simulated crash right after step {self.step}", file=sys.stderr, flush=True)
            os._exit(CRASH_EXIT_CODE)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--save-folder", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-interval", type=interval, default=10)
    p.add_argument("--ephemeral-save-interval", type=interval, default=None)
    p.add_argument("--crash-at-step", type=int, default=None)
    p.add_argument("--report", default=None)
    p.add_argument("--no-ckptkeeper", action="store_true")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    torch.manual_seed(0)

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
    targs = TrainingArguments(
        output_dir=args.save_folder,
        max_steps=args.steps,
        per_device_train_batch_size=8,  # 6 steps an epoch
        learning_rate=1e-3,
        # Warm-up then constant: a schedule that does not depend on --steps, so runs with different
        # --steps share their first steps exactly (the tests resume a shorter run into a longer one).
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=2,
        save_strategy="no",  # the schedule is ckptkeeper's (--save-interval ...)
        logging_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
    )
    callbacks = [CrashAt(args.crash_at_step)] if args.crash_at_step is not None else []
    if args.no_ckptkeeper:
        trainer: Trainer = Trainer(model=model, args=targs, train_dataset=Tokens(), callbacks=callbacks)
        trainer.train()
        start = 0
    else:
        from ckptkeeper import CheckpointPolicyConfig
        from ckptkeeper.hf import CkptkeeperTrainer

        policy = CheckpointPolicyConfig(
            save_interval=args.save_interval, ephemeral_save_interval=args.ephemeral_save_interval
        )
        trainer = CkptkeeperTrainer(
            model=model, args=targs, train_dataset=Tokens(), callbacks=callbacks, checkpoint_config=policy
        )
        trainer.train()
        mgr = trainer.checkpoint_manager
        start = mgr.start_step if mgr is not None else 0

    if args.report:
        from ckptkeeper import state_digest

        opt = trainer.optimizer
        with open(args.report, "w") as f:
            json.dump(
                {
                    "start_step": start,
                    "final_step": trainer.state.global_step,
                    "state_digest": state_digest(trainer.model, getattr(opt, "optimizer", opt)),
                },
                f,
            )
    print(f"trained steps {start}..{trainer.state.global_step}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
