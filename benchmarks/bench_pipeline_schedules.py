"""End to end, as a user sees it: a Trainer step under ``hybrid_pipeline`` per schedule and micro-batch count.

One run, every configuration in turn on the same machine: the one-device step (the reference ``T1``), then
``hybrid_pipeline`` with S = 2 stages and D = 1 (two processes, CPU/gloo, one intra-op thread each) for each schedule
and M. The model is an MLP of 8 blocks ``Linear(768, 768) + Tanh`` and a head, batch 128, SGD. Per configuration:

- ``step ms``: the median time from one ``on_train_batch_start`` to the next on rank 0 (the pipeline's period, with
  everything Lightning does per step);
- ``ideal/measured``: the perfect pipeline of the schedule, ``T1 / S / (1 - formula bubble)``, over the measured step;
- ``bubble``: the measured bubble (1 - compute / step, the mean over the ranks of their median over steps), beside the
  schedule's formula (the clock-table model, every action one tick; backward twice a forward for the zero-bubble
  schedules, which split it in two);
- ``act MiB``: the peak bytes saved for backward on the busiest rank (``measure_activations``);
- ``p2p MB/step``: activations and their gradients sent between stages per step (both directions, every rank).

Then (c), in one process with no pipeline: the compute a rank does per step, a stage's forward and backward on the
batch cut into M micro-batches in GPipe's order, over the same batch in one piece. Its inverse is the ceiling: the
``ideal/measured`` of a schedule whose bubble is exactly its formula's, on top of this compute. Beside it, over
GPipe's order: the same pieces in rank 0's 1F1B order, and with each weight gradient computed once over all the
pieces (the cost a schedule that batched its weight passes would pay). And why it grows: one GEMM's time per
row at the smallest micro-batch's rows over the whole batch's, cycling through 1 weight, a stage's weights or two
stages' (the bigger the weights that stream through the cache, the more a small GEMM pays per row).

``--data-parallel 2`` measures instead the data-parallel reduction of S = 2 x D = 2 (four processes, 128 samples per
replica), each schedule with the reduction started after the schedule (the strategy's ``_overlap_reduction``
patched to ``False``: every bucket launched at ``backward``) and inside it (each chunk's buckets filled during its
last backward pass): ``exposed ms`` is the wait for the reduction after the schedule, per step, the mean over ranks.

Usage::

    python benchmarks/bench_pipeline_schedules.py [--steps 30] [--schedules 1f1b,gpipe] [--micro 1,2,4,8]
    python benchmarks/bench_pipeline_schedules.py --data-parallel 2 [--schedules 1f1b,zbv] [--micro 4]
    ... --json benchmarks/results/pipeline_schedules.json   # also store the tables (benchmarks/render_docs.py)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _launch import QUIET_TRAINER, ROOT

BATCH, STAGES = 128, 2


def _round_robin_medians(runs: dict[Any, Any], repeats: int) -> dict[Any, float]:
    """Median seconds of each ``runs[key]()``, timed in turns so that a slow spell of the machine hits every key."""
    times: dict[Any, list[float]] = {key: [] for key in runs}
    for round_ in range(3 + repeats):  # 3 rounds to warm up
        for key, run in runs.items():
            start = time.perf_counter()
            run()
            if round_ >= 3:
                times[key].append(time.perf_counter() - start)
    return {key: statistics.median(seconds) for key, seconds in times.items()}


def _orders(micro: int) -> dict[str, list[tuple[str, int]]]:
    """The order of a stage's forwards and backwards: all forwards then all backwards (GPipe), or rank 0's order
    under 1F1B at S = 2 (two forwards, then a backward and a forward in turn, then the last backward)."""
    gpipe = [("F", m) for m in range(micro)] + [("B", m) for m in range(micro)]
    one_f_one_b = [("F", m) for m in range(min(2, micro))]
    for m in range(micro - 2):
        one_f_one_b += [("B", m), ("F", m + 2)]
    one_f_one_b += [("B", m) for m in range(max(0, micro - 2), micro)]
    return {"gpipe": gpipe, "1f1b": one_f_one_b}


def _compute(config: dict[str, Any], out: str) -> None:
    """Part (c), in one process and no pipeline: a stage's forward and backward as M micro-batches (in GPipe's and
    in 1F1B's order, and in GPipe's order with every weight gradient computed once over all the pieces), and one
    GEMM's cost per row at the micro-batch's rows against the whole batch's, with 1, a stage's or two stages'
    weights."""
    import torch
    from torch import nn

    torch.set_num_threads(1)
    torch.manual_seed(0)
    width, per_stage = config["width"], config["blocks"] // STAGES
    stage = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(per_stage)])
    x = torch.randn(BATCH, width)

    def step(micro: int, order: str) -> None:
        for param in stage.parameters():
            param.grad = None
        chunks, outputs = x.chunk(micro), {}
        for kind, m in _orders(micro)[order]:
            if kind == "F":
                outputs[m] = stage(chunks[m]).sum()
            else:
                outputs.pop(m).backward()

    class StashedLinear(torch.autograd.Function):
        """``a W^T + b`` whose backward returns the input's gradient only and keeps ``(a, dy)`` for one later
        weight-gradient pass over every micro-batch."""

        @staticmethod
        def forward(ctx: Any, a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, stash: list) -> torch.Tensor:
            ctx.save_for_backward(a, weight)
            ctx.stash = stash
            return torch.addmm(bias, a, weight.t())

        @staticmethod
        def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
            a, weight = ctx.saved_tensors
            ctx.stash.append((a, dy))
            return (dy @ weight if ctx.needs_input_grad[0] else None), None, None, None

    linears = [block[0] for block in stage]

    def step_one_weight_pass(micro: int) -> None:
        for param in stage.parameters():
            param.grad = None
        stashes: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in linears]
        outputs = []
        for chunk in x.chunk(micro):  # GPipe's order: every forward, then every backward
            a = chunk
            for linear, stash in zip(linears, stashes, strict=True):
                a = torch.tanh(StashedLinear.apply(a, linear.weight, linear.bias, stash))
            outputs.append(a.sum())
        for output in outputs:
            output.backward()
        with torch.no_grad():
            for linear, stash in zip(linears, stashes, strict=True):
                inputs, grads = torch.cat([a for a, _ in stash]), torch.cat([dy for _, dy in stash])
                linear.weight.grad, linear.bias.grad = grads.t() @ inputs, grads.sum(0)

    step(max(config["micro"]), "gpipe")  # the deferred pass computes the same gradients as autograd
    expected = [p.grad.clone() for p in stage.parameters()]  # type: ignore[union-attr]
    step_one_weight_pass(max(config["micro"]))
    for param, grad in zip(stage.parameters(), expected, strict=True):
        torch.testing.assert_close(param.grad, grad, rtol=1e-4, atol=1e-5)

    repeats = config["steps"]
    runs = {f"{m} {order}": functools.partial(step, m, order) for m in config["micro"] for order in ("gpipe", "1f1b")}
    runs.update({f"{m} one W pass": functools.partial(step_one_weight_pass, m) for m in config["micro"]})
    seconds = _round_robin_medians(runs, repeats)
    result: dict[str, Any] = {"stage": {m: seconds[f"{m} gpipe"] for m in config["micro"]}}
    result["order"] = {m: seconds[f"{m} 1f1b"] / seconds[f"{m} gpipe"] for m in config["micro"]}
    result["one_w_pass"] = {m: seconds[f"{m} one W pass"] / seconds[f"{m} gpipe"] for m in config["micro"]}
    rows = BATCH // max(config["micro"])
    gemm: dict[int, float] = {}
    for count in (1, per_stage, 2 * per_stage):
        weights = [torch.randn(width, width) for _ in range(count)]
        inputs = {rows: torch.randn(rows, width), BATCH: torch.randn(BATCH, width)}

        def run(a: torch.Tensor, weights: list[torch.Tensor] = weights) -> None:
            for weight in weights:
                a.mm(weight)

        # each size on its own, not in turns: the other size's data would evict part of the weights between calls
        seconds = {n: _round_robin_medians({n: functools.partial(run, a)}, repeats)[n] for n, a in inputs.items()}
        gemm[count] = (seconds[rows] / rows) / (seconds[BATCH] / BATCH)
    result.update(gemm=gemm, rows=rows, weight_mb=width * width * 4 / 1e6)
    Path(out, "rank0.json").write_text(json.dumps(result))


def _run(config: dict[str, Any], out: str) -> None:
    """One configuration, in this process (and, through the strategy's launcher, its other ranks)."""
    if config["schedule"] == "stage compute":
        _compute(config, out)
        return
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_dp_strategies import HybridPipelineStrategy

    torch.set_num_threads(1)
    if config.get("overlap") is False:  # the reduction as before it overlapped: every bucket launched at backward
        HybridPipelineStrategy._overlap_reduction = lambda self: False  # type: ignore[method-assign]
    replicas = config.get("replicas", 1)

    class Net(L.LightningModule):
        pipeline_body = "body"

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            width = config["width"]
            blocks = [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(config["blocks"])]
            self.body = nn.Sequential(*blocks, nn.Linear(width, 10))

        def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(output, target)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return self.pipeline_loss(self.body(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []
            self.schedule: list[float] = []
            self.compute: list[float] = []

        def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
            self.starts.append(time.perf_counter())
            if len(self.starts) == steps - 1 and config.get("activations"):
                trainer.strategy.runner.measure_activations = True  # type: ignore[attr-defined]  # the last 2 steps

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            buckets = getattr(trainer.strategy, "buckets", None)
            self.buckets = len(buckets.buckets) if buckets is not None else 0
            stats = getattr(trainer.strategy, "pipeline_stats", None)
            if stats is not None:
                self.schedule.append(stats.last.step_seconds)
                self.compute.append(stats.last.compute_seconds)

    steps = config["steps"] + 6  # 3 to warm up, the measured ones, 1 more (a period ends there), 2 for activations
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(BATCH * steps, config["width"], generator=gen),
        torch.randint(0, 10, (BATCH * steps,), generator=gen),
    )
    clock = Clock()
    if config["schedule"] == "one device":
        strategy: Any = "auto"
        devices = 1
    else:
        strategy = HybridPipelineStrategy(
            pipeline_stages=STAGES,
            micro_batches=config["micro"],
            schedule=config["schedule"],
            virtual_stages=config.get("virtual"),
        )
        devices = STAGES * replicas
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_steps=steps,
        callbacks=[clock],
        **QUIET_TRAINER,
    )
    trainer.fit(Net(), DataLoader(data, batch_size=BATCH))
    periods = [b - a for a, b in zip(clock.starts[3:-2], clock.starts[4:-1], strict=False)]
    result: dict[str, Any] = {"step": statistics.median(periods)}
    if isinstance(strategy, HybridPipelineStrategy):
        stats = strategy.pipeline_stats
        result.update(
            bubble=statistics.median(1 - c / s for c, s in zip(clock.compute[3:-2], clock.schedule[3:-2], strict=True)),
            compute=statistics.median(clock.compute[3:-2]),
            schedule=statistics.median(clock.schedule[3:-2]),
            activations=stats.peak_activation_bytes,
            p2p=strategy.step_stats.pipeline_bytes_sent + strategy.step_stats.pipeline_bytes_received,
        )
        totals = strategy.comm_stats
        if totals.synced_backwards:
            result.update(
                exposed=totals.exposed_seconds / totals.synced_backwards,
                overlapped=totals.overlapped_buckets / totals.synced_backwards,
                buckets=clock.buckets,
            )
    Path(out, f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="measured steps per configuration")
    parser.add_argument(
        "--schedules", default="gpipe,1f1b,interleaved_1f1b,looped_bfs,interleaved_zb,zbv", help="comma-separated"
    )
    parser.add_argument("--micro", default="1,2,4,8", help="comma-separated micro-batch counts")
    parser.add_argument("--width", type=int, default=768, help="width of each Linear block")
    parser.add_argument("--blocks", type=int, default=8, help="Linear+Tanh blocks in the body")
    parser.add_argument("--data-parallel", type=int, default=1, help="replicas D (2: the reduction's overlap)")
    parser.add_argument("--json", type=Path, help="also write the results here (see benchmarks/render_docs.py)")
    parser.add_argument("--config", help=argparse.SUPPRESS)  # one configuration, in a child process
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.config:
        _run(json.loads(args.config), args.out)
        return

    from _results import Report

    from lightning_dp_strategies.pipeline import clock_table, schedule_bubble, schedule_micro_batches, table_in_flight

    settings = {k: v for k, v in vars(args).items() if k not in ("config", "out")}
    report = Report("pipeline_schedules_dp" if args.data_parallel > 1 else "pipeline_schedules", settings)

    def measure(config: dict[str, Any]) -> list[dict[str, Any]]:
        config.update(width=args.width, blocks=args.blocks)
        with tempfile.TemporaryDirectory() as out:
            command = [sys.executable, __file__, "--config", json.dumps(config), "--out", out]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
            subprocess.run(command, check=True, timeout=600, env=env, cwd=ROOT, capture_output=True)
            return [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]

    if args.data_parallel > 1:
        replicas = args.data_parallel
        model = f"{args.blocks} blocks of Linear({args.width}) + Tanh"
        setting = f"S={STAGES}, D={replicas}, {model}, batch {BATCH} per replica, CPU/gloo, one thread per rank"
        print(setting)
        report.note(setting)
        dp_rows: list[list[str]] = []
        columns = f"{'reduction':>18} {'step ms':>8} {'exposed ms':>11} {'launched in schedule':>21}"
        print(f"{'schedule':>16} {'M':>3} {columns}")
        for schedule in args.schedules.split(","):
            for micro in [int(m) for m in args.micro.split(",")]:
                steps: dict[bool, float] = {}
                for overlap in (False, True):
                    config = {"schedule": schedule, "micro": micro, "steps": args.steps, "replicas": replicas}
                    ranks = measure({**config, "overlap": overlap})
                    steps[overlap] = ranks[0]["step"]
                    exposed = sum(r["exposed"] for r in ranks) / len(ranks)
                    launched = f"{ranks[0]['overlapped']:.0f} of {ranks[0]['buckets']} buckets"
                    where = "inside schedule" if overlap else "after schedule"
                    print(
                        f"{schedule:>16} {micro:>3} {where:>18} {steps[overlap] * 1e3:>8.1f} {exposed * 1e3:>11.2f} "
                        f"{launched:>21}"
                    )
                    dp_rows.append(
                        [schedule, str(micro), where, f"{steps[overlap] * 1e3:.1f}", f"{exposed * 1e3:.2f}", launched]
                    )
                print(f"{'':>16} {'':>3} {'after / inside':>18} {steps[False] / steps[True]:>8.2f}")
                dp_rows.append([schedule, str(micro), "after / inside", f"{steps[False] / steps[True]:.2f}", "", ""])
        columns = ["schedule", "M", "reduction", "step ms", "exposed ms", "launched in schedule"]
        report.table("The data-parallel reduction: after the schedule or inside it", columns, dp_rows)
        report.save(args.json)
        return

    one = measure({"schedule": "one device", "steps": args.steps})[0]["step"]
    half = one / STAGES
    model = f"{args.blocks} blocks of Linear({args.width}) + Tanh"
    print(f"S={STAGES}, D=1, {model}, batch {BATCH}, CPU/gloo, one thread per rank")
    print(f"one device: {one * 1e3:.1f} ms/step; T1/S = {half * 1e3:.1f} ms\n")
    report.note(f"S={STAGES}, D=1, {model}, batch {BATCH}, CPU/gloo, one thread per rank")
    report.note(f"one device (T1): {one * 1e3:.1f} ms/step; T1/S = {half * 1e3:.1f} ms")
    rows_a: list[list[str]] = []
    rows_b: list[list[str]] = []
    rows_c: list[list[str]] = []
    print("(a) step time and bubble (rank means; compute/(T1/S): a rank's compute over its share of T1)")
    header = f"{'schedule':>16} {'M':>3} {'step ms':>8} {'ideal ms':>9} {'ideal/meas':>11} {'compute ms':>11} "
    print(header + f"{'compute/(T1/S)':>15} {'bubble':>7} {'formula':>8} {'diff':>7} {'p2p MB/step':>12}")
    schedules = args.schedules.split(",")
    peaks: dict[str, tuple[int, int]] = {}
    for schedule in schedules:
        for micro in [int(m) for m in args.micro.split(",")]:
            if not schedule_micro_batches(schedule, STAGES, micro):
                continue
            ranks = measure({"schedule": schedule, "micro": micro, "steps": args.steps, "activations": True})
            peaks[schedule] = (micro, max(r["activations"] for r in ranks))  # the largest M's stays
            step = ranks[0]["step"]
            formula = schedule_bubble(schedule, STAGES, micro)
            ideal = half / (1 - formula)
            compute = sum(r["compute"] for r in ranks) / len(ranks)
            bubble = sum(r["bubble"] for r in ranks) / len(ranks)
            p2p = sum(r["p2p"] for r in ranks) / len(ranks) / 1e6
            print(
                f"{schedule:>16} {micro:>3} {step * 1e3:>8.1f} {ideal * 1e3:>9.1f} {ideal / step:>11.2f} "
                f"{compute * 1e3:>11.1f} {compute / half:>15.2f} {bubble:>7.3f} {formula:>8.3f} "
                f"{bubble - formula:>+7.3f} {p2p:>12.3f}"
            )
            rows_a.append(
                [
                    schedule,
                    str(micro),
                    f"{step * 1e3:.1f}",
                    f"{ideal * 1e3:.1f}",
                    f"{ideal / step:.2f}",
                    f"{compute * 1e3:.1f}",
                    f"{compute / half:.2f}",
                    f"{bubble:.3f}",
                    f"{formula:.3f}",
                    f"{bubble - formula:+.3f}",
                    f"{p2p:.3f}",
                ]
            )
    columns = ["schedule", "M", "step ms", "ideal ms", "ideal/measured", "compute ms", "compute/(T1/S)", "bubble"]
    columns += ["formula", "diff", "p2p MB/step"]
    report.table("(a) Step time and bubble (means over the ranks)", columns, rows_a)
    print("\n(b) peak activation memory at each schedule's largest M (bytes saved for backward, busiest rank)")
    print(f"{'schedule':>16} {'M':>3} {'MiB':>8} {'/ 1f1b':>7} {'model: chunks held (per rank)':>31}")
    for schedule, (micro, peak) in peaks.items():
        held = table_in_flight(clock_table(schedule, STAGES, micro))
        ratio = peak / peaks["1f1b"][1] if "1f1b" in peaks and peaks["1f1b"][0] == micro else float("nan")
        print(f"{schedule:>16} {micro:>3} {peak / 2**20:>8.2f} {ratio:>7.2f} {held!s:>31}")
        rows_b.append([schedule, str(micro), f"{peak / 2**20:.2f}", f"{ratio:.2f}", str(held)])
    columns = ["schedule", "M", "MiB", "/ 1f1b", "model: chunks held (per rank)"]
    report.table("(b) Peak activation memory at each schedule's largest M (busiest rank)", columns, rows_b)

    micros = sorted({1, *(int(m) for m in args.micro.split(","))})
    compute = measure({"schedule": "stage compute", "micro": micros, "steps": args.steps})[0]
    stage = {int(m): t for m, t in compute["stage"].items()}
    order = {int(m): r for m, r in compute["order"].items()}
    one_w_pass = {int(m): r for m, r in compute["one_w_pass"].items()}
    blocks = args.blocks // STAGES
    print(f"\n(c) one process, no pipeline: a stage ({blocks} blocks) forward and backward, {BATCH} rows in M pieces")
    print("    (GPipe's order; ceiling: the ideal/measured of a schedule that meets its formula; 1f1b order: the same")
    print("    pieces in rank 0's 1F1B order over GPipe's; one W pass: GPipe's order with each weight gradient")
    print("    computed once over all the pieces, over GPipe's)")
    print(f"{'M':>3} {'ms':>7} {'/ M=1':>6} {'ceiling':>8} {'1f1b order':>11} {'one W pass':>11}")
    for micro in micros:
        ratio = stage[micro] / stage[1]
        cells = f"{ratio:>6.2f} {1 / ratio:>8.2f} {order[micro]:>11.2f} {one_w_pass[micro]:>11.2f}"
        print(f"{micro:>3} {stage[micro] * 1e3:>7.1f} {cells}")
        rows_c.append(
            [
                str(micro),
                f"{stage[micro] * 1e3:.1f}",
                f"{ratio:.2f}",
                f"{1 / ratio:.2f}",
                f"{order[micro]:.2f}",
                f"{one_w_pass[micro]:.2f}",
            ]
        )
    gemm_notes: list[str] = []
    rows, weight_mb = compute["rows"], compute["weight_mb"]
    shape = f"({rows} x {args.width}) @ ({args.width} x {args.width})"
    print(f"one GEMM {shape}: its time per row over the time per row of {BATCH} rows")
    for count, ratio in compute["gemm"].items():
        print(f"  weights cycled through: {int(count):>2} ({int(count) * weight_mb:5.1f} MB): {ratio:.2f}")
        gemm_notes.append(
            f"one GEMM {shape}, time per row over that of {BATCH} rows, {int(count)} weights "
            f"({int(count) * weight_mb:.1f} MB) cycled through: {ratio:.2f}"
        )
    columns = ["M", "ms", "/ M=1", "ceiling", "1f1b order / GPipe's", "one W pass / GPipe's"]
    title = f"(c) One process, no pipeline: a stage ({blocks} blocks) forward and backward, {BATCH} rows in M pieces"
    report.table(title, columns, rows_c, gemm_notes)
    report.save(args.json)


if __name__ == "__main__":
    main()
