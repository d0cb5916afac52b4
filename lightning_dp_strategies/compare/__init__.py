"""Side-by-side comparison of strategies on the built-in demo or your own model: ``lightning-dp-strategies compare``.

========================  ==================================================================================
module                    what it holds
========================  ==================================================================================
:mod:`.spec`              the fixed choices (precisions, the demo's batch), importable without torch
:mod:`.demo`              the built-in model and data
:mod:`.task`              one strategy's run, described so a worker process can rebuild it
:mod:`.runner`            which strategies can run here, the workers, :func:`compare`
:mod:`.report`            the table, the JSON and the figure
========================  ==================================================================================

The names below are imported on first use, so the command's parser reads :mod:`.spec` without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_dp_strategies.compare.demo import (
        DemoClassifier as DemoClassifier,
    )
    from lightning_dp_strategies.compare.demo import (
        DemoConfig as DemoConfig,
    )
    from lightning_dp_strategies.compare.demo import (
        GlobalBatchSampler as GlobalBatchSampler,
    )
    from lightning_dp_strategies.compare.demo import (
        make_dataset as make_dataset,
    )
    from lightning_dp_strategies.compare.report import (
        format_table as format_table,
    )
    from lightning_dp_strategies.compare.report import (
        make_figure as make_figure,
    )
    from lightning_dp_strategies.compare.report import (
        write_figure as write_figure,
    )
    from lightning_dp_strategies.compare.report import (
        write_json as write_json,
    )
    from lightning_dp_strategies.compare.runner import (
        BASELINE as BASELINE,
    )
    from lightning_dp_strategies.compare.runner import (
        RunResult as RunResult,
    )
    from lightning_dp_strategies.compare.runner import (
        available_strategies as available_strategies,
    )
    from lightning_dp_strategies.compare.runner import (
        compare as compare,
    )
    from lightning_dp_strategies.compare.runner import (
        default_strategies as default_strategies,
    )
    from lightning_dp_strategies.compare.runner import (
        runnable_strategies as runnable_strategies,
    )
    from lightning_dp_strategies.compare.task import (
        replica_slice as replica_slice,
    )

_HOMES = {
    "demo": ("DemoClassifier", "DemoConfig", "GlobalBatchSampler", "make_dataset"),
    "report": ("format_table", "make_figure", "write_figure", "write_json"),
    "runner": ("BASELINE", "RunResult", "available_strategies", "compare", "default_strategies", "runnable_strategies"),
    "task": ("replica_slice",),
}

__all__ = sorted(name for names in _HOMES.values() for name in names)


def __getattr__(name: str) -> Any:
    for module, names in _HOMES.items():
        if name in names:
            return getattr(importlib.import_module(f"{__name__}.{module}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
