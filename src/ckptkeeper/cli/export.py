"""``ckptkeeper export``: a checkpoint's model weights as one file an inference stack takes."""

from __future__ import annotations

import argparse
import os
import uuid
from typing import Any

from ..errors import ConfigurationError
from ..storage.layout import parse_step
from ._common import human, progress, require_local

__all__ = ["add_parser", "run"]

_DTYPES = ("float32", "bfloat16", "float16")


def add_parser(sub: Any) -> None:
    """Register the ``export`` sub-command."""
    p = sub.add_parser(
        "export",
        help="write a checkpoint's model weights to one safetensors (or torch) file",
        description="Write the model weights of a checkpoint to OUT, consolidated from every shard and rank, "
        "keyed by parameter name without the 'model.' prefix (the names model.state_dict() uses), without "
        "optimizer state unless --include-optimizer. The file is written to a temporary name and renamed, "
        "so OUT is never half-written. safetensors files load with safetensors.torch.load_file and the "
        "Hugging Face hub; 'torch' files with torch.load(weights_only=True).",
    )
    p.add_argument("path", help="the checkpoint: a step{N} folder (path or URL)")
    p.add_argument("out", help="the file to write (local path)")
    p.add_argument(
        "--format", choices=["safetensors", "torch"], default="safetensors", help="file format (default: safetensors)"
    )
    p.add_argument(
        "--dtype", choices=_DTYPES, default=None,
        help="cast floating-point tensors to this dtype (default: keep each tensor's own)",
    )  # fmt: skip
    p.add_argument(
        "--include-optimizer",
        action="store_true",
        help="also write optimizer state; keys then keep their prefixes (model.*, optim.*)",
    )
    p.set_defaults(func=run)


def _check_out(out: str) -> None:
    """OUT must be a new or regular local file, and not inside a checkpoint (never overwrite one)."""
    if not out or "://" in out:
        raise ConfigurationError(f"OUT must be a local file path, got {out!r}; export locally, then upload it")
    if os.path.lexists(out) and (os.path.islink(out) or not os.path.isfile(out)):
        raise ConfigurationError(f"{out} exists and is not a regular file; give a new file name")
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise ConfigurationError(f"cannot write {out}: folder {folder} does not exist")
    probe = folder
    for _ in range(16):
        if parse_step(os.path.basename(probe)) is not None and os.path.lexists(os.path.join(probe, ".metadata.json")):
            raise ConfigurationError(f"{out} is inside the checkpoint {probe}; write the export somewhere else")
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent


def run(args: argparse.Namespace) -> int:
    """Run ``ckptkeeper export``; returns the exit code."""
    require_local(args.path)
    _check_out(args.out)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    import torch

    from ..engine.reader import read_dcp_metadata, read_tensors

    metadata = read_dcp_metadata(args.path)
    prefixes = ("model.", "optim.") if args.include_optimizer else ("model.",)
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    names = [
        n
        for n, md in metadata.state_dict_metadata.items()
        if n.startswith(prefixes) and isinstance(md, TensorStorageMetadata)
    ]
    if not names:
        raise ConfigurationError(f"checkpoint {args.path} holds no model tensors (no keys starting with 'model.')")
    with progress("reading tensors", None):
        tensors = read_tensors(args.path, names)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            continue
        key = name if args.include_optimizer else name.removeprefix("model.")
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        # safetensors refuses tensors that share storage (tied weights) or are not contiguous.
        out[key] = t.detach().contiguous().clone()
    tmp = os.path.join(out_dir, f".{os.path.basename(args.out)}.{uuid.uuid4().hex[:8]}.part")
    try:
        if args.format == "safetensors":
            try:
                from safetensors.torch import save_file
            except ImportError:
                raise ConfigurationError(
                    "--format safetensors needs the safetensors package: pip install 'ckptkeeper[export]' "
                    "(or use --format torch)"
                ) from None
            save_file(out, tmp, metadata={"format": "pt", "source": args.path})
        else:
            torch.save(out, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as any new file; temporary files start private
        os.replace(tmp, args.out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    total = sum(t.numel() * t.element_size() for t in out.values())
    print(f"wrote {len(out)} tensors ({human(total)}) to {args.out}")
    return 0
