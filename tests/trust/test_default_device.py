"""A process whose default device is not the CPU (``torch.set_default_device``, common where
models are built on a GPU or on the meta device) saves and loads checkpoints as any other: every
tensor blob names the CPU, as DCP's own writer's do, so stock DCP and every other process read them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from ckptkeeper import Checkpointer, TrainingState, state_digest

_CHILD = r"""
import sys, torch
from ckptkeeper import Checkpointer, TrainingState, state_digest
folder = sys.argv[1]
torch.manual_seed(0)
# Shapes no other test uses: a blob's bytes are worked out once per shape and dtype per process.
model = torch.nn.Sequential(torch.nn.Linear(13, 11), torch.nn.Linear(11, 17))
opt = torch.optim.AdamW(model.parameters(), lr=0.1)
model(torch.randn(2, 13)).sum().backward()
opt.step()
again = torch.nn.Sequential(torch.nn.Linear(13, 11), torch.nn.Linear(11, 17))
again_opt = torch.optim.AdamW(again.parameters(), lr=0.1)
torch.set_default_device("meta")  # what torch.empty makes from here on has no memory, nor a CPU
path = Checkpointer().save(folder, 1, TrainingState(model, opt)).path
Checkpointer().load(path, TrainingState(again, again_opt))
torch.set_default_device("cpu")
print(state_digest(model, opt), state_digest(again, again_opt))
print(state_digest(model))
"""


def test_a_process_whose_default_device_is_not_the_cpu_saves_checkpoints_any_process_reads(tmp_path: Path) -> None:
    # Found here: a blob's header was worked out from torch.empty on the default device. Under
    # torch.set_default_device("meta") every save failed ("failed locating file data/0"), and the
    # load of a good checkpoint called it corrupt; a "cuda" default would have written headers
    # naming a GPU, which a CPU-only machine (or stock DCP there) cannot load.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2] / "src"), *sys.path])}
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path)], env=env, capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, child.stderr[-2000:]
    saved, loaded, saved_model = child.stdout.split()
    assert saved == loaded  # model and optimizer, optimizer slots made by the load included
    # This process (default device: the CPU) and stock DCP read it alike.
    back = torch.nn.Sequential(torch.nn.Linear(13, 11), torch.nn.Linear(11, 17))
    Checkpointer().load(str(tmp_path / "step1"), TrainingState(back))
    assert state_digest(back) == saved_model
    stock = {"model": {k: torch.zeros_like(v) for k, v in back.state_dict().items()}}
    dcp_load(stock, storage_reader=FileSystemReader(str(tmp_path / "step1" / "model_and_optim")), no_dist=True)
    assert all(torch.equal(stock["model"][k], v) for k, v in back.state_dict().items())
