"""A hand-written PyTorch training loop checkpointed by ckptkeeper's CheckpointManager.

The model has dropout (torch RNG), the data loader shuffles (RNG at every epoch), AdamW has
per-parameter state, and an LR scheduler changes the learning rate every step: everything that
makes an exact resume hard. Crash it with ``--crash-at-step``, run it again with the same
``--save-folder`` and it continues where the last checkpoint left off; the final ``state_digest``
equals that of a run that never stopped, and of a run with ``--no-ckptkeeper``.

    python examples/plain_loop.py --save-folder /tmp/run --steps 60 --crash-at-step 37
    python examples/plain_loop.py --save-folder /tmp/run --steps 60 --report /tmp/report.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

CRASH_EXIT_CODE = 3


def interval(text: str) -> int | None:
    """A positive step interval, or ``none``."""
    if text.lower() == "none":
        return None
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive interval or 'none', got {text!r}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--save-folder", required=True, help="where checkpoints go (path, s3:// or gs:// URL)")
    p.add_argument("--steps", type=int, required=True, help="train until this many updates are done")
    p.add_argument("--save-interval", type=interval, default=20, metavar="K|none", help="permanent checkpoints")
    p.add_argument("--ephemeral-save-interval", type=interval, default=5, metavar="K|none", help="ephemeral ones")
    p.add_argument("--save-mode", choices=("async", "sync"), default="async", help="background or blocking saves")
    p.add_argument("--crash-at-step", type=int, metavar="S", help="end the process abruptly right after step S")
    p.add_argument("--report", metavar="FILE", help="write start_step, final_step and state_digest as JSON")
    p.add_argument("--no-ckptkeeper", action="store_true", help="the same training without ckptkeeper")
    return p.parse_args(argv)


def build(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, DataLoader]:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(256, 16, generator=g)
    y = x @ torch.randn(16, 4, generator=g)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.9)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    return model, opt, sched, loader


def state_digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    """SHA-256 over the model's and the optimizer's tensors (and the optimizer's numbers), by name."""
    h = hashlib.sha256()
    names = {id(p): n for n, p in model.named_parameters()}
    items = [(f"model.{k}", v) for k, v in model.state_dict().items()]
    for p, st in opt.state.items():
        for k, v in st.items():
            items.append((f"optim.{names[id(p)]}.{k}", v if torch.is_tensor(v) else torch.tensor(v)))
    for name, t in sorted(items, key=lambda kv: kv[0]):
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train_step(
    model: nn.Module, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler, batch: list[torch.Tensor]
) -> None:
    x, y = batch
    opt.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    sched.step()


def crash_if(args: argparse.Namespace, step: int) -> None:
    if args.crash_at_step == step:
        sys.stdout.flush()
        os._exit(CRASH_EXIT_CODE)  # like a power cut: no clean-up, no final save


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model, opt, sched, loader = build()

    if args.no_ckptkeeper:
        step = start = 0
        while step < args.steps:
            for batch in loader:
                train_step(model, opt, sched, batch)
                step += 1
                crash_if(args, step)
                if step == args.steps:
                    break
    else:
        from ckptkeeper import CheckpointManager, CheckpointPolicyConfig

        config = CheckpointPolicyConfig(
            save_interval=args.save_interval,
            ephemeral_save_interval=args.ephemeral_save_interval,
            save_async=args.save_mode == "async",
        )
        with CheckpointManager(
            args.save_folder, model=model, optimizer=opt, extra_state={"sched": sched}, config=config
        ) as mgr:
            step = start = mgr.restore()  # newest good checkpoint; 0 on a fresh start
            # Continues the data position after a resume; ends at --steps without drawing more.
            for batch in mgr.data(loader, max_steps=args.steps):
                train_step(model, opt, sched, batch)
                step += 1
                mgr.save_if_due(step)
                crash_if(args, step)
            # Leaving the block saves the last step (if not saved yet) and waits for the writer.

    digest = state_digest(model, opt)
    print(f"trained steps {start}..{step}; state digest {digest[:16]}")
    if args.report:
        with open(args.report, "w") as f:
            json.dump({"start_step": start, "final_step": step, "state_digest": digest}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
