"""Functions that run inside spawned ranks for test_dead_rank (module level, so spawn can import them)."""

from __future__ import annotations

from torch import nn

from ckptkeeper import CheckpointerCallback, Trainer

from .workers import _batches, _sharded, faulty_checkpointer


def train_while_one_rank_dies(rank: int, folder: str, dead_rank: int) -> str:
    """Train to step 9 saving every 4 steps; ``dead_rank`` vanishes (exit code 9) mid-save at step 4."""
    model, opt = _sharded()
    cb = CheckpointerCallback(save_interval=4, save_async=False)
    Trainer(
        model=model, optimizer=opt, loss_fn=nn.MSELoss(), data_loader=_batches(rank), save_folder=folder,
        max_steps=9, callbacks=[cb], checkpointer=faulty_checkpointer(rank=dead_rank, step=4, vanish=True),
    ).fit()  # fmt: skip
    return "finished"
