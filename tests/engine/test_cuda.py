"""Checkpoints of training states that live on a CUDA device (issue 11, item 7).

These run only where torch sees a GPU (a lent GPU machine runs them with ``benchmarks/gpu_check.py``);
elsewhere they skip with the reason. What they hold a GPU run to: a state saved from the device loads
back bit-identical and stays on the device; async saves keep the values of the moment they were
asked for, staged in pinned host memory; a checkpoint taken on a GPU machine loads on a CPU-only one
and in stock DCP; a CPU checkpoint loads into a model on the device; a process whose default device
is the GPU writes blobs that name the CPU; an FSDP2 state sharded over a CUDA mesh (NCCL) round-trips.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from ckptkeeper import Checkpointer, TrainingState, state_digest

from ..helpers import load_readers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: states that live on a GPU")


def _trained(device: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(96, 160), nn.GELU(), nn.Linear(160, 24)).to(device=device, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(5, 96, device=device, dtype=dtype)).float().square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def _fresh(device: str, seed: int, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, torch.optim.Optimizer]:
    # A new model and an optimizer that has never stepped: the load makes every optimizer slot.
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(96, 160), nn.GELU(), nn.Linear(160, 24)).to(device=device, dtype=dtype)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _fast_written(folder: str) -> bool:
    # The fast writers leave a segment table beside DCP's files; DCP's writer does not.
    return any(p.name.startswith(".ckptkeeper-layout") for p in (Path(folder) / "model_and_optim").iterdir())


def _tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    found: list[torch.Tensor] = list(model.parameters())
    for slots in opt.state.values():
        found += [v for v in slots.values() if isinstance(v, torch.Tensor)]
    return found


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cuda_state_round_trips_bit_identical_and_stays_on_the_device(
    tmp_path: Path, dtype: torch.dtype, caplog: pytest.LogCaptureFixture
) -> None:
    model, opt = _trained("cuda", dtype=dtype)
    want = state_digest(model, opt)
    ckpt = Checkpointer()
    path = ckpt.save(str(tmp_path), 1, TrainingState(model, opt)).path
    assert _fast_written(path)  # a synchronous save from the GPU goes through host staging, not DCP's writer
    assert ckpt._stager.nbytes == 0  # through a copy freed after the save: sync saves keep no host copy
    back, back_opt = _fresh("cuda", seed=7, dtype=dtype)
    caplog.set_level(logging.INFO, logger="ckptkeeper.metrics")
    Checkpointer().load(path, TrainingState(back, back_opt))
    assert load_readers(caplog.records) == ["fast"]  # read through host tensors, not DCP's reader
    assert state_digest(back, back_opt) == want
    loaded = _tensors(back, back_opt)
    assert len(loaded) == len(_tensors(model, opt))
    # AdamW's "step" is a CPU scalar unless capturable; what the load made follows the optimizer's
    # own rule, the same as the saved optimizer's slots.
    saved_devices = sorted(t.device.type for t in _tensors(model, opt))
    assert sorted(t.device.type for t in loaded) == saved_devices
    assert all(p.device.type == "cuda" for p in back.parameters())


def test_an_async_save_from_cuda_keeps_the_values_it_was_asked_for_in_pinned_staging(tmp_path: Path) -> None:
    model, opt = _trained("cuda")
    want = state_digest(model, opt)
    ckpt = Checkpointer()
    try:
        path, future = ckpt.save_async(str(tmp_path), 1, TrainingState(model, opt))
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-3.0)  # on the device, while the save may still be writing
        result = future.result()
        assert result.blocked_s <= result.durable_s
        # Every buffer of a GPU tensor is pinned; AdamW's steps are CPU scalars, staged as they are.
        on_gpu = sum(t.is_cuda for t in _tensors(model, opt))
        assert on_gpu and sum(b.is_pinned() for b in ckpt._stager._buffers.values()) == on_gpu
        back, back_opt = _fresh("cuda", seed=3)
        ckpt.load(path, TrainingState(back, back_opt))
        assert state_digest(back, back_opt) == want
        # A second async save reuses the pinned buffers and sees the new values.
        changed = state_digest(model, opt)
        path2, future2 = ckpt.save_async(str(tmp_path), 2, TrainingState(model, opt))
        future2.result()
        assert sum(b.is_pinned() for b in ckpt._stager._buffers.values()) == on_gpu
        again, again_opt = _fresh("cuda", seed=4)
        ckpt.load(path2, TrainingState(again, again_opt))
        assert state_digest(again, again_opt) == changed
    finally:
        ckpt.close()


def test_a_checkpoint_saved_on_a_gpu_loads_on_the_cpu_and_in_stock_dcp(tmp_path: Path) -> None:
    model, opt = _trained("cuda")
    path = Checkpointer().save(str(tmp_path), 1, TrainingState(model, opt)).path
    cpu_model, cpu_opt = _fresh("cpu", seed=5)
    Checkpointer().load(path, TrainingState(cpu_model, cpu_opt))
    assert all(p.device.type == "cpu" for p in cpu_model.parameters())
    for a, b in zip(cpu_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b.cpu())
    stock = {"model": {k: torch.zeros_like(v) for k, v in cpu_model.state_dict().items()}}
    dcp_load(stock, storage_reader=FileSystemReader(str(Path(path) / "model_and_optim")), no_dist=True)
    assert all(torch.equal(stock["model"][k], v.cpu()) for k, v in model.state_dict().items())


def test_a_cpu_checkpoint_loads_into_a_model_on_the_device(tmp_path: Path) -> None:
    model, opt = _trained("cpu")
    path = Checkpointer().save(str(tmp_path), 1, TrainingState(model, opt)).path
    gpu_model, gpu_opt = _fresh("cuda", seed=6)
    Checkpointer().load(path, TrainingState(gpu_model, gpu_opt))
    assert all(p.device.type == "cuda" for p in gpu_model.parameters())
    for a, b in zip(gpu_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.cpu(), b)
    assert state_digest(gpu_model, gpu_opt) == state_digest(model, opt)


_DEFAULT_CUDA_CHILD = r"""
import sys, torch
from ckptkeeper import Checkpointer, TrainingState, state_digest
torch.set_default_device("cuda")  # models built here land on the GPU, and so would any torch.empty
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(19, 23), torch.nn.Linear(23, 5))
opt = torch.optim.AdamW(model.parameters(), lr=0.1)
model(torch.randn(2, 19)).sum().backward()
opt.step()
path = Checkpointer().save(sys.argv[1], 1, TrainingState(model, opt)).path
again = torch.nn.Sequential(torch.nn.Linear(19, 23), torch.nn.Linear(23, 5))
again_opt = torch.optim.AdamW(again.parameters(), lr=0.1)
Checkpointer().load(path, TrainingState(again, again_opt))
print(state_digest(model, opt) == state_digest(again, again_opt), state_digest(model))
"""


def test_a_process_whose_default_device_is_the_gpu_writes_checkpoints_a_cpu_process_reads(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2] / "src"), *sys.path])}
    child = subprocess.run(
        [sys.executable, "-c", _DEFAULT_CUDA_CHILD, str(tmp_path)], env=env, capture_output=True, text=True, timeout=180
    )
    assert child.returncode == 0, child.stderr[-2000:]
    same, saved_model = child.stdout.split()
    assert same == "True"
    back = nn.Sequential(nn.Linear(19, 23), nn.Linear(23, 5))
    Checkpointer().load(str(tmp_path / "step1"), TrainingState(back))
    assert state_digest(back) == saved_model
    stock = {"model": {k: torch.zeros_like(v) for k, v in back.state_dict().items()}}
    dcp_load(stock, storage_reader=FileSystemReader(str(tmp_path / "step1" / "model_and_optim")), no_dist=True)
    assert all(torch.equal(stock["model"][k], v) for k, v in back.state_dict().items())


def test_an_fsdp2_state_on_a_cuda_mesh_round_trips(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process; this test makes its own NCCL one")
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))

        def sharded(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
            torch.manual_seed(seed)
            model = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 8)).cuda()
            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            return model, torch.optim.AdamW(model.parameters(), lr=0.01)

        model, opt = sharded(0)
        model(torch.randn(4, 32, device="cuda")).sum().backward()
        opt.step()
        want = state_digest(model, opt)
        ckpt = Checkpointer()
        ckpt.save(str(tmp_path), 1, TrainingState(model, opt))
        _, future = ckpt.save_async(str(tmp_path), 2, TrainingState(model, opt))
        future.result()
        caplog.set_level(logging.INFO, logger="ckptkeeper.metrics")
        for step in (1, 2):
            other, other_opt = sharded(step + 10)
            ckpt.load(str(tmp_path / f"step{step}"), TrainingState(other, other_opt))
            assert state_digest(other, other_opt) == want
            assert all(p.to_local().device.type == "cuda" for p in other.parameters())  # type: ignore[attr-defined]
        # At one rank each shard is the whole tensor: read by the single-process reader through a
        # host copy (the per-rank reader with CUDA shards serves several ranks, which one GPU cannot).
        assert load_readers(caplog.records) == ["fast", "fast"]
        ckpt.close()
    finally:
        dist.destroy_process_group()
