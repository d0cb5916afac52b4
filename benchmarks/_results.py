"""What every benchmark stores with ``--json PATH``: its tables, its settings, the machine and the command line.

``benchmarks/render_docs.py`` turns the stored files (``benchmarks/results/NAME.json``) into the tables of
``docs/benchmarks.md``. A stored file looks like::

    {"benchmark": "plan", "command": "python benchmarks/bench_plan.py --repeats 9 --json ...",
     "machine": {"platform": ..., "cpu_count": 2, "torch": "2.13.0+cpu", ...},
     "settings": {"repeats": 9, ...},
     "tables": [{"title": ..., "columns": [...], "rows": [[...], ...], "notes": [...]}],
     "notes": [...]}
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def cpu_model() -> str:
    """The CPU's model name as ``/proc/cpuinfo`` gives it (``"unknown"`` where it gives none)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown"
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown")


def machine() -> dict[str, Any]:
    """The machine and software a measurement ran on, the processor's model included (a result can depend on it)."""
    import torch

    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        affinity = None
    try:
        load = round(os.getloadavg()[0], 1)
    except OSError:
        load = None
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cores_usable": affinity,
        "load_average_at_start": load,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def command_line() -> str:
    """The command that ran, with the script's path relative to the repository."""
    script = Path(sys.argv[0]).resolve()
    try:
        shown = str(script.relative_to(ROOT))
    except ValueError:
        shown = script.name
    return shlex.join(["python", shown, *sys.argv[1:]])


def save_figure(fig: Any, path: Path) -> None:
    """Lay out a matplotlib figure, write it to ``path`` (its folder made if missing) and say so."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


class Report:
    """Tables and notes of one benchmark run, written as JSON by :meth:`save`."""

    def __init__(self, benchmark: str, settings: dict[str, Any], started: dict[str, Any] | None = None) -> None:
        """``started``: :func:`machine` as taken before the measurement (its load average is the start's); by default
        it is taken now, which is right only for a report made before anything ran."""
        self.data: dict[str, Any] = {
            "benchmark": benchmark,
            "command": command_line(),
            "machine": dict(started) if started is not None else machine(),
            "settings": {k: v for k, v in settings.items() if k != "json"},
            "tables": [],
            "notes": [],
        }

    def table(self, title: str, columns: list[str], rows: list[list[Any]], notes: list[str] | None = None) -> None:
        """Add a table: ``rows`` hold the cells as printed (strings) or numbers."""
        self.data["tables"].append({"title": title, "columns": columns, "rows": rows, "notes": list(notes or [])})

    def note(self, text: str) -> None:
        """Add a line that belongs to the whole run (a fitted link, a summary)."""
        self.data["notes"].append(text)

    def save(self, path: str | Path | None) -> None:
        """Write the JSON file (nothing when ``path`` is ``None``)."""
        if path is None:
            return
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.data, indent=2) + "\n")
        print(f"wrote {path}")
