"""Optimizer state across stages: per-stage state dicts <-> the one state dict of the whole model.

Each stage's optimizer knows only its own parameters, numbered from 0. A single-device optimizer over the whole
model numbers them in the module's order, group by group. To save a checkpoint that loads anywhere, the stages'
states are keyed by parameter name (:func:`name_optimizer_state`), merged in the module's order
(:func:`merge_optimizer_states`), and split again on load (:func:`select_optimizer_state`).

The one assumption: each parameter group lists its parameters in the module's order, as ``self.parameters()`` and
filters of it (``[p for n, p in self.named_parameters() if ...]``) do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "full_group_names",
    "keep_owned_parameters",
    "merge_optimizer_states",
    "name_optimizer_state",
    "select_optimizer_state",
]

StateDict = dict[str, Any]


def name_optimizer_state(state: Mapping[str, Any], names: Sequence[Sequence[str]], owned: set[str]) -> StateDict:
    """Key a stage optimizer's ``state_dict()`` by parameter name, keeping only the parameters in ``owned``.

    Args:
        state: ``optimizer.state_dict()``.
        names: per parameter group, the names of its parameters in the group's order.
        owned: the names this stage is responsible for (others are saved by the stage that owns them).

    Examples:
        >>> s = {"state": {1: {"momentum_buffer": 5}}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]}
        >>> name_optimizer_state(s, [["a.w", "b.w"]], owned={"a.w", "b.w"})
        {'state': {'b.w': {'momentum_buffer': 5}}, 'param_groups': [{'lr': 0.1, 'params': ['a.w', 'b.w']}]}
    """
    groups = state["param_groups"]
    if len(groups) != len(names):
        raise ValueError(f"The optimizer has {len(groups)} parameter groups but {len(names)} lists of names.")
    index_to_name: dict[int, str] = {}
    for group, group_names in zip(groups, names, strict=True):
        index_to_name.update(zip(group["params"], group_names, strict=True))
    return {
        "state": {index_to_name[i]: s for i, s in state["state"].items() if index_to_name[i] in owned},
        "param_groups": [
            {
                **{k: v for k, v in g.items() if k not in ("params", "param_names")},
                "params": [index_to_name[i] for i in g["params"] if index_to_name[i] in owned],
            }
            for g in groups
        ],
    }


def full_group_names(per_stage: Sequence[Sequence[Sequence[str]]], order: Sequence[str]) -> list[list[str]]:
    """Per parameter group, the names of all stages together, in the module's ``order``.

    Examples:
        >>> full_group_names([[["l0.w"]], [["l1.w", "head"]]], order=["head", "l0.w", "l1.w"])
        [['head', 'l0.w', 'l1.w']]
    """
    counts = {len(groups) for groups in per_stage}
    if len(counts) != 1:
        raise ValueError(
            f"The stages' optimizers have different numbers of parameter groups ({sorted(counts)}): build the same "
            "groups on every stage in `configure_optimizers` (a group may hold no parameter of a stage)."
        )
    position = {name: i for i, name in enumerate(order)}
    merged = []
    for k in range(counts.pop()):
        names = {n for groups in per_stage for n in groups[k]}
        merged.append(sorted(names, key=lambda n: position.get(n, len(position))))
    return merged


def merge_optimizer_states(states: Sequence[Mapping[str, Any]], order: Sequence[str]) -> StateDict:
    """Merge the stages' named states (:func:`name_optimizer_state`) into one index-based state of the whole model.

    Hyperparameters of each group (``lr``, ...) come from the first stage. The result loads into a single-device
    optimizer built over the whole module.

    Examples:
        >>> s0 = {"state": {"l0.w": {"step": 1}}, "param_groups": [{"lr": 0.1, "params": ["l0.w"]}]}
        >>> s1 = {"state": {"l1.w": {"step": 1}}, "param_groups": [{"lr": 0.1, "params": ["l1.w"]}]}
        >>> merge_optimizer_states([s0, s1], order=["l0.w", "l1.w"])
        {'state': {0: {'step': 1}, 1: {'step': 1}}, 'param_groups': [{'lr': 0.1, 'params': [0, 1]}]}
    """
    names = full_group_names([[g["params"] for g in s["param_groups"]] for s in states], order)
    name_to_index: dict[str, int] = {}
    groups = []
    for k, group_names in enumerate(names):
        first = len(name_to_index)
        name_to_index.update({n: first + i for i, n in enumerate(group_names)})
        hyper = {key: v for key, v in states[0]["param_groups"][k].items() if key != "params"}
        groups.append({**hyper, "params": [name_to_index[n] for n in group_names]})
    merged: dict[int, Any] = {}
    for s in states:
        for name, value in s["state"].items():
            merged[name_to_index[name]] = value
    return {"state": dict(sorted(merged.items())), "param_groups": groups}


def select_optimizer_state(
    full: Mapping[str, Any], full_names: Sequence[Sequence[str]], local_names: Sequence[Sequence[str]]
) -> StateDict:
    """The part of a whole-model optimizer state for one stage's optimizer, numbered as that optimizer expects.

    Args:
        full: an index-based state of the whole model (saved by :func:`merge_optimizer_states` or by a
            single-device run).
        full_names: per group, the names of the whole model's parameters (:func:`full_group_names`).
        local_names: per group, the names of this stage optimizer's parameters, in its order.

    Examples:
        >>> full = {"state": {0: {"step": 1}, 1: {"step": 2}}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]}
        >>> select_optimizer_state(full, [["l0.w", "l1.w"]], [["l1.w"]])
        {'state': {0: {'step': 2}}, 'param_groups': [{'lr': 0.1, 'params': [0]}]}
    """
    groups = full["param_groups"]
    if len(groups) != len(full_names) or len(groups) != len(local_names):
        raise ValueError(
            f"The checkpoint's optimizer has {len(groups)} parameter groups but this model's has "
            f"{len(local_names)}: resume with the same `configure_optimizers`."
        )
    name_to_full: dict[str, int] = {}
    for k, (group, names) in enumerate(zip(groups, full_names, strict=True)):
        if len(group["params"]) != len(names):
            raise ValueError(
                f"Parameter group {k} of the checkpoint's optimizer holds {len(group['params'])} parameters but this "
                f"model's holds {len(names)}: the checkpoint belongs to another model or optimizer configuration."
            )
        name_to_full.update(zip(names, group["params"], strict=True))
    state: dict[int, Any] = {}
    local_groups = []
    index = 0
    for group, names in zip(groups, local_names, strict=True):
        ids = []
        for name in names:
            full_index = name_to_full.get(name)
            if full_index is None:
                raise ValueError(f"Parameter {name!r} is missing from the checkpoint's optimizer state.")
            if full_index in full["state"]:
                state[index] = full["state"][full_index]
            ids.append(index)
            index += 1
        hyper = {key: v for key, v in group.items() if key not in ("params", "param_names")}
        local_groups.append({**hyper, "params": ids})
    return {"state": state, "param_groups": local_groups}


def keep_owned_parameters(optimizer: Any, owned: set[int]) -> bool:
    """Keep in each parameter group of ``optimizer`` only the parameters whose ``id`` is in ``owned``, in place.

    The user's optimizer is built over the whole module, as on one device; each stage then keeps its own parameters.
    The groups and their options (learning rate, weight decay, ...) stay, a group may become empty, and an LR
    scheduler attached to the optimizer keeps working. Safe to call again after groups were added during training
    (``BaseFinetuning.unfreeze_and_add_param_group``); it refuses to drop a parameter that holds optimizer state.
    Returns whether it dropped anything.

    Examples:
        >>> import torch
        >>> a, b = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
        >>> opt = torch.optim.SGD([{"params": [a]}, {"params": [b], "lr": 0.5}], lr=0.1)
        >>> keep_owned_parameters(opt, {id(b)})
        True
        >>> [len(g["params"]) for g in opt.param_groups], opt.param_groups[1]["lr"]
        ([0, 1], 0.5)
    """
    dropped = False
    for group in optimizer.param_groups:
        kept = [p for p in group["params"] if id(p) in owned]
        if len(kept) == len(group["params"]):
            continue
        if any(id(p) not in owned and p in optimizer.state for p in group["params"]):
            raise RuntimeError("keep_owned_parameters would drop a parameter that holds optimizer state.")
        group["params"] = kept
        dropped = True
    if dropped and hasattr(optimizer, "_params"):  # LBFGS keeps its one group's list as well
        optimizer._params = optimizer.param_groups[0]["params"]
    return dropped
