"""The options of ``hybrid_pipeline``, in one frozen object validated on creation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_dp_strategies.core.options import BucketedConfig, check_flag
from lightning_dp_strategies.pipeline import SCHEDULES, check_balance, check_schedule, default_virtual_stages

__all__ = ["HybridPipelineConfig"]


@dataclass(frozen=True)
class HybridPipelineConfig(BucketedConfig):
    """The options of :class:`HybridPipelineStrategy` (see its arguments), validated on creation."""

    pipeline_stages: int = 2
    micro_batches: int = 4
    schedule: str = "1f1b"
    balance: tuple[int, ...] | str = "parameters"
    log_pipeline_stats: bool = False
    virtual_stages: int | None = None
    measure_activations: bool = False

    @property
    def chunks_per_rank(self) -> int:
        """``virtual_stages``, or the schedule's default (1 for GPipe and 1F1B, 2 for the others)."""
        return default_virtual_stages(self.schedule) if self.virtual_stages is None else self.virtual_stages

    @property
    def chunks(self) -> int:
        """Chunks the body is cut into: ``pipeline_stages x chunks_per_rank``."""
        return self.pipeline_stages * self.chunks_per_rank

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("pipeline_stages", "micro_batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be an integer >= 1, got {value!r}.")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"Unknown pipeline `schedule` {self.schedule!r}: use one of {list(SCHEDULES)}.")
        check_schedule(self.schedule, self.pipeline_stages, self.micro_batches, self.chunks_per_rank)
        object.__setattr__(self, "balance", _check_balance_option(self.balance, self.chunks))
        check_flag("log_pipeline_stats", self.log_pipeline_stats)
        check_flag("measure_activations", self.measure_activations)


def _check_balance_option(balance: object, stages: int) -> tuple[int, ...] | str:
    if isinstance(balance, str):
        if balance not in ("parameters", "time"):
            raise ValueError(f"Unknown `balance` {balance!r}: use 'parameters', 'time', or a list of blocks per stage.")
        return balance
    if isinstance(balance, Sequence):
        # the body's block count is known at setup; here: one entry >= 1 per stage
        entries: list[Any] = list(balance)
        counted = sum(b for b in entries if isinstance(b, int) and not isinstance(b, bool) and b > 0)
        return tuple(check_balance(entries, max(counted, stages), stages))
    raise ValueError(
        f"`balance` must be 'parameters', 'time', or a list of blocks per stage (e.g. {[1] * stages} for "
        f"pipeline_stages={stages}), got {balance!r}."
    )
