"""The small built-in model and synthetic data that ``ckptkeeper train`` and the demo use.

Small enough for a CPU run of a few hundred steps in seconds, yet with everything that makes
bit-exact resumption hard: dropout (torch RNG), a shuffling data loader (RNG at every epoch),
AdamW state, and several epochs per run. With several processes the model is sharded with
FSDP2 (``fully_shard``) and each rank reads its own slice of the data.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from .. import distributed as D

__all__ = ["BuiltinSetup", "build_builtin"]


@dataclass
class BuiltinSetup:
    """What a training run needs: model, optimizer, data loader and loss."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    data_loader: DataLoader[tuple[torch.Tensor, ...]]
    loss_fn: nn.Module


def _seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


def build_builtin(seed: int = 0, hidden: int = 64, samples: int = 512, batch_size: int = 32) -> BuiltinSetup:
    """Build the model and data deterministically from ``seed`` (also seeds the global RNGs).

    Every rank builds the same full model (same seed) before sharding; then each rank's RNG is
    reseeded with its rank, so dropout masks and shuffles differ between ranks.
    """
    _seed_all(seed)
    data_gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(samples, 16, generator=data_gen)
    w = torch.randn(16, 4, generator=data_gen)
    y = x @ w + 0.1 * torch.randn(samples, 4, generator=data_gen)
    model = nn.Sequential(
        nn.Linear(16, hidden), nn.GELU(), nn.Dropout(0.1), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, 4)
    )
    rank, world = D.get_rank(), D.get_world_size()
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        x, y = x[rank::world], y[rank::world]
        _seed_all(seed + 1000 * rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    loader = DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True)
    return BuiltinSetup(model, optimizer, loader, nn.MSELoss())
