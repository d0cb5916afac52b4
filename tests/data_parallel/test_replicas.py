"""replicate: CPU replicas alias the root's parameters; only replica 0 shares (and updates) the root's buffers."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from lightning_dp_strategies.data_parallel import parallel_apply, replicate, scatter

# numerically sensitive: CI runs this file again under other CPU kernel paths and thread counts
pytestmark = pytest.mark.numerics


CPU3 = ["cpu"] * 3


class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(3, 3)
        self.again = self.block  # the same module twice
        self.norm = nn.BatchNorm1d(3)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(self.again(self.block(x)))


def test_cpu_replicas_share_parameters_and_only_replica_0_shares_buffers() -> None:
    net = Shared()
    replicas = replicate(net, CPU3)
    assert all(r is not net for r in replicas)
    for r in replicas:
        assert r.block is r.again  # shared submodules stay shared inside each replica
        # with grad enabled: autograd aliases of the root's parameters (the same memory), summed in replica order
        assert r.block.weight.data_ptr() == net.block.weight.data_ptr() and r.block.weight.grad_fn is not None
    with torch.no_grad():
        for r in replicate(net, CPU3):
            assert [id(p) for p in r.parameters()] == [id(p) for p in net.parameters()]
    assert replicas[0].norm.running_mean is net.norm.running_mean
    for r in replicas[1:]:
        assert r.norm.running_mean is not net.norm.running_mean
        assert torch.equal(r.norm.running_mean, net.norm.running_mean)


def test_batchnorm_keeps_the_first_replicas_running_statistics() -> None:
    torch.manual_seed(0)
    net, reference = Shared(), Shared()
    reference.load_state_dict(net.state_dict())
    x = torch.randn(10, 3) * 3 + 1
    replicas = replicate(net, CPU3)
    inputs = scatter(((x,), {}), CPU3)
    parallel_apply([r.forward for r in replicas], inputs, CPU3)
    reference(x[:4])  # the first chunk, alone
    # Tolerance, not bits: replica 0 ran with its share of the intra-op threads, the reference with all of them, and
    # a mean reduced over other threads may differ in the last place. Replica 1's chunk would be off by ~0.1-1.
    for name in ("running_mean", "running_var"):
        torch.testing.assert_close(getattr(net.norm, name), getattr(reference.norm, name), rtol=1e-6, atol=1e-6)
    assert net.norm.num_batches_tracked.item() == 1  # replicas 1 and 2 did not touch the root's buffers


def test_batchnorm_updates_of_other_replicas_are_private() -> None:
    net = Shared()
    replicas = replicate(net, CPU3)
    x = torch.randn(9, 3)
    parallel_apply([r.forward for r in replicas], scatter(((x,), {}), CPU3), CPU3)
    assert replicas[1].norm.num_batches_tracked.item() == 1 and replicas[2].norm.num_batches_tracked.item() == 1
    assert not torch.equal(replicas[1].norm.running_mean, net.norm.running_mean)


def test_a_compiled_submodule_is_refused_before_anything_is_copied() -> None:
    """A torch.compile'd submodule forwards attribute writes to the module it compiled: copying it for a replica
    would overwrite that module's parameters and submodules (here ``net[0]`` became a cycle). Refused first."""
    net = nn.Sequential(torch.compile(nn.Linear(3, 3)), nn.Linear(3, 3))
    before = {name: p for name, p in net.named_parameters()}
    for devices in (CPU3, ["cuda:0", "cuda:1"]):  # refused before any device is touched, CUDA as CPU
        with pytest.raises(ValueError, match=r"submodule `0` is compiled with torch\.compile.*ring_allreduce"):
            replicate(net, devices)
    assert {name: p for name, p in net.named_parameters()} == before
    assert net(torch.ones(2, 3)).shape == (2, 3)
