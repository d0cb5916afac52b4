"""Side-by-side comparison of strategies on a built-in demo: ``lightning-dp-strategies compare``."""

from lightning_dp_strategies.compare.demo import DemoClassifier, DemoConfig, GlobalBatchSampler, make_dataset
from lightning_dp_strategies.compare.report import format_table, write_figure, write_json
from lightning_dp_strategies.compare.runner import (
    BASELINE,
    RunResult,
    available_strategies,
    compare,
    default_strategies,
)

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
    "write_figure",
    "write_json",
]
