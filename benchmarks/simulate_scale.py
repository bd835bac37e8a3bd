"""Bookkeeping at scale without the processes: what N ranks x K tensors cost the commit record and ``ls``.

Builds, for each simulated rank, the files a sharded save writes (its DCP data file, its segment
table and its trainer-state JSON; rank 0 also DCP's ``.metadata``) and the table of them it hands
rank 0 (the gather of the save's "writing trainer state" step), then the commit record rank 0
writes; and the size of the per-piece entries rank 0 gathers to write DCP's ``.metadata``. It
then lays ``--checkpoints`` such checkpoints out on local disk (sparse files of the right sizes,
the real records) and times ``ckptkeeper``'s listing, which reads only each record and the
folder's file sizes. Tensor counts matter only to what per-tensor bookkeeping would cost; the
record holds none since the segment table left it.

    python benchmarks/simulate_scale.py --ranks 1024 --tensors 1000 [--checkpoints 20] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import tempfile
import time
from typing import Any

import torch

from ckptkeeper.engine import discovery
from ckptkeeper.engine.record import CommitRecord, FileEntry
from ckptkeeper.engine.sharded import table_name
from ckptkeeper.storage.layout import COMMIT_RECORD, MODEL_DIR, step_dir_name, train_state_name

ROW_BYTES_INLINE = 282
"""Bytes one tensor's segment row took inside the record before the table had a file of its own."""


def rank_files(rank: int, tensors: int, tensor_bytes: int) -> dict[str, FileEntry]:
    """What one rank writes and hashes in a sharded save (a fake checksum per file)."""
    files = {
        f"{MODEL_DIR}/__{rank}_0.distcp": FileEntry(tensors * tensor_bytes, f"{rank:016x}"),
        # Its segment table: three rows (head, data, tail) of about 100 bytes per tensor.
        table_name(rank): FileEntry(tensors * 300, f"{rank + 2:016x}"),
        train_state_name(rank): FileEntry(2048, f"{rank + 1:016x}"),
    }
    if rank == 0:
        files[f"{MODEL_DIR}/.metadata"] = FileEntry(64 * tensors, "0" * 16)
    return files


def simulate(ranks: int, tensors: int, checkpoints: int, tensor_bytes: int = 4096) -> dict[str, Any]:
    """Build the record and the gather for ``ranks`` x ``tensors``, then time listing ``checkpoints`` of them."""
    per_rank = [rank_files(r, tensors, tensor_bytes) for r in range(ranks)]
    gathered = sum(len(pickle.dumps(files)) for files in per_rank)  # all_gather_object pickles each rank's table
    # Rank 0 also gathers one entry per piece of every rank, to write DCP's .metadata (DCP's own
    # format names every piece): measured for one rank's entries, times the ranks.
    entries = [(f"layers.{i}.weight", ("layers", str(i), "weight"), (4096, 4096), torch.float32,
                (4096 // ranks * 0, 0), (4096 // ranks, 4096), i * tensor_bytes, tensor_bytes)
               for i in range(tensors)]  # fmt: skip
    metadata_gather = len(pickle.dumps(entries)) * ranks
    files: dict[str, FileEntry] = {}
    for part in per_rank:
        files.update(part)
    record = CommitRecord(step=0, ephemeral=False, world_size=ranks, files=files).to_json()

    with tempfile.TemporaryDirectory(prefix="ckptkeeper-scale-") as root:
        for i in range(checkpoints):
            step = 1000 * (i + 1)
            folder = os.path.join(root, step_dir_name(step))
            doc = CommitRecord(step=step, ephemeral=False, world_size=ranks, files=files).to_json()
            for rel, entry in files.items():
                path = os.path.join(folder, rel)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    f.truncate(entry.bytes)  # sparse: sizes are what listing checks
            with open(os.path.join(folder, COMMIT_RECORD), "wb") as f:
                f.write(doc)
        t0 = time.perf_counter()
        infos = discovery.list_checkpoints(root)
        took = time.perf_counter() - t0
    assert len(infos) == checkpoints and all(i.complete for i in infos), [i.problem for i in infos]
    return {
        "ranks": ranks,
        "tensors_per_rank": tensors,
        "files_in_record": len(files),
        "record_bytes": len(record),
        "record_bytes_if_segments_were_inline": len(record) + ranks * tensors * ROW_BYTES_INLINE,
        "bytes_rank0_gathers": gathered,
        "bytes_rank0_gathers_for_dcp_metadata": metadata_gather,
        "checkpoints_listed": checkpoints,
        "ls_seconds_per_checkpoint": took / checkpoints,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--tensors", type=int, default=1000, help="tensors per rank")
    p.add_argument("--checkpoints", type=int, default=20, help="checkpoints laid out and listed")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    out = simulate(args.ranks, args.tensors, args.checkpoints)
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:40} {v:,.4f}" if isinstance(v, float) else f"{k:40} {v:,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
