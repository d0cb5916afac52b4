"""Side-by-side comparison of strategies on the built-in demo or your own model: ``lightning-dp-strategies compare``."""

from lightning_dp_strategies.compare.demo import DemoClassifier, DemoConfig, GlobalBatchSampler, make_dataset
from lightning_dp_strategies.compare.report import format_table, make_figure, write_figure, write_json
from lightning_dp_strategies.compare.runner import (
    BASELINE,
    RunResult,
    available_strategies,
    compare,
    default_strategies,
    runnable_strategies,
)
from lightning_dp_strategies.compare.task import replica_slice

__all__ = [
    "BASELINE",
    "DemoClassifier",
    "DemoConfig",
    "GlobalBatchSampler",
    "RunResult",
    "available_strategies",
    "compare",
    "default_strategies",
    "format_table",
    "make_dataset",
    "make_figure",
    "replica_slice",
    "runnable_strategies",
    "write_figure",
    "write_json",
]
