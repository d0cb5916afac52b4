"""Optimizer state across stages: two stages' optimizers <-> one single-device optimizer over the whole model."""

from __future__ import annotations

import torch
from torch import nn

from lightning_dp_strategies.pipeline import (
    full_group_names,
    merge_optimizer_states,
    name_optimizer_state,
    select_optimizer_state,
)


def trained(model: nn.Module, params: list[nn.Parameter], optimizer: torch.optim.Optimizer) -> None:
    for _ in range(2):
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def test_round_trip_through_a_single_device_optimizer() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    order = [n for n, _ in model.named_parameters()]
    # single device: one Adam with two groups (weights, biases), built from named_parameters in module order
    groups = [
        {"params": [p for n, p in model.named_parameters() if n.endswith("weight")], "lr": 0.1},
        {"params": [p for n, p in model.named_parameters() if n.endswith("bias")], "lr": 0.2},
    ]
    single = torch.optim.Adam(groups)
    trained(model, [], single)
    full = single.state_dict()

    # two stages: blocks {0} and {1, 2}; each stage builds the same groups over its own parameters
    stages = [["0."], ["1.", "2."]]
    names_per_stage = [
        [[n for n in order if n.endswith(kind) and n[:2] in prefixes] for kind in ("weight", "bias")]
        for prefixes in stages
    ]
    full_names = full_group_names(names_per_stage, order)
    assert full_names == [["0.weight", "1.weight", "2.weight"], ["0.bias", "1.bias", "2.bias"]]
    local_states = [select_optimizer_state(full, full_names, names) for names in names_per_stage]
    assert [len(g["params"]) for g in local_states[1]["param_groups"]] == [2, 2]
    assert local_states[1]["param_groups"][1]["lr"] == 0.2

    # the stages' states, merged back, are the single-device state
    named = [
        name_optimizer_state(state, names, owned={n for g in names for n in g})
        for state, names in zip(local_states, names_per_stage, strict=True)
    ]
    merged = merge_optimizer_states(named, order)
    assert merged["param_groups"] == full["param_groups"]
    assert merged["state"].keys() == full["state"].keys()
    for index, state in full["state"].items():
        for key, value in state.items():
            assert torch.equal(merged["state"][index][key], value)
    single.load_state_dict(merged)  # and loads


def test_a_parameter_owned_by_another_stage_is_saved_once() -> None:
    state = {"state": {0: {"m": 1}, 1: {"m": 2}}, "param_groups": [{"lr": 1, "params": [0, 1]}]}
    named = name_optimizer_state(state, [["body.0.w", "head.w"]], owned={"body.0.w"})
    assert named == {"state": {"body.0.w": {"m": 1}}, "param_groups": [{"lr": 1, "params": ["body.0.w"]}]}


def test_different_group_counts_name_the_fix() -> None:
    import pytest

    with pytest.raises(ValueError, match="build the same groups on every stage"):
        full_group_names([[["a"]], [["b"], ["c"]]], ["a", "b", "c"])
