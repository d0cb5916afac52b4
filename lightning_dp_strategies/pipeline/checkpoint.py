"""The whole model's checkpoint from the stages' parts, and each stage's part of a whole-model checkpoint.

A stage holds the state of its own blocks, and the last stage also the state outside the body
(:meth:`Layout.owns`). Saving gathers the parts of replica 0 onto its first stage (global rank 0), which merges them
in the whole model's key and parameter order: the result is what one device would save, so it loads under any
strategy. Loading takes from such a checkpoint what this stage holds. The functions are collectives over the
pipeline group: every stage of a replica calls the same one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_dp_strategies.pipeline.layout import Layout
from lightning_dp_strategies.pipeline.state import (
    full_group_names,
    merge_optimizer_states,
    name_optimizer_state,
    select_optimizer_state,
)

__all__ = [
    "all_gather_stages",
    "gather_to_first_stage",
    "load_stage_optimizer_state",
    "load_stage_state",
    "param_group_names",
    "stage_state",
    "whole_model_state",
    "whole_optimizer_state",
]


def gather_to_first_stage(local: Any, layout: Layout) -> list[Any] | None:
    """``local`` of every stage of replica 0, on its first stage; ``None`` on every other rank."""
    if layout.replica != 0:
        return None
    out: list[Any] | None = [None] * layout.stages if layout.stage == 0 else None
    dist.gather_object(local, out, group=layout.pipeline_group, group_dst=0)
    return out


def all_gather_stages(local: Any, layout: Layout) -> list[Any]:
    """``local`` of every stage of this replica, on every stage."""
    out: list[Any] = [None] * layout.stages
    dist.all_gather_object(out, local, group=layout.pipeline_group)
    return out


def stage_state(module: nn.Module, layout: Layout) -> dict[str, Tensor]:
    """The entries of ``module.state_dict()`` this stage owns, on the CPU."""
    return {k: v.detach().cpu() for k, v in module.state_dict().items() if layout.owns(k)}


def whole_model_state(module: nn.Module, layout: Layout) -> dict[str, Any] | None:
    """The whole model's ``state_dict`` in its own key order on global rank 0, ``None`` elsewhere."""
    parts = gather_to_first_stage(stage_state(module, layout), layout)
    if parts is None:
        return None
    merged = {k: v for part in parts for k, v in part.items()}
    return OrderedDict((k, merged[k]) for k in layout.full_keys if k in merged)


def param_group_names(optimizer: Optimizer, module: nn.Module) -> list[list[str]]:
    """Per parameter group of ``optimizer``, the names in ``module`` of its parameters."""
    names = {id(p): n for n, p in module.named_parameters()}
    return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def whole_optimizer_state(optimizer: Optimizer, module: nn.Module, layout: Layout) -> dict[str, Any] | None:
    """The optimizer state of the whole model on global rank 0, numbered as one optimizer over the module would be."""
    owned = {n for n, _ in module.named_parameters() if layout.owns(n)}
    named = name_optimizer_state(optimizer.state_dict(), param_group_names(optimizer, module), owned)
    parts = gather_to_first_stage(named, layout)
    return None if parts is None else merge_optimizer_states(parts, layout.param_order)


def load_stage_state(module: nn.Module, layout: Layout, state: Mapping[str, Any], strict: bool = True) -> None:
    """Load the entries of a whole-model ``state_dict`` that this stage owns; ``strict`` checks the keys against the
    whole model."""
    if strict:
        full = set(layout.full_keys)
        missing = sorted(k for k in layout.full_keys if k not in state)
        unexpected = sorted(k for k in state if k not in full)
        if missing or unexpected:
            raise RuntimeError(
                f"The checkpoint does not match {type(module).__name__}: missing keys {missing}, unexpected keys "
                f"{unexpected}. Pass `strict=False` to load what matches."
            )
    module.load_state_dict({k: v for k, v in state.items() if layout.owns(k)}, strict=False)


def load_stage_optimizer_state(
    optimizer: Optimizer, module: nn.Module, layout: Layout, full: Mapping[str, Any]
) -> None:
    """Load into this stage's ``optimizer`` its part of a whole-model optimizer state (collective)."""
    owned = {n for n, _ in module.named_parameters() if layout.owns(n)}
    local_names = param_group_names(optimizer, module)
    owned_names = [[n for n in group if n in owned] for group in local_names]
    full_names = full_group_names(all_gather_stages(owned_names, layout), layout.param_order)
    optimizer.load_state_dict(select_optimizer_state(full, full_names, local_names))
