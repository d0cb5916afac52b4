"""The sharded optimizer state machine in one process: what a strategy calls around backward and the step."""

from __future__ import annotations

import torch
from torch import nn

from lightning_dp_strategies.bucketing import GradientBuckets
from lightning_dp_strategies.reducers import ScatterReducer
from lightning_dp_strategies.sharding import OptimizerSharding


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _backward(model: nn.Module, buckets: GradientBuckets, sharding: OptimizerSharding, x: torch.Tensor) -> None:
    sharding.before_backward()
    buckets.arm()
    model(x).pow(2).sum().backward()
    buckets.finish()
    sharding.after_backward()


def test_two_synchronised_backward_passes_before_a_step_add_up_as_in_plain_training() -> None:
    x1, x2 = torch.randn(3, 4), torch.randn(5, 4)
    plain = _model()
    reference = torch.optim.Adam(plain.parameters(), lr=0.1)
    for _ in range(2):  # two steps, each of two backward passes and zero_grad(set_to_none=False)
        plain(x1).pow(2).sum().backward()
        plain(x2).pow(2).sum().backward()
        reference.step()
        reference.zero_grad(set_to_none=False)

    model = _model()
    buckets = GradientBuckets(model.named_parameters(), reducer=ScatterReducer())
    sharding = OptimizerSharding()
    sharding.attach(buckets, group=None)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    sharding.bind(optimizer)
    for _ in range(2):
        _backward(model, buckets, sharding, x1)
        assert all(p.grad is None for p in model.parameters())  # the reduced gradient lives in the pieces
        _backward(model, buckets, sharding, x2)  # refills the buckets: the first pass's gradient must survive
        optimizer.step()
        sharding.after_step(optimizer)
        optimizer.zero_grad(set_to_none=False)  # zeroes the pieces' gradients in place
    buckets.close()
    for mine, theirs in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)
    assert sharding.state_numel() == 2 * sum(p.numel() for p in model.parameters())  # one rank: all of it


def test_pieces_are_named_after_their_parameters() -> None:
    model = _model()
    buckets = GradientBuckets(model.named_parameters(), reducer=ScatterReducer())
    sharding = OptimizerSharding()
    sharding.attach(buckets, group=None)
    names = [name for name, _ in sharding.named_pieces(model.named_parameters())]
    assert sorted(names) == ["0.bias[0:8]", "0.weight[0:32]", "2.bias[0:2]", "2.weight[0:16]"]
    buckets.close()
