"""Which rank holds which blocks' tensors: a stage holds its own blocks, the other blocks stay on the meta device.

At setup (:func:`share_units`) every rank tells the others which units (blocks, or other submodules) it holds with
storage; a rank that needs a unit it holds only on the meta device receives it from rank 0, or else from the lowest
rank that holds it. Units no rank holds are left to be initialized (deferred initialization). After a run
(:func:`return_to_rank_zero`) rank 0 receives the units the other stages trained, one tensor at a time, so that it
holds the whole model again. Sends and receives are point to point over the default group, in an order every rank
follows, one tensor in flight.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_dp_strategies.pipeline.materialize import has_meta

__all__ = ["Shared", "release", "return_to_rank_zero", "share_units", "unit_tensors"]

Unit = nn.Module | Sequence[Tensor]
"""A submodule (all its parameters and buffers), or a list of tensors (a module's own, outside any submodule)."""


def unit_tensors(unit: Unit) -> list[Tensor]:
    """The tensors of a unit, in an order every rank agrees on."""
    if isinstance(unit, nn.Module):
        return [*unit.parameters(), *unit.buffers()]
    return list(unit)


def _is_real(unit: Unit) -> bool:
    return not any(t.is_meta for t in unit_tensors(unit))


def _send(tensor: Tensor, dst: int, device: torch.device) -> None:
    data = tensor.detach().to(device).contiguous()
    dist.send(data.view(torch.uint8) if data.dtype == torch.bool else data, dst=dst)


def _receive_into(tensor: Tensor, src: int, device: torch.device) -> None:
    target = tensor.detach()
    if target.device == device and target.is_contiguous() and target.dtype != torch.bool:
        dist.recv(target, src=src)
        return
    buffer = torch.empty(target.shape, dtype=target.dtype, device=device)
    dist.recv(buffer.view(torch.uint8) if buffer.dtype == torch.bool else buffer, src=src)
    target.copy_(buffer)


def _allocate(unit: Unit, device: torch.device) -> None:
    if isinstance(unit, nn.Module) and has_meta(unit):
        unit.to_empty(device=device)


@dataclass(frozen=True)
class Shared:
    """What :func:`share_units` found."""

    nowhere: list[int]
    """Units no rank holds with storage: to be initialized by the ranks that need them."""
    whole_on_rank_zero: bool
    """Whether rank 0 held every unit with storage (then it gets the whole model back after the run)."""


def share_units(
    units: Sequence[Unit], needed_by: Sequence[set[int]], device: torch.device, comm_device: torch.device
) -> Shared:
    """Give each rank in ``needed_by[i]`` that holds unit ``i`` only on the meta device a copy, allocated on
    ``device``, from rank 0 if it holds the unit, else from the lowest rank that does. A collective over every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    table: list[list[bool] | None] = [None] * world
    dist.all_gather_object(table, [_is_real(unit) for unit in units])
    real = [row or [] for row in table]
    nowhere = []
    for i, unit in enumerate(units):
        holders = [r for r in range(world) if real[r][i]]
        if not holders:
            nowhere.append(i)
            continue
        src = holders[0]  # rank 0 when it holds the unit
        for dst in sorted(r for r in needed_by[i] if not real[r][i]):
            if rank == src:
                for tensor in unit_tensors(unit):
                    _send(tensor, dst, comm_device)
            elif rank == dst:
                _allocate(unit, device)
                for tensor in unit_tensors(unit):
                    _receive_into(tensor, src, comm_device)
    return Shared(nowhere=nowhere, whole_on_rank_zero=all(real[0]))


def release(units: Sequence[nn.Module]) -> None:
    """Move ``units`` to the meta device: their memory is freed, their shapes and parameter objects stay."""
    for unit in units:
        unit.to("meta")


def return_to_rank_zero(
    units: Sequence[Unit], owners: Sequence[int], device: torch.device, comm_device: torch.device
) -> None:
    """Rank 0 receives unit ``i`` from rank ``owners[i]`` (allocated on ``device`` if it holds it on the meta device),
    one tensor at a time; the owners send. A collective over rank 0 and the owners."""
    rank = dist.get_rank()
    for unit, owner in zip(units, owners, strict=True):
        if owner == 0:
            continue
        if rank == 0:
            _allocate(unit, device)
            for tensor in unit_tensors(unit):
                _receive_into(tensor, owner, comm_device)
        elif rank == owner:
            for tensor in unit_tensors(unit):
                _send(tensor, 0, comm_device)
