"""Collectives on ``torch.distributed`` point-to-point operations; knows nothing of Lightning."""

from lightning_dp_strategies.comm.ring import (
    CommCounter,
    ReduceOpLike,
    divide,
    divide_,
    is_average,
    new_duplex_group,
    reference_all_reduce,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
    ring_workspace_numel,
)

__all__ = [
    "CommCounter",
    "ReduceOpLike",
    "divide",
    "divide_",
    "is_average",
    "new_duplex_group",
    "reference_all_reduce",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_reduce_scatter",
    "ring_workspace_numel",
]
