"""Data-parallel training strategies for PyTorch Lightning's Trainer and Fabric.

Importing the package imports Lightning and registers the strategy names with it (Trainer and Fabric), as Lightning's
own strategies register theirs; importing it again or reloading it registers them again, replacing this package's
entries. The other public names are imported on first use.

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
        GradientBuckets as GradientBuckets,
        assign_buckets as assign_buckets,
    )
    from lightning_dp_strategies.comm import (
        CommCounter as CommCounter,
        reference_all_reduce as reference_all_reduce,
        ring_all_reduce as ring_all_reduce,
    )
    from lightning_dp_strategies.comm.probe import (
        probe_link as probe_link,
    )
    from lightning_dp_strategies.core.checkpoint_files import (
        latest_checkpoint as latest_checkpoint,
    )
    from lightning_dp_strategies.core.checkpoint_io import (
        AtomicCheckpointIO as AtomicCheckpointIO,
    )
    from lightning_dp_strategies.core.fault_tolerance import (
        FaultTolerance as FaultTolerance,
    )
    from lightning_dp_strategies.core.options import (
        BucketedConfig as BucketedConfig,
    )
    from lightning_dp_strategies.data_parallel import (
        gather as gather,
        parallel_apply as parallel_apply,
        replicate as replicate,
        scatter as scatter,
    )
    from lightning_dp_strategies.fabric import (
        FabricLocalSGDStrategy as FabricLocalSGDStrategy,
        FabricRingAllReduceStrategy as FabricRingAllReduceStrategy,
        FabricScatterGatherStrategy as FabricScatterGatherStrategy,
    )
    from lightning_dp_strategies.local_sgd import (
        diloco_outer_optimizer as diloco_outer_optimizer,
    )
    from lightning_dp_strategies.plan import (
        Link as Link,
        Prediction as Prediction,
        Reduction as Reduction,
        Topology as Topology,
        Workload as Workload,
        measure_compute as measure_compute,
        predict as predict,
    )
    from lightning_dp_strategies.reducers import (
        REDUCERS as REDUCERS,
        AutoReducer as AutoReducer,
        CastCompression as CastCompression,
        GradBucket as GradBucket,
        NativeReducer as NativeReducer,
        PerTensorReducer as PerTensorReducer,
        PowerSGD as PowerSGD,
        Reducer as Reducer,
        ReducerBase as ReducerBase,
        ReducerWrapper as ReducerWrapper,
        RingReducer as RingReducer,
        bf16_compress as bf16_compress,
        calibrate_cpu as calibrate_cpu,
        fp16_compress as fp16_compress,
        resolve_reducer as resolve_reducer,
    )
    from lightning_dp_strategies.strategies import (
        BucketedDataParallel as BucketedDataParallel,
        HybridPipelineStrategy as HybridPipelineStrategy,
        LocalSGDStrategy as LocalSGDStrategy,
        RingAllReduceStrategy as RingAllReduceStrategy,
        ScatterGatherStrategy as ScatterGatherStrategy,
    )


register_all = _imports.register_all


def __getattr__(name: str) -> Any:
    if name == "__all__":  # `from lightning_dp_strategies import *`: the public names and every strategy class
        return sorted([*_imports.PUBLIC, "register_all", *(c.__name__ for c in _imports._strategy_classes())])
    return _imports.public_name(name)


register_all()
