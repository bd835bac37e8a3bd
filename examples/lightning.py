"""Train a tiny Lightning model with ckptkeeper checkpoints; rehearse a crash and an exact resume.

    python examples/lightning.py --save-folder F --steps N [--save-interval K|none]
        [--ephemeral-save-interval K|none] [--crash-at-step S] [--report FILE] [--no-ckptkeeper]

A second run with the same ``--save-folder`` resumes from the newest good checkpoint. The report
holds ``start_step``, ``final_step`` and ``state_digest`` (``ckptkeeper.state_digest``: SHA-256 of
every model and optimizer tensor), so a crashed-and-resumed run can be compared with an
uninterrupted one, and with ``--no-ckptkeeper`` (the same training without ckptkeeper).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from typing import Any

# This file is named lightning.py and Python puts its folder first on sys.path, where it would
# shadow the lightning package: take that folder off before importing it.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

CRASH_EXIT_CODE = 75


def interval(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


class TinyModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, prog_bar=False)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Data(pl.LightningDataModule):
    def __init__(self, resumable: bool) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1234)
        self.dataset = TensorDataset(torch.randn(48, 8, generator=g), torch.randn(48, 1, generator=g))
        self.resumable = resumable

    def train_dataloader(self) -> Any:
        loader = DataLoader(self.dataset, batch_size=8, shuffle=True)  # 6 batches an epoch
        if self.resumable:
            from ckptkeeper.lightning import ResumableLoader

            return ResumableLoader(loader)
        return loader


class CrashAt(pl.Callback):
    """Ends the process like a power cut right after a step: no clean-up, no final save."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
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
    warnings.filterwarnings("ignore", module="lightning")
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)

    model = TinyModel()
    callbacks: list[pl.Callback] = []
    ckpt = None
    if not args.no_ckptkeeper:
        from ckptkeeper.lightning import CkptkeeperCallback

        ckpt = CkptkeeperCallback(
            args.save_folder, save_interval=args.save_interval, ephemeral_save_interval=args.ephemeral_save_interval
        )
        callbacks.append(ckpt)
    if args.crash_at_step is not None:
        callbacks.append(CrashAt(args.crash_at_step))  # after ckptkeeper's: the step's save has started
    trainer = pl.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=1,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,  # Lightning's own .ckpt files: not needed with ckptkeeper
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=args.save_folder,
    )
    trainer.fit(model, datamodule=Data(resumable=not args.no_ckptkeeper))

    start = ckpt.manager.start_step if ckpt is not None and ckpt.manager is not None else 0
    if args.report:
        from ckptkeeper import state_digest

        with open(args.report, "w") as f:
            json.dump(
                {
                    "start_step": start,
                    "final_step": trainer.global_step,
                    "state_digest": state_digest(model, trainer.optimizers[0]),
                },
                f,
            )
    print(f"trained steps {start}..{trainer.global_step}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
