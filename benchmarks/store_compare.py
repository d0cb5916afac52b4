"""Run the README's ``lightning-dp-strategies compare`` and store its ``comparison.json`` among the results, so the
README's comparison tables are rendered from a stored run (``benchmarks/render_docs.py``, ``doc_values.COMPARE``).

Usage::

    # the built-in demo (README: lightning-dp-strategies compare), and its figure
    python benchmarks/store_compare.py --json benchmarks/results/compare.json --figure docs/figures/comparison.png
    # docs/examples' model (README: cd docs/examples && lightning-dp-strategies compare --model ... --data ...)
    python benchmarks/store_compare.py --user --json benchmarks/results/compare_user.json
    # the demo with streaming DiLoCo's merge knobs (benchmarks/streaming_variants.py), for the local SGD page
    python benchmarks/store_compare.py --streaming --json benchmarks/results/compare_streaming.json
    # the figure again from the stored run, with the installed package's drawing code (nothing runs)
    python benchmarks/store_compare.py --redraw --json benchmarks/results/compare.json \
        --figure docs/figures/comparison.png

The command runs with its defaults, its ``--output`` a temporary folder, from the repository's root (the demo),
``docs/examples`` (``--user``) or ``benchmarks`` (``--streaming``: the demo with :data:`STREAMING`'s arguments).
The stored file is the command's ``comparison.json`` (configuration, devices, every row with its curves) with what
every stored result names: ``benchmark``, ``command`` (this script's command line), ``ran`` (the compare command and
the folder it ran in, relative to the repository) and ``machine`` (the benchmarks' block of ``_results.machine()``,
taken just before the run: usable cores and the load average included); the command's own shorter block is kept as
``compare_machine``. Machine paths are relativised: the temporary output
folder reads ``comparison`` (the command's default), the repository ``.``; the script refuses to store a file that
still names one. It also refuses a run whose JSON does not give back, through the package's ``format_table``, the
table the command printed: that is what the README and the docs show.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from _results import ROOT, command_line, machine
from doc_values import compare_printed

DEMO: list[str] = []
USER = ["--model", "my_models:Forecaster", "--data", "my_models:SeriesData"]
STREAMING = ["--import", "streaming_variants", "--strategies"]
STREAMING += ["single,local_sgd,streaming_delay_1,streaming_delay_0,streaming_mixing_half"]
RUNS = {  # what each kind of run passes, the folder it runs in, the stored benchmark's name
    "demo": (DEMO, ROOT, "compare"),
    "user": (USER, ROOT / "docs" / "examples", "compare_user"),
    "streaming": (STREAMING, ROOT / "benchmarks", "compare_streaming"),
}


def run_compare(kind: str, output: Path) -> tuple[str, list[str], Path]:
    """Run the comparison of ``kind`` (a key of :data:`RUNS`) into ``output``: what it printed, its arguments and the
    folder it ran in."""
    args, where, _ = RUNS[kind]
    cmd = [sys.executable, "-m", "lightning_dp_strategies", "compare", *args, "--output", str(output)]
    done = subprocess.run(cmd, cwd=where, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    print(done.stdout, end="")
    if done.returncode not in (0, 1) or not (output / "comparison.json").exists():  # 1: a row did not run
        sys.exit(f"the comparison failed (exit {done.returncode}): nothing stored")
    return done.stdout, args, where


def relativise(text: str, output: Path) -> str:
    """``text`` with the temporary output folder as ``comparison`` and the repository as ``.``; exits if a machine path
    is left."""
    text = text.replace(str(output), "comparison").replace(str(ROOT), ".")
    left = [p for p in (tempfile.gettempdir(), str(Path.home())) if p in text]
    if left:
        sys.exit(f"the stored JSON would name {left}: nothing stored")
    return text


def redraw(stored: Path, figure: Path) -> None:
    """Draw ``figure`` from the rows of the stored run ``stored``, as the compare command draws its own."""
    from lightning_dp_strategies.compare.report import write_figure
    from lightning_dp_strategies.compare.runner import RunResult

    rows = [RunResult(**row) for row in json.loads(stored.read_text())["results"]]
    if not write_figure(rows, figure):
        sys.exit("--redraw needs matplotlib")
    print(f"wrote {figure}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--user", action="store_true", help="docs/examples' Forecaster instead of the built-in demo")
    which.add_argument("--streaming", action="store_true", help="the demo with streaming DiLoCo's merge knobs")
    parser.add_argument("--json", type=Path, required=True, help="where to store the run")
    parser.add_argument("--figure", type=Path, help="also copy the run's comparison.png here")
    parser.add_argument("--redraw", action="store_true", help="only draw --figure from the stored --json; run nothing")
    args = parser.parse_args()
    if args.redraw:
        if args.figure is None:
            parser.error("--redraw draws --figure: name it")
        redraw(args.json, args.figure)
        return
    at_start = machine()
    with tempfile.TemporaryDirectory(prefix="store-compare-") as tmp:
        output = Path(tmp) / "comparison"
        kind = "user" if args.user else "streaming" if args.streaming else "demo"
        printed, compare_args, where = run_compare(kind, output)
        data = json.loads((output / "comparison.json").read_text())
        if f"\n{compare_printed(data)}\n\nwrote to " not in printed:
            sys.exit("format_table of comparison.json is not the table the command printed: nothing stored")
        stored = {
            "benchmark": RUNS[kind][2],
            "command": command_line(),
            "ran": {
                "command": shlex.join(["lightning-dp-strategies", "compare", *compare_args]),
                "in": where.relative_to(ROOT).as_posix(),
            },
            "machine": at_start,
            "compare_machine": data.pop("machine"),
            **data,
        }
        text = relativise(json.dumps(stored, indent=2) + "\n", output)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
        print(f"wrote {args.json}")
        if args.figure:
            args.figure.parent.mkdir(parents=True, exist_ok=True)
            args.figure.write_bytes((output / "comparison.png").read_bytes())
            print(f"wrote {args.figure}")


if __name__ == "__main__":
    main()
