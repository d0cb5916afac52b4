"""The comparison's outputs: a terminal table, a JSON file and a PNG figure."""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from lightning_dp_strategies._text import text_table
from lightning_dp_strategies.compare.demo import DemoConfig
from lightning_dp_strategies.compare.runner import RunResult

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
    ("status", "status", "{}"),
)


def format_table(results: Sequence[RunResult]) -> str:
    """A plain-text table, one row per strategy; ``-`` where a figure does not apply or was not measured.

    Examples:
        >>> row = RunResult("single", processes=1, devices=1, step_ms=12.5, samples_per_second=5120.0)
        >>> failed = RunResult("ddp", processes=2, devices=2, status="failed", error="exit 1")
        >>> lines = format_table([row, failed]).splitlines()
        >>> lines[2].split(), lines[-1]
        (['single', '1', '1', '5120', '12.5', '-', '-', '-', '-', '-', '-', '-', 'ok'], '  ddp: exit 1')
    """
    rows = [
        ["-" if getattr(result, key) is None else fmt.format(getattr(result, key)) for key, _, fmt in COLUMNS]
        for result in results
    ]
    table = text_table([title for _, title, _ in COLUMNS], rows, rule=True)
    notes = [f"  {r.strategy}: {r.error}" for r in results if r.error]
    return "\n".join([table, *(["", "errors:", *notes] if notes else [])])


def machine() -> dict[str, object]:
    """Where the numbers were measured."""
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "cuda": torch.cuda.is_available(),
    }


def write_json(results: Sequence[RunResult], config: DemoConfig, devices: int, path: Path) -> None:
    """Everything measured, curves included, with the configuration and the machine.

    Examples:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     write_json([RunResult("single", 1, 1)], DemoConfig(), devices=1, path=Path(tmp) / "results.json")
        ...     sorted(json.loads((Path(tmp) / "results.json").read_text()))
        ['config', 'devices', 'machine', 'results']
    """
    payload = {
        "config": asdict(config),
        "devices": devices,
        "machine": machine(),
        "results": [asdict(r) for r in results],
    }
    path.write_text(json.dumps(payload, indent=2))


def write_figure(results: Sequence[RunResult], path: Path) -> bool:
    """Throughput, communication and loss curves side by side; ``False`` (and no file) without matplotlib.

    Examples:
        >>> results = [RunResult("single", 1, 1, samples_per_second=5120.0, loss_curve=[2.1, 1.4, 0.9])]
        >>> write_figure(results, Path("comparison.png"))  # doctest: +SKIP
        True
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ok = [r for r in results if r.status == "ok"]
    fig, (ax_tp, ax_comm, ax_loss) = plt.subplots(1, 3, figsize=(15, 4.2))
    names = [r.strategy for r in ok]
    ax_tp.bar(names, [r.samples_per_second or 0 for r in ok], color="tab:blue")
    ax_tp.set_title("throughput (samples/s, higher is better)")
    gradients = [r.comm_mb_per_step or 0 for r in ok]
    bars = ax_comm.bar(names, gradients, color="tab:orange", label="gradients (sent)")
    pipeline = [r.pipeline_mb_per_step or 0 for r in ok]
    if any(pipeline):
        ax_comm.bar(names, pipeline, bottom=gradients, color="tab:green", label="activations between stages")
        ax_comm.legend(fontsize="small")
    for bar, r in zip(bars, ok, strict=True):
        if r.comm_mb_per_step is None and r.pipeline_mb_per_step is None:  # one process, or nothing counted
            ax_comm.annotate("not measured", (bar.get_x() + bar.get_width() / 2, 0), ha="center", va="bottom")
    ax_comm.set_title("communication (MB per step, rank 0)")
    for r in ok:
        ax_loss.plot(range(1, len(r.loss_curve) + 1), r.loss_curve, label=r.strategy)
    ax_loss.set_title("training loss (rank 0's shard of each global batch)")
    ax_loss.set_xlabel("step")
    ax_loss.legend()
    for ax in (ax_tp, ax_comm):
        ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
