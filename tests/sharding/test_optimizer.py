"""The user's optimizer bound to this rank's pieces: what it steps, which optimizers are refused, and the whole state
cut to a rank's pieces and put back together at any world size."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_dp_strategies.sharding import ShardedParameters, ShardLayout, check_elementwise
from lightning_dp_strategies.sharding.checkpoint import local_state


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


def _layout(model: nn.Module, world: int) -> ShardLayout:
    return ShardLayout([list(model.parameters())], world)


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return torch.optim.AdamW([{"params": weights}, {"params": biases, "weight_decay": 0.0}], lr=0.1)


def _trained_state(model: nn.Module) -> dict[str, Any]:
    optimizer = _optimizer(model)
    for _ in range(2):
        model(torch.ones(5, 4)).pow(2).sum().backward()
        optimizer.step()
    return optimizer.state_dict()


def test_the_optimizer_steps_views_of_the_parameters_and_keeps_its_groups() -> None:
    model = _model()
    optimizer = _optimizer(model)
    shards = ShardedParameters(_layout(model, 2), rank=0)
    bound = shards.bind(optimizer)
    assert [len(g) for g in bound.groups] == [2, 2]
    assert optimizer.param_groups[1]["weight_decay"] == 0.0
    steps = [p for g in optimizer.param_groups for p in g["params"]]
    assert sum(p.numel() for p in steps) == 11  # 23 elements: rank 0 owns chunk 1, elements 12:23
    with torch.no_grad():
        for p in steps:
            p.fill_(7.0)  # writes reach the module's own parameters
    assert sum(int((p == 7.0).sum()) for p in model.parameters()) == sum(p.numel() for p in steps)


@pytest.mark.parametrize("loaded_by", [1, 2, 3, 4])
def test_a_whole_state_cut_for_every_rank_covers_it_exactly(loaded_by: int) -> None:
    model = _model()
    whole = _trained_state(model)
    rebuilt: dict[int, dict[str, torch.Tensor]] = {}
    for rank in range(loaded_by):
        optimizer = _optimizer(model)
        shards = ShardedParameters(_layout(model, loaded_by), rank)
        bound = shards.bind(optimizer)
        optimizer.load_state_dict(local_state(whole, shards, bound))
        numbering = [p for params in bound.groups for p in params]
        for piece_list in bound.pieces:
            for piece in piece_list:
                state = optimizer.state[shards.views[piece]]
                index = next(i for i, p in enumerate(numbering) if p is shards.layout.params[piece.param])
                entry = rebuilt.setdefault(index, {"exp_avg": torch.full((numbering[index].numel(),), float("nan"))})
                entry["exp_avg"][piece.start : piece.stop] = state["exp_avg"]
                assert state["step"] == whole["state"][index]["step"]
    for index, state in whole["state"].items():
        torch.testing.assert_close(rebuilt[index]["exp_avg"], state["exp_avg"].reshape(-1), rtol=0, atol=0)


def test_a_state_for_other_groups_is_refused() -> None:
    model = _model()
    whole = torch.optim.Adam(model.parameters()).state_dict()  # one group of 4, not two of 2
    optimizer = _optimizer(model)
    shards = ShardedParameters(_layout(model, 2), rank=0)
    with pytest.raises(ValueError, match="saved for another model or optimizer"):
        local_state(whole, shards, shards.bind(optimizer))


def test_optimizers_that_are_not_element_wise_are_refused_naming_the_fix() -> None:
    param = nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(TypeError, match="set `elementwise = True`"):
        check_elementwise(torch.optim.LBFGS([param]))
    with pytest.raises(TypeError, match="Adafactor"):
        check_elementwise(torch.optim.Adafactor([param]))

    class Declared(torch.optim.Optimizer):
        elementwise = True

    check_elementwise(Declared([param], {}))


def test_a_parameter_outside_the_module_and_one_added_later_are_refused() -> None:
    model = _model()
    stranger = nn.Parameter(torch.zeros(3))
    shards = ShardedParameters(_layout(model, 2), rank=0)
    with pytest.raises(ValueError, match="not a trainable parameter of the LightningModule"):
        shards.bind(torch.optim.SGD([*model.parameters(), stranger], lr=0.1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    shards.bind(optimizer)
    shards.check_bound()
    optimizer.add_param_group({"params": [stranger]})
    with pytest.raises(RuntimeError, match="would never be stepped"):
        shards.check_bound()


def test_a_parameter_whose_storage_is_replaced_is_refused() -> None:
    """``param.data = ...`` (Lightning's ModelPruning resets weights so) leaves the pieces, views of the old storage,
    stepped where the module no longer reads: the parameters silently stop training."""
    model = _model()
    shards = ShardedParameters(_layout(model, 2), rank=0)
    shards.bind(torch.optim.SGD(model.parameters(), lr=0.1))
    first = next(model.parameters())
    first.data.copy_(torch.ones_like(first))  # in place: still what the pieces view
    shards.check_bound()
    first.data = torch.zeros_like(first)
    with pytest.raises(RuntimeError, match=r"storage of 1 parameter\(s\).*was replaced.*param\.data\.copy_"):
        shards.check_bound()
