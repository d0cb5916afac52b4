"""Regenerate what the docs state about measurements from the stored runs in ``benchmarks/results/*.json``: the
result tables, and every measured number the pages' prose quotes. Every page of ``docs/`` and ``README.md`` is read.

Each table sits between markers named after its result file::

    <!-- results:plan -->
    ... generated from benchmarks/results/plan.json: the machine, the command, the tables ...
    <!-- /results:plan -->

Everything between the markers is replaced; the rest of the page is left alone. A marker whose file is missing gets
the command that produces it instead of a table. A sentence of the page's text that quotes measured numbers sits
between quote markers, inline, naming the result file and one of its ``quotes``::

    ... <!-- quote:survive/kill -->the sentence stored under "quotes": {"kill": ...}<!-- /quote:survive/kill --> ...

A single number (or a short phrase, a small table, a log) the text takes from a result sits between value markers,
inline, naming the result file and a function of it in ``benchmarks/doc_values.py`` (``VALUES[NAME][KEY]``, a
named, typed function of the stored JSON: nothing written in a page is evaluated)::

    ... two levels were <!-- value:cluster/two_level_1gbit_2x2 -->0.75x<!-- /value:cluster/two_level_1gbit_2x2 -->
    the flat ring's step ...

``--check`` fails, naming the page and the marker, where a table, a quote or a value differs from what the stored
results give; both modes fail on a value marker that names a missing file or a function ``doc_values`` lacks, or that
is never closed.

Usage::

    python benchmarks/render_docs.py            # rewrite the pages
    python benchmarks/render_docs.py --check    # exit 1 if a page is not what the stored results give
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from doc_values import VALUES

ROOT = Path(__file__).resolve().parents[1]
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")))
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
    "local_sgd_ft": (
        "python benchmarks/bench_local_sgd.py --layouts 2 --variants ddp local_sgd_8 local_sgd_8_ft --steps 160"
    ),
    "network_guide": "python benchmarks/cluster_model.py --guide",
    "zero": "python benchmarks/bench_zero.py",
    "lm": "python benchmarks/bench_lm.py --links 200mbit 1gbit --nodes 2 4",
    "lm_amd": "python benchmarks/bench_lm.py --links 200mbit --nodes 2",
    "lm_seeds": (
        "python benchmarks/bench_lm_seeds.py --seeds 0 1 2 3 --variants streaming_diloco ring_allreduce_auto local_sgd"
    ),
    "lm_steps": "python benchmarks/bench_lm_steps.py --seeds 0 1 2 3",
    "lm_steps_knobs": (
        "python benchmarks/bench_lm_steps.py --seeds 0 1 2 3 --variants ddp streaming_diloco streaming_outer_lr_1.2 "
        "streaming_every_2"
    ),
    "lm_steps_every_1": "python benchmarks/bench_lm_steps.py --seeds 0 1 2 3 --variants ddp local_sgd_every_1",
    "lm_steps_delay_0": "python benchmarks/bench_lm_steps.py --seeds 0 1 2 3 --variants ddp streaming_delay_0",
    "lm_steps_long": (
        "python benchmarks/bench_lm_steps.py --seeds 0 1 2 3 --variants ddp streaming_diloco --steps 225 "
        "--eval-from 185 --target-step 195"
    ),
    "restart": "python benchmarks/bench_restart.py --tries 4",
    "survive_local_sgd": "python benchmarks/bench_survive.py --strategy local_sgd",
    "compare": "python benchmarks/store_compare.py --figure docs/figures/comparison.png",
    "compare_user": "python benchmarks/store_compare.py --user",
    "compare_streaming": "python benchmarks/store_compare.py --streaming",
}
"""The command that produces each result file (without ``--json``), shown where the file is missing."""

MARKER = re.compile(
    r"(?P<open><!-- results:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(?P<close><!-- /results:(?P=name) -->)", re.S
)
QUOTE = re.compile(
    r"(?P<open><!-- quote:(?P<name>\w+)/(?P<key>\w+) -->)(?P<body>[^<]*)(?P<close><!-- /quote:(?P=name)/(?P=key) -->)"
)
VALUE = re.compile(
    r"(?P<open><!-- value:(?P<name>\w+)/(?P<key>\w+) -->)(?P<body>.*?)(?P<close><!-- /value:(?P=name)/(?P=key) -->)",
    re.S,
)
VALUE_OPEN = re.compile(r"<!-- value:[^>]*-->")


class MarkerError(Exception):
    """A marker that names nothing the stored results or ``doc_values`` give."""


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
        *([m["cpu"]] if m.get("cpu") else []),  # the processor's model, where the run recorded it
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
    *steps, last = data["command"].split(" && ")  # a chain of commands keeps its earlier steps' outputs
    # the last step's output is said below; a figure written outside the repository is not part of the result
    ran = " && ".join([*steps, re.sub(r" --json[ =]\S+| --figure[ =]/\S+", "", last)])
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


def value(name: str, key: str) -> str:
    """What ``doc_values.VALUES[name][key]`` gives for ``name``'s stored result file."""
    known = VALUES.get(name, {})
    if key not in known:
        offer = ", ".join(sorted(known)) or "none"
        raise MarkerError(f"benchmarks/doc_values.py has no value {key!r} for {name}.json (it has: {offer})")
    path = RESULTS / f"{name}.json"
    if not path.exists():
        command = COMMANDS.get(name, f"python benchmarks/bench_{name}.py")
        raise MarkerError(f"no stored result {path.name}: `{command} --json benchmarks/results/{name}.json`")
    try:
        return known[key](json.loads(path.read_text()))
    except (KeyError, IndexError, TypeError, ValueError, StopIteration) as error:
        raise MarkerError(f"{name}.json lacks what {key!r} reads ({type(error).__name__}: {error})") from error


def _clip(text: str, limit: int = 100) -> str:
    flat = " ".join(text.split())
    return repr(flat if len(flat) <= limit else flat[: limit - 3] + "...")


def _difference(said: str, given: str) -> str:
    """How a marker's text differs from what the results give: both, or their first differing line in a block."""
    if "\n" not in said.strip() and "\n" not in given.strip():
        return f"says {_clip(said)}, the stored results give {_clip(given)}"
    lines, wanted = said.strip("\n").splitlines(), given.strip("\n").splitlines()
    for number, (line, want) in enumerate(zip(lines, wanted, strict=False), start=1):
        if line != want:
            return f"line {number} says {_clip(line)}, the stored results give {_clip(want)}"
    return f"has {len(lines)} lines, the stored results give {len(wanted)}"


def render_page(page: Path, check: bool) -> bool:
    """Rewrite (or with ``check`` only compare) ``page``'s result blocks, quotes and values; whether it was up to date
    (with ``check``) or every marker could be filled. Each difference and each bad marker is printed, with the page."""
    text = page.read_text()
    where = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page
    problems: list[str] = []  # markers that name nothing: fail both modes
    stale: list[str] = []  # markers whose text is not what the results give: fail --check

    def fill(body_of: Callable[[re.Match[str]], str], whole: bool = False) -> Callable[[re.Match[str]], str]:
        def substitute(match: re.Match[str]) -> str:
            marker = match.group("open").strip()
            try:
                body = body_of(match)
            except MarkerError as error:
                problems.append(f"{where}: {marker}: {error}")
                return match.group(0)
            if body != match.group("body"):
                said = "differs from what the stored results give" if whole else _difference(match.group("body"), body)
                stale.append(f"{where}: {marker} {said}")
            return match.group("open") + body + match.group("close")

        return substitute

    closed = {m.start() for m in VALUE.finditer(text)}
    for match in VALUE.finditer(text):
        line = text[text.rfind("\n", 0, match.start()) + 1 : match.start()]
        if "\n" not in match.group("body") and not line.strip():
            problems.append(
                f"{where}: {match.group('open')} starts a line: Markdown takes a line that opens with a comment for an "
                "HTML block and cuts the paragraph there; put the word before it on its line"
            )
    for opening in VALUE_OPEN.finditer(text):
        if opening.start() not in closed:
            problems.append(
                f"{where}: {opening.group(0)} opens no value marker "
                "(<!-- value:NAME/KEY -->TEXT<!-- /value:NAME/KEY -->, NAME and KEY letters, digits and _)"
            )
    new = MARKER.sub(fill(lambda m: render(m.group("name")), whole=True), text)
    new = QUOTE.sub(fill(lambda m: quote(m.group("name"), m.group("key"))), new)
    new = VALUE.sub(fill(lambda m: value(m.group("name"), m.group("key"))), new)
    markers = (len(MARKER.findall(text)), len(QUOTE.findall(text)), len(closed))
    counts = "{} result blocks, {} quotes, {} values".format(*markers)
    for line in problems + (stale if check else []):
        print(line, file=sys.stderr)
    if not any(markers) and not problems:  # a page that states no measurement
        return True
    if check:
        print(f"{where} is {'up to date' if new == text and not problems else 'out of date'} ({counts})")
        return new == text and not problems
    if new != text:
        page.write_text(new)
    print(f"rendered {where} ({counts}{f', {len(problems)} bad markers left as they were' if problems else ''})")
    return not problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check that the pages are up to date")
    parser.add_argument("--page", type=Path, action="append", help="only this page (default: all of them)")
    args = parser.parse_args()
    fresh = [render_page(page, args.check) for page in args.page or PAGES]
    if not all(fresh):
        print(
            "render with python benchmarks/render_docs.py; a value it cannot give needs its function in "
            "benchmarks/doc_values.py, or a marker that names one",
            file=sys.stderr,
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
