"""Data-parallel training strategies for PyTorch Lightning; importing the package registers their names.

>>> import lightning_dp_strategies
>>> from lightning.pytorch.strategies import StrategyRegistry
>>> "ring_allreduce" in StrategyRegistry and "dp" in StrategyRegistry
True
"""

from lightning_dp_strategies.bucketing import (
    CommStats,
    GradientBuckets,
    GradReducer,
    RingReducer,
    assign_buckets,
    ring_reducer,
)
from lightning_dp_strategies.comm import CommCounter, reference_all_reduce, ring_all_reduce
from lightning_dp_strategies.data_parallel import gather, parallel_apply, replicate, scatter
from lightning_dp_strategies.strategies import (
    HybridPipelineStrategy,
    RingAllReduceStrategy,
    ScatterGatherStrategy,
    register_all,
)

__version__ = "0.1.0"

__all__ = [
    "CommCounter",
    "CommStats",
    "GradReducer",
    "GradientBuckets",
    "HybridPipelineStrategy",
    "RingAllReduceStrategy",
    "RingReducer",
    "ScatterGatherStrategy",
    "assign_buckets",
    "gather",
    "parallel_apply",
    "reference_all_reduce",
    "register_all",
    "replicate",
    "ring_all_reduce",
    "ring_reducer",
    "scatter",
]

register_all()
