"""Feed ckptkeeper's metrics (the JSON lines of CKPTKEEPER_METRICS=FILE) to TensorBoard.

    CKPTKEEPER_METRICS=ckpt-metrics.jsonl python train.py       # or ckptkeeper train ...
    python examples/metrics_to_tensorboard.py ckpt-metrics.jsonl --logdir runs/tb
    tensorboard --logdir runs/tb

Each save becomes scalars under ``checkpoint/save/*`` (blocked seconds, seconds until durable,
GB/s, bytes, retries) at the checkpoint's step; loads and removals likewise. Needs the
``tensorboard`` package (``pip install tensorboard``); ``--print`` shows the scalars instead.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from typing import Any

FIELDS = ("blocked_s", "durable_s", "seconds", "gb_s", "bytes", "files", "retries")


def scalars(path: str) -> Iterator[tuple[str, float, int, float]]:
    """(tag, value, step, wall time) for every numeric field of every event in the file."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            event: dict[str, Any] = json.loads(line)
            step = event.get("step")
            if not isinstance(step, int):
                continue
            for field in FIELDS:
                value = event.get(field)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    yield f"checkpoint/{event['event']}/{field}", float(value), step, float(event["time_unix"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics", help="the JSON-lines file CKPTKEEPER_METRICS wrote")
    parser.add_argument("--logdir", default="runs/ckptkeeper-metrics", help="TensorBoard log folder")
    parser.add_argument("--print", action="store_true", help="print the scalars instead of writing them")
    args = parser.parse_args()
    if args.print:
        for tag, value, step, _ in scalars(args.metrics):
            print(f"{tag}\t{step}\t{value}")
        return
    from torch.utils.tensorboard import SummaryWriter  # needs: pip install tensorboard

    writer = SummaryWriter(args.logdir)
    for tag, value, step, wall in scalars(args.metrics):
        writer.add_scalar(tag, value, global_step=step, walltime=wall)
    writer.close()
    print(f"wrote checkpoint scalars to {args.logdir}")


if __name__ == "__main__":
    main()
