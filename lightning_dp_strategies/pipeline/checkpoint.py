"""The whole model's checkpoint from the stages' parts, and each stage's part of a whole-model checkpoint.

A stage holds the state of its own blocks, and the last stage also the state outside the body
(:meth:`Layout.owns`). For a save, the stages of replica 0 describe their parts to global rank 0 (shapes, no data);
rank 0 builds the whole model's state in its own key and parameter order, with meta-device stand-ins for the other
stages' tensors, which :func:`~lightning_dp_strategies.pipeline.streamed.write_streamed` fills in one tensor at a
time as the file is written. The result is what one device would save, so it loads under any strategy. Loading
takes from such a checkpoint what this rank holds. The save functions are collectives over every rank (the default
group, which outlives the strategy's own groups, so saving after ``fit`` works); the load functions over the
pipeline group.
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
    keep_owned_parameters,
    merge_optimizer_states,
    name_optimizer_state,
    select_optimizer_state,
)
from lightning_dp_strategies.pipeline.streamed import Inbox, Outbox

__all__ = [
    "all_gather_stages",
    "load_stage_optimizer_state",
    "load_stage_state",
    "param_group_names",
    "stage_state",
    "whole_model_state",
    "whole_optimizer_state",
]


def _describe_to_rank_zero(local: Any, layout: Layout, outbox: Outbox, inbox: Inbox) -> list[Any] | None:
    """Per stage of replica 0, its ``local`` on global rank 0 (stage 0's as it is, the others' as stand-ins filled in
    when the checkpoint is written); ``None`` on every other rank. A collective over every rank."""
    sends = layout.replica == 0 and layout.stage != 0
    described = outbox.describe(local) if sends else None
    rank = dist.get_rank()
    out: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(described, out, dst=0)
    if out is None:
        return None
    return [local, *(inbox.adopt(out[s * layout.replicas], s * layout.replicas) for s in range(1, layout.stages))]


def all_gather_stages(local: Any, layout: Layout) -> list[Any]:
    """``local`` of every stage of this replica, on every stage."""
    out: list[Any] = [None] * layout.stages
    dist.all_gather_object(out, local, group=layout.pipeline_group)
    return out


def stage_state(module: nn.Module, layout: Layout) -> dict[str, Tensor]:
    """The entries of ``module.state_dict()`` this stage owns (detached, on their device)."""
    return {k: v.detach() for k, v in module.state_dict().items() if layout.owns(k)}


def _on_cpu(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _on_cpu(v) for k, v in obj.items()}
    return obj.cpu() if isinstance(obj, Tensor) else obj


def whole_model_state(module: nn.Module, layout: Layout, outbox: Outbox, inbox: Inbox) -> dict[str, Any]:
    """The whole model's ``state_dict`` in its own key order on global rank 0 (the other stages' tensors as stand-ins
    in ``inbox``), this stage's own entries elsewhere (those of replica 0 queued in ``outbox``)."""
    local = stage_state(module, layout)
    parts = _describe_to_rank_zero(local, layout, outbox, inbox)
    if parts is None:
        return local
    merged = {k: v for part in parts for k, v in part.items()}
    merged.update(_on_cpu(local))
    return OrderedDict((k, merged[k]) for k in layout.full_keys if k in merged)


def param_group_names(optimizer: Optimizer, module: nn.Module) -> list[list[str]]:
    """Per parameter group of ``optimizer``, the names in ``module`` of its parameters."""
    names = {id(p): n for n, p in module.named_parameters()}
    return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def whole_optimizer_state(
    optimizer: Optimizer, module: nn.Module, layout: Layout, outbox: Outbox, inbox: Inbox
) -> tuple[dict[str, Any], list[list[str]]] | None:
    """The optimizer state of the whole model on global rank 0, numbered as one optimizer over the module would be
    (the other stages' tensors as stand-ins in ``inbox``), and per parameter group the names of its parameters in
    that numbering's order; ``None`` elsewhere."""
    owned = {n for n, _ in module.named_parameters() if layout.owns(n)}
    named = name_optimizer_state(optimizer.state_dict(), param_group_names(optimizer, module), owned)
    parts = _describe_to_rank_zero(named, layout, outbox, inbox)
    if parts is None:
        return None
    parts[0] = {**named, "state": _on_cpu(named["state"])}
    names = full_group_names([[g["params"] for g in part["param_groups"]] for part in parts], layout.param_order)
    return merge_optimizer_states(parts, layout.param_order), names


def load_stage_state(
    module: nn.Module, layout: Layout | None, state: Mapping[str, Any], strict: bool = True
) -> dict[str, Any]:
    """Load the entries of a whole-model ``state_dict`` that this rank holds: every tensor of ``module`` that is not
    on the meta device (its stage's blocks, the submodules outside the body, the blocks a finetuning run keeps).
    ``strict`` checks the keys against the whole model (``layout``'s, or ``module``'s own where there is no layout).

    Returns:
        The entries left out, whose tensors are on the meta device here (another stage's blocks, or blocks not yet
        allocated).

    Examples:
        >>> import torch
        >>> with torch.device("meta"):
        ...     elsewhere = nn.Linear(2, 2)
        >>> held = nn.Sequential(nn.Linear(2, 2, bias=False), elsewhere)
        >>> left = load_stage_state(held, None, {"0.weight": torch.ones(2, 2), "1.weight": torch.ones(2, 2),
        ...                                      "1.bias": torch.ones(2)})
        >>> held[0].weight.sum().item(), held[1].weight.is_meta, sorted(left)
        (4.0, True, ['1.bias', '1.weight'])
    """
    current = module.state_dict(keep_vars=True)
    if strict:
        keys = layout.full_keys if layout is not None else list(current)
        missing = sorted(k for k in keys if k not in state)
        unexpected = sorted(k for k in state if k not in set(keys))
        if missing or unexpected:
            raise RuntimeError(
                f"The checkpoint does not match {type(module).__name__}: missing keys {missing}, unexpected keys "
                f"{unexpected}. Pass `strict=False` to load what matches."
            )
    held = {k: v for k, v in state.items() if k in current and not current[k].is_meta}
    module.load_state_dict(held, strict=False)
    return {k: v for k, v in state.items() if k in current and current[k].is_meta}


def load_stage_optimizer_state(
    optimizer: Optimizer, module: nn.Module, layout: Layout, full: Mapping[str, Any]
) -> None:
    """Load into this stage's ``optimizer`` its part of a whole-model optimizer state (collective). Its groups are
    first cut to this stage's parameters, which a callback that sets whole-model groups before the load (Lightning's
    ``BaseFinetuning`` when a fit resumes) leaves to do."""
    owned = {n for n, _ in module.named_parameters() if layout.owns(n)}
    keep_owned_parameters(optimizer, {id(p) for n, p in module.named_parameters() if n in owned})
    local_names = param_group_names(optimizer, module)
    owned_names = [[n for n in group if n in owned] for group in local_names]
    full_names = full_group_names(all_gather_stages(owned_names, layout), layout.param_order)
    optimizer.load_state_dict(select_optimizer_state(full, full_names, local_names))
