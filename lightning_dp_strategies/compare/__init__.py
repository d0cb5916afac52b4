"""Side-by-side comparison of strategies on the built-in demo or your own model: ``lightning-dp-strategies compare``.

========================  ==================================================================================
module                    what it holds
========================  ==================================================================================
:mod:`.spec`              the fixed choices (precisions, the demo's batch), importable without torch
:mod:`.demo`              the built-in model and data
:mod:`.task`              one strategy's run, described so a worker process can rebuild it
:mod:`.catalogue`         which strategies there are, which run by default, which can run here
:mod:`.worker`            one strategy's training, inside the processes launched for it
:mod:`.runner`            each strategy in its own processes, the evaluation, :func:`compare`
:mod:`.report`            the table, the JSON and the figure
========================  ==================================================================================

The names below are imported on first use: the command's parser reads :mod:`.spec` without importing the runner.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_dp_strategies.compare.catalogue import (
        BASELINE as BASELINE,
        available_strategies as available_strategies,
        default_strategies as default_strategies,
        runnable_strategies as runnable_strategies,
    )
    from lightning_dp_strategies.compare.demo import (
        DemoClassifier as DemoClassifier,
        DemoConfig as DemoConfig,
        GlobalBatchSampler as GlobalBatchSampler,
        make_dataset as make_dataset,
    )
    from lightning_dp_strategies.compare.report import (
        format_table as format_table,
        make_figure as make_figure,
        write_figure as write_figure,
        write_json as write_json,
    )
    from lightning_dp_strategies.compare.runner import (
        RunResult as RunResult,
        compare as compare,
    )
    from lightning_dp_strategies.compare.task import (
        replica_slice as replica_slice,
    )

_HOMES = {
    "catalogue": ("BASELINE", "available_strategies", "default_strategies", "runnable_strategies"),
    "demo": ("DemoClassifier", "DemoConfig", "GlobalBatchSampler", "make_dataset"),
    "report": ("format_table", "make_figure", "write_figure", "write_json"),
    "runner": ("RunResult", "compare"),
    "task": ("replica_slice",),
}

__all__ = sorted(name for names in _HOMES.values() for name in names)


def __getattr__(name: str) -> Any:
    for module, names in _HOMES.items():
        if name in names:
            return getattr(importlib.import_module(f"{__name__}.{module}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
