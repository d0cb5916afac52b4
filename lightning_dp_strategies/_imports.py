"""What importing the package does: the strategy names registered with Lightning (:func:`register_all`, which
imports Lightning), and the public names of the package root, each imported on first use (:func:`public_name`).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["PUBLIC", "public_name", "register_all"]

_PACKAGE = "lightning_dp_strategies"

PUBLIC: dict[str, str] = {
    name: f"{_PACKAGE}.{module}"
    for module, names in {
        "bucketing": ("CommStats", "GradientBuckets", "assign_buckets"),
        "comm": ("CommCounter", "reference_all_reduce", "ring_all_reduce"),
        "comm.probe": ("probe_link",),
        "core.checkpoint_files": ("latest_checkpoint",),
        "core.checkpoint_io": ("AtomicCheckpointIO",),
        "core.fault_tolerance": ("FaultTolerance",),
        "core.options": ("BucketedConfig",),
        "data_parallel": ("gather", "parallel_apply", "replicate", "scatter"),
        "local_sgd": ("diloco_outer_optimizer",),
        "plan": ("Link", "Prediction", "Reduction", "Topology", "Workload", "measure_compute", "predict"),
        "reducers": (
            "REDUCERS",
            "AutoReducer",
            "CastCompression",
            "GradBucket",
            "NativeReducer",
            "PerTensorReducer",
            "PowerSGD",
            "Reducer",
            "ReducerBase",
            "ReducerWrapper",
            "RingReducer",
            "bf16_compress",
            "calibrate_cpu",
            "fp16_compress",
            "resolve_reducer",
        ),
        "strategies": ("BucketedDataParallel",),
    }.items()
    for name in names
}
"""The package's public names besides its strategies, and the module each comes from. The strategy classes
(Trainer and Fabric) are found by :func:`public_name` in the modules that define them."""


def _strategy_classes() -> list[type]:
    from lightning_dp_strategies.fabric import fabric_strategies
    from lightning_dp_strategies.strategies import trainer_strategies

    return [*trainer_strategies(), *fabric_strategies()]


def public_name(name: str) -> Any:
    """The public object ``name`` of the package root: from :data:`PUBLIC`, or a strategy class of that name."""
    if name in PUBLIC:
        return getattr(importlib.import_module(PUBLIC[name]), name)
    if name.startswith("__"):  # probes such as __wrapped__ or __path__ of a submodule: not a strategy class
        raise AttributeError(f"module {_PACKAGE!r} has no attribute {name!r}")
    for cls in _strategy_classes():
        if cls.__name__ == name:
            return cls
    raise AttributeError(f"module {_PACKAGE!r} has no attribute {name!r}")


def register_all() -> None:
    """Register every strategy name of this package with Lightning's registries, the Trainer's ``StrategyRegistry``
    and Fabric's ``STRATEGY_REGISTRY``. Importing the package calls it; calling it again, or reloading the package,
    registers the same names again, replacing the entries this package made (and leaving other packages' alone).

    Examples:
        >>> register_all()
        >>> from lightning.pytorch.strategies import StrategyRegistry
        >>> "ring_allreduce" in StrategyRegistry and "dp" in StrategyRegistry
        True
        >>> from lightning.fabric.strategies import STRATEGY_REGISTRY
        >>> "ring_allreduce" in STRATEGY_REGISTRY and "scatter_gather" in STRATEGY_REGISTRY
        True
    """
    from lightning_dp_strategies.fabric import register_fabric_strategies
    from lightning_dp_strategies.strategies import register_trainer_strategies

    register_trainer_strategies()
    register_fabric_strategies()
