"""Data-parallel training strategies for PyTorch Lightning's Trainer and Fabric; importing the package registers their
names.

>>> import lightning_dp_strategies
>>> from lightning.pytorch.strategies import StrategyRegistry
>>> "ring_allreduce" in StrategyRegistry and "dp" in StrategyRegistry
True
"""

from lightning_dp_strategies.bucketing import CommStats, GradientBuckets, assign_buckets
from lightning_dp_strategies.comm import CommCounter, reference_all_reduce, ring_all_reduce
from lightning_dp_strategies.compression import CastCompression, PowerSGD, bf16_compress, fp16_compress
from lightning_dp_strategies.data_parallel import gather, parallel_apply, replicate, scatter
from lightning_dp_strategies.fabric import FabricRingAllReduceStrategy, FabricScatterGatherStrategy
from lightning_dp_strategies.plan import Link, Prediction, Workload, predict
from lightning_dp_strategies.reducers import (
    REDUCERS,
    GradBucket,
    NativeReducer,
    PerTensorReducer,
    Reducer,
    RingReducer,
    resolve_reducer,
)
from lightning_dp_strategies.strategies import (
    AtomicCheckpointIO,
    BucketedConfig,
    BucketedDataParallel,
    HybridPipelineStrategy,
    RingAllReduceStrategy,
    ScatterGatherStrategy,
    register_all,
)

__version__ = "0.1.0"

__all__ = [
    "REDUCERS",
    "AtomicCheckpointIO",
    "BucketedConfig",
    "BucketedDataParallel",
    "CastCompression",
    "CommCounter",
    "CommStats",
    "FabricRingAllReduceStrategy",
    "FabricScatterGatherStrategy",
    "GradBucket",
    "GradientBuckets",
    "HybridPipelineStrategy",
    "Link",
    "NativeReducer",
    "PerTensorReducer",
    "PowerSGD",
    "Prediction",
    "Reducer",
    "RingAllReduceStrategy",
    "RingReducer",
    "ScatterGatherStrategy",
    "Workload",
    "assign_buckets",
    "bf16_compress",
    "fp16_compress",
    "gather",
    "parallel_apply",
    "predict",
    "reference_all_reduce",
    "register_all",
    "replicate",
    "resolve_reducer",
    "ring_all_reduce",
    "scatter",
]

register_all()
