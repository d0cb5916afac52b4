"""A bf16-compressed ring all-reduce strategy: subclass, choose a reducer, register a name."""
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import StrategyRegistry

from lightning_dp_strategies import CommCounter, RingAllReduceStrategy, ring_all_reduce


def bf16_ring_reducer(buffer: torch.Tensor, group: dist.ProcessGroup | None, counter: CommCounter) -> None:
    compressed = buffer.div(dist.get_world_size(group)).to(torch.bfloat16)  # divide first: no overflow in the sum
    ring_all_reduce(compressed, "sum", group=group, counter=counter)
    buffer.copy_(compressed)


class BF16RingAllReduceStrategy(RingAllReduceStrategy):
    """Ring all-reduce on bf16 copies of the gradients: half the bytes, bf16 rounding."""

    def __init__(self, **kwargs):
        super().__init__(reducer=bf16_ring_reducer, **kwargs)


StrategyRegistry.register("ring_allreduce_bf16", BF16RingAllReduceStrategy, description=BF16RingAllReduceStrategy.__doc__,
                          override=True)
StrategyRegistry.register("ring_allreduce_bf16_notebook", BF16RingAllReduceStrategy, override=True,
                          description="bf16 ring all-reduce, fork launcher (Jupyter)", start_method="fork")
