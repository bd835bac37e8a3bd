"""Write ``tests/data/olmo_core/``: a save folder made by the real OLMo-core 3.0.0 checkpointer.

The folder is committed; this script documents how it was made and makes it again. It needs
``ai2-olmo-core`` (not a dependency of ckptkeeper, and never installed into the project's
environment), so it was run against a throwaway install:

    .venv/bin/python -m pip install --target /tmp/olmo_site --no-deps \\
        ai2-olmo-core==3.0.0 cached-path huggingface_hub httpx2 dataclass-extensions bettermap dill safetensors
    PYTHONPATH=/tmp/olmo_site .venv/bin/python tests/data/make_olmo_core_folder.py

(the extra packages are the ones ``olmo_core.train`` imports that the project's environment lacks:
cached-path 1.8.10, huggingface_hub 2.4.0, httpx2 2.16.2, dataclass-extensions 0.5.0,
bettermap 1.3.1, dill 0.4.1, safetensors 0.8.0; torch 2.13.0 and numpy come from the venv).

What it does, single process, no process group (OLMo-core's checkpointer needs none there): a
``nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))`` with AdamW, seed 0, takes one
step and is saved with ``olmo_core.train.checkpoint.Checkpointer.save`` as ``step1`` (permanent),
then one more step and saved as ``step2`` (ephemeral). The train module is OLMo-core's own
``BasicTrainModule``; ``step1`` uses its state dict as shipped (unflattened optimizer state:
``optim.state.<param>.<slot>`` plus ``optim.param_groups.0.*``), ``step2`` the options
``TransformerTrainModule`` saves with (``flatten_optimizer_state_dict=True``: the same
``optim.state.<param>.<slot>`` tensors, ``optim.param_groups.<param>.*``). The trainer state is
what ``olmo_core.train.Trainer.state_dict()`` returns for such a run (global step, tokens seen,
epoch, world size, OLMo-core's ``EnvRngStates``, callbacks).

The save folder goes to ``tests/data/olmo_core/run/``; beside it, ``expected.json`` holds: for each
checkpoint its step, ephemeral flag, the sha256 / dtype / shape of every saved tensor by DCP key,
and the trainer state's global step.

The files are written under ``/tmp/olmo_core_fixture/run`` first (OLMo-core records that path in
its DCP metadata), then copied to ``tests/data/olmo_core/run/``.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint.state_dict as dist_cp_sd
from olmo_core.distributed.utils import get_world_size
from olmo_core.train.checkpoint import Checkpointer
from olmo_core.train.train_module import BasicTrainModule
from olmo_core.train.utils import EnvRngStates
from olmo_core.version import VERSION
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "olmo_core")
WORK = "/tmp/olmo_core_fixture"


class FlatOptimTrainModule(BasicTrainModule):
    """BasicTrainModule saving with TransformerTrainModule's default save options."""

    def state_dict(self, *, optim: bool | None = None) -> dict[str, Any]:
        opts = dist_cp_sd.StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=True)
        sd: dict[str, Any] = {"model": dist_cp_sd.get_model_state_dict(self.model, options=opts)}
        if optim is not False:
            sd["optim"] = dist_cp_sd.get_optimizer_state_dict(self.model, self.optim, options=opts)
        return sd


def flat_tensors(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Tensor leaves by the dotted key DCP stores them under."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(flat_tensors(v, f"{prefix}{k}."))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(flat_tensors(v, f"{prefix}{i}."))
    elif isinstance(tree, torch.Tensor):
        out[prefix[:-1]] = tree
    return out


def digest(t: torch.Tensor) -> dict[str, Any]:
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return {
        "dtype": str(t.dtype).removeprefix("torch."),
        "shape": list(t.shape),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


def trainer_state(step: int, tokens: int) -> dict[str, Any]:
    # The keys olmo_core.train.Trainer.state_dict() returns.
    return {
        "global_step": step,
        "global_train_tokens_seen": tokens,
        "global_train_petaflops": 0.0,
        "max_steps": 2,
        "data_loader": {"dataset_type": "fsl", "tokens_processed": tokens, "epoch": 1},
        "epoch": 1,
        "world_size": get_world_size(),
        "rng": EnvRngStates.current_state().as_dict(),
        "callbacks": {},
    }


def main() -> None:
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(16, 4), torch.randn(16, 3)

    shutil.rmtree(WORK, ignore_errors=True)
    run = os.path.join(WORK, "run")
    checkpointer = Checkpointer(work_dir=os.path.join(WORK, "work"))
    expected: dict[str, Any] = {"olmo_core_version": VERSION, "torch_version": torch.__version__, "checkpoints": {}}
    for step, module_cls, ephemeral in ((1, BasicTrainModule, False), (2, FlatOptimTrainModule, True)):
        optim.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optim.step()
        module = module_cls(model, optim, rank_microbatch_size=16)
        train_state = trainer_state(step, 16 * step)
        path = os.path.join(run, f"step{step}")
        checkpointer.save(path, module, train_state, ephemeral=ephemeral)
        saved = flat_tensors(module.state_dict_to_save())
        expected["checkpoints"][f"step{step}"] = {
            "step": step,
            "ephemeral": ephemeral,
            "global_step": train_state["global_step"],
            "tensors": {k: digest(v) for k, v in sorted(saved.items())},
        }

    shutil.rmtree(OUT, ignore_errors=True)
    shutil.copytree(run, os.path.join(OUT, "run"))
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
        f.write("\n")
    total = sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(OUT) for n in ns)
    print(f"wrote {OUT} ({total} bytes)")


if __name__ == "__main__":
    main()
