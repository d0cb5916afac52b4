"""Lightning Trainer strategies; importing this package registers their names with the Trainer's
``StrategyRegistry``.

Each strategy is one module here (a subpackage for the hybrid pipeline) whose class says its own registered name
(``registered_name``), cost model (``cost_model``) and whether the comparison runs it by default (``compared_as``);
:func:`trainer_strategies` finds them, so nothing else lists them.

Examples:
    >>> [cls.__name__ for cls in trainer_strategies()]
    ['HybridPipelineStrategy', 'LocalSGDStrategy', 'RingAllReduceStrategy', 'ScatterGatherStrategy']
"""

from lightning.pytorch.strategies import Strategy, StrategyRegistry

from lightning_dp_strategies.core.checkpoint_io import AtomicCheckpointIO
from lightning_dp_strategies.core.options import BucketedConfig
from lightning_dp_strategies.core.registry import discovery
from lightning_dp_strategies.strategies.bucketed import BucketedDataParallel
from lightning_dp_strategies.strategies.hybrid_pipeline import HybridPipelineStrategy
from lightning_dp_strategies.strategies.local_sgd import LocalSGDStrategy
from lightning_dp_strategies.strategies.ring_allreduce import RingAllReduceStrategy
from lightning_dp_strategies.strategies.scatter_gather import ScatterGatherStrategy

__all__ = [
    "AtomicCheckpointIO",
    "BucketedConfig",
    "BucketedDataParallel",
    "HybridPipelineStrategy",
    "LocalSGDStrategy",
    "RingAllReduceStrategy",
    "ScatterGatherStrategy",
    "register_trainer_strategies",
    "trainer_strategies",
]

# trainer_strategies() finds the classes in this package's modules that have a ``registered_name``;
# register_trainer_strategies() registers their names with the Trainer's StrategyRegistry (safe to call twice)
trainer_strategies, register_trainer_strategies = discovery(__name__, Strategy, StrategyRegistry)
register_trainer_strategies()
