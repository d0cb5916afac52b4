"""The keyword options the multi-process Fabric strategies of the package take besides their own, documented once."""

from __future__ import annotations

from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins.precision import Precision

from lightning_dp_strategies.core.options import SharedOptions

__all__ = ["FABRIC_PLUGINS", "FabricOptions"]


class FabricOptions(SharedOptions, total=False):
    """What ``FabricRingAllReduceStrategy`` and ``FabricLocalSGDStrategy`` take by keyword besides their own options:
    Fabric's ``accelerator`` and ``precision`` (the Trainer's ``precision_plugin``) and the options of
    :class:`~lightning_dp_strategies.core.options.SharedOptions` (``nonfinite_grads``, ``timeout``, ...).

    Examples:
        >>> options: FabricOptions = {"nonfinite_grads": "raise"}
        >>> sorted(options)
        ['nonfinite_grads']
    """

    accelerator: Accelerator | None
    precision: Precision | None


FABRIC_PLUGINS = ("accelerator", "precision")
"""The Fabric plugins among :class:`FabricOptions` besides the shared ones."""
