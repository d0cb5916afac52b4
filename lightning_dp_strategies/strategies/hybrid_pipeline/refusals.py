"""What the pipeline strategy refuses to run, each refusal with the fix in its message."""

from __future__ import annotations

from collections.abc import Iterable

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelPruning, StochasticWeightAveraging, WeightAveraging
from lightning.pytorch.plugins.precision import MixedPrecision, Precision

__all__ = [
    "check_automatic_optimization",
    "check_no_sync_batchnorm",
    "check_precision",
    "check_reducer_not_auto",
    "check_whole_model_callbacks",
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


WHOLE_MODEL_CALLBACKS: dict[type, str] = {
    StochasticWeightAveraging: "keeps a copy of the whole model and averages every parameter after each epoch",
    WeightAveraging: "keeps a copy of the whole model and averages every parameter after each step",
    ModelPruning: "prunes (and with the lottery ticket hypothesis resets) the whole model's parameters",
}
"""Lightning's callbacks that work on every parameter of the module, with what they do."""


def check_whole_model_callbacks(callbacks: Iterable[object], fitting: bool, stages: int, strategy: str) -> None:
    """Refuse, when fitting over several stages, the callbacks of :data:`WHOLE_MODEL_CALLBACKS`: each rank holds only
    its stage's blocks (the others are on the meta device there).

    Args:
        callbacks: the Trainer's callbacks.
        fitting: the Trainer is fitting.
        stages: the number of pipeline stages (one holds the whole model).
        strategy: the strategy's class name.

    Examples:
        >>> check_whole_model_callbacks([StochasticWeightAveraging(swa_lrs=0.1)], True, 1, "HybridPipelineStrategy")
    """
    found = [(c, why) for c in callbacks for kind, why in WHOLE_MODEL_CALLBACKS.items() if isinstance(c, kind)]
    if fitting and stages > 1 and found:
        callback, why = found[0]
        raise ValueError(
            f"{type(callback).__name__} is not supported by {strategy} over several stages: it {why}, and each "
            "rank holds only its own stage's blocks (the others are on the meta device there). Use "
            "strategy='ring_allreduce', where every rank holds the whole model, or pipeline_stages=1."
        )
