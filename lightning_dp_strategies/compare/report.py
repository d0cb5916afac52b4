"""The comparison's outputs: a terminal table, a JSON file and a PNG figure."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import platform
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lightning_dp_strategies.compare.catalogue import BASELINE
from lightning_dp_strategies.compare.demo import DemoConfig
from lightning_dp_strategies.compare.runner import RunResult
from lightning_dp_strategies.plan.tables import text_table

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

COLUMNS = (
    ("strategy", "strategy", "{}"),
    ("processes", "procs", "{}"),
    ("devices", "devices", "{}"),
    ("samples_per_second", "samples/s", "{:.0f}"),
    ("step_ms", "step ms", "{:.1f}"),
    ("comm_mb_per_step", "comm MB/step", "{:.3f}"),
    ("pipeline_mb_per_step", "p2p MB/step", "{:.3f}"),
    ("exposed_comm_ms", "exposed ms", "{:.2f}"),
    ("pipeline_bubble", "bubble", "{:.0%}"),
    ("final_loss", "final loss", "{:.4f}"),
    ("max_param_diff", "max |dθ|", "{:.1e}"),
    ("accuracy", "accuracy", "{:.1%}"),
    ("peak_mb_per_rank", "peak MB/rank", "{:.0f}"),
    ("status", "status", "{}"),
)


def format_table(results: Sequence[RunResult]) -> str:
    """A plain-text table, one row per strategy (``-`` where a figure does not apply or was not measured), then why
    each row that did not run did not.

    Examples:
        >>> row = RunResult("single", processes=1, devices=1, step_ms=12.5, samples_per_second=5120.0)
        >>> failed = RunResult("ddp", processes=2, devices=2, status="failed", error="exit 1")
        >>> lines = format_table([row, failed]).splitlines()
        >>> lines[2].split(), lines[-1]
        (['single', '1', '1', '5120', '12.5', '-', '-', '-', '-', '-', '-', '-', '-', 'ok'], '  ddp (failed): exit 1')
    """
    rows = [
        ["-" if getattr(result, key) is None else fmt.format(getattr(result, key)) for key, _, fmt in COLUMNS]
        for result in results
    ]
    table = text_table([title for _, title, _ in COLUMNS], rows, rule=True)
    notes = [f"  {r.strategy} ({r.status}): {r.error or 'no reason recorded'}" for r in results if r.status != "ok"]
    return "\n".join([table, *(["", "why some rows did not run:", *notes] if notes else [])])


def machine() -> dict[str, object]:
    """Where the numbers were measured."""
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "cuda": torch.cuda.is_available(),
    }


def write_json(results: Sequence[RunResult], config: DemoConfig | Mapping[str, Any], devices: int, path: Path) -> None:
    """Everything measured, curves included, with the configuration (the demo's, or any mapping describing the
    workload) and the machine.

    Examples:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     write_json([RunResult("single", 1, 1)], DemoConfig(), devices=1, path=Path(tmp) / "results.json")
        ...     sorted(json.loads((Path(tmp) / "results.json").read_text()))
        ['config', 'devices', 'machine', 'results']
    """
    payload = {
        "config": asdict(config) if isinstance(config, DemoConfig) else dict(config),
        "devices": devices,
        "machine": machine(),
        "results": [asdict(r) for r in results],
    }
    path.write_text(json.dumps(payload, indent=2))


PARITY_TOLERANCE = 1e-5
"""Where the parity panel draws its reference line: max |dθ| below it counts as agreeing with the baseline."""
_LINESTYLES = ("-", "--", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)))
_MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*")
_STATUS_COLORS = {"n/a": "0.35", "failed": "tab:red", "timeout": "tab:red"}


def make_figure(results: Sequence[RunResult], tolerance: float = PARITY_TOLERANCE) -> Figure:
    """Step time, communication, parity with the baseline and loss curves, every strategy in every bar panel.

    A row that did not run shows its status at its slot in each bar panel and in the loss panel's legend.

    Examples:
        >>> rows = [RunResult("single", 1, 1, step_ms=2.0, max_param_diff=0.0, loss_curve=[2.1, 1.4])]
        >>> [ax.get_title() for ax in make_figure(rows).axes][:2]
        ['step time (lower is better)', 'communication per step']
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(16, 4.5))
    FigureCanvasAgg(fig)
    ax_step, ax_comm, ax_parity, ax_loss = fig.subplots(1, 4)
    names = [r.strategy for r in results]
    _step_panel(ax_step, results)
    _comm_panel(ax_comm, results)
    _parity_panel(ax_parity, results, tolerance)
    for ax in (ax_step, ax_comm, ax_parity):
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize="small")
        ax.set_xlim(-0.6, len(names) - 0.4)
    _loss_panel(ax_loss, results)
    fig.tight_layout()
    return fig


def write_figure(results: Sequence[RunResult], path: Path, tolerance: float = PARITY_TOLERANCE) -> bool:
    """Save :func:`make_figure` as a PNG at ``path``; ``False`` (and no file) without matplotlib.

    Examples:
        >>> results = [RunResult("single", 1, 1, samples_per_second=5120.0, loss_curve=[2.1, 1.4, 0.9])]
        >>> write_figure(results, Path("comparison.png"))  # doctest: +SKIP
        True
    """
    if importlib.util.find_spec("matplotlib") is None:
        return False
    make_figure(results, tolerance).savefig(path, dpi=110)
    return True


def _slot_text(ax: Axes, x: float, text: str, color: str = "0.35") -> None:
    """Vertical text from the bottom of slot ``x``: narrower than a slot, so neighbours never overlap."""
    from matplotlib.transforms import blended_transform_factory

    transform = blended_transform_factory(ax.transData, ax.transAxes)
    ax.text(x, 0.02, text, transform=transform, rotation=90, ha="center", va="bottom", fontsize=8, color=color)


def _value_text(ax: Axes, x: float, y: float, text: str) -> None:
    """Vertical text just above a bar's top, inside its slot."""
    ax.annotate(
        text, (x, y), xytext=(0, 2), textcoords="offset points", rotation=90, ha="center", va="bottom", fontsize=8
    )


def _status_slots(ax: Axes, results: Sequence[RunResult]) -> list[tuple[int, RunResult]]:
    """Label the slots of rows that did not run with their status; return the others with their slot."""
    ok = []
    for x, r in enumerate(results):
        if r.status == "ok":
            ok.append((x, r))
        else:
            _slot_text(ax, x, r.status, _STATUS_COLORS.get(r.status, "tab:red"))
    return ok


def _step_panel(ax: Axes, results: Sequence[RunResult]) -> None:
    """Milliseconds per optimizer step as bars, samples per second written above each."""
    top = 0.0
    for x, r in _status_slots(ax, results):
        if r.step_ms is None:
            _slot_text(ax, x, "not measured")
            continue
        ax.bar(x, r.step_ms, color="tab:blue")
        top = max(top, r.step_ms)
        if r.samples_per_second is not None:
            _value_text(ax, x, r.step_ms, f"{r.samples_per_second:.0f} samples/s")
    ax.set_ylim(0, top * 1.6 or 1.0)
    ax.set_title("step time (lower is better)")
    ax.set_ylabel("ms per optimizer step")


def _comm_panel(ax: Axes, results: Sequence[RunResult]) -> None:
    """Gradient traffic with activation traffic between pipeline stages stacked on it, in MB per step on rank 0."""
    top = 0.0
    for x, r in _status_slots(ax, results):
        if r.comm_mb_per_step is None and r.pipeline_mb_per_step is None:
            _slot_text(ax, x, "none (1 process)" if r.processes == 1 else "not counted")
            continue
        gradients, activations = r.comm_mb_per_step or 0.0, r.pipeline_mb_per_step or 0.0
        ax.bar(x, gradients, color="tab:orange")
        ax.bar(x, activations, bottom=gradients, color="tab:green")
        total = gradients + activations
        top = max(top, total)
        if total > 0:
            _value_text(ax, x, total, f"{total:.3g}")
        else:
            _slot_text(ax, x, "0")
    from matplotlib.patches import Patch

    handles = [Patch(color="tab:orange", label="gradients"), Patch(color="tab:green", label="activations (stages)")]
    ax.legend(handles=handles, fontsize="x-small", loc="best")
    ax.set_ylim(0, top * 1.8 or 1.0)
    ax.set_title("communication per step")
    ax.set_ylabel("MB per step (rank 0)")


def _parity_panel(ax: Axes, results: Sequence[RunResult], tolerance: float) -> None:
    """Max |dθ| against the baseline on a log axis; exact zeros sit on a floor labelled ``0`` (``reference``)."""
    diffs = [d for r in results if r.status == "ok" and (d := r.max_param_diff) and math.isfinite(d)]
    floor = 10.0 ** math.floor(math.log10(min([*diffs, tolerance]))) / 10
    bottom = floor / 10
    ax.set_yscale("log")
    for x, r in _status_slots(ax, results):
        if r.max_param_diff is None:
            _slot_text(ax, x, "not measured")
            continue
        if not math.isfinite(r.max_param_diff):
            _slot_text(ax, x, f"{r.max_param_diff} (diverged)", "tab:red")
            continue
        value = max(r.max_param_diff, floor)
        color = "tab:green" if r.max_param_diff <= tolerance else "tab:red"
        ax.bar(x, value - bottom, bottom=bottom, color="0.8" if r.strategy == BASELINE else color)
        label = "reference" if r.strategy == BASELINE else "0" if r.max_param_diff == 0 else f"{r.max_param_diff:.0e}"
        _value_text(ax, x, value, label)
    ax.axhline(tolerance, color="tab:red", linestyle="--", linewidth=1, label=f"parity tolerance ({tolerance:.0e})")
    ax.legend(fontsize="x-small", loc="best")
    ax.set_ylim(bottom, max([*diffs, tolerance]) * 1e3)
    ax.set_title(f"parity with {BASELINE!r} (lower is better)")
    ax.set_ylabel("max |dθ| after training (log)")


def _loss_panel(ax: Axes, results: Sequence[RunResult]) -> None:
    """Loss curves told apart by colour, line style, width and staggered markers; rows without a curve in the legend."""
    from matplotlib.lines import Line2D

    drawn = [(x, r) for x, r in enumerate(results) if r.status == "ok" and r.loss_curve]
    widen = min(1.2, 4.0 / max(len(drawn) - 1, 1))
    for k, (x, r) in enumerate(drawn):  # widest first, so every coinciding curve shows at its edges
        every = max(len(drawn), len(r.loss_curve) // 6, 1)
        ax.plot(
            range(1, len(r.loss_curve) + 1),
            r.loss_curve,
            label=r.strategy,
            color=f"C{x % 10}",
            linestyle=_LINESTYLES[x % len(_LINESTYLES)],
            linewidth=1.0 + widen * (len(drawn) - 1 - k),
            marker=_MARKERS[x % len(_MARKERS)],
            markevery=(k * every // len(drawn), every),
            markersize=5,
            zorder=2 + k,
        )
    handles, _ = ax.get_legend_handles_labels()
    for r in results:
        if r.status != "ok" or not r.loss_curve:
            reason = f"{r.status}, not drawn" if r.status != "ok" else "no curve recorded"
            handles.append(Line2D([], [], linestyle="none", label=f"{r.strategy}: {reason}"))
    if handles:
        ax.legend(handles=handles, fontsize="x-small", title="coinciding curves agree", title_fontsize="x-small")
    ax.set_title("training loss of each step's global batch")
    # the table's "final loss" is another measurement: the whole training set, after the last step
    ax.set_xlabel(
        "optimizer step\n(the table's final loss: the whole training set after the last step)", fontsize="x-small"
    )
    ax.set_ylabel("training loss")
