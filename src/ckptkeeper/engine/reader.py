"""Reading what a checkpoint holds without a model: its DCP metadata, whole tensors, trainer state.

For the command line (``inspect``, ``export``). Every function takes a step folder of either
flavor (ckptkeeper or OLMo-core) on any store, and trusts nothing it has not checked first: a
ckptkeeper checkpoint's files are checked against its commit record (sizes and checksums), an
OLMo-core checkpoint as far as it can be (structure, sizes, the CRC-32 inside each ``torch.save``
record). Pickles are decoded through the allow-lists of :mod:`.safe_metadata` only.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from ..errors import CheckpointError, CorruptCheckpointError
from ..storage import storage_for
from ..storage.layout import MODEL_DIR, train_state_name
from . import discovery
from .agreement import unwrap
from .checkpointer import Checkpointer
from .deleter import new_spool
from .loading import download
from .record import MAX_STATE_BYTES, CommitRecord, loads_bounded
from .safe_metadata import SafeFileSystemReader, SafeLoadPlanner
from .saving import quiet_dcp

__all__ = ["read_dcp_metadata", "read_tensors", "read_train_state"]


def read_dcp_metadata(path: str) -> Metadata:
    """The DCP metadata of the checkpoint at ``path``, decoded without running code from it.

    A ckptkeeper checkpoint's ``.metadata`` is checked against its commit record's checksum first;
    OLMo-core's storage-info entries come back as DCP's own ``_StorageInfo``.
    """
    record = discovery.verify(path, checksums=False, structure=False)
    return discovery.read_metadata_of(path, record)


def read_train_state(path: str, rank: int = 0) -> dict[str, Any]:
    """Rank ``rank``'s trainer-state file as plain data (rank 0's when the checkpoint has none for it).

    For a ckptkeeper checkpoint, the checksum-checked JSON document of ``train/rank{R}.json``:
    ``step``, ``train_state`` (what :meth:`Checkpointer.load` returns) and ``state_meta`` (the
    optimizer's and extras' non-tensor state). For an OLMo-core checkpoint, ``train/rank{R}.pt``
    read with ``torch.load(weights_only=True)``, tensors and arrays turned into lists (what
    :meth:`Checkpointer.load` returns for it).
    """
    record = discovery.verify(path, checksums=False, structure=False)
    if isinstance(record, discovery.OlmoCoreRecord):
        olmo_state, _ = discovery.read_olmo_train_state(path, rank, record)
        return olmo_state
    name = train_state_name(rank)
    if name not in record.files:
        name = train_state_name(0)
    if name not in record.files:
        raise CorruptCheckpointError(f"checkpoint {path} is corrupt: its commit record lists no trainer state")
    data = discovery.read_small(path, name, MAX_STATE_BYTES, record.files[name])
    doc = loads_bounded(data, f"{path}/{name}", max_bytes=MAX_STATE_BYTES, max_depth=64, allow_nonfinite=True)
    if not isinstance(doc, dict) or not isinstance(doc.get("train_state", {}), dict):
        raise CorruptCheckpointError(f"{path}/{name} is malformed (not a JSON object with a train_state object)")
    return doc


def read_tensors(path: str, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Whole CPU tensors of the checkpoint at ``path`` by dotted DCP key (``model.0.weight``, ...).

    ``names`` picks tensors (default: every tensor). Sharded and multi-rank checkpoints are put
    together into full tensors, in this process, without a process group. Every file is checked
    first (ckptkeeper: sizes and checksums; OLMo-core: structure, sizes, CRC-32s); object-store
    checkpoints are downloaded to a temporary spool (room for one checkpoint) and checked there.
    A name that is not a tensor of the checkpoint is a CheckpointError.
    """
    storage = storage_for(path)
    local = storage.local_path(path)
    spool: str | None = None
    try:
        if local is None:
            spool = new_spool(None, "read")
            record: CommitRecord = download(Checkpointer(), storage, path, spool)
            local = spool
        else:
            record = discovery.verify(path, checksums=True, structure=False)
        metadata = discovery.read_metadata_of(local, record) if spool is None else _metadata_in(spool, record, path)
        wanted = _pick(metadata, names, path)
        dest = {fqn: torch.empty(tuple(md.size), dtype=md.properties.dtype, device="cpu") for fqn, md in wanted.items()}
        if not dest:
            return {}
        data_files = [k[len(MODEL_DIR) + 1 :] for k in record.files if k.startswith(MODEL_DIR + "/")]
        reader = SafeFileSystemReader(
            os.path.join(local, MODEL_DIR),
            data_files,
            olmo_core=isinstance(record, discovery.OlmoCoreRecord),
        )
        try:
            with quiet_dcp():
                dcp_load(dest, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
        except (Exception, CheckpointException) as raw:
            inner = unwrap(raw)
            if isinstance(inner, CheckpointError):
                raise inner from raw
            raise CorruptCheckpointError(
                f"checkpoint {path} could not be read ({type(inner).__name__}: {str(inner).strip()[:300]}); "
                "restore it from a copy"
            ) from inner
        return dest
    finally:
        if spool is not None:
            shutil.rmtree(spool, ignore_errors=True)


def _metadata_in(spool: str, record: CommitRecord, where: str) -> Metadata:
    # The spool's files were checked while they were downloaded.
    if isinstance(record, discovery.OlmoCoreRecord):
        return discovery.check_olmo_core(spool, record, where)
    return discovery.read_metadata_of(spool, record)


def _pick(metadata: Metadata, names: Iterable[str] | None, path: str) -> dict[str, TensorStorageMetadata]:
    tensors = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    if names is None:
        return tensors
    out: dict[str, TensorStorageMetadata] = {}
    for name in names:
        if name not in tensors:
            what = "is not a tensor" if name in metadata.state_dict_metadata else "is not in it"
            raise CheckpointError(f"checkpoint {path} has no tensor {name!r} ({what}); `ckptkeeper inspect` lists them")
        out[name] = tensors[name]
    return out
