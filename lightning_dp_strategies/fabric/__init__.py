"""The package's data-parallel strategies for Lightning Fabric, on the machinery the Trainer strategies use.

======================  ==================================  =====================================================
``Fabric(strategy=)``   class                               what it does
======================  ==================================  =====================================================
``"ring_allreduce"``    :class:`FabricRingAllReduceStrategy`  one process per device, gradients averaged by the
(``_spawn``,                                                bucketed ring all-reduce in ``fabric.backward``
``_notebook``)
``"scatter_gather"``    :class:`FabricScatterGatherStrategy`  one process, every ``model(x)`` scattered across
                                                            the devices and gathered
``"local_sgd"``         :class:`FabricLocalSGDStrategy`       one process per device, local optimizer steps; the
                                                            parameter change averaged every ``sync_every`` steps
======================  ==================================  =====================================================

Importing :mod:`lightning_dp_strategies` registers the names (:func:`register_fabric_strategies`).

Examples:
    >>> import lightning as L
    >>> from lightning.fabric.strategies import STRATEGY_REGISTRY
    >>> "ring_allreduce_notebook" in STRATEGY_REGISTRY and "scatter_gather" in STRATEGY_REGISTRY
    True
    >>> STRATEGY_REGISTRY["ring_allreduce_spawn"]["init_params"]
    {'start_method': 'spawn'}
    >>> [cls.__name__ for cls in fabric_strategies()]
    ['FabricLocalSGDStrategy', 'FabricRingAllReduceStrategy', 'FabricScatterGatherStrategy']
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY, Strategy

from lightning_dp_strategies.core.registry import discovery
from lightning_dp_strategies.fabric.local_sgd import FabricLocalSGDStrategy
from lightning_dp_strategies.fabric.ring_allreduce import FabricRingAllReduceStrategy
from lightning_dp_strategies.fabric.scatter_gather import FabricScatterGatherStrategy

__all__ = [
    "FabricLocalSGDStrategy",
    "FabricRingAllReduceStrategy",
    "FabricScatterGatherStrategy",
    "fabric_strategies",
    "register_fabric_strategies",
]

# fabric_strategies() finds the classes in this package's modules that have a ``registered_name``;
# register_fabric_strategies() registers their names with Fabric's STRATEGY_REGISTRY (safe to call twice)
fabric_strategies, register_fabric_strategies = discovery(__name__, Strategy, STRATEGY_REGISTRY)
register_fabric_strategies()
