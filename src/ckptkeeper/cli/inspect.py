"""``ckptkeeper inspect``: what is inside one checkpoint: record, trainer state, tensors."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from ..errors import CkptkeeperError
from ._common import human, require_local, shown

__all__ = ["add_parser", "describe", "run"]


def add_parser(sub: Any) -> None:
    """Register the ``inspect`` sub-command."""
    p = sub.add_parser(
        "inspect",
        help="show a checkpoint's commit record, trainer state and tensors",
        description="Show one checkpoint: its commit record (or OLMo-core marker), the trainer state of rank 0, "
        "and a table of tensors (name, shape, dtype, bytes) with totals. Nothing is loaded into memory but "
        "the small files; DCP's metadata is decoded without running code from it.",
    )
    p.add_argument("path", help="the checkpoint: a step{N} folder (path or URL)")
    p.add_argument(
        "--json", action="store_true", help="print one JSON object (record, train_state, tensors: [{name, shape, "
        "dtype, bytes}], total_tensor_bytes, total_file_bytes)"
    )  # fmt: skip
    p.set_defaults(func=run)


def describe(path: str) -> dict[str, Any]:
    """Everything ``inspect`` shows, as plain data."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ..engine import discovery
    from ..engine.reader import read_dcp_metadata, read_train_state
    from ..storage import storage_for

    storage = storage_for(path)
    record: dict[str, Any] | None
    try:
        rec = discovery.read_record(path)
        files = {k: {"bytes": v.bytes, "xxh3_64": v.xxh3_64} for k, v in sorted(rec.files.items())}
        record = {"step": rec.step, "ephemeral": rec.ephemeral, "world_size": rec.world_size,
                  "created_unix": rec.created_unix, "version": rec.version, "format": "ckptkeeper",
                  "files": files}  # fmt: skip
    except CkptkeeperError as exc:
        try:
            marker = discovery.parse_olmo_marker(storage.read_bytes(storage.join(path, ".metadata.json")))
        except OSError:
            marker = None
        if marker is None:
            raise exc from None  # neither ours nor OLMo-core's: the record's error says what is wrong
        record = {"format": "olmo-core", "ephemeral": marker[0], "version": marker[1]}
    metadata = read_dcp_metadata(path)
    tensors = []
    for name, md in sorted(metadata.state_dict_metadata.items()):
        if isinstance(md, TensorStorageMetadata):
            dtype = md.properties.dtype
            numel = math.prod(md.size)
            size = numel * torch.empty((), dtype=dtype).element_size()
            tensors.append({"name": name, "shape": list(md.size), "dtype": str(dtype).removeprefix("torch."),
                            "bytes": size})  # fmt: skip
        else:
            tensors.append({"name": name, "shape": None, "dtype": "object", "bytes": None})
    return {
        "path": path,
        "record": record,
        "train_state": read_train_state(path, 0),
        "tensors": tensors,
        "total_tensor_bytes": sum(t["bytes"] or 0 for t in tensors),
        "total_file_bytes": sum(f.size for f in storage.walk(path)),
    }


_BRIEF_KEYS = 20


def _brief(value: Any, depth: int) -> Any:
    """A short form of a trainer-state value: scalars as they are (long strings cut), dicts ``depth``
    levels deep (at most 20 keys each), anything else by its type's name."""
    if isinstance(value, (int, float, bool)) or value is None:
        return value
    if isinstance(value, str):
        return value if len(value) <= 80 else value[:77] + "..."
    if isinstance(value, dict) and depth > 0:
        items = list(value.items())
        out = {_brief(k, 0) if isinstance(k, str) else k: _brief(v, depth - 1) for k, v in items[:_BRIEF_KEYS]}
        if len(items) > _BRIEF_KEYS:
            out[f"<{len(items) - _BRIEF_KEYS} more keys: --json shows all>"] = "..."
        return out
    return type(value).__name__


def run(args: argparse.Namespace) -> int:
    """Run ``ckptkeeper inspect``; returns the exit code."""
    require_local(args.path)
    info = describe(args.path)
    if args.json:
        print(json.dumps(info, indent=1, default=str))
        return 0
    from rich.console import Console
    from rich.table import Table

    # Written to a log or a pipe, lines keep their width instead of folding into 80 (as ls does).
    console = Console() if sys.stdout.isatty() else Console(width=200)
    rec = info["record"] or {}
    # Paths, names and stored strings are the user's: shown as text, never read as Rich markup
    # (a folder named "a[/]b" crashed the command: found by an outside attack).
    head = shown(args.path)
    head.stylize("bold")
    console.print(head + shown(f" ({rec.get('format', '?')})"))
    for key in ("step", "ephemeral", "world_size", "version"):
        if key in rec:
            console.print(shown(f"  {key}: {rec[key]}"))
    if "files" in rec:
        console.print(f"  files: {len(rec['files'])} listed with sizes and xxh3-64 checksums")
    # The user's own trainer state (``train_state``, e.g. {"epoch": 3}) one level deeper: it was
    # only named as a dict, and shown only with --json (found by a newcomer).
    summary = {k: _brief(v, 1 if k == "train_state" else 0) for k, v in info["train_state"].items()}
    console.print(shown(f"  trainer state: {summary}"))
    table = Table(title="tensors")
    for col in ("name", "shape", "dtype", "bytes"):
        table.add_column(col, justify="right" if col == "bytes" else "left")
    for t in info["tensors"]:
        table.add_row(
            shown(t["name"]),
            str(t["shape"]),
            shown(t["dtype"]),
            human(t["bytes"]) if t["bytes"] is not None else "-",
        )
    console.print(table)
    console.print(f"{len(info['tensors'])} tensors, {human(info['total_tensor_bytes'])} of tensor data, "
                  f"{human(info['total_file_bytes'])} on storage")  # fmt: skip
    return 0
