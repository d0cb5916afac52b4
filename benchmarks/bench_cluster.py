"""Benchmark the strategies on a simulated cluster: nodes joined by a 1 or 10 GbE-shaped link (``netsim.py``).

For each link and layout (nodes x processes a node), every variant trains the same 12.6 M-parameter MLP (50.4 MB of fp32
gradients, SGD, batch 32 per rank) with Lightning's Trainer; the variants take turns launch by launch (the order
flipped every launch), and each figure is the median over launches of the median steady-state step. Variants:

    ddp             Lightning's own DDP (torch's reducer, gloo's all-reduce)
    ring            RingAllReduceStrategy(two_level=False): one flat ring over every rank
    two_level       RingAllReduceStrategy(two_level=True): inside each node, across nodes by shard, inside again
    ring_bf16       the flat ring with bf16_compress("ring")
    two_level_bf16  the two-level reduction with bf16 on the hop across nodes
    powersgd        the flat ring with PowerSGD("ring", rank=4)
    torch_powersgd  the flat ring's buckets through torch's powerSGD_hook (rank 4, from the third step)
    auto            RingAllReduceStrategy(reducer="auto"): it times 6 steps, then picks from the above
    hybrid_pipeline HybridPipelineStrategy(pipeline_stages=2, micro_batches=4): only activations cross between stages

Each launch also saves rank 0's final parameters, and the table gives every variant's largest difference from
``ddp``'s (the same seed, data and steps), and the package's variants record how long each step waited for
communication after backward (``exposed_ms``). What the step model needs is what the ``auto`` launches measured at
run time, before choosing (``auto_inputs``: the compute and backward of their warm-up steps as the strategy runs them,
the ring probed between and inside nodes, the CPU's per-byte costs on bucket-sized buffers); a cell's ``inputs`` are
their median, and ``benchmarks/cluster_model.py`` predicts every ring variant's step from them: the JSON holds both.
Needs root (network namespaces): without it the script says so and exits with status 0. Always leaves the simulated
cluster down.

The simulated cluster is ``benchmarks/netsim.py`` (Linux, root and iproute2). ``--quick`` is a reviewer's short run
(under a minute on 2 cores): one link, one layout, ``ddp`` and the flat ring, a small MLP, few steps, one launch, its
JSON written to ``--json`` (by default a file in the temporary folder; never one of ``benchmarks/results``).

Usage::

    python benchmarks/bench_cluster.py --links 1gbit --layouts 2x2 --json benchmarks/results/cluster.json
    python benchmarks/bench_cluster.py --quick --json /tmp/cluster_quick.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _launch import (
    add_comparison_arguments,
    apply_quick,
    fit_rank,
    hide_gpus,
    launch_order,
    measured_cluster,
    mlp,
    parse_or_work,
    torchrun_on_cluster,
    worker_command,
)

hide_gpus()  # every process here runs on the CPU over gloo

VARIANTS = (
    "ddp",
    "ring",
    "two_level",
    "ring_bf16",
    "two_level_bf16",
    "powersgd",
    "torch_powersgd",
    "auto",
    "hybrid_pipeline",
)


def make_strategy(variant: str, bucket_cap_mb: float = 25.0) -> Any:
    """The Trainer's ``strategy=`` for ``variant``, the package's with buckets of ``bucket_cap_mb``."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

    from lightning_dp_strategies import HybridPipelineStrategy, PowerSGD, RingAllReduceStrategy, bf16_compress

    if variant == "hybrid_pipeline":
        return HybridPipelineStrategy(pipeline_stages=2, micro_batches=4, bucket_cap_mb=bucket_cap_mb)
    hook_state = PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=2)
    options: dict[str, dict[str, Any]] = {
        "ring": {"two_level": False},
        "two_level": {"two_level": True},
        "ring_bf16": {"two_level": False, "reducer": bf16_compress("ring")},
        "two_level_bf16": {"two_level": True, "reducer": bf16_compress("ring")},
        "powersgd": {"two_level": False, "reducer": PowerSGD("ring", rank=4)},
        "torch_powersgd": {"two_level": False, "ddp_comm_hook": powerSGD_hook, "ddp_comm_state": hook_state},
        "auto": {"reducer": "auto"},
    }
    return "ddp" if variant == "ddp" else RingAllReduceStrategy(bucket_cap_mb=bucket_cap_mb, **options[variant])


def worker(args: argparse.Namespace) -> None:
    """One rank of one launch (started by torchrun on every simulated node)."""
    import lightning as L
    import torch

    torch.set_num_threads(1)  # the simulated nodes share the machine's cores (OMP_NUM_THREADS=1 keeps Lightning to it)

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.exposed: list[float] = []
            self.decision: Any = None

        def on_train_end(self, trainer: L.Trainer, *_: Any) -> None:  # before teardown closes the reducer
            reducer = getattr(getattr(trainer.strategy, "grad_sync", None), "reducer", None)
            self.decision = getattr(reducer, "decision", None)

        def on_train_batch_end(self, trainer: L.Trainer, *_: Any) -> None:
            self.times.append(time.perf_counter())
            stats = getattr(trainer.strategy, "step_stats", None)
            self.exposed.append(stats.exposed_seconds if stats is not None else float("nan"))

    timer = Timer()
    trainer, model = fit_rank(lambda: mlp(args), lambda: make_strategy(args.worker, args.bucket_cap_mb), timer, args)
    steps = [b - a for a, b in zip(timer.times, timer.times[1:], strict=False)][args.warmup :]
    exposed = timer.exposed[1:][args.warmup :]
    result: dict[str, Any] = {"variant": args.worker, "step_ms": 1e3 * statistics.median(steps)}
    if not any(map(math.isnan, exposed)):
        result["exposed_ms"] = 1e3 * statistics.median(exposed)
    if timer.decision is not None:
        result["auto_chose"] = timer.decision.chosen
        result["auto_inputs"] = decision_inputs(timer.decision)
    if trainer.global_rank == 0:
        out = Path(args.out)
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out.with_suffix(".pt"))
        out.write_text(json.dumps(result))


INPUTS = ("compute_s", "backward_s", "add", "add_low", "cast", "powersgd", "overlap")
INPUTS += ("inter_latency_s", "inter_bytes_per_s", "intra_latency_s", "intra_bytes_per_s")
INPUTS += ("flat_latency_s", "flat_bytes_per_s", "inter_busy", "intra_busy", "flat_busy")
"""What the step model takes, as a cell's ``inputs`` holds it (the median over the ``auto`` launches)."""


def decision_inputs(decision: Any) -> dict[str, Any]:
    """What ``reducer="auto"`` measured at run time (the compute and backward of its warm-up steps, its probes of the
    links, its CPU calibration) under the keys of :data:`INPUTS`, and the step it predicted for each candidate (ms)."""
    t, cpu = decision.topology, decision.cpu
    intra, flat = t.intra, t.flat
    return {
        "compute_s": decision.compute_seconds,
        "backward_s": decision.backward_seconds,
        "add": cpu.add,
        "add_low": cpu.add_low,
        "cast": cpu.cast,
        "powersgd": cpu.powersgd,
        "overlap": cpu.overlap,
        "inter_latency_s": t.inter.latency_s,
        "inter_bytes_per_s": t.inter.bandwidth_bytes_per_s,
        "intra_latency_s": intra.latency_s if intra is not None else 0.0,
        "intra_bytes_per_s": intra.bandwidth_bytes_per_s if intra is not None else 0.0,
        "flat_latency_s": flat.latency_s if flat is not None else 0.0,
        "flat_bytes_per_s": flat.bandwidth_bytes_per_s if flat is not None else 0.0,
        "inter_busy": t.inter_busy,
        "intra_busy": t.intra_busy,
        "flat_busy": t.flat_busy,
        "predicted_ms": {label: 1e3 * s for label, s in decision.predicted_step_seconds.items()},
    }


WORKER_SETTINGS = ("width", "depth", "steps", "batch", "warmup", "bucket_cap_mb")
"""The settings a rank is started with."""


def launch(variant: str, per_node: int, args: argparse.Namespace, folder: Path, name: str) -> dict[str, Any]:
    """One launch of ``variant`` on the cluster that is up (one thread a process); its rank 0's result."""
    out = folder / f"{name}.json"
    torchrun_on_cluster(per_node, worker_command(__file__, variant, out, args, WORKER_SETTINGS), folder, variant)
    return json.loads(out.read_text())


def measure_cell(link: str, nodes: int, per_node: int, args: argparse.Namespace) -> dict[str, Any]:
    """Every variant on ``nodes`` x ``per_node`` over ``link``, launches interleaved."""
    import torch

    with measured_cluster(nodes, link) as bandwidth:
        times: dict[str, list[float]] = {v: [] for v in args.variants}
        exposed: dict[str, list[float]] = {v: [] for v in args.variants}
        auto_inputs: list[dict[str, Any]] = []
        chose: list[str] = []
        with tempfile.TemporaryDirectory(prefix="cluster-") as tmp:
            folder = Path(tmp)
            for index in range(args.launches):
                for variant in launch_order(args.variants, index):
                    result = launch(variant, per_node, args, folder, f"{variant}-{index}")
                    times[variant].append(result["step_ms"])
                    exposed[variant] += [result["exposed_ms"]] if "exposed_ms" in result else []
                    auto_inputs += [result["auto_inputs"]] if "auto_inputs" in result else []
                    chose += [result["auto_chose"]] if "auto_chose" in result else []
                    print(f"  {link} {nodes}x{per_node} {variant:15s} launch {index}: {result['step_ms']:.0f} ms")
            reference = torch.load(folder / "ddp-0.pt") if "ddp" in times else None
            diffs = {}
            for variant in args.variants:
                params = torch.load(folder / f"{variant}-0.pt")
                if reference is not None and variant != "hybrid_pipeline":  # S stages of N/S replicas: another batch
                    diffs[variant] = max((params[k] - reference[k]).abs().max().item() for k in reference)
    step = {v: statistics.median(t) for v, t in times.items()}
    return {
        "link": link,
        "nodes": nodes,
        "per_node": per_node,
        "bandwidth": bandwidth,
        "step_ms": step,
        "launches_ms": times,
        "max_param_diff_vs_ddp": diffs,
        "exposed_ms": {v: statistics.median(t) for v, t in exposed.items() if t},
        "inputs": {k: statistics.median(i[k] for i in auto_inputs) for k in INPUTS} if auto_inputs else None,
        "auto_chose": chose,
        "auto_inputs": auto_inputs,
    }


def table(cells: list[dict[str, Any]], variants: list[str]) -> dict[str, Any]:
    """Every cell's measured steps, against ``ddp`` (a parameter difference only where the global batch is ddp's)."""
    rows = []
    for cell in cells:
        ddp = cell["step_ms"].get("ddp")
        for v in variants:
            if v not in cell["step_ms"]:
                continue
            ms = cell["step_ms"][v]
            rows.append(
                [
                    cell["link"],
                    f"{cell['nodes']} x {cell['per_node']}",
                    v,
                    round(ms),
                    f"{ms / ddp:.2f}" if ddp else "-",
                    f"{diff:.1e}" if (diff := cell["max_param_diff_vs_ddp"].get(v)) is not None else "-",
                ]
            )
    return {
        "title": "Median step time on the simulated cluster",
        "rows": rows,
        "columns": ["link", "nodes x procs", "variant", "step ms", "/ ddp", "max |dθ| vs ddp"],
    }


QUICK = {
    "links": ["1gbit"],
    "layouts": ["2x1"],
    "variants": ["ddp", "ring"],
    "launches": 1,
    "steps": 8,
    "warmup": 3,
    "width": 512,
    "depth": 4,
}
"""What ``--quick`` sets, each where the command line left the default: one link, one layout, two variants, a small
MLP (1.1 M parameters), one launch."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--links", nargs="+", default=["1gbit", "10gbit"], help="tc rates of the links")
    parser.add_argument("--layouts", nargs="+", default=["2x1", "2x2", "4x1"], help="NODESxPROCESSES a node")
    add_comparison_arguments(parser, VARIANTS)
    parser.add_argument("--quick", action="store_true", help="a short run: 1gbit, 2x1, ddp and ring, small MLP")
    args = parse_or_work(parser, worker)
    if args is None:
        return None
    if args.quick:
        apply_quick(args, parser, QUICK, "cluster_quick.json")
    if os.geteuid() != 0:
        print("bench_cluster.py needs root for the simulated cluster (network namespaces and tc); nothing measured.")
        return None
    from _results import Report
    from cluster_model import auto_rows, prediction_rows

    keys = ("links", "layouts", "variants", "launches", "steps", "warmup", "bucket_cap_mb", "quick")
    settings = {k: getattr(args, k) for k in keys}
    report = Report("cluster", {**settings, "width": args.width, "depth": args.depth, "batch": args.batch})
    cells = []
    for link in args.links:
        for layout in args.layouts:
            nodes, per_node = (int(n) for n in layout.split("x"))
            cells.append(measure_cell(link, nodes, per_node, args))
    if args.merge and args.json is not None and args.json.exists():
        kept = json.loads(args.json.read_text())
        key = lambda c: (c["link"], c["nodes"], c["per_node"])  # noqa: E731
        cells = sorted([c for c in kept["cells"] if key(c) not in {key(n) for n in cells}] + cells, key=key)
        report.data["notes"] = kept.get("notes", [])  # how the kept cells were run
        report.data["settings"]["links"] = sorted({c["link"] for c in cells})
        report.data["settings"]["layouts"] = sorted({f"{c['nodes']}x{c['per_node']}" for c in cells})
    report.data["cells"] = cells
    result = table(cells, args.variants)
    for row in result["rows"]:
        print("  ".join(str(c) for c in row))
    notes = [f"{c['link']} {c['nodes']}x{c['per_node']}: measured {c['bandwidth']}" for c in cells]
    report.table(result["title"], result["columns"], result["rows"], notes)
    columns = ["link", "nodes x procs", "variant", "measured ms", "predicted ms", "error"]
    report.table("The step model against the measured step", columns, prediction_rows(report.data))
    columns = ["link", "nodes x procs", "auto chose", "auto ms", "best fixed", "its ms", "auto / best"]
    report.table("reducer='auto' against the best fixed reducer", columns, auto_rows(report.data))
    report.save(args.json)
    return None


if __name__ == "__main__":
    main()
