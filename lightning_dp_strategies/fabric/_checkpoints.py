"""``fabric.save`` and ``fabric.load`` under sharded optimizer state: the whole state written, each rank's part read."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.utilities.types import _PATH
from torch.optim import Optimizer

from lightning_dp_strategies.core.engine import BucketedEngine
from lightning_dp_strategies.sharding import OptimizerSharding

__all__ = ["load_sharded", "save_sharded"]


class _LoadsShards:
    """Stands in for a sharded optimizer in ``fabric.load``: loading gives it this rank's pieces of the whole state."""

    def __init__(self, sharding: OptimizerSharding, optimizer: Optimizer) -> None:
        self.sharding, self.optimizer = sharding, optimizer

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.sharding.load(self.optimizer, state_dict)


def save_sharded(
    strategy: DDPStrategy,
    engine: BucketedEngine,
    path: _PATH,
    state: dict[str, Any],
    storage_options: Any | None,
    filter: dict[str, Callable[[str, Any], bool]] | None,
) -> None:
    """Rank 0 writes ``state`` while every rank sends its pieces of the optimizer state, one tensor at a time."""
    engine.sharding.begin_save()
    converted = strategy._convert_stateful_objects_in_state(state, filter=(filter or {}))
    nccl = strategy._process_group_backend == "nccl"
    device = strategy.root_device if nccl else torch.device("cpu")

    def save_whole(whole: dict[str, Any]) -> None:
        strategy.checkpoint_io.save_checkpoint(checkpoint=whole, path=path, storage_options=storage_options)

    io, writer = strategy.checkpoint_io, strategy.is_global_zero
    engine.save_sharded(converted, path, io, writer, device, save_whole, storage_options)


def load_sharded(
    engine: BucketedEngine, state: dict[str, Any], load: Callable[[dict[str, Any]], dict[str, Any]]
) -> dict[str, Any]:
    """``load(state)`` with each optimizer of ``state`` standing in as a loader of this rank's pieces; what the file
    holds beyond ``state`` is returned, as ``fabric.load`` returns it."""
    proxy = {
        name: _LoadsShards(engine.sharding, getattr(obj, "optimizer", obj)) if isinstance(obj, Optimizer) else obj
        for name, obj in state.items()
    }
    remaining = load(proxy)
    for name, value in proxy.items():
        if not isinstance(value, _LoadsShards):
            state[name] = value
    return remaining
