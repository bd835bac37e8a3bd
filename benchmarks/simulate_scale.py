"""Bookkeeping at scale without the processes: what N ranks x K tensors cost the commit record and ``ls``.

Builds, for each simulated rank, the files a sharded save writes (its DCP data file, its segment
table and its trainer-state JSON; rank 0 also DCP's ``.metadata``) and the table of them it hands
rank 0 (the gather of the save's "writing trainer state" step), then the commit record rank 0
writes; the size of the layouts (piece names and kinds) rank 0 gathers to write DCP's
``.metadata``; and the segment-table bytes a load reads (its own table and rank 0's shared index
at the saved world size, every rank's table at another). It
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
from ckptkeeper.engine.sharded import INDEX_FILE, ShardLayout, _encode_table, index_bytes, shard_name, table_name
from ckptkeeper.storage.layout import COMMIT_RECORD, MODEL_DIR, step_dir_name, train_state_name

ROW_BYTES_INLINE = 282
"""Bytes one tensor's segment row took inside the record before the table had a file of its own."""


def rank_layout(rank: int, ranks: int, tensors: int) -> tuple[ShardLayout, bytes]:
    """One rank's gathered layout and its encoded format-2 segment table, as a save makes them:
    ``tensors`` FSDP2 shards (rows split over the ranks) of 4096-column weights in 8 shapes, as a
    stack of transformer blocks repeats a few (the kinds column lists each shape once)."""
    kinds = tuple((torch.float32, (4 * ranks * (k + 1), 4096), (rank * 4 * (k + 1), 0), (4 * (k + 1), 4096))
                  for k in range(min(8, tensors)))  # fmt: skip
    names = tuple(f"model.layers.{i // 8}.block.w{i % 8}" for i in range(tensors))
    layout = ShardLayout(names, kinds, tuple(i % len(kinds) for i in range(tensors)), ())
    table = _encode_table(f"{MODEL_DIR}/{shard_name(rank)}", layout, [f"{i:016x}" for i in range(tensors)])
    return layout, table


def rank_files(rank: int, tensors: int, tensor_bytes: int, table_bytes: int, index_bytes: int) -> dict[str, FileEntry]:
    """What one rank writes and hashes in a sharded save (a fake checksum per file)."""
    files = {
        f"{MODEL_DIR}/__{rank}_0.distcp": FileEntry(tensors * tensor_bytes, f"{rank:016x}"),
        table_name(rank): FileEntry(table_bytes, f"{rank + 2:016x}"),
        train_state_name(rank): FileEntry(2048, f"{rank + 1:016x}"),
    }
    if rank == 0:
        files[f"{MODEL_DIR}/.metadata"] = FileEntry(64 * tensors, "0" * 16)
        files[INDEX_FILE] = FileEntry(index_bytes, "1" * 16)
    return files


def simulate(ranks: int, tensors: int, checkpoints: int, tensor_bytes: int = 4096) -> dict[str, Any]:
    """Build the record and the gather for ``ranks`` x ``tensors``, then time listing ``checkpoints`` of them."""
    # Every rank's layout has the same size (names and kinds differ only in numbers of the same
    # width): one rank's, measured, stands for each.
    layout, table = rank_layout(1, ranks, tensors)
    # Rank 0's shared index (every tensor once, and the whole pieces: none here, all sharded),
    # which a load at the saved world size reads with its own table instead of every table.
    index = index_bytes([(rank_layout(r, ranks, tensors)[0], ()) for r in range(ranks)])
    per_rank = [rank_files(r, tensors, tensor_bytes, len(table), len(index)) for r in range(ranks)]
    gathered = sum(len(pickle.dumps(files)) for files in per_rank)  # all_gather_object pickles each rank's table
    # Rank 0 also gathers every rank's layout (names and kinds of its pieces), to write DCP's
    # .metadata (DCP's own format names every piece of every rank).
    metadata_gather = len(pickle.dumps(layout)) * ranks
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
        "segment_table_bytes_per_rank": len(table),
        "shared_index_bytes": len(index),
        # What each rank reads, and all ranks together, before its first tensor byte: at the
        # saved world size its own table and the shared index; at another, every rank's table.
        "table_bytes_each_rank_reads_per_load": len(table) + len(index),
        "table_bytes_all_ranks_read_per_load": (len(table) + len(index)) * ranks,
        "table_bytes_each_rank_reads_per_resharding_load": len(table) * ranks,
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
