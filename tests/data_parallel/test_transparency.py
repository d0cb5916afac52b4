"""scatter -> replicate -> parallel_apply -> gather gives the single-device gradients: the specification.

A loss on the gathered outputs gives the single-device gradients (max abs difference <= 1e-6, fp32) for any split,
even or not.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_dp_strategies.data_parallel import gather, parallel_apply, replicate, scatter, split_sizes

# numerically sensitive: CI runs this file again under other CPU kernel paths and thread counts
pytestmark = pytest.mark.numerics


TOLERANCE = 1e-6  # fp32 max absolute difference to single-device results (observed ~1e-8)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))


def data_parallel_outputs(net: nn.Module, x: Tensor, devices: int) -> list[Any]:
    targets = ["cpu"] * devices
    inputs = scatter(((x,), {}), targets)
    replicas = replicate(net, targets[: len(inputs)])
    return parallel_apply([r.forward for r in replicas], inputs, targets[: len(inputs)])


def max_grad_diff(net: nn.Module, expected: list[Tensor]) -> float:
    return max((p.grad - w).abs().max().item() for p, w in zip(net.parameters(), expected, strict=True))  # type: ignore[operator]


@pytest.mark.parametrize(("devices", "batch"), [(2, 7), (3, 10), (4, 11), (4, 3)])
def test_transparency_gradients_equal_single_device_for_uneven_splits(devices: int, batch: int) -> None:
    torch.manual_seed(devices)
    net = mlp()
    x, y = torch.randn(batch, 5), torch.randn(batch, 2)
    nn.functional.mse_loss(net(x), y).backward()
    expected = [p.grad.clone() for p in net.parameters()]  # type: ignore[union-attr]

    net.zero_grad()
    outputs = data_parallel_outputs(net, x, devices)
    assert len(outputs) == min(devices, batch)
    nn.functional.mse_loss(gather(outputs, "cpu"), y).backward()
    assert max_grad_diff(net, expected) <= TOLERANCE

    if len(set(split_sizes(batch, devices))) == 1:
        return
    # the classic mistake, averaging per-replica mean losses, is measurably wrong here, so the check above can fail
    net.zero_grad()
    targets = y.split(split_sizes(batch, devices))
    outputs = data_parallel_outputs(net, x, devices)
    torch.stack([nn.functional.mse_loss(o, t) for o, t in zip(outputs, targets, strict=True)]).mean().backward()
    assert max_grad_diff(net, expected) > 1e-4


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_cuda_transparency_two_gpus() -> None:
    torch.manual_seed(0)
    net = mlp().cuda(0)
    x, y = torch.randn(9, 5, device="cuda:0"), torch.randn(9, 2, device="cuda:0")
    nn.functional.mse_loss(net(x), y).backward()
    expected = [p.grad.clone() for p in net.parameters()]  # type: ignore[union-attr]
    net.zero_grad()
    targets = ["cuda:0", "cuda:1"]
    inputs = scatter(((x,), {}), targets)
    assert inputs[1][0][0].device == torch.device("cuda:1")
    outputs = parallel_apply([r.forward for r in replicate(net, targets)], inputs, targets)
    nn.functional.mse_loss(gather(outputs, "cuda:0"), y).backward()
    for got, want in zip(net.parameters(), expected, strict=True):
        assert (got.grad - want).abs().max().item() <= 1e-5  # type: ignore[operator]
