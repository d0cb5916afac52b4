"""What a strategy adds to :class:`~lightning_dp_strategies.strategies.survival.TrainerSurvival` at fixed points
(:class:`SurvivalHooks`), and what the survival uses of its strategy (:class:`SurvivingStrategy`).

The ring needs none of it (:class:`SurvivalHooks` itself: every hook does nothing); local SGD's
:class:`~lightning_dp_strategies.strategies.local_survival.LocalSurvival` overrides them to train the lost ranks'
replicas and to hand their state to replacements.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Protocol

import lightning.pytorch as pl
import torch

from lightning_dp_strategies.core.engine import BucketedEngine
from lightning_dp_strategies.reducers import Reducer

__all__ = ["SurvivalHooks", "SurvivingStrategy"]


class SurvivalHooks:
    """The survival's extension points, each a no-op here."""

    trains_lost_batches: bool = True
    """Whether backward adds the lost ranks' micro-batches to this rank's step (local SGD trains replicas instead)."""

    alike: bool = True
    """Whether every rank holds the same parameters and optimizer states after a step: a rank one step behind takes
    them from one that completed it (local SGD's differ, so one behind redoes its own step instead)."""

    def after_own_step(self) -> None:
        """After each optimizer step of this rank that completed."""

    def after_recovery_between_steps(self) -> None:
        """On every survivor of a rank lost between optimizer steps (validation, a checkpoint's save), once the
        groups are re-formed, before the collective is redone."""

    def after_recovery_in_step(self) -> None:
        """On every survivor of a rank lost in an optimizer step (in its gradients' reduction, or in a Lightning
        collective of ``training_step``), once the groups are re-formed, before the step is redone."""

    def on_regroup(self) -> None:
        """On every survivor, once the gradient sync averages over new groups (after a failure, an admission)."""

    def ready_to_admit(self) -> bool:
        """Whether replacements may be admitted at this epoch's start."""
        return True

    def on_admit(self, joining: list[int]) -> dict[str, Any]:
        """On every survivor before the world is re-formed for ``joining`` (collective over the survivors): entries
        added to the leader's training state that the replacements receive."""
        return {}

    def after_admit(self, joining: list[int]) -> None:
        """On every rank of the re-formed world, once the replacements have their state."""


class SurvivingStrategy(Protocol):
    """What :class:`TrainerSurvival` uses of its strategy (a :class:`~lightning_dp_strategies.strategies.bucketed.
    BucketedDataParallel`)."""

    engine: BucketedEngine
    _timeout: timedelta | None

    @property
    def global_rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def root_device(self) -> torch.device: ...
    @property
    def lightning_module(self) -> pl.LightningModule | None: ...
    @property
    def precision_plugin(self) -> Any: ...
    @property
    def optimizers(self) -> list[Any]: ...
    def _get_process_group_backend(self) -> str: ...
    def configure_reducer(self) -> Reducer: ...
    def arrange_reducer(self, reducer: Reducer) -> Reducer: ...
    def _build_buckets(self) -> None: ...
    def _check_ranks_agree(self) -> None: ...
    def batch_to_device(self, batch: Any) -> Any: ...
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any: ...
