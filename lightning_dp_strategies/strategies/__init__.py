"""Lightning ``Strategy`` subclasses; the only package modules (with the comparison command) that import Lightning."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_dp_strategies.strategies.bucketed import BucketedConfig, BucketedDataParallel
from lightning_dp_strategies.strategies.checkpoint_io import AtomicCheckpointIO
from lightning_dp_strategies.strategies.hybrid_pipeline import HybridPipelineStrategy
from lightning_dp_strategies.strategies.ring_allreduce import RingAllReduceStrategy
from lightning_dp_strategies.strategies.scatter_gather import ScatterGatherStrategy

__all__ = [
    "AtomicCheckpointIO",
    "BucketedConfig",
    "BucketedDataParallel",
    "HybridPipelineStrategy",
    "RingAllReduceStrategy",
    "ScatterGatherStrategy",
    "register_all",
]


def register_all() -> None:
    """Register every strategy name of this package with Lightning's registries, the Trainer's ``StrategyRegistry``
    and Fabric's ``STRATEGY_REGISTRY`` (safe to call twice).

    Examples:
        >>> register_all()  # importing lightning_dp_strategies already did; a second call changes nothing
        >>> "ring_allreduce" in StrategyRegistry and "dp" in StrategyRegistry
        True
        >>> from lightning.fabric.strategies import STRATEGY_REGISTRY
        >>> "ring_allreduce" in STRATEGY_REGISTRY and "scatter_gather" in STRATEGY_REGISTRY
        True
    """
    # imported here: the Fabric strategies build on this package's modules, which must not import them back
    from lightning_dp_strategies.fabric import register_fabric_strategies

    for strategy in (HybridPipelineStrategy, RingAllReduceStrategy, ScatterGatherStrategy):
        strategy.register_strategies(StrategyRegistry)
    register_fabric_strategies()
