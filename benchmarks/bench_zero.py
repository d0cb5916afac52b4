"""Sharded optimizer state (ZeRO stage 1) against the unsharded ring: optimizer memory per rank and step time, Adam.

Every variant trains the same 12.6 M-parameter MLP (12 layers of 1024, tanh; 50 MB of fp32 parameters, so 101 MB of
Adam state) with ``torch.optim.Adam`` and Lightning's Trainer, batch 32 per rank, on the same data and seed:

    ring    RingAllReduceStrategy(two_level=False): gradients all-reduced, every rank steps the whole model
    zero    RingAllReduceStrategy(two_level=False, shard_optimizer_state=True): gradients reduce-scattered, each rank
            steps (and keeps the Adam state of) its 1/N of the parameters, then the parameters are all-gathered
    ddp     Lightning's own DDP, a reference

Settings (``--links`` x ``--layouts``): ``loopback`` runs NODES x PROCS processes on this machine (gloo over
loopback, no root needed); a tc rate such as ``1gbit`` runs NODES simulated nodes of PROCS processes each, joined by
links of that rate (``benchmarks/netsim.py``; needs root: without it those settings are skipped with a message and the
script exits with status 0). Every process runs one thread (``OMP_NUM_THREADS=1``).

In each setting the variants take turns launch by launch (the order flipped every launch); a figure is the median
over launches of each launch's median steady-state step (the slowest rank's). Per rank each launch records the bytes
of the tensors in ``trainer.optimizers[0].state`` (sharded: this rank's pieces), its peak RSS, the phases of a step
(forward, backward, the wait for the gradients after backward, the optimizer step, and for ``zero`` the parameter
all-gather inside it) and the strategy's per-step communication (bytes sent, seconds on the communication thread).
Each launch saves rank 0's final parameters; the table gives every variant's largest difference from ``ring``'s in
the same launch round (the same data, seed and steps). Always leaves the simulated cluster down.

Usage::

    python benchmarks/bench_zero.py --json benchmarks/results/zero.json
    python benchmarks/bench_zero.py --links 1gbit --layouts 4x1 --json benchmarks/results/zero.json --merge
    python benchmarks/bench_zero.py --plot benchmarks/results/zero.json --figure docs/figures/zero.png
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from _launch import (
    ROOT,
    add_comparison_arguments,
    fit_rank,
    launch_order,
    measured_cluster,
    parse_or_work,
    torchrun_local,
    torchrun_on_cluster,
    worker_command,
)

VARIANTS = ("ring", "zero", "ddp")
PHASES = ("forward_ms", "backward_ms", "wait_ms", "optimizer_ms", "gather_ms")
"""A step's phases (medians over the steady steps): forward, backward, after backward until the optimizer step (the
wait for the gradients), the optimizer step with what the strategy does after it, and of that the all-gather."""


def make_strategy(variant: str, bucket_cap_mb: float = 25.0) -> Any:
    """The Trainer's ``strategy=`` for ``variant``."""
    from lightning_dp_strategies import RingAllReduceStrategy

    if variant == "ddp":
        return "ddp"
    sharded = {"ring": False, "zero": True}[variant]
    return RingAllReduceStrategy(two_level=False, bucket_cap_mb=bucket_cap_mb, shard_optimizer_state=sharded)


def state_bytes(optimizer: Any) -> int:
    """Bytes of the tensors an optimizer's ``state`` holds (sharded: this rank's pieces' state)."""
    import torch

    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))


def worker(args: argparse.Namespace) -> None:
    """One rank of one launch (started by torchrun, on loopback or on every simulated node)."""
    import lightning as L
    import torch
    from torch import nn

    torch.set_num_threads(1)  # the processes share the machine's cores

    class Probe(L.Callback):
        """Times each step's phases; at the end, reads the optimizer state and the communication counts."""

        def __init__(self) -> None:
            self.marks: list[dict[str, float]] = []
            self.gather: list[float] = []
            self.sent: list[float] = []
            self.comm: list[float] = []
            self.state = 0
            self.buffers: int | None = None
            self.workspaces: int | None = None

        def on_train_start(self, trainer: L.Trainer, *_: Any) -> None:
            sharding = getattr(trainer.strategy, "sharding", None)
            if sharding is not None and sharding.attached:  # time the all-gather after each optimizer step
                after_step = sharding.after_step

                def timed(optimizer: Any) -> None:
                    start = time.perf_counter()
                    after_step(optimizer)
                    self.gather.append(time.perf_counter() - start)

                sharding.after_step = timed
            grad_sync = getattr(trainer.strategy, "grad_sync", None)
            if grad_sync is not None:  # backward ends where the wait for the buckets begins (before the hooks)
                finish = grad_sync.finish

                def timed_finish() -> None:
                    self.marks[-1]["backward_end"] = time.perf_counter()
                    finish()

                grad_sync.finish = timed_finish

        def on_train_batch_start(self, *_: Any) -> None:
            self.marks.append({"start": time.perf_counter()})

        def on_before_backward(self, *_: Any) -> None:
            self.marks[-1]["backward"] = time.perf_counter()

        def on_after_backward(self, *_: Any) -> None:  # ddp: torch's reducer has waited inside backward
            self.marks[-1].setdefault("backward_end", time.perf_counter())

        def on_before_optimizer_step(self, *_: Any) -> None:
            self.marks[-1]["optimizer"] = time.perf_counter()

        def on_train_batch_end(self, trainer: L.Trainer, *_: Any) -> None:
            self.marks[-1]["end"] = time.perf_counter()
            stats = getattr(trainer.strategy, "step_stats", None)
            self.sent.append(stats.bytes_sent if stats is not None else float("nan"))
            self.comm.append(stats.comm_seconds if stats is not None else float("nan"))

        def on_train_end(self, trainer: L.Trainer, *_: Any) -> None:  # before teardown releases the buffers
            self.state = state_bytes(trainer.optimizers[0])
            buckets = getattr(trainer.strategy, "buckets", None)
            self.buffers = sum(b.buffer.nbytes for b in buckets.buckets) if buckets is not None else None
            gather = getattr(getattr(trainer.strategy, "sharding", None), "gather", None)
            self.workspaces = sum(w.nbytes for w in gather._workspaces) if gather is not None else None

    class MLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            layers = [m for _ in range(args.depth) for m in (nn.Linear(args.width, args.width), nn.Tanh())]
            self.net = nn.Sequential(*layers, nn.Linear(args.width, 10))

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    probe = Probe()
    trainer, model = fit_rank(MLP, lambda: make_strategy(args.worker, args.bucket_cap_mb), probe, args)
    Path(args.out).with_name(f"{Path(args.out).stem}-rank{trainer.global_rank}.json").write_text(
        json.dumps(rank_result(args, probe, model, trainer.global_rank))
    )
    if trainer.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, Path(args.out).with_suffix(".pt"))


def rank_result(args: argparse.Namespace, probe: Any, model: Any, rank: int) -> dict[str, Any]:
    """One rank's figures of one launch (medians over the steps after ``args.warmup``)."""
    import math
    import resource

    marks = probe.marks[1:][args.warmup :]  # a step is the time between two ends of a batch
    ends = [m["end"] for m in probe.marks]
    steps = [b - a for a, b in itertools.pairwise(ends)][args.warmup :]

    def phase(a: str, b: str) -> float:
        return 1e3 * statistics.median(m[b] - m[a] for m in marks)

    gather = probe.gather[1:][args.warmup :]
    sent, comm = probe.sent[1:][args.warmup :], probe.comm[1:][args.warmup :]
    return {
        "variant": args.worker,
        "rank": rank,
        "step_ms": 1e3 * statistics.median(steps),
        "steps_ms": [1e3 * s for s in steps],
        "forward_ms": phase("start", "backward"),
        "backward_ms": phase("backward", "backward_end"),
        "wait_ms": phase("backward_end", "optimizer"),
        "optimizer_ms": phase("optimizer", "end"),
        "gather_ms": 1e3 * statistics.median(gather) if gather else None,
        "bytes_sent_per_step": statistics.median(sent) if not any(map(math.isnan, sent)) else None,
        "comm_ms_per_step": 1e3 * statistics.median(comm) if not any(map(math.isnan, comm)) else None,
        "state_bytes": probe.state,
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "bucket_buffer_bytes": probe.buffers,
        "gather_workspace_bytes": probe.workspaces,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # KiB on Linux
    }


# ---------------------------------------------------------------------- launching
WORKER_SETTINGS = ("width", "depth", "steps", "batch", "warmup", "bucket_cap_mb")
"""The settings a rank is started with."""


def launch(variant: str, cell: dict[str, Any], args: argparse.Namespace, folder: Path, name: str) -> dict[str, Any]:
    """One launch of ``variant`` in ``cell`` (on loopback, or on the simulated cluster that is up; one thread a
    process): every rank's result, in rank order."""
    out = folder / f"{name}.json"
    script = worker_command(__file__, variant, out, args, WORKER_SETTINGS)
    what = f"{variant} ({cell['link']} {cell['nodes']}x{cell['per_node']})"
    if cell["link"] == "loopback":
        torchrun_local(cell["nodes"] * cell["per_node"], script, what, timeout=1800, NNODES="1")
    else:
        torchrun_on_cluster(cell["per_node"], script, folder, what)
    ranks = sorted(folder.glob(f"{name}-rank*.json"), key=lambda p: int(p.stem.rsplit("rank", 1)[1]))
    return {"ranks": [json.loads(p.read_text()) for p in ranks]}


def max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def measure_cell(link: str, nodes: int, per_node: int, args: argparse.Namespace) -> dict[str, Any]:
    """Every variant in one setting, launches interleaved (the order flipped each launch)."""
    import torch
    from _results import command_line

    cell: dict[str, Any] = {"link": link, "nodes": nodes, "per_node": per_node, "command": command_line()}
    cell["load_average_at_start"] = round(os.getloadavg()[0], 2)
    with measured_cluster(nodes, link) if link != "loopback" else nullcontext() as bandwidth:
        if bandwidth is not None:
            cell["bandwidth"] = bandwidth
        runs: dict[str, list[dict[str, Any]]] = {v: [] for v in args.variants}
        with tempfile.TemporaryDirectory(prefix="zero-") as tmp:
            folder = Path(tmp)
            for index in range(args.launches):
                for variant in launch_order(args.variants, index):
                    result = launch(variant, cell, args, folder, f"{variant}-{index}")
                    result["step_ms"] = max(r["step_ms"] for r in result["ranks"])  # the slowest rank's median
                    runs[variant].append(result)
                    state = max(r["state_bytes"] for r in result["ranks"]) / 1e6
                    print(
                        f"  {link} {nodes}x{per_node} {variant:5s} launch {index}: {result['step_ms']:.0f} ms, "
                        f"state {state:.1f} MB/rank",
                        flush=True,
                    )
                if "ring" in runs:  # every variant's final parameters against ring's of the same round
                    ring = torch.load(folder / f"ring-{index}.pt")
                    for variant in args.variants:
                        runs[variant][-1]["max_param_diff_vs_ring"] = max_diff(
                            torch.load(folder / f"{variant}-{index}.pt"), ring
                        )
    cell["settings"] = {k: getattr(args, k) for k in ("steps", "warmup", "launches", "width", "depth", "batch")}
    cell["runs"] = runs
    cell["summary"] = {v: summarize(r) for v, r in runs.items()}
    return cell


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A variant's figures in one setting: medians over launches (of the slowest rank's medians), per-rank maxima."""

    def over_launches(key: str) -> float | None:
        values = [max(r[key] for r in run["ranks"]) for run in runs if run["ranks"][0].get(key) is not None]
        return statistics.median(values) if values else None

    ranks = runs[0]["ranks"]
    diffs = [run["max_param_diff_vs_ring"] for run in runs if "max_param_diff_vs_ring" in run]
    return {
        "step_ms": statistics.median(run["step_ms"] for run in runs),
        "launches_ms": [run["step_ms"] for run in runs],
        **{key: over_launches(key) for key in (*PHASES, "bytes_sent_per_step", "comm_ms_per_step", "peak_rss_mb")},
        "state_bytes_per_rank": [r["state_bytes"] for r in ranks],
        "param_bytes": ranks[0]["param_bytes"],
        "bucket_buffer_bytes": ranks[0].get("bucket_buffer_bytes"),
        "gather_workspace_bytes": ranks[0].get("gather_workspace_bytes"),
        "max_param_diff_vs_ring": max(diffs) if diffs else None,
    }


# ---------------------------------------------------------------------- tables
def _setting(cell: dict[str, Any]) -> list[str]:
    procs = cell["nodes"] * cell["per_node"]
    if cell["link"] == "loopback":
        return ["loopback", f"{procs} procs"]
    return [cell["link"], f"{cell['nodes']} x {cell['per_node']}"]


def _ratio(value: float | None, reference: float | None, digits: int = 2) -> str:
    return f"{value / reference:.{digits}f}" if value is not None and reference else "-"


def memory_and_time_rows(cells: list[dict[str, Any]]) -> list[list[Any]]:
    """Per setting and variant: optimizer state per rank (the largest rank's) and step time, each against ring's."""
    rows = []
    for cell in cells:
        summary = cell["summary"]
        ring = summary.get("ring")
        for variant, s in summary.items():
            state = max(s["state_bytes_per_rank"])
            ring_state = max(ring["state_bytes_per_rank"]) if ring else None
            pairs = [z / r for z, r in zip(s["launches_ms"], ring["launches_ms"], strict=False)] if ring else []
            diff = s["max_param_diff_vs_ring"]
            rows.append(
                [
                    *_setting(cell),
                    variant,
                    f"{state / 1e6:.1f}",
                    _ratio(state, ring_state, 3),
                    round(s["step_ms"]),
                    _ratio(s["step_ms"], ring["step_ms"] if ring else None),
                    f"{min(pairs):.2f}-{max(pairs):.2f}" if pairs else "-",
                    round(s["peak_rss_mb"]),
                    f"{s['peak_rss_mb'] - ring['peak_rss_mb']:+.0f}" if ring else "-",
                    f"{work / 1e6:.1f}" if (work := s.get("gather_workspace_bytes")) is not None else "-",
                    f"{diff:.1e}" if diff is not None and variant != "ring" else "-",
                ]
            )
    return rows


MEMORY_COLUMNS = [
    "link",
    "layout",
    "variant",
    "optimizer state MB / rank",
    "/ ring",
    "step ms",
    "/ ring",
    "per-launch / ring",
    "peak RSS MB",
    "- ring's",
    "all-gather workspaces MB",
    "max |dθ| vs ring",
]


def phase_rows(cells: list[dict[str, Any]]) -> list[list[Any]]:
    """Per setting and variant: where a step's time goes, and the strategy's communication per step."""
    rows = []
    for cell in cells:
        for variant, s in cell["summary"].items():
            sent = s["bytes_sent_per_step"]
            rows.append(
                [
                    *_setting(cell),
                    variant,
                    *(f"{s[k]:.0f}" if s[k] is not None else "-" for k in PHASES),
                    f"{sent / 1e6:.1f}" if sent is not None else "-",
                    f"{s['comm_ms_per_step']:.0f}" if s["comm_ms_per_step"] is not None else "-",
                ]
            )
    return rows


PHASE_COLUMNS = [
    "link",
    "layout",
    "variant",
    "forward ms",
    "backward ms",
    "wait after backward ms",
    "optimizer step ms",
    "of which all-gather ms",
    "MB sent / step",
    "comm thread ms / step",
]


def plot(path: Path, figure: Path) -> None:
    """Optimizer state per rank and step time of ``zero`` against ``ring``, per setting, from a stored result."""
    import matplotlib
    from _results import save_figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [c for c in json.loads(path.read_text())["cells"] if {"ring", "zero"} <= c["summary"].keys()]
    labels = [" ".join(_setting(c)) for c in cells]
    state = [max(c["summary"]["zero"]["state_bytes_per_rank"]) / max(c["summary"]["ring"]["state_bytes_per_rank"])
             for c in cells]  # fmt: skip
    step = [c["summary"]["zero"]["step_ms"] / c["summary"]["ring"]["step_ms"] for c in cells]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    xs = range(len(cells))
    ax.bar([x - 0.2 for x in xs], state, width=0.4, label="optimizer state per rank / ring's")
    ax.bar([x + 0.2 for x in xs], step, width=0.4, label="step time / ring's")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.axhline(1.05, color="gray", lw=0.8, ls=":")
    ax.set_xticks(list(xs), labels)
    ax.set(ylabel="zero / ring", title="Sharded Adam state (ZeRO-1) against the unsharded ring")
    ax.legend(fontsize=8)
    save_figure(fig, figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--links", nargs="+", default=["loopback", "1gbit"], help="loopback and/or tc link rates")
    parser.add_argument(
        "--layouts", nargs="+", default=["2x1", "4x1"], help="NODESxPROCS a node (loopback: NODES*PROCS processes)"
    )
    add_comparison_arguments(parser, VARIANTS)
    args = parse_or_work(parser, worker, plot, figure=ROOT / "docs" / "figures" / "zero.png", figure_from="zero.json")
    if args is None:
        return None
    if "ring" not in args.variants:
        parser.error("--variants must include ring: every ratio is against it")
    links = args.links
    if os.geteuid() != 0 and any(link != "loopback" for link in links):
        print("bench_zero.py needs root for the simulated cluster (network namespaces and tc); only loopback runs.")
        links = [link for link in links if link == "loopback"]
        if not links:
            return None
    from _results import Report

    keys = ("links", "layouts", "variants", "launches", "steps", "warmup", "width", "depth", "batch", "bucket_cap_mb")
    report = Report("zero", {k: getattr(args, k) for k in keys})
    cells = []
    for link in links:
        for layout in args.layouts:
            nodes, per_node = (int(n) for n in layout.split("x"))
            cells.append(measure_cell(link, nodes, per_node, args))
    if args.merge and args.json is not None and args.json.exists():
        key = lambda c: (c["link"] != "loopback", c["link"], c["nodes"] * c["per_node"], c["nodes"])  # noqa: E731
        fresh = {key(c) for c in cells}
        cells = sorted([c for c in json.loads(args.json.read_text())["cells"] if key(c) not in fresh] + cells, key=key)
        report.data["settings"]["links"] = sorted({c["link"] for c in cells})
        report.data["settings"]["layouts"] = sorted({f"{c['nodes']}x{c['per_node']}" for c in cells})
    report.data["cells"] = cells
    rows = memory_and_time_rows(cells)
    for row in rows:
        print("  ".join(str(c) for c in row))
    notes = [
        f"{' '.join(_setting(c))}: {c['settings']['launches']} launches of {c['settings']['steps']} steps per variant"
        f" (median after {c['settings']['warmup']}), load average {c['load_average_at_start']} at its start"
        + (f"; link measured {c['bandwidth']}" if c.get("bandwidth") else "")
        for c in cells
    ]
    commands = list(dict.fromkeys(c["command"] for c in cells if "command" in c))
    if len(commands) > 1:
        report.note("The settings were measured by " + "; ".join(f"`{c}`" for c in commands) + ".")
    report.table("Adam's state per rank and the step, sharded (zero) and not (ring)", MEMORY_COLUMNS, rows, notes)
    report.table("Where a step's time goes (the slowest rank's medians)", PHASE_COLUMNS, phase_rows(cells))
    report.save(args.json)
    return None


if __name__ == "__main__":
    main()
