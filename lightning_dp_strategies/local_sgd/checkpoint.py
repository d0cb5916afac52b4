"""Local SGD in a checkpoint: every rank's own parameters and inner optimizer state gathered to one writer, and back."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch import nn

from lightning_dp_strategies.local_sgd.algorithm import LocalSGD

__all__ = ["gather_to_zero", "local_checkpoint_record", "merged_record", "rank_record", "restore_local_record"]


def gather_to_zero(obj: object, group: dist.ProcessGroup | None = None, dst: int = 0) -> list[Any] | None:
    """Every rank's ``obj`` of ``group`` (default: the world), in rank order, on global rank ``dst`` (``None`` on the
    others); ``[obj]`` on one process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [obj]
    gathered: list[Any] | None = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    dist.gather_object(obj, gathered, dst=dst, group=group)
    return gathered


def local_checkpoint_record(
    local: LocalSGD, module: nn.Module, optimizer_states: list[dict[str, Any]]
) -> dict[str, Any] | None:
    """The checkpoint's ``"local_sgd"`` entry on rank 0 (``None`` on the others); collective over the world, every
    rank calls it.

    It holds :meth:`LocalSGD.state_dict` and, per rank of the world, ``{"module": its module state (``None`` when the
    ranks are in sync), "optimizer": its inner optimizer states}`` (:func:`rank_record`).
    """
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    gathered = gather_to_zero({rank: rank_record(local, module, optimizer_states)})
    return None if gathered is None else merged_record(local, gathered, world)


def rank_record(local: LocalSGD, module: nn.Module, optimizer_states: list[dict[str, Any]]) -> dict[str, Any]:
    """One rank's part of the record: its module state (``None`` when the ranks are in sync) and its inner optimizer
    states."""
    own = None if local.in_sync else {k: v.detach().clone() for k, v in module.state_dict().items()}
    return {"module": own, "optimizer": optimizer_states}


def merged_record(local: LocalSGD, gathered: list[Mapping[int, Any]], world: int) -> dict[str, Any]:
    """The ``"local_sgd"`` entry from the gathered ``{rank: its part}`` maps: :meth:`LocalSGD.state_dict` and the
    part of every rank of the world (``None`` for a rank nobody held)."""
    held = {r: record for part in gathered for r, record in part.items()}
    return {**local.state_dict(), "ranks": [held.get(r) for r in range(world)]}


def restore_local_record(local: LocalSGD, module: nn.Module, record: dict[str, Any] | None, rank: int) -> None:
    """Resume from a checkpoint's ``"local_sgd"`` entry (after the averaged model was loaded into ``module``); without
    one (another strategy's checkpoint), the loaded model becomes the anchor."""
    if record is None:
        local.restart()
        return
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if len(record["ranks"]) != world:
        raise ValueError(
            f"This local SGD checkpoint was saved by {len(record['ranks'])} ranks, and {world} are resuming it: each "
            "rank resumes its own parameters and inner optimizer state. Resume with the same number of ranks, or "
            "load only its model (`Model.load_from_checkpoint(path)`: the averaged model) and start a new fit."
        )
    local.load_state_dict(record)
    own = record["ranks"][rank]["module"] if record["ranks"][rank] is not None else None
    if own is not None:
        module.load_state_dict(own)
