"""FabricScatterGatherStrategy: one process, logical CPU replicas; gradients equal to one device's (1e-6, fp32)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dp_strategies import FabricScatterGatherStrategy

NUMERICS = pytest.mark.numerics

TOLERANCE = 1e-6  # the Trainer scatter/gather tests'


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def train(model: nn.Module, opt: torch.optim.Optimizer, backward: object, steps: int = 4) -> None:
    gen = torch.Generator().manual_seed(7)
    for _ in range(steps):
        x, y = torch.randn(10, 8, generator=gen), torch.randint(0, 3, (10,), generator=gen)  # 4 + 3 + 3 on 3 devices
        backward(F.cross_entropy(model(x), y))  # type: ignore[operator]
        opt.step()
        opt.zero_grad()


@NUMERICS
def test_scatter_gather_trains_like_one_device_with_an_uneven_split(tmp_path: Path) -> None:
    single = make_model()
    train(single, torch.optim.SGD(single.parameters(), lr=0.1, momentum=0.9), Tensor.backward)

    fabric = L.Fabric(strategy="scatter_gather", accelerator="cpu", devices=3)
    assert isinstance(fabric.strategy, FabricScatterGatherStrategy)
    model = make_model()
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    with fabric.no_backward_sync(model):  # one process: nothing to skip, and no warning
        pass
    train(model, opt, fabric.backward)

    stats = fabric.strategy.stats
    assert (stats.forward_calls, stats.replica_calls, stats.last_num_replicas) == (4, 12, 3)
    got, expected = dict(model.module.named_parameters()), dict(single.named_parameters())
    diff = max((got[n] - expected[n]).abs().max().item() for n in expected)
    assert diff <= TOLERANCE, diff
    assert max((got[n] - p).abs().max().item() for n, p in make_model().named_parameters()) > 1e-2

    fabric.save(tmp_path / "sg.ckpt", {"model": model, "optimizer": opt})
    assert sorted(torch.load(tmp_path / "sg.ckpt")["model"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    trained = {n: p.detach().clone() for n, p in got.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    fabric.load(tmp_path / "sg.ckpt", {"model": model, "optimizer": opt})
    assert all(torch.equal(p, trained[n]) for n, p in model.module.named_parameters())


class StepModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(x)

    def training_step(self, x: Tensor) -> Tensor:
        return self(x).sum()


def test_methods_redirected_through_forward_are_refused_and_bad_dim_fails_early() -> None:
    fabric = L.Fabric(strategy="scatter_gather", accelerator="cpu", devices=2)
    model = fabric.setup(StepModule())
    assert model(torch.ones(3, 4)).shape == (3, 1)
    with pytest.raises(TypeError, match="splits calls of the model itself"):
        model.training_step(torch.ones(3, 4))
    with pytest.raises(ValueError, match="`dim` must be a non-negative int"):
        FabricScatterGatherStrategy(dim=-1)
    with pytest.raises(ValueError, match="Unknown `nonfinite_grads`"):
        FabricScatterGatherStrategy(nonfinite_grads="maybe")  # type: ignore[arg-type]


def test_a_compiled_submodule_is_refused_at_setup() -> None:
    """Replicas cannot copy a torch.compile'd submodule (see ``check_replicable``): refused by ``fabric.setup``."""
    fabric = L.Fabric(strategy="scatter_gather", accelerator="cpu", devices=2)
    inner = make_model()
    inner[0] = torch.compile(inner[0])
    with pytest.raises(ValueError, match=r"submodule `0` is compiled with torch\.compile"):
        fabric.setup(inner)


def test_a_lazy_module_is_refused_at_setup_naming_the_fix() -> None:
    fabric = L.Fabric(strategy="scatter_gather", accelerator="cpu", devices=2)
    with pytest.raises(ValueError, match=r"`0\.weight`, `0\.bias` do not exist yet.*Run one forward on a sample batch"):
        fabric.setup(nn.Sequential(nn.LazyLinear(3)))
