"""The parts of local SGD a strategy holds beside :class:`~lightning_dp_strategies.local_sgd.LocalSGD`: the option
checks and :class:`HoldsLocalSGD`; the algorithm's names, from :mod:`lightning_dp_strategies.local_sgd`, are exported
here too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_dp_strategies.bucketing.stats import CommStats
from lightning_dp_strategies.local_sgd import (
    LocalSGD,
    LocalSGDConfig,
    OuterOptimizerFactory,
    diloco_outer_optimizer,
    gather_to_zero,
    local_checkpoint_record,
    make_outer_optimizer,
    restore_local_record,
)

__all__ = [
    "HoldsLocalSGD",
    "LocalSGD",
    "LocalSGDConfig",
    "OuterOptimizerFactory",
    "check_not_sharded",
    "check_single_optimizer",
    "diloco_outer_optimizer",
    "gather_to_zero",
    "local_checkpoint_record",
    "make_outer_optimizer",
    "restore_local_record",
]


def check_not_sharded(shard_optimizer_state: object) -> None:
    """A clear error for ``shard_optimizer_state=True``: between averages every rank steps its whole model, so every
    rank needs the whole optimizer state.

    Examples:
        >>> check_not_sharded(False)
        >>> check_not_sharded(True)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Local SGD cannot shard the optimizer state: ...
    """
    if shard_optimizer_state:
        raise ValueError(
            "Local SGD cannot shard the optimizer state: between averages every rank steps its whole model on its "
            "own, so every rank needs the whole optimizer state. To save optimizer memory, train with "
            "`RingAllReduceStrategy(shard_optimizer_state=True)`; to save traffic, keep local SGD unsharded."
        )


def check_single_optimizer(optimizers: Sequence[object], strategy: str) -> None:
    """Local SGD counts the steps of one optimizer: a clear error for several."""
    if len(optimizers) > 1:
        raise ValueError(
            f"{strategy} counts `sync_every` in steps of one optimizer, but `configure_optimizers` returned "
            f"{len(optimizers)}. Return one optimizer with a parameter group per part of the model "
            "(`torch.optim.AdamW([{'params': a.parameters()}, {'params': b.parameters(), 'lr': 1e-4}])`), or use "
            "RingAllReduceStrategy."
        )


class HoldsLocalSGD:
    """What a strategy holding a :class:`LocalSGD` as ``local_sgd`` (and its gradient sync as ``grad_sync``) shows of
    it, Trainer and Fabric alike: the statistics, the synchronisation, the options the ranks must agree on."""

    local_config: LocalSGDConfig
    local_sgd: LocalSGD | None
    grad_sync: Any
    _averaged_step: CommStats

    def _local_options(self) -> dict[str, Any]:
        """The local SGD options every rank must agree on (for the ranks' fingerprint)."""
        cfg = self.local_config
        outer = None if cfg.outer_optimizer is None else getattr(cfg.outer_optimizer, "__qualname__", "callable")
        return {
            "sync_every": cfg.sync_every,
            "warmup_steps": cfg.warmup_steps,
            "outer_optimizer": outer,
            "average_buffers": cfg.average_buffers,
        }

    def _after_optimizer_step(self) -> None:
        """Count the step (synchronising at the end of a period) and keep what that synchronisation sent."""
        if self.local_sgd is not None:
            before = self.local_sgd.stats
            self.local_sgd.after_step()
            self._averaged_step = self.local_sgd.stats - before

    @property
    def step_stats(self) -> CommStats:
        """Communication of the last optimizer step: the warm-up's gradients, or the synchronisation it ended with."""
        stats: CommStats = self.grad_sync.step_stats + self._averaged_step
        return stats

    @property
    def comm_stats(self) -> CommStats:
        """Running totals on this rank: the warm-up's gradients and every synchronisation."""
        averaged = self.local_sgd.stats if self.local_sgd is not None else CommStats()
        totals: CommStats = self.grad_sync.totals + averaged
        return totals

    def synchronize(self) -> None:
        """Average the ranks' parameter changes now and apply the outer step (on every rank; nothing when the ranks
        are in sync already). The strategies call it before validation and at the end of training."""
        if self.local_sgd is not None:
            self.local_sgd.synchronize()
