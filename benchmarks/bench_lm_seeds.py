"""Time to ddp's held-out loss seed by seed on the simulated cluster: ddp and ``streaming_diloco`` (or other variants)
on one link, each a ``bench_lm.py`` run a seed.

One ``bench_lm.py`` cell trains every variant from one seed, and a variant's time to ddp's final loss rests on where
one noisy loss curve first crosses another. Here each seed (the model's initialisation and the global batch sequence,
``bench_lm.py --seed``) runs ddp and each of ``--variants`` one after another on the same simulated link, with
``bench_lm.py``'s task and training settings (its defaults; ``--budget`` and ``--eval-seconds`` as given). A seed's
target is its own ddp run's final held-out loss, and a variant's share is its training time to that loss over ddp's
(interpolated between evaluations, as ``bench_lm.py`` does). Steps, step times and shares all come from the same
runs on the same machine. The JSON holds every run (one ``bench_lm.py`` cell a seed, with ``"seed"``), a table with
a row per seed and variant, and the shares' median. Needs root (network namespaces); without it the script says so
and exits with status 0. Always leaves the cluster down.

Usage::

    python benchmarks/bench_lm_seeds.py --seeds 0 1 2 3 --json benchmarks/results/lm_seeds.json
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
from pathlib import Path
from typing import Any

import bench_lm  # its workers train every run (the script's folder is on the path: run it as a script)

COLUMNS = ["seed", *bench_lm.COLUMNS[2:]]


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--seeds", nargs="+", type=int, default=[0, 1, 2, 3], help="ddp and each variant run once a seed"
    )
    parser.add_argument("--link", default="200mbit", help="the tc rate of the links")
    parser.add_argument("--nodes", type=int, default=2, help="nodes (one process each)")
    others = [v for v in bench_lm.VARIANTS if v != "ddp"]
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["streaming_diloco"],
        choices=others,
        metavar="VARIANT",
        help=f"what runs beside ddp (default: streaming_diloco; any of {', '.join(others)})",
    )
    parser.add_argument("--budget", type=float, default=60.0, help="training seconds of every run")
    parser.add_argument("--eval-seconds", type=float, default=5.0, help="training seconds between evaluations")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    parser.add_argument("--json", type=Path, help="write the results here")
    return parser


def training(args: argparse.Namespace, seed: int) -> argparse.Namespace:
    """``bench_lm.py``'s arguments (its defaults) for one seed's runs, with this run's budget and evaluations."""
    lm = bench_lm.arguments().parse_args([])
    lm.budget, lm.eval_seconds, lm.seed = args.budget, args.eval_seconds, seed
    return lm


def plan(args: argparse.Namespace) -> list[str]:
    """What a run would do, one line a seed."""
    runs = f"{', '.join(['ddp', *args.variants])} ({args.budget:.0f} s of training each)"
    return [f"seed {s}: {args.link} x {args.nodes} nodes: {runs}" for s in args.seeds]


def shares(cells: list[dict[str, Any]], variant: str) -> list[float | str]:
    """``variant``'s time to its seed's ddp loss over ddp's, one a cell, or why there is none: ``"not reached"``
    (it trained but never got there), ``"failed"`` (its run failed), ``"no ddp run"`` (the seed's ddp run failed)."""
    said: list[float | str] = []
    for cell in cells:
        rows = cell["variants"]
        if "ddp" not in rows:
            said.append("no ddp run")
        elif variant not in rows:
            said.append("failed")
        else:
            ratio = rows[variant]["ratio_to_ddp"]
            said.append("not reached" if ratio is None else ratio)
    return said


def median_share(values: list[float | str]) -> float | None:
    """The median of the shares among ``values`` (see :func:`shares`), a seed that trained but never reached its
    target counted as the longest and a failed run left out; ``None`` when the median falls among those never
    reached, or nothing ran.

    Examples:
        >>> median_share([0.3, 0.2, "not reached"]), median_share([0.3, "not reached", "not reached"])
        (0.3, None)
        >>> median_share([0.3, "failed", 0.5]), median_share(["failed"])
        (0.4, None)
    """
    ran = [math.inf if v == "not reached" else v for v in values if isinstance(v, float) or v == "not reached"]
    if not ran:
        return None
    middle = statistics.median(ran)
    return None if math.isinf(middle) else middle


def table(cells: list[dict[str, Any]]) -> list[list[Any]]:
    """One row per seed and run: ``bench_lm.py``'s row, the seed in place of the link and node count."""
    return [[cell["seed"], *row[2:]] for cell in cells for row in bench_lm.table([cell])]


def quote(cells: list[dict[str, Any]], variants: list[str]) -> str:
    """The sentence the docs quote: each variant's share of ddp's time seed by seed, their median, and the range of
    its step over ddp's (the share it would take needing as many steps as ddp); a run that failed is named."""
    cell = cells[0]
    seeds = ", ".join(str(c["seed"]) for c in cells)
    ran = [c for c in cells if "ddp" in c["variants"]]
    said = []
    for variant in variants:
        values = shares(cells, variant)
        each = ", ".join(v if isinstance(v, str) else f"{v:.2f}" for v in values)
        middle = median_share(values)
        short = "most seeds fell short" if "not reached" in values else "no run to take it from"
        median = f"median {middle:.2f}" if middle is not None else f"no median: {short}"
        steps = [
            c["variants"][variant]["seconds_per_step"] / c["variants"]["ddp"]["seconds_per_step"]
            for c in ran
            if variant in c["variants"]
        ]
        step = f", a step taking {min(steps):.2f} to {max(steps):.2f} of ddp's" if steps else ""
        name = bench_lm.NAMES.get(variant, f"`{variant}`")
        said.append(f"{name} reached its seed's ddp loss in {each} of ddp's time ({median}){step}")
    ddp_steps = [c["variants"]["ddp"]["seconds_per_step"] for c in ran]
    ddp = f" ddp's step took {min(ddp_steps):.2f} to {max(ddp_steps):.2f} s." if ddp_steps else ""
    return (
        f"Over {cell['link']} between {cell['nodes']} nodes, seeds {seeds}, each against its own ddp run: "
        f"{'; '.join(said)}.{ddp}"
    )


def main() -> None:
    args = arguments().parse_args()
    for line in plan(args):
        print(line)
    if args.dry_run:
        return
    if os.geteuid() != 0:
        print("bench_lm_seeds.py needs root for the simulated cluster (network namespaces and tc); nothing measured.")
        return
    from _results import Report, machine

    started = machine()
    cells = []
    for seed in args.seeds:
        print(f"seed {seed}:", flush=True)
        cell = bench_lm.measure_cell(args.link, args.nodes, ["ddp", *args.variants], training(args, seed))
        cells.append({**cell, "seed": seed})
    settings = {"seeds": args.seeds, "link": args.link, "nodes": args.nodes, "variants": args.variants}
    lm = training(args, args.seeds[0])
    settings.update({k: getattr(lm, k) for k in bench_lm.TRAINING if k != "seed"})
    report = Report("lm_seeds", settings, started)
    notes = [f"seed {c['seed']}: {bench_lm.cell_note(c)}" for c in cells]
    notes += [f"seed {c['seed']}: {run} failed (its error is in the JSON)" for c in cells for run in c["failed"]]
    report.table("Time to each seed's ddp held-out loss", COLUMNS, table(cells), notes)
    report.data["quotes"] = {"shares": quote(cells, args.variants)}
    report.data["cells"] = cells
    for row in table(cells):
        print("  ".join(str(c) for c in row))
    print(report.data["quotes"]["shares"])
    report.save(args.json)


if __name__ == "__main__":
    main()
