"""Functions that run inside spawned ranks (module level, so spawn can import them)."""

from __future__ import annotations

import dataclasses
import os
import threading
from concurrent.futures import Future, wait
from typing import Any

import torch
from torch import nn

from ckptkeeper import Callback, Checkpointer, CheckpointerCallback, Trainer, TrainingState, state_digest
from ckptkeeper.engine import SaveResult, SaveStage


class RecordingCheckpointer(Checkpointer):
    """Remembers which checkpoints this process removed itself."""

    def __init__(self) -> None:
        super().__init__()
        self.removed: list[str] = []

    def remove(self, path: str, run_in_background: Any = None) -> None:
        self.removed.append(path.rstrip("/").rsplit("/", 1)[-1])
        super().remove(path, run_in_background)


class _FaultyCheckpointer(Checkpointer):
    """Remembers the futures of its background saves (a test waits on them to fix the timing)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.futures: list[Future[SaveResult]] = []
        self.release = threading.Event()  # the fault waits for it (set: no wait)
        self.release.set()

    def save_async(self, *args: Any, **kwargs: Any) -> tuple[str, Future[SaveResult]]:
        path, fut = super().save_async(*args, **kwargs)
        self.futures.append(fut)
        return path, fut


def faulty_checkpointer(rank: int, step: int, vanish: bool = False) -> _FaultyCheckpointer:
    """On one rank, at one step, mid-save (when its trainer state is written): fails, or vanishes."""

    def fault(stage: SaveStage) -> None:
        if stage.name == "writing trainer state" and stage.rank == rank and stage.step == step:
            if vanish:
                os._exit(9)
            ckpt.release.wait(timeout=120)
            raise OSError(5, "Input/output error", os.path.join(stage.work, "model_and_optim", f"__{rank}_0.distcp"))

    ckpt = _FaultyCheckpointer(on_stage=fault)
    return ckpt


class _SettleSavesAt(Callback):
    """Holds the fault until ``step``; there, before the checkpointer's hook, lets it fail and
    waits until every background save started so far has ended (its outcome is left for the
    checkpointer to collect): which call finds the failure then does not depend on how fast the
    machine is (CI found it at step 8 once, where the test had assumed step 5)."""

    priority = 2  # before CheckpointerCallback's

    def __init__(self, ckpt: _FaultyCheckpointer, step: int) -> None:
        self.ckpt, self.at = ckpt, step
        ckpt.release.clear()

    def post_train_batch(self) -> None:
        if self.step == self.at:
            self.ckpt.release.set()
            wait(self.ckpt.futures)


def _sharded(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 12), nn.GELU(), nn.Linear(12, 3))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g)) for _ in range(5)]


def train_and_record_removals(rank: int, folder: str) -> list[str]:
    model, opt = _sharded()
    ckpt = RecordingCheckpointer()
    cb = CheckpointerCallback(save_interval=10, ephemeral_save_interval=2, save_async=False)
    Trainer(
        model=model, optimizer=opt, loss_fn=nn.MSELoss(), data_loader=_batches(rank), save_folder=folder,
        max_steps=7, callbacks=[cb], checkpointer=ckpt,
    ).fit()  # fmt: skip
    return ckpt.removed


def train_with_a_failing_rank(rank: int, folder: str, save_async: bool, found_at: int = 5) -> str:
    """Step 4's save fails on rank 1; with async saves, the ranks learn it at step ``found_at``
    (5: the step after; 8: only at the next due save, which the failure must not cost)."""
    model, opt = _sharded()
    cb = CheckpointerCallback(save_interval=4, save_async=save_async)
    ckpt = faulty_checkpointer(rank=1, step=4)
    Trainer(
        model=model, optimizer=opt, loss_fn=nn.MSELoss(), data_loader=_batches(rank), save_folder=folder,
        max_steps=9, callbacks=[cb, *([_SettleSavesAt(ckpt, found_at)] if save_async else [])], checkpointer=ckpt,
    ).fit()  # fmt: skip
    return "finished"


def sharded_round_trip(rank: int, folder: str) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    model, opt = _sharded()
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    want = state_digest(model, opt)
    ckpt = Checkpointer()
    _, fut = ckpt.save_async(folder, 3, TrainingState(model, opt))
    fut.result()
    staged = list(ckpt._stager._buffers.values())
    tensors, _ = TrainingState(model, opt).capture()
    placements = {str(t.placements) for t in tensors["model"].values() if isinstance(t, DTensor)}
    other, other_opt = _sharded(seed=1)
    assert state_digest(other, other_opt) != want
    ckpt.load(f"{folder}/step3", TrainingState(other, other_opt))
    ckpt.close()
    return {
        "equal": state_digest(other, other_opt) == want,
        "staged_local_numel": sum(b.numel() for b in staged),
        "full_numel": sum(p.numel() for p in model.parameters()),
        "placements": sorted(placements),
    }


def async_save_over_budget_on_one_rank(rank: int, folder: str, over_budget: str) -> str:
    model, opt = _sharded()
    ckpt = Checkpointer(over_budget=over_budget)  # the budget comes from this rank's environment
    _, fut = ckpt.save_async(folder, 1, TrainingState(model, opt))
    fut.result()
    ckpt.close()
    return "saved"


def train_into(rank: int, folder: str) -> str:
    model, opt = _sharded()
    Trainer(
        model=model, optimizer=opt, loss_fn=nn.MSELoss(), data_loader=_batches(rank), save_folder=folder,
        max_steps=3, callbacks=[CheckpointerCallback(save_interval=2)],
    ).fit()  # fmt: skip
    return "trained"


def train_while_a_rank_dies(rank: int, folder: str) -> str:
    model, opt = _sharded()
    cb = CheckpointerCallback(save_interval=4, save_async=False)
    Trainer(
        model=model, optimizer=opt, loss_fn=nn.MSELoss(), data_loader=_batches(rank), save_folder=folder,
        max_steps=9, callbacks=[cb], checkpointer=faulty_checkpointer(rank=1, step=4, vanish=True),
    ).fit()  # fmt: skip
    return "finished"


def _wide(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """An FSDP2 model whose shards are large (read straight into place) and small and uneven
    (5 and 7 rows over 2 or 3 ranks: read through a buffer, resharded piece by piece)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(1024, 512), nn.GELU(), nn.Linear(512, 5), nn.Linear(5, 7))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 1024)).sum().backward()
    opt.step()
    return model, opt


def _hsdp(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """:func:`_wide`'s model under HSDP at 4 ranks (a 2 x 2 mesh: replicated over its first
    dimension, sharded over its second), under plain FSDP2 at other world sizes."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    if world == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(1024, 512), nn.GELU(), nn.Linear(512, 5), nn.Linear(5, 7))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 1024)).sum().backward()
    opt.step()
    return model, opt


_LAYOUTS = {"fsdp": _wide, "hsdp": _hsdp}


def _full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the training state, whole (shards gathered), on every rank."""
    from torch.distributed.tensor import DTensor

    from ckptkeeper.engine.state import flatten_tensors

    tensors, _ = TrainingState(model, opt).capture()
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in flatten_tensors(tensors)}


class _Events:
    """Collects the metrics events this process emits."""

    def __init__(self) -> None:
        import logging

        self.events: list[dict[str, Any]] = []
        handler = logging.Handler()
        handler.emit = lambda record: self.events.append(record.ckptkeeper_event)  # type: ignore[method-assign, attr-defined]
        logger = logging.getLogger("ckptkeeper.metrics")
        logger.setLevel(logging.INFO)
        logger.addHandler(handler)


def save_wide(rank: int, folder: str, reference: str, layout: str = "fsdp") -> list[str]:
    """Save a trained FSDP2 (or ``layout``) state at step 5; rank 0 keeps its whole tensors in ``reference``."""
    model, opt = _LAYOUTS[layout](0)
    model(torch.randn(4, 1024) * (rank + 1)).sum().backward()
    opt.step()
    ckpt = Checkpointer()
    ckpt.save(folder, 5, TrainingState(model, opt))
    full = _full_state(model, opt)
    if rank == 0:
        torch.save(full, reference)
    ckpt.close()
    return sorted(ckpt.verify(f"{folder}/step5").files)


def load_wide(rank: int, path: str, reference: str, layout: str = "fsdp", strict: bool = True) -> dict[str, Any]:
    """Load ``path`` into a differently initialised FSDP2 (or ``layout``) state; compare whole
    tensors with ``reference``."""
    model, opt = _LAYOUTS[layout](1)
    before = _full_state(model, opt)
    events = _Events()
    ckpt = Checkpointer()
    state = TrainingState(model, opt, strict=strict)
    try:
        ckpt.load(path, state)
    except Exception as exc:
        after = _full_state(model, opt)
        unchanged = set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)
        return {"error": type(exc).__name__, "message": str(exc), "unchanged": unchanged}
    finally:
        ckpt.close()
    full = _full_state(model, opt)
    ref = torch.load(reference, weights_only=True)
    load = [e for e in events.events if e["event"] == "load"][-1]
    return {
        "equal": set(full) == set(ref) and all(torch.equal(full[k], ref[k]) for k in ref),
        "keys": len(ref),
        "reader": load["reader"],
        "fetched": load["fetched"],
        "bytes": load["bytes"],
        "report": dataclasses.asdict(state.load_report) if state.load_report is not None else None,
    }


def compare_model_state_dicts(rank: int) -> bool:
    """Whether ckptkeeper's quick model state dict is DCP's on an FSDP2 model, tensor for tensor."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    from ckptkeeper.engine.state import _loads_by_copying, model_state_dict

    model, _ = _wide(seed=0)
    ours, dcps = model_state_dict(model), get_model_state_dict(model)
    same = list(ours) == list(dcps) and _loads_by_copying(model)
    for key, value in ours.items():
        other = dcps[key]
        same = same and type(value) is type(other) is DTensor and not value.requires_grad
        same = same and value._spec == other._spec and value._local_tensor.data_ptr() == other._local_tensor.data_ptr()
    return same


class _Holder(nn.Module):
    """A user's own wrapper that keeps its inner module as ``.module``, as DDP does."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.module = inner


def names_after_a_swap(rank: int) -> list[list[str]]:
    """Checkpoint names of a model whose DDP child is swapped for a look-alike, ours then DCP's."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ckptkeeper.engine.state import model_state_dict

    top = nn.Module()
    top.enc = DDP(nn.Linear(4, 4))
    first = list(model_state_dict(top))  # DDP's "module." is not part of the names
    top.enc = _Holder(nn.Linear(4, 4))  # same attribute names, but "module" is now a real part
    return [first, list(model_state_dict(top)), list(get_model_state_dict(top))]


def names_after_rebinding(rank: int) -> list[list[str]]:
    """Checkpoint names after the same module objects are re-bound under each other's names."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ckptkeeper.engine.state import model_state_dict

    top = nn.Module()
    ddp, holder = DDP(nn.Linear(4, 4)), _Holder(nn.Linear(4, 4))
    top.a, top.b = ddp, holder
    model_state_dict(top)
    del top.a, top.b
    top.b, top.a = ddp, holder  # the same objects, in the same order, under swapped names
    return [list(model_state_dict(top)), list(get_model_state_dict(top))]


def slot_order_after_load(rank: int, folder: str) -> bool:
    """Whether each parameter's optimizer slots keep their order through a save and a load."""
    model, opt = _wide(seed=0)
    before = [list(opt.state[p]) for p in model.parameters()]
    ckpt = Checkpointer()
    try:
        saved = ckpt.save(folder, 5, TrainingState(model, opt))
        ckpt.load(saved.path, TrainingState(model, opt))
    finally:
        ckpt.close()
    return before[0][0] == "step" and [list(opt.state[p]) for p in model.parameters()] == before


def load_wide_counting_tables(rank: int, path: str, reference: str, strict: bool = True) -> dict[str, Any]:
    """:func:`load_wide`, which data files' segment tables this rank read to plan it, and which
    reader read its pieces ("flat": the columnar lane at the saved world size, or "general")."""
    from ckptkeeper.engine import discovery, loading

    read: list[str] = []
    lanes: list[str] = []
    original = discovery.read_table_doc
    readers = loading.read_flat, loading.read_pieces

    def counting(path: str, record: Any, data_file: str, local: str | None = None) -> Any:
        read.append(data_file)
        return original(path, record, data_file, local)

    def lane(name: str, reader: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            lanes.append(name)
            return reader(*args, **kwargs)

        return run

    discovery.read_table_doc = counting  # type: ignore[assignment]
    loading.read_flat, loading.read_pieces = lane("flat", readers[0]), lane("general", readers[1])  # type: ignore[assignment]
    try:
        out = load_wide(rank, path, reference, strict=strict)
    finally:
        discovery.read_table_doc = original  # type: ignore[assignment]
        loading.read_flat, loading.read_pieces = readers  # type: ignore[assignment]
    return {**out, "tables": sorted(set(read)), "lanes": lanes}


def load_wide_counting_tables_each(
    rank: int, paths: list[str], reference: str, strict: bool = True
) -> list[dict[str, Any]]:
    """:func:`load_wide_counting_tables` for each of ``paths`` in turn, in one process group (a
    group per checkpoint spent most of a test's time starting processes)."""
    return [load_wide_counting_tables(rank, path, reference, strict) for path in paths]


def load_round_with_different_failures(rank: int) -> str:
    """One load agreement round in which rank 0 finds a mismatch, the last rank corruption and any
    other rank nothing wrong: the class each raises."""
    import torch.distributed as dist

    from ckptkeeper.engine.agreement import agree, load_error
    from ckptkeeper.engine.loader import CheckpointMismatchError
    from ckptkeeper.errors import CorruptCheckpointError

    last = dist.get_world_size() - 1

    def fail() -> None:
        if rank == 0:
            raise CheckpointMismatchError("does not fit this model")
        if rank == last:
            raise CorruptCheckpointError("its index is damaged")

    try:
        agree(fail, None, None, load_error)
    except Exception as exc:
        return type(exc).__name__
    return "no error"


def load_wide_while_rank_one_dies_planning(rank: int, path: str) -> dict[str, Any]:
    """Load ``path`` while rank 1 vanishes (exit code 9) checking the shared index: the survivors'
    error, and whether their local shards are unchanged (no collective after the failure)."""
    import os

    from torch.distributed.tensor import DTensor

    from ckptkeeper.engine import loading
    from ckptkeeper.engine.state import flatten_tensors

    model, opt = _wide(seed=1)
    state = TrainingState(model, opt)

    def local() -> dict[str, torch.Tensor]:
        tensors, _ = state.capture()
        return {
            k: (v.to_local() if isinstance(v, DTensor) else v).detach().clone() for k, v in flatten_tensors(tensors)
        }

    before = local()
    if rank == 1:
        loading._index_from_own_table = lambda *a, **k: os._exit(9)  # type: ignore[assignment]
    try:
        Checkpointer().load(path, state)
    except Exception as exc:
        after = local()
        return {"error": type(exc).__name__, "message": str(exc),
                "unchanged": all(torch.equal(after[k], before[k]) for k in before)}  # fmt: skip
    return {"error": None}


class _TiedPairs(nn.Module):
    """Embeddings with output layers that share their weights (a replicated, unsharded model)."""

    def __init__(self, seed: int, tied: bool) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.ModuleList(nn.Embedding(16, 8) for _ in range(8))
        self.h = nn.ModuleList(nn.Linear(8, 16, bias=False) for _ in range(8))
        if tied:
            for a, h in zip(self.a, self.h, strict=True):
                h.weight = a.weight


def load_tied_weights(rank: int, folder: str) -> dict[str, Any]:
    """At the saved world size: an untied checkpoint into a tied model, then a tied checkpoint one
    of whose pair's earlier copy is damaged (both copies in one rank's file, read by one job)."""
    import json
    from pathlib import Path

    import torch.distributed as dist

    from ckptkeeper.engine.sharded import table_pieces
    from ckptkeeper.errors import CorruptCheckpointError

    untied = _TiedPairs(0, tied=False)
    Checkpointer().save(f"{folder}/untied", 1, TrainingState(untied))
    target = _TiedPairs(1, tied=True)
    Checkpointer().load(f"{folder}/untied/step1", TrainingState(target))
    # The later name in the file is the one a tied pair keeps, as DCP leaves it.
    later = [torch.equal(target.h[i].weight, untied.h[i].weight) for i in range(8)]

    Checkpointer().save(f"{folder}/tied", 1, TrainingState(_TiedPairs(0, tied=True)))
    step = f"{folder}/tied/step1/model_and_optim"
    damaged = None
    if rank == 0:
        where = {}
        for r in range(dist.get_world_size()):
            doc = json.loads(Path(f"{step}/.ckptkeeper-pieces-{r}.json").read_text())
            data = f"__{r}_0.distcp"
            for fqn, _, stored, _ in table_pieces(doc, data, os.path.getsize(f"{step}/{data}")):
                where[fqn] = (r, stored.segs["data"].offset)
        for i in range(8):
            pair = sorted([(where[f"model.{n}.{i}.weight"], f"model.{n}.{i}.weight") for n in ("a", "h")])
            if pair[0][0][0] == pair[1][0][0]:  # one file
                (r, offset), damaged = pair[0]
                raw = bytearray(Path(f"{step}/__{r}_0.distcp").read_bytes())
                raw[offset + 5] ^= 0xFF
                Path(f"{step}/__{r}_0.distcp").write_bytes(bytes(raw))
                break
    box = [damaged]
    dist.broadcast_object_list(box, src=0)
    victim = _TiedPairs(2, tied=True)
    before = state_digest(victim)
    error = ""
    try:
        Checkpointer().load(f"{folder}/tied/step1", TrainingState(victim))
    except CorruptCheckpointError as exc:
        error = str(exc)
    return {"later": later, "damaged": box[0], "error": error, "unchanged": state_digest(victim) == before}


def _lazy_views(seed: int, lazy: bool) -> nn.Module:
    """Plain (replicated) parameters that are, with ``lazy``, a lazy conjugate and a lazy negation
    (their memory holds the other values)."""
    g = torch.Generator().manual_seed(seed)
    m = nn.Module()
    x = torch.randn(4, dtype=torch.cfloat, generator=g)
    m.c = nn.Parameter(x.conj() if lazy else x)
    y = torch.randn(6, generator=g)
    m.n = nn.Parameter(torch._neg_view(y) if lazy else y)
    return m


def load_into_lazy_views(rank: int, folder: str) -> dict[str, Any]:
    """Save plain parameters at the saved world size and load them into lazy conj/neg views: the
    values each parameter then reads as, against the saved ones."""
    src = _lazy_views(0, lazy=False)
    Checkpointer().save(folder, 1, TrainingState(src))
    dst = _lazy_views(1, lazy=True)
    Checkpointer().load(f"{folder}/step1", TrainingState(dst))
    return {
        name: torch.equal(getattr(dst, name).detach().resolve_conj().resolve_neg(), getattr(src, name).detach())
        for name in ("c", "n")
    } | {"still_lazy": bool(dst.c.is_conj() and dst.n.is_neg())}


def save_in_a_group_without_global_rank_zero(rank: int, folder: str) -> bool | None:
    """Rank 1 alone saves and loads with a checkpointer given a group of rank 1 only."""
    import torch.distributed as dist

    group = dist.new_group([1])  # every rank takes part in making a group
    if rank != 1:
        return None
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    ckpt = Checkpointer(process_group=group)
    path = ckpt.save(folder, 1, TrainingState(model)).path
    other = nn.Linear(4, 2)
    ckpt.load(path, TrainingState(other))
    ckpt.close()
    return state_digest(other) == state_digest(model)


def _fsdp1(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import FullyShardedDataParallel

    torch.manual_seed(seed)
    inner = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))
    model = FullyShardedDataParallel(inner, device_id=torch.device("cpu"), use_orig_params=True)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _fsdp1_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(4, 16, generator=g)).square().sum().backward()
    opt.step()
    opt.zero_grad()


def _local_state(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    # This rank's shards of the parameters and of the optimizer's state (FSDP1 keeps them flat).
    out = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        out += [v.detach().clone() for v in opt.state[p].values() if isinstance(v, torch.Tensor)]
    return out


class _Refuses:
    """An extra whose load_state_dict raises, after the tensors have been read."""

    def state_dict(self) -> dict[str, Any]:
        return {"n": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise ValueError("refused")


def fsdp1_async_save_and_load(rank: int, folder: str) -> dict[str, Any]:
    """FSDP1 (ShardedTensor state dicts): an async save writes the state at its call, a load puts
    it back, and a load that fails after its reads leaves the state as it found it."""
    model, opt = _fsdp1(0)
    _fsdp1_step(model, opt, 1)
    ckpt = Checkpointer()
    at_call = _local_state(model, opt)
    path, fut = ckpt.save_async(folder, 2, TrainingState(model, opt))
    _fsdp1_step(model, opt, 2)  # training goes on at once
    fut.result()
    later = _local_state(model, opt)
    ckpt.load(path, TrainingState(model, opt))
    loaded = _local_state(model, opt)
    _fsdp1_step(model, opt, 3)
    ckpt.save(folder, 4, TrainingState(model, opt, extra={"x": _Refuses()}))
    _fsdp1_step(model, opt, 4)
    before_failed = _local_state(model, opt)
    failed = ""
    try:
        ckpt.load(f"{folder}/step4", TrainingState(model, opt, extra={"x": _Refuses()}))
    except Exception as exc:
        failed = type(exc).__name__
    after_failed = _local_state(model, opt)
    ckpt.close()

    def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

    return {
        "loaded_equals_call": same(loaded, at_call),
        "training_moved_on": not same(later, at_call),
        "failed": failed,
        "failed_load_changed_nothing": same(after_failed, before_failed),
        "pieces": len(at_call),
    }


def saves_reusing_plans(rank: int, folder: str) -> dict[str, Any]:
    """Train and save again and again (sync, async, after a load) with one checkpointer, which
    reuses its save plans where the tensors are the same; every checkpoint must hold the state
    as it was at its save: loaded back by ckptkeeper, and (one reused-plan checkpoint) by stock DCP
    in no-dist mode, tensor by tensor against the whole tensors."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    model, opt = _sharded()
    state = TrainingState(model, opt)
    batches = _batches(rank)
    ckpt = Checkpointer()
    digests: dict[int, str] = {}

    def train(i: int) -> None:
        x, y = batches[i % len(batches)]
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    def save(step: int, background: bool = False) -> None:
        train(step)
        if background:
            _, fut = ckpt.save_async(folder, step, state)
            digests[step] = state_digest(model, opt)  # the state as snapshotted
            fut.result()
        else:
            ckpt.save(folder, step, state)
            digests[step] = state_digest(model, opt)

    save(1)
    save(2)  # the same tensors: the plan of step 1
    save(3, background=True)  # the stager's buffers: a plan of their own
    save(4, background=True)
    save(5)  # the live tensors' plan, kept beside the stager's
    whole = _full_state(model, opt)
    counts = [ckpt._save_memo.hits, ckpt._save_memo.misses]
    ckpt.load(f"{folder}/step2", state)  # the optimizer's state is new tensors now
    save(6)
    recalled = ckpt._save_memo.recalled  # rank 0: layouts named by token (steps 2, 4 and 5)
    if rank == 0:
        ckpt._save_memo._layouts.clear()  # rank 0 loses what it was sent: the ranks are asked again
    save(7)
    counts += [ckpt._save_memo.hits, ckpt._save_memo.misses, recalled, ckpt._save_memo.lost]
    loaded = {}
    for step, want in digests.items():
        other, other_opt = _sharded(seed=1)
        ckpt.load(f"{folder}/step{step}", TrainingState(other, other_opt))
        loaded[step] = state_digest(other, other_opt) == want
    ckpt.close()
    meta = dcp.FileSystemReader(f"{folder}/step5/model_and_optim").read_metadata()
    read = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata)}  # fmt: skip
    dcp.load(read, checkpoint_id=f"{folder}/step5/model_and_optim", no_dist=True)
    by_dcp = set(read) == set(whole) and all(torch.equal(read[k], whole[k]) for k in whole)
    return {"counts": counts, "loaded": loaded, "by_dcp": by_dcp, "rank": rank}


def hook_casts_the_model_during_a_save(rank: int, folder: str) -> dict[str, Any]:
    """An on_stage hook that casts the FSDP2 model to float64 ("writing tensors") during a save
    whose plan was reused and whose layout would go to rank 0 by token: the save is planned again
    after the hook, and its checkpoint must hold the float64 state, whole (verify, ckptkeeper's
    load, stock DCP)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    model, opt = _sharded()
    armed = [False]

    def hook(stage: SaveStage) -> None:
        if stage.name == "writing tensors" and armed[0]:
            model.to(torch.float64)

    ckpt = Checkpointer(on_stage=hook)
    ckpt.save(folder, 1, TrainingState(model, opt))
    ckpt.save(folder, 2, TrainingState(model, opt))  # the plan of step 1, its layout sent by token
    armed[0] = True
    ckpt.save(folder, 3, TrainingState(model, opt))
    armed[0] = False
    want = state_digest(model, opt)
    whole = _full_state(model, opt)
    verified = True
    try:
        ckpt.verify(f"{folder}/step3")
    except Exception:
        verified = False
    other, other_opt = _sharded(seed=1)
    other.to(torch.float64)
    ckpt.load(f"{folder}/step3", TrainingState(other, other_opt))
    ckpt.close()
    meta = dcp.FileSystemReader(f"{folder}/step3/model_and_optim").read_metadata()
    read = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata)}  # fmt: skip
    dcp.load(read, checkpoint_id=f"{folder}/step3/model_and_optim", no_dist=True)
    return {
        "verified": verified,
        "loaded": state_digest(other, other_opt) == want,
        "by_dcp": set(read) == set(whole) and all(torch.equal(read[k], whole[k]) for k in whole),
    }


def load_inside_a_sync_save_on_one_rank(rank: int, folder: str) -> dict[str, Any]:
    """Rank 1's on_stage hook calls load() during a synchronous save; rank 0's does nothing. Both
    ranks must get the save's error (not wait for each other), with nothing committed or loaded."""
    from ckptkeeper import CheckpointSaveError

    model, opt = _sharded()
    box: list[Checkpointer] = []

    def hook(stage: SaveStage) -> None:
        if stage.name == "writing tensors" and stage.step == 2 and rank == 1:
            box[0].load(f"{folder}/step1", TrainingState(model, opt))

    ckpt = Checkpointer(on_stage=hook)
    box.append(ckpt)
    ckpt.save(folder, 1, TrainingState(model, opt))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    before = state_digest(model, opt)
    error = ""
    try:
        ckpt.save(folder, 2, TrainingState(model, opt))
    except CheckpointSaveError as exc:
        error = str(exc)
    unchanged = state_digest(model, opt) == before
    ckpt.on_stage = None
    ckpt.save(folder, 3, TrainingState(model, opt))
    steps = [s for s, _ in ckpt.find_checkpoints(folder)]
    ckpt.close()
    return {"error": error, "unchanged": unchanged, "steps": steps}


def shrunk_shard_on_one_rank(rank: int, folder: str, how: str) -> dict[str, Any]:
    """Rank 1 shrinks the storage of its local shard of one FSDP2 parameter to half after two
    saves (the second reused the first's plan), then saves (``sync`` or ``async``) or loads
    (``load``, into a model whose shard is shrunk the same way). Every rank must get an error
    (rank 1's naming the parameter), with nothing committed, loaded or crashed."""
    from ckptkeeper import CkptkeeperError

    model, opt = _sharded()
    st = TrainingState(model, opt)
    ckpt = Checkpointer()
    ckpt.save(folder, 1, st)
    ckpt.save(folder, 2, st)
    target = model if how != "load" else _sharded(seed=1)[0]
    local = target[0].weight._local_tensor
    if rank == 1:
        local.untyped_storage().resize_(local.untyped_storage().nbytes() // 2)
    before = state_digest(target[2])
    error = ""
    try:
        if how == "sync":
            ckpt.save(folder, 3, st)
        elif how == "async":
            ckpt.save_async(folder, 3, st)[1].result()
        else:
            ckpt.load(f"{folder}/step2", TrainingState(target))
    except CkptkeeperError as exc:
        error = str(exc)
    steps = [s for s, _ in ckpt.find_checkpoints(folder)]
    ckpt.close()
    return {"error": error, "steps": steps, "unchanged": state_digest(target[2]) == before}


def interrupted_on_one_rank(rank: int, folder: str, what: str) -> dict[str, Any]:
    """Rank 1 is interrupted (KeyboardInterrupt, as Ctrl-C raises it) in the middle of a
    synchronous save (``save``: from an on_stage hook) or of a load (``load``: from its trainer
    state check). Rank 1 must see its KeyboardInterrupt, rank 0 an error naming rank 1 instead of
    waiting for it; both then go on (a save and a load that work)."""
    from ckptkeeper import CheckpointError

    model, opt = _sharded()
    armed = [False]

    def hook(stage: SaveStage) -> None:
        if armed[0] and rank == 1 and stage.name == "writing tensors":
            if what == "exit":
                raise SystemExit(3)
            raise KeyboardInterrupt

    def check(train_state: dict[str, Any]) -> None:
        if armed[0] and rank == 1:
            raise KeyboardInterrupt

    ckpt = Checkpointer(on_stage=hook)
    st = TrainingState(model, opt)
    ckpt.save(folder, 1, st)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    before = state_digest(model, opt)
    armed[0] = True
    seen = ""
    try:
        if what in ("save", "exit"):
            ckpt.save(folder, 2, st)
        else:
            ckpt.load(f"{folder}/step1", st, check)
    except (KeyboardInterrupt, SystemExit) as exc:
        seen = type(exc).__name__
    except CheckpointError as exc:
        seen = f"{type(exc).__name__}: {exc}"
    armed[0] = False
    unchanged = state_digest(model, opt) == before
    ckpt.save(folder, 3, st)
    ckpt.load(f"{folder}/step3", st)
    steps = [s for s, _ in ckpt.find_checkpoints(folder)]
    ckpt.close()
    return {"seen": seen, "unchanged": unchanged, "steps": steps}


class _Box:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def state_dict(self) -> dict[str, Any]:
        if isinstance(self.t, Exception):
            raise self.t
        return {"t": self.t}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.t = sd["t"]


def unsaveable_extra_on_one_rank(
    rank: int, folder: str, kind: str, background: bool, writer: str = "dcp"
) -> dict[str, Any]:
    """Rank 1 alone holds an extra that cannot be saved (``sparse``: CSR; ``shrunk``: storage
    resized under it; ``meta``; ``no memory``: its staging buffers cannot be allocated;
    ``state_dict raises``: the extra's state_dict() fails; ``train state``: a train_state that
    cannot be stored; the save going through DCP's writer or async staging). Every rank
    must fail the save together (rank 1 naming the tensor), and then save again."""
    from ckptkeeper import CkptkeeperError

    t: Any = torch.arange(8.0)
    train_state: dict[str, Any] | None = None
    if rank == 1:
        if kind == "state_dict raises":
            t = RuntimeError("the extra's state_dict failed")
        elif kind == "train state":
            train_state = {"bad": object()}  # cannot be stored without pickle
        elif kind == "sparse":
            t = torch.eye(4).to_sparse_csr()
        elif kind == "shrunk":
            t.untyped_storage().resize_(8)
        elif kind == "meta":
            t = torch.empty(8, device="meta")
        elif kind == "nested":
            t = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    box = _Box(t)
    st = TrainingState(nn.Linear(2, 2), extra={"b": box})
    ckpt = Checkpointer(writer=writer)  # type: ignore[arg-type]
    error = ""
    allocate = torch.empty_like
    if kind == "no memory" and rank == 1:
        # Host memory runs out while rank 1 allocates its staging buffers, after the ranks agreed.

        def no_memory(*args: Any, **kwargs: Any) -> torch.Tensor:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 32 bytes")

        torch.empty_like = no_memory  # type: ignore[assignment]
    try:
        if background:
            ckpt.save_async(folder, 1, st, train_state=train_state)
            ckpt.wait()  # raises a failure of the background part and takes it (result() would not)
        else:
            ckpt.save(folder, 1, st, train_state=train_state)
    except (CkptkeeperError, RuntimeError) as exc:
        error = str(exc)
    finally:
        torch.empty_like = allocate  # type: ignore[assignment]
    box.t = torch.arange(8.0)
    ckpt.save(folder, 2, st)
    steps = [s for s, _ in ckpt.find_checkpoints(folder)]
    ckpt.close()
    return {"error": error, "steps": steps}


def ctrl_c_while_waiting_in_an_exchange(rank: int, folder: str, what: str) -> dict[str, Any]:
    """A real SIGINT reaches rank 1 while it waits for rank 0 in one of a save's (or load's)
    exchanges (rank 0 is held up in a hook). The save or load must end alike on both ranks, the
    interrupt then raised on rank 1; both go on saving and loading after it."""
    import signal
    import threading
    import time

    model, opt = _sharded()
    armed = [False]

    def hold_up() -> None:
        if rank == 1:
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        else:
            time.sleep(1.5)

    def hook(stage: SaveStage) -> None:
        if armed[0] and stage.name == "writing tensors":
            armed[0] = False
            hold_up()

    def check(train_state: dict[str, Any]) -> None:
        if armed[0]:
            armed[0] = False
            hold_up()
            if what == "failing load" and rank == 0:
                raise ValueError("not this one")  # the load fails on every rank, Ctrl-C held on rank 1

    from ckptkeeper import CheckpointError

    ckpt = Checkpointer(on_stage=hook)
    st = TrainingState(model, opt)
    ckpt.save(folder, 1, st)
    armed[0] = True
    seen = ""
    try:
        if what == "save":
            ckpt.save(folder, 2, st)
        else:
            ckpt.load(f"{folder}/step1", st, check)
    except (KeyboardInterrupt, CheckpointError) as exc:
        seen = type(exc).__name__
    ckpt.save(folder, 3, st)
    ckpt.load(f"{folder}/step3", st)
    steps = [s for s, _ in ckpt.find_checkpoints(folder)]
    ckpt.close()
    return {"seen": seen, "steps": steps}


def ctrl_c_while_staging(rank: int, folder: str) -> dict[str, Any]:
    """A real SIGINT reaches rank 1 inside its async save's staging copy, after the ranks agreed
    to save. The save must still be made by every rank (the interrupt raised on rank 1 once it
    is handed over), and both ranks must go on saving together."""
    import signal

    st = TrainingState(nn.Linear(4, 4))
    ckpt = Checkpointer()
    allocate = torch.empty_like
    if rank == 1:

        def interrupted(*args: Any, **kwargs: Any) -> torch.Tensor:
            torch.empty_like = allocate  # type: ignore[assignment]
            os.kill(os.getpid(), signal.SIGINT)  # raised at the next line Python runs
            return allocate(*args, **kwargs)

        torch.empty_like = interrupted  # type: ignore[assignment]
    seen = ""
    try:
        ckpt.save_async(folder, 1, st)
    except KeyboardInterrupt:
        seen = "KeyboardInterrupt"
    finally:
        torch.empty_like = allocate  # type: ignore[assignment]
    ckpt.wait()
    ckpt.save(folder, 2, st)
    steps = [s for s, _ in ckpt.find_checkpoints(folder)]
    ckpt.close()
    return {"seen": seen, "steps": steps}


def state_fails_on_one_rank(rank: int, folder: str, how: str) -> dict[str, Any]:
    """Rank 1 alone cannot take its state for the step-1 save (``manager sync``/``manager async``:
    a json_state object's state_dict() raises; ``interrupt``: an extra's raises KeyboardInterrupt;
    ``nan metric``: a NaN metric; ``resave``: an extra's raises while step 1, already saved, is
    saved again; ``manager resave``: the same through the manager's save(force=True);
    ``manager fsdp1``: a json_state object's state_dict() raises, the model being FSDP1's).
    Every rank must fail that save together, nothing saved or removed, and then save step 2
    together."""
    from ckptkeeper import CheckpointManager, CheckpointPolicyConfig

    class Failing:
        def __init__(self) -> None:
            self.exc: BaseException | None = None

        def state_dict(self) -> dict[str, Any]:
            if self.exc is not None:
                raise self.exc
            return {"n": 1}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            pass

    failing = Failing()
    bad: BaseException = KeyboardInterrupt() if how == "interrupt" else RuntimeError("state_dict failed here")
    error = ""
    if how.startswith("manager"):
        config = CheckpointPolicyConfig(save_interval=1000, save_async=how.endswith("async"))
        model: nn.Module = nn.Linear(4, 4)
        opt = None
        if how == "manager fsdp1":
            # Capturing an FSDP1 model runs collectives of its own, which every rank must join.
            from torch.distributed.fsdp import FullyShardedDataParallel

            model = FullyShardedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)),
                                             device_id=torch.device("cpu"), use_orig_params=True)  # fmt: skip
            opt = torch.optim.AdamW(model.parameters(), lr=0.01)
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
        mgr = CheckpointManager(folder, model=model, optimizer=opt, json_state={"j": failing}, take_lease=False,
                                config=config)  # fmt: skip
        mgr.restore()
        if how == "manager resave":
            mgr.save(1, wait=True)  # then saved again with force=True, failing on rank 1
        failing.exc = bad if rank == 1 else None
        try:
            mgr.save(1, force=how == "manager resave", wait=True)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        failing.exc = None
        mgr.save(2, wait=True)
        mgr.close(final_save=False)
    else:
        st = TrainingState(nn.Linear(4, 4), extra={"f": failing})
        ckpt = Checkpointer()
        if how == "resave":
            ckpt.save(folder, 1, st)
        failing.exc = bad if rank == 1 and how != "nan metric" else None
        metrics = {"loss": float("nan") if rank == 1 else 1.0} if how == "nan metric" else None
        try:
            if how == "nan metric":
                ckpt.save_async(folder, 1, st, metrics=metrics)
                ckpt.wait()
            else:
                ckpt.save(folder, 1, st)
        except BaseException as exc:  # KeyboardInterrupt too: raised as itself on rank 1
            error = f"{type(exc).__name__}: {exc}"
        failing.exc = None
        ckpt.save(folder, 2, st)
        ckpt.close()
    steps = [s for s, _ in Checkpointer().find_checkpoints(folder)]
    return {"error": error, "steps": steps}


def sharded_round_trip_under_a_meta_default(rank: int, folder: str) -> bool:
    """An FSDP2 state saved and loaded with torch.set_default_device("meta") in force."""
    model, opt = _sharded()
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    want = state_digest(model, opt)
    other, other_opt = _sharded(seed=1)
    torch.set_default_device("meta")
    try:
        ckpt = Checkpointer()
        ckpt.save(folder, 1, TrainingState(model, opt))
        ckpt.load(f"{folder}/step1", TrainingState(other, other_opt))
        ckpt.close()
    finally:
        torch.set_default_device("cpu")
    return state_digest(other, other_opt) == want


def _dtensor_linear(seed: int, transposed: bool) -> nn.Module:
    # A Linear whose weight is a row-sharded DTensor made by hand; with ``transposed`` its local
    # shard's memory holds the transpose (non-contiguous), as some tensor-parallel layouts do.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(seed)
    model = nn.Linear(16, 12, bias=False)
    rows = torch.randn(12, 16).chunk(2)[mesh.get_local_rank()]
    local = rows.t().contiguous().t() if transposed else rows.clone()
    model.weight = nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False))
    return model


def non_contiguous_dtensor_load(rank: int, folder: str) -> dict[str, Any]:
    """A checkpoint of row-sharded DTensors loaded into DTensors whose local shards are not contiguous."""
    import logging

    readers: list[str] = []

    class _Readers(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            event = getattr(record, "ckptkeeper_event", {})
            if event.get("event") == "load":
                readers.append(event["reader"])

    metrics = logging.getLogger("ckptkeeper.metrics")
    metrics.setLevel(logging.INFO)
    metrics.addHandler(_Readers())
    saved = _dtensor_linear(0, transposed=False)
    ckpt = Checkpointer()
    ckpt.save(folder, 1, TrainingState(saved))
    into = _dtensor_linear(1, transposed=True)
    local = into.weight._local_tensor  # type: ignore[attr-defined]
    strides, at = local.stride(), local.data_ptr()
    ckpt.load(f"{folder}/step1", TrainingState(into))
    ckpt.close()
    after = into.weight._local_tensor  # type: ignore[attr-defined]
    return {
        "equal": bool(torch.equal(after, saved.weight._local_tensor)),  # type: ignore[attr-defined]
        "in_place": after is local and after.stride() == strides and after.data_ptr() == at,
        "readers": readers,
    }


def load_into_sharded_digest(rank: int, path: str) -> str:
    """Load ``path`` into a 2-rank FSDP2 copy of tests/engine/test_one_rank_dtensors.py's model; its digest."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(12, 20), nn.GELU(), nn.Linear(20, 6))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    Checkpointer().load(path, TrainingState(model, opt))
    return state_digest(model, opt)


def pick_with_one_rank_failing_to_verify(rank: int, folder: str) -> str | None:
    """Rank 1 alone cannot verify step6 (a read error of its own); which checkpoint each rank picks."""
    from ckptkeeper import CheckpointManager, CorruptCheckpointError
    from ckptkeeper.engine import CommitRecord

    class FlakyOnRank1(Checkpointer):
        def verify(self, path: str, checksums: bool = True) -> CommitRecord:
            if rank == 1 and path.rstrip("/").endswith("step6"):
                raise CorruptCheckpointError(f"{path}: simulated read error on rank 1")
            return super().verify(path, checksums)

    mgr = CheckpointManager(folder, model=nn.Linear(4, 2), checkpointer=FlakyOnRank1(), take_lease=False)
    try:
        picked = mgr.pick()
    finally:
        mgr.close(final_save=False)
    return None if picked is None else picked[0].rstrip("/").rsplit("/", 1)[-1]


def pick_with_ctrl_c_on_rank1_while_it_waits(rank: int, folder: str, how: str = "pick") -> str | None:
    """Rank 0 takes seconds over step6 (to find it unreadable in pick(), to load it in restore());
    Ctrl-C reaches rank 1 while it waits for rank 0."""
    import signal
    import time

    from ckptkeeper import CheckpointManager, CorruptCheckpointError
    from ckptkeeper.engine import CommitRecord

    signal.signal(signal.SIGINT, signal.default_int_handler)

    def slow_on_step6(path: str) -> bool:
        if not path.rstrip("/").endswith("step6"):
            return False
        if rank == 0:
            time.sleep(3)
        else:
            threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
        return rank == 0

    class Slow(Checkpointer):
        def verify(self, path: str, checksums: bool = True) -> CommitRecord:
            if slow_on_step6(path):
                raise CorruptCheckpointError(f"{path}: simulated read error on rank 0")
            return super().verify(path, checksums)

        def load(self, path: str, state: TrainingState, check_train_state: Any = None) -> dict[str, Any]:
            slow_on_step6(path)
            return super().load(path, state, check_train_state)

    mgr = CheckpointManager(folder, model=nn.Linear(4, 2), checkpointer=Slow(), take_lease=False)
    try:
        if how == "pick":
            picked = mgr.pick()
            return None if picked is None else picked[0].rstrip("/").rsplit("/", 1)[-1]
        mgr.restore(begin=False)
        return str(mgr.step)
    finally:
        mgr.close(final_save=False)


def pick_with_its_own_load_path(rank: int, folder: str, load_path: str, spelling: str = "none") -> str | None:
    """Rank 0 is given a load_path, rank 1 none (``none``) or the same with a trailing slash (``slash``)."""
    from ckptkeeper import CheckpointManager

    given = {"none": load_path if rank == 0 else None, "slash": load_path + "/" * rank}[spelling]
    mgr = CheckpointManager(folder, model=nn.Linear(4, 2), load_path=given, take_lease=False)
    try:
        picked = mgr.pick()
    finally:
        mgr.close(final_save=False)
    return None if picked is None else picked[0]


def resume_failing_on_one_rank(rank: int, folder: str, how: str) -> str | None:
    """One rank fails after its agreed part: restore()'s on_loaded callback raises on rank 1, or
    pick()'s accept raises a corrupt-checkpoint error on rank 0 and another error on rank 1."""
    from ckptkeeper import CheckpointManager, CorruptCheckpointError

    mgr = CheckpointManager(folder, model=nn.Linear(4, 2), take_lease=False)
    try:
        if how == "restore":

            def on_loaded(path: str) -> None:
                if rank == 1:
                    raise ValueError("on_loaded failed on rank 1")

            mgr.on_loaded.append(on_loaded)
            mgr.restore(begin=False)
            return str(mgr.step)

        def accept(path: str, ts: dict[str, Any]) -> None:
            if path.rstrip("/").endswith("step6"):
                raise CorruptCheckpointError("not this one (rank 0)") if rank == 0 else RuntimeError("broken (rank 1)")

        picked = mgr.pick(accept=accept)
        return None if picked is None else picked[0]
    finally:
        mgr.close(final_save=False)
