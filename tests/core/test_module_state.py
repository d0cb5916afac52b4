"""Rank 0's parameters and buffers on every rank, except what the module asks torch DDP to leave alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dp_strategies.core.module_state import broadcast_module_buffers, sync_module_states
from tests.helpers.distributed import run_distributed


def _check_sync(rank: int, world_size: int) -> None:
    torch.manual_seed(rank)  # every rank starts from other weights
    module = nn.BatchNorm1d(3)
    with torch.no_grad():
        module.weight.fill_(rank + 1.0)
        module.bias.fill_(rank + 1.0)
        module.running_mean.fill_(rank + 1.0)
    module._ddp_params_and_buffers_to_ignore = ["bias"]  # type: ignore[assignment]  # torch DDP's convention
    sync_module_states(module)
    assert torch.equal(module.weight, torch.ones(3)) and torch.equal(module.running_mean, torch.ones(3))
    assert torch.equal(module.bias, torch.full((3,), rank + 1.0)), "an ignored parameter keeps this rank's value"
    module.running_var.fill_(rank + 5.0)
    broadcast_module_buffers(module)
    assert torch.equal(module.running_var, torch.full((3,), 5.0))


@pytest.mark.timeout(120)
def test_rank_zero_state_reaches_every_rank_except_what_the_module_ignores() -> None:
    run_distributed(_check_sync, 2)
