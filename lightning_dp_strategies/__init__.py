"""Data-parallel training strategies for PyTorch Lightning; importing the package registers their names.

>>> import lightning_dp_strategies
>>> from lightning.pytorch.strategies import StrategyRegistry
>>> "ring_allreduce" in StrategyRegistry
True
"""

from lightning_dp_strategies.bucketing import CommStats, GradientBuckets, GradReducer, assign_buckets, ring_reducer
from lightning_dp_strategies.comm import CommCounter, reference_all_reduce, ring_all_reduce
from lightning_dp_strategies.strategies import RingAllReduceStrategy, register_all

__version__ = "0.1.0"

__all__ = [
    "CommCounter",
    "CommStats",
    "GradReducer",
    "GradientBuckets",
    "RingAllReduceStrategy",
    "assign_buckets",
    "reference_all_reduce",
    "register_all",
    "ring_all_reduce",
    "ring_reducer",
]

register_all()
