"""Two strategies in a few lines each: a bf16-compressed ring, and buckets reduced by the backend's all-reduce."""
from lightning.pytorch.strategies import StrategyRegistry

from lightning_dp_strategies import NativeReducer, Reducer, RingAllReduceStrategy, bf16_compress


class BF16RingAllReduceStrategy(RingAllReduceStrategy):
    """Ring all-reduce on bf16 copies of the gradients: half the bytes, bf16 rounding."""

    def __init__(self, **kwargs):
        super().__init__(reducer=bf16_compress("ring"), **kwargs)


class NativeAllReduceStrategy(RingAllReduceStrategy):
    """The same buckets and overlap; each bucket goes to gloo's (or NCCL's) own all-reduce."""

    def configure_reducer(self) -> Reducer:
        return NativeReducer()


for name, cls in (("ring_allreduce_bf16", BF16RingAllReduceStrategy), ("native_allreduce", NativeAllReduceStrategy)):
    StrategyRegistry.register(name, cls, description=cls.__doc__, override=True)
    StrategyRegistry.register(f"{name}_notebook", cls, description=f"{cls.__doc__} (fork launcher, Jupyter)",
                              override=True, start_method="fork")
