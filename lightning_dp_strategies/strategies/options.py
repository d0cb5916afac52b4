"""The keyword options every multi-process Trainer strategy of the package takes besides its own, documented once."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import Precision

from lightning_dp_strategies.core.options import SharedOptions

__all__ = ["TRAINER_PLUGINS", "StrategyOptions"]


class StrategyOptions(SharedOptions, total=False):
    """What ``RingAllReduceStrategy``, ``LocalSGDStrategy``, ``HybridPipelineStrategy`` and a strategy of your own on
    ``BucketedDataParallel`` take by keyword besides their own options: Lightning's ``accelerator`` and
    ``precision_plugin`` (the Trainer fills them in) and the options of
    :class:`~lightning_dp_strategies.core.options.SharedOptions` (``nonfinite_grads``, ``timeout``,
    ``process_group_backend``, ``start_method``, ...).

    Examples:
        >>> options: StrategyOptions = {"nonfinite_grads": "skip", "timeout": 60}
        >>> sorted(options)
        ['nonfinite_grads', 'timeout']
    """

    accelerator: pl.accelerators.Accelerator | None
    precision_plugin: Precision | None


TRAINER_PLUGINS = ("accelerator", "precision_plugin")
"""The Lightning plugins among :class:`StrategyOptions` besides the shared ones."""
