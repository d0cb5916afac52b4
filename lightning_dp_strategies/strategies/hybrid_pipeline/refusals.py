"""What the pipeline strategy refuses to run, each refusal with the fix in its message."""

from __future__ import annotations

from collections.abc import Iterable

import lightning.pytorch as pl
from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging
from lightning.pytorch.plugins.precision import MixedPrecision, Precision

__all__ = [
    "check_automatic_optimization",
    "check_no_sync_batchnorm",
    "check_no_weight_averaging",
    "check_precision",
    "check_reducer_not_auto",
]


def check_reducer_not_auto(reducer: object, strategy: str) -> None:
    """Refuse ``reducer="auto"``: it times the data-parallel ring's steps, and the pipeline's schedule runs its own.

    Examples:
        >>> check_reducer_not_auto("ring", "HybridPipelineStrategy")
    """
    if reducer == "auto" or type(reducer).__name__ == "AutoReducer":
        raise ValueError(
            f"`reducer='auto'` is not supported by {strategy}: it picks a reduction for `ring_allreduce` from timed "
            "steps, and the pipeline reduces each stage's gradients inside its own schedule. Name one instead: "
            "reducer='ring' (the default), reducer=bf16_compress('ring') or PowerSGD('ring', rank=4)."
        )


def check_no_sync_batchnorm(layer_sync: object, strategy: str) -> None:
    """Refuse ``sync_batchnorm=True``: a stage's BatchNorm runs micro-batch by micro-batch, unsynchronised.

    Args:
        layer_sync: the strategy's layer sync plugin (``None`` without ``sync_batchnorm``).
        strategy: the strategy's class name.

    Examples:
        >>> check_no_sync_batchnorm(None, "HybridPipelineStrategy")
    """
    if layer_sync is not None:
        raise ValueError(
            f"`sync_batchnorm=True` is not supported by {strategy}: a stage's BatchNorm layers run "
            "micro-batch by micro-batch inside the pipeline schedule, with no synchronisation across replicas. "
            "Drop `sync_batchnorm=True` (each micro-batch then uses its own statistics), or use "
            "strategy='ring_allreduce'."
        )


def check_automatic_optimization(module: pl.LightningModule, fitting: bool, strategy: str) -> None:
    """Refuse manual optimization when fitting: the schedule runs backward itself.

    Args:
        module: the LightningModule.
        fitting: the Trainer is fitting.
        strategy: the strategy's class name.
    """
    if fitting and not module.automatic_optimization:
        raise ValueError(
            f"{strategy} supports automatic optimization only: the pipeline schedule runs backward "
            "itself, micro-batch by micro-batch, so `manual_backward` has nothing to do. Remove "
            "`self.automatic_optimization = False` (Lightning then clips and steps), or use "
            "strategy='ring_allreduce'."
        )


def check_precision(plugin: Precision, strategy: str) -> None:
    """Refuse ``precision='16-mixed'``: its loss scaling would have to run inside the schedule.

    Args:
        plugin: the strategy's precision plugin.
        strategy: the strategy's class name.

    Examples:
        >>> check_precision(Precision(), "HybridPipelineStrategy")
    """
    if isinstance(plugin, MixedPrecision) and plugin.scaler is not None:
        raise ValueError(
            f"{strategy} does not support precision='16-mixed': its loss scaling would have to run "
            "inside the pipeline schedule. Use precision='bf16-mixed' or '32-true'."
        )


def check_no_weight_averaging(callbacks: Iterable[object], fitting: bool, stages: int, strategy: str) -> None:
    """Refuse, when fitting over several stages, Lightning's weight-averaging callbacks: they copy the whole module
    and average every parameter, while each rank holds only its stage's blocks (the others are on the meta device).

    Args:
        callbacks: the Trainer's callbacks.
        fitting: the Trainer is fitting.
        stages: the number of pipeline stages (one holds the whole model).
        strategy: the strategy's class name.

    Examples:
        >>> check_no_weight_averaging([StochasticWeightAveraging(swa_lrs=0.1)], True, 1, "HybridPipelineStrategy")
    """
    found = [type(c).__name__ for c in callbacks if isinstance(c, (StochasticWeightAveraging, WeightAveraging))]
    if fitting and stages > 1 and found:
        raise ValueError(
            f"{found[0]} is not supported by {strategy}: it keeps a copy of the whole model and averages every "
            "parameter after each step or epoch, and each rank holds only its own stage's blocks (the others are on "
            "the meta device there). Use strategy='ring_allreduce', where every rank holds the whole model, or "
            "average the checkpoints of the run afterwards."
        )
