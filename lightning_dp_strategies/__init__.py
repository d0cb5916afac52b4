"""Data-parallel training strategies for PyTorch Lightning's Trainer and Fabric.

Importing the package registers the strategy names with Lightning, at once when Lightning is imported already, else
as soon as it is. The public names are imported on first use, so ``import lightning_dp_strategies`` stays fast.

>>> import lightning_dp_strategies
>>> from lightning.pytorch.strategies import StrategyRegistry
>>> "ring_allreduce" in StrategyRegistry and "dp" in StrategyRegistry
True
>>> lightning_dp_strategies.RingAllReduceStrategy.registered_name
'ring_allreduce'
"""

from typing import TYPE_CHECKING, Any

from lightning_dp_strategies import _imports

__version__ = "0.1.0"

if TYPE_CHECKING:  # what type checkers see; at run time each name is imported on first use
    from lightning_dp_strategies.bucketing import (
        CommStats as CommStats,
    )
    from lightning_dp_strategies.bucketing import (
        GradientBuckets as GradientBuckets,
    )
    from lightning_dp_strategies.bucketing import (
        assign_buckets as assign_buckets,
    )
    from lightning_dp_strategies.comm import (
        CommCounter as CommCounter,
    )
    from lightning_dp_strategies.comm import (
        reference_all_reduce as reference_all_reduce,
    )
    from lightning_dp_strategies.comm import (
        ring_all_reduce as ring_all_reduce,
    )
    from lightning_dp_strategies.core.checkpoint_io import (
        AtomicCheckpointIO as AtomicCheckpointIO,
    )
    from lightning_dp_strategies.core.options import (
        BucketedConfig as BucketedConfig,
    )
    from lightning_dp_strategies.data_parallel import (
        gather as gather,
    )
    from lightning_dp_strategies.data_parallel import (
        parallel_apply as parallel_apply,
    )
    from lightning_dp_strategies.data_parallel import (
        replicate as replicate,
    )
    from lightning_dp_strategies.data_parallel import (
        scatter as scatter,
    )
    from lightning_dp_strategies.fabric import (
        FabricRingAllReduceStrategy as FabricRingAllReduceStrategy,
    )
    from lightning_dp_strategies.fabric import (
        FabricScatterGatherStrategy as FabricScatterGatherStrategy,
    )
    from lightning_dp_strategies.plan import (
        Link as Link,
    )
    from lightning_dp_strategies.plan import (
        Prediction as Prediction,
    )
    from lightning_dp_strategies.plan import (
        Workload as Workload,
    )
    from lightning_dp_strategies.plan import (
        predict as predict,
    )
    from lightning_dp_strategies.reducers import (
        REDUCERS as REDUCERS,
    )
    from lightning_dp_strategies.reducers import (
        CastCompression as CastCompression,
    )
    from lightning_dp_strategies.reducers import (
        GradBucket as GradBucket,
    )
    from lightning_dp_strategies.reducers import (
        NativeReducer as NativeReducer,
    )
    from lightning_dp_strategies.reducers import (
        PerTensorReducer as PerTensorReducer,
    )
    from lightning_dp_strategies.reducers import (
        PowerSGD as PowerSGD,
    )
    from lightning_dp_strategies.reducers import (
        Reducer as Reducer,
    )
    from lightning_dp_strategies.reducers import (
        RingReducer as RingReducer,
    )
    from lightning_dp_strategies.reducers import (
        bf16_compress as bf16_compress,
    )
    from lightning_dp_strategies.reducers import (
        fp16_compress as fp16_compress,
    )
    from lightning_dp_strategies.reducers import (
        resolve_reducer as resolve_reducer,
    )
    from lightning_dp_strategies.strategies import (
        BucketedDataParallel as BucketedDataParallel,
    )
    from lightning_dp_strategies.strategies import (
        HybridPipelineStrategy as HybridPipelineStrategy,
    )
    from lightning_dp_strategies.strategies import (
        RingAllReduceStrategy as RingAllReduceStrategy,
    )
    from lightning_dp_strategies.strategies import (
        ScatterGatherStrategy as ScatterGatherStrategy,
    )
    from lightning_dp_strategies.strategies import (
        register_all as register_all,
    )


def __getattr__(name: str) -> Any:
    if name == "__all__":  # `from lightning_dp_strategies import *`: the public names and every strategy class
        return sorted([*_imports.PUBLIC, *(cls.__name__ for cls in _imports._strategy_classes())])
    return _imports.public_name(name)


_imports.install()
