"""Benchmark the pipeline: measured bubble vs the GPipe formula, and activation memory of GPipe vs 1F1B.

Two processes form a 2-stage pipeline (plain ``torch.distributed`` on gloo, one thread each) over
:class:`~lightning_dp_strategies.pipeline.PipelineRunner`, the engine of ``"hybrid_pipeline"``:

(a) for M = 1, 2, 4, 8 micro-batches (the same batch of 256 cut finer), the measured bubble of each stage
    (1 - its compute time / the pipeline's step time, barrier to barrier; median over steps after warm-up; the
    stages are nearly balanced) next to the ideal ``(S-1)/(M+S-1)``. The measured bubble also includes the
    point-to-point sends and receives and the per-micro-batch overhead, which the formula ignores.
(b) at M = 8, the peak bytes of activations saved for backward (saved-tensor hooks, so it works on the CPU) under
    ``"gpipe"`` and ``"1f1b"``, side by side with the clock-table model's micro-batches held at once.

Usage::

    python benchmarks/bench_hybrid_pipeline.py [--steps 12] [--width 1024]
    python benchmarks/bench_hybrid_pipeline.py --json benchmarks/results/hybrid_pipeline.json  # also store the tables
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _launch import run_ranks
from torch import nn

STAGES = 2
BATCH = 256
MICRO = [1, 2, 4, 8]


def _stage_module(rank: int, width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(rank)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    if rank == STAGES - 1:
        layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


def _worker(rank: int, world: int, steps: int, width: int, depth: int, out: str) -> None:
    from lightning_dp_strategies.pipeline import PipelineRunner

    torch.set_num_threads(1)
    module = _stage_module(rank, width, depth)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(BATCH, width, generator=gen), torch.randint(0, 10, (BATCH,), generator=gen)
    results: dict[str, object] = {"bubble": {}, "memory": {}}
    for micro in MICRO:
        runner = PipelineRunner(module, rank, STAGES, None, torch.device("cpu"), "gpipe", micro)
        bubbles = []
        for step in range(steps + 2):
            dist.barrier()
            start = time.perf_counter()
            result = runner.train_step(x, y, F.cross_entropy)
            dist.barrier()  # the pipeline's step ends when its last stage ends: time it barrier to barrier
            total = time.perf_counter() - start
            if step >= 2:  # the first step infers shapes, the second warms caches
                bubbles.append(1.0 - result.stats.compute_seconds / total)
            module.zero_grad(set_to_none=True)
        results["bubble"][str(micro)] = statistics.median(bubbles)  # type: ignore[index]
    for schedule in ("gpipe", "1f1b"):
        runner = PipelineRunner(module, rank, STAGES, None, torch.device("cpu"), schedule, 8, measure_activations=True)
        peaks = []
        for step in range(3):
            dist.barrier()
            peak = runner.train_step(x, y, F.cross_entropy).stats.peak_activation_bytes
            if step > 0:  # the first step also runs torch's shape inference
                peaks.append(peak)
            module.zero_grad(set_to_none=True)
        results["memory"][schedule] = max(peaks)  # type: ignore[index]
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(results, f)


def main() -> None:
    from _results import Report

    from lightning_dp_strategies.pipeline import clock_table, gpipe_bubble, table_in_flight

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="measured steps per configuration")
    parser.add_argument("--width", type=int, default=1024, help="hidden width of the MLP")
    parser.add_argument("--depth", type=int, default=8, help="Linear+Tanh layers per stage")
    parser.add_argument("--json", type=Path, help="also write the results here (see benchmarks/render_docs.py)")
    args = parser.parse_args()
    report = Report("hybrid_pipeline", vars(args))
    rows_a: list[list[str]] = []
    rows_b: list[list[str]] = []
    with tempfile.TemporaryDirectory() as out:
        run_ranks(_worker, STAGES, args.steps, args.width, args.depth, out)
        ranks = [json.load(open(f"{out}/rank{r}.json")) for r in range(STAGES)]

    print(f"(a) bubble, S={STAGES}, batch {BATCH}, width {args.width}, {args.depth} layers/stage, gpipe, CPU/gloo")
    print(f"{'M':>3} {'stage 0':>9} {'stage 1':>9} {'mean':>9} {'(S-1)/(M+S-1)':>14} {'mean/formula':>13}")
    for micro in MICRO:
        measured = [r["bubble"][str(micro)] for r in ranks]
        mean = sum(measured) / len(measured)
        ideal = gpipe_bubble(STAGES, micro)
        print(f"{micro:>3} {measured[0]:>9.3f} {measured[1]:>9.3f} {mean:>9.3f} {ideal:>14.3f} {mean / ideal:>13.2f}")
        cells = [f"{measured[0]:.3f}", f"{measured[1]:.3f}", f"{mean:.3f}", f"{ideal:.3f}", f"{mean / ideal:.2f}"]
        rows_a.append([str(micro), *cells])
    title = f"(a) Bubble, S={STAGES}, batch {BATCH}, width {args.width}, {args.depth} layers/stage, gpipe, CPU/gloo"
    report.table(title, ["M", "stage 0", "stage 1", "mean", "(S-1)/(M+S-1)", "mean/formula"], rows_a)

    print(f"\n(b) peak activation memory at M=8 (bytes saved for backward), S={STAGES}")
    held = {s: table_in_flight(clock_table(s, STAGES, 8)) for s in ("gpipe", "1f1b")}
    print(f"{'stage':>5} {'gpipe MiB':>10} {'1f1b MiB':>10} {'1f1b/gpipe':>11} {'model: held (gpipe vs 1f1b)':>29}")
    for s, r in enumerate(ranks):
        g, o = r["memory"]["gpipe"], r["memory"]["1f1b"]
        ratio = o / g if g else float("nan")
        model = f"{held['gpipe'][s]} vs {held['1f1b'][s]} = {held['1f1b'][s] / held['gpipe'][s]:.3f}"
        print(f"{s:>5} {g / 2**20:>10.2f} {o / 2**20:>10.2f} {ratio:>11.3f} {model:>29}")
        rows_b.append([str(s), f"{g / 2**20:.2f}", f"{o / 2**20:.2f}", f"{ratio:.3f}", model])
    columns = ["stage", "gpipe MiB", "1f1b MiB", "1f1b/gpipe", "model: held (gpipe vs 1f1b)"]
    report.table(f"(b) Peak activation memory at M=8 (bytes saved for backward), S={STAGES}", columns, rows_b)
    report.save(args.json)


if __name__ == "__main__":
    main()
