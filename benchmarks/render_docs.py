"""Regenerate the result tables of the docs (``docs/benchmarks.md``, ``docs/network.md``, ``docs/sharding.md``,
``docs/slow_links.md``, ``docs/fault_tolerance.md``) from the stored runs in ``benchmarks/results/*.json``.

Each table sits between markers named after its result file::

    <!-- results:plan -->
    ... generated from benchmarks/results/plan.json: the machine, the command, the tables ...
    <!-- /results:plan -->

Everything between the markers is replaced; the rest of the page is left alone. A marker whose file is missing gets
the command that produces it instead of a table. A sentence of the page's text that quotes measured numbers sits
between quote markers, inline, naming the result file and one of its ``quotes``::

    ... <!-- quote:survive/kill -->the sentence stored under "quotes": {"kill": ...}<!-- /quote:survive/kill --> ...

Usage::

    python benchmarks/render_docs.py            # rewrite the pages
    python benchmarks/render_docs.py --check    # exit 1 if a page is not what the stored results give
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PAGES = tuple(
    ROOT / "docs" / page
    for page in ("benchmarks.md", "network.md", "sharding.md", "slow_links.md", "fault_tolerance.md")
)
RESULTS = ROOT / "benchmarks" / "results"

COMMANDS = {
    "plan": "python benchmarks/bench_plan.py --repeats 15",
    "pipeline_schedules": "python benchmarks/bench_pipeline_schedules.py --micro 2,4 --steps 8",
    "pipeline_schedules_dp": (
        "python benchmarks/bench_pipeline_schedules.py --data-parallel 2 --schedules 1f1b,zbv --micro 4"
    ),
    "pipeline_memory": "python benchmarks/bench_pipeline_memory.py --stages 1 2 4",
    "hybrid_pipeline": "python benchmarks/bench_hybrid_pipeline.py --steps 12",
    "ring_allreduce_a": "python benchmarks/bench_ring_allreduce.py --part a",
    "ring_allreduce_b": "python benchmarks/bench_ring_allreduce.py --part b",
    "ring_allreduce_c": "python benchmarks/bench_ring_allreduce.py --part c",
    "step_phases": "python benchmarks/bench_step_phases.py",
    "scatter_gather": "python benchmarks/bench_scatter_gather.py",
    "cluster": "python benchmarks/bench_cluster.py",
    "local_sgd": "python benchmarks/bench_local_sgd.py",
    "network_guide": "python benchmarks/cluster_model.py --guide",
    "zero": "python benchmarks/bench_zero.py",
    "lm": "python benchmarks/bench_lm.py --links 200mbit 1gbit --nodes 2",
    "restart": "python benchmarks/bench_restart.py --tries 4",
}
"""The command that produces each result file (without ``--json``), shown where the file is missing."""

MARKER = re.compile(r"(<!-- results:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /results:(?P=name) -->)", re.S)
QUOTE = re.compile(r"(<!-- quote:(?P<name>\w+)/(?P<key>\w+) -->)(?P<body>[^<]*)(<!-- /quote:(?P=name)/(?P=key) -->)")


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("*", "\\*")


def _table(columns: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(_cell(c) for c in columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
    for row in rows:
        cells = [*row, *[""] * (len(columns) - len(row))]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return lines


def _machine(data: dict[str, Any]) -> str:
    m = data.get("machine", {})
    cores = m.get("cpu_count")
    usable = m.get("cores_usable")
    parts = [
        f"{m.get('platform', '?')}",
        f"{cores} CPU cores" + (f" ({usable} usable)" if usable not in (None, cores) else ""),
    ]
    if m.get("cuda"):
        parts.append(m["cuda"])
    else:
        parts.append("no GPU")
    parts.append(f"Python {m.get('python', '?')}, torch {m.get('torch', '?')}")
    if m.get("load_average_at_start") is not None:
        parts.append(f"load average {m['load_average_at_start']} at the start")
    return "; ".join(parts)


def render(name: str) -> str:
    """The Markdown that goes between the markers of ``name``."""
    path = RESULTS / f"{name}.json"
    command = COMMANDS.get(name, f"python benchmarks/bench_{name}.py")
    if not path.exists():
        return (
            "No stored result: this table is produced on your machine by\n\n"
            f"```bash\n{command} --json benchmarks/results/{name}.json\npython benchmarks/render_docs.py\n```\n"
        )
    data = json.loads(path.read_text())
    ran = re.sub(r" --json \S+", "", data["command"])  # where the file went is said below
    if "machine" in data:
        lines = [f"*Machine:* {_machine(data)}.  ", f"*Command:* `{ran} --json benchmarks/results/{name}.json`.", ""]
    else:  # computed, not measured
        lines = [f"*Computed by:* `{ran}`.", ""]
    m = data.get("machine", {})
    load, cores = m.get("load_average_at_start"), m.get("cpu_count")
    if load is not None and cores and load >= cores:
        lines += [
            f"*Caveat:* the load average was {load} on {cores} cores at the start: more runnable processes than "
            "cores over the preceding minutes, so the timed contenders' times may spread more than on an idle "
            "machine (byte and memory counts are unaffected); rerun on an idle machine, with the script's defaults, "
            "for steadier ratios.",
            "",
        ]
    for note in data.get("notes", []):
        lines.append(f"- {note}")
    if data.get("notes"):
        lines.append("")
    for table in data.get("tables", []):
        lines += [f"**{table['title']}**", ""]
        lines += _table(table["columns"], table["rows"])
        lines.append("")
        for note in table.get("notes", []):
            lines.append(f"- {note}")
        if table.get("notes"):
            lines.append("")
    return "\n".join(lines)


def quote(name: str, key: str) -> str:
    """The sentence stored as ``quotes[key]`` in ``name``'s result file, or what to run when there is none."""
    path = RESULTS / f"{name}.json"
    said = json.loads(path.read_text()).get("quotes", {}).get(key) if path.exists() else None
    if said is None:
        command = COMMANDS.get(name, f"python benchmarks/bench_{name}.py")
        return f"(not measured yet: `{command} --json benchmarks/results/{name}.json`)"
    return str(said)


def render_page(page: Path, check: bool) -> bool:
    """Rewrite (or with ``check`` only compare) ``page``'s result blocks and quotes; whether it was up to date."""
    text = page.read_text()
    names = [m.group("name") for m in MARKER.finditer(text)]
    new = MARKER.sub(lambda m: m.group(1) + render(m.group("name")) + m.group(4), text)
    new = QUOTE.sub(lambda m: m.group(1) + quote(m.group("name"), m.group("key")) + m.group(5), new)
    if check:
        print(f"{page} is {'up to date' if new == text else 'out of date'} ({len(names)} result blocks)")
        return new == text
    page.write_text(new)
    stored = [n for n in names if (RESULTS / f"{n}.json").exists()]
    print(f"rendered {len(names)} result blocks into {page} ({len(stored)} from stored results: {', '.join(stored)})")
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check that the pages are up to date")
    parser.add_argument("--page", type=Path, action="append", help="only this page (default: all of them)")
    args = parser.parse_args()
    fresh = [render_page(page, args.check) for page in args.page or PAGES]
    if not all(fresh):
        print("run python benchmarks/render_docs.py", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
