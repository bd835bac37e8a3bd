"""``ckptkeeper bench``: ckptkeeper's saves and loads measured beside the alternatives, in one run.

Only the command line lives here (cheap to import); the measurements are in ``bench_run`` (one
process) and ``bench_ranks`` (an FSDP2-sharded state under torchrun, or --tensors/--store).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from .train import int_in_range

__all__ = ["DEFAULT_TENSORS", "add_parser", "run"]

DEFAULT_TENSORS = 200
"""Tensors in the sharded benchmark's model unless --tensors says otherwise (a 1 GiB model has about as many)."""


def add_parser(sub: Any) -> None:
    """Register the ``bench`` sub-command."""
    p = sub.add_parser(
        "bench",
        help="measure saves and loads beside torch.save and DCP",
        description="Measure ckptkeeper's saves and loads beside raw I/O, torch.save and DCP on one synthetic "
        "state. Under torchrun (torchrun --standalone --nproc-per-node N -m ckptkeeper bench ...) the state is "
        "an FSDP2-sharded model (Linear layers) with its AdamW state, compared with DCP at the same world size; "
        "rank 0 prints the report (world_size, state_bytes, medians_s: the slowest rank's times, ratios: "
        "save_vs_dcp, load_vs_dcp, async_blocked_vs_dcp). --tensors, --compare-tensors or --store selects that "
        "benchmark in one process too.",
    )
    p.add_argument(
        "--model-mib", type=int_in_range(1), default=1024, help="model size in MiB (optimizer state is 2x more)"
    )
    p.add_argument("--repeats", type=int_in_range(1), default=3, help="repeats per measurement (medians are reported)")
    p.add_argument(
        "--dir", type=_writable_folder, default=None, help="an existing folder to write in (default: a temporary one)"
    )
    p.add_argument("--json", action="store_true", help="print a JSON object instead of a table")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the state lives")
    p.add_argument(
        "--tensors",
        type=int_in_range(1),
        default=None,
        help="sharded benchmark: split the model's parameters into about this many tensors of the same total "
        f"size (default {DEFAULT_TENSORS})",
    )
    p.add_argument(
        "--compare-tensors",
        type=int_in_range(1),
        default=None,
        metavar="F",
        help="sharded benchmark: also measure the per-tensor cost. Before the rounds beside DCP, ckptkeeper alone "
        "saves and cold-loads the state and a second one of about the same bytes in about F tensors (fewer than "
        "--tensors), in turn; reported as save_vs_few_tensors and load_vs_few_tensors, the main state's time / the "
        "F-tensor state's, per byte (e.g. --tensors 2500 --compare-tensors 10), and save_again_vs_few_tensors for a "
        "second save of the same tensors right after the first (each first save follows a load). The second state "
        "takes as much host memory again",
    )
    p.add_argument(
        "--store",
        type=_url,
        default=None,
        metavar="URL",
        help="sharded benchmark: save to and load from this object-store URL (e.g. s3://bucket/prefix; a "
        "sub-prefix is written and removed at the end), reporting the bytes each rank fetched per load against "
        "its share (fetched_vs_share); DCP is not compared there",
    )
    p.set_defaults(func=run)


def _writable_folder(text: str) -> str:
    """An argparse ``type=``: an existing folder this process may create files in."""
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"{text} does not exist; create it first or leave --dir out")
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is not a folder")
    if not os.access(text, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text} is not writable (permission denied)")
    return text


def _url(text: str) -> str:
    """An argparse ``type=``: a store URL (``scheme://...``); local folders go to --dir."""
    if "://" not in text or text.startswith("file://"):
        raise argparse.ArgumentTypeError(f"expected an object-store URL such as s3://bucket/prefix, got {text!r}")
    return text


def run(args: argparse.Namespace) -> int:
    """Run ``ckptkeeper bench``; returns the exit code."""
    from .bench_run import run as run_bench

    return run_bench(args)
