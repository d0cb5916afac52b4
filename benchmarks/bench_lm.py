"""Training over slow links: a byte-level Transformer LM on the simulated cluster, time to ddp's validation loss.

The task is ``benchmarks/lm_task.py``: a 7.2 M-parameter byte-level causal Transformer (4 blocks of width 384, tied
byte embedding, context 128) trained with AdamW, its learning rate warmed up over ``--warmup`` steps, on the standard
library's ``pydoc_data.topics`` text, the last 10% held out. Every variant trains the same model from the same seed
(``--seed``) on the same global batch sequence (8 windows a process and step) for the same training-time budget
(``--budget`` seconds, evaluations left out), one process a simulated node with one thread. Every ``--eval-seconds``
of training the ranks' averaged model (for local SGD mid-period: the mean of the ranks' parameters, in a copy) is
scored on 64 held-out windows; the clock stops meanwhile (the score at step 0 runs on every rank, which warms every
rank's forward pass before the clock starts). ``--add-to`` refuses a stored result whose cells trained with other
settings.
Variants (one line each in :data:`VARIANTS`):

    ddp                    Lightning's own DDP
    ring_allreduce         the package's ring all-reduce (registered name)
    ring_allreduce_auto    the ring with reducer="auto" (it times a few steps, then picks a reducer)
    powersgd               RingAllReduceStrategy(reducer=PowerSGD("ring", rank=4))
    local_sgd              LocalSGDStrategy(sync_every=8), inner AdamW
    diloco                 LocalSGDStrategy(sync_every=16, outer_optimizer=diloco_outer_optimizer()), inner AdamW
    streaming_diloco       the registered name: 4 fragments, outer gradients sent as int4 during at least one
                           inner step, plain averaging as the outer step, sync_every="auto"
    streaming_diloco_int8  the same with outer gradients sent as int8
    streaming_nesterov     4 fragments, int4, DiLoCo's outer Nesterov step, sync_every=16, mixing 0.5

A variant the installed package cannot build yet is skipped and listed in the JSON. While a variant runs, the host
samples every node's link counters every 50 ms (``netsim.LinkSampler``): the JSON holds the bytes the nodes sent while
training (headers included), per step, and the peak: the most bytes one node sent in any one-second window. Time to
quality is each variant's training time to reach ddp's final validation loss (interpolated between the evaluations
around the first one at or below it), against ddp's own. Needs root (network namespaces); without it the script
says so and exits with status 0. Always leaves the cluster down. ``--dry-run`` prints the plan; ``--quick`` is a
short run (one cell, two variants, 20 s).
``--plot`` draws validation loss against training time, one panel per link x nodes cell.

Usage::

    python benchmarks/bench_lm.py --links 200mbit --nodes 2 --json benchmarks/results/lm.json
    python benchmarks/bench_lm.py --links 1gbit --nodes 2 --add-to benchmarks/results/lm.json --json ...
    python benchmarks/bench_lm.py --plot benchmarks/results/lm.json --figure docs/figures/lm_loss_time.png
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

# ``_launch`` and ``netsim`` are imported where they are used: tests load this file by its path
ROOT = Path(__file__).resolve().parents[1]
STREAMING = 'sync_every="auto", fragments=4, delay=1'

VARIANTS: dict[str, str] = {
    "ddp": '"ddp"',
    "ring_allreduce": '"ring_allreduce"',
    "ring_allreduce_auto": '"ring_allreduce_auto"',
    "powersgd": 'RingAllReduceStrategy(reducer=PowerSGD("ring", rank=4))',
    "local_sgd": "LocalSGDStrategy(sync_every=8)",
    "diloco": "LocalSGDStrategy(sync_every=16, outer_optimizer=diloco_outer_optimizer())",
    "streaming_diloco": '"streaming_diloco"',
    "streaming_diloco_int8": f'LocalSGDStrategy({STREAMING}, outer_precision="int8")',
    "streaming_nesterov": 'LocalSGDStrategy(sync_every=16, outer_optimizer=diloco_outer_optimizer(), fragments=4, delay=1, mixing=0.5, outer_precision="int4")',  # noqa: E501
}
"""Each variant's ``Trainer(strategy=...)``, as Python evaluated over the package's names."""


def make_strategy(variant: str) -> Any:
    """The Trainer's ``strategy=`` for ``variant`` (``TypeError`` where the package lacks an option it names)."""
    return strategy_from(VARIANTS[variant])


def strategy_from(expression: str) -> Any:
    """``expression`` (a variant's line) evaluated over the package's exported names, ``diloco_outer_optimizer``
    and ``torch``."""
    import torch

    import lightning_dp_strategies as ldp
    from lightning_dp_strategies.core.local_sgd import diloco_outer_optimizer

    names = {"torch": torch, "diloco_outer_optimizer": diloco_outer_optimizer}
    names.update({n: getattr(ldp, n) for n in ldp.__all__})
    return eval(expression, {"__builtins__": {}, **names})  # as globals: a lambda in the line looks its names up there


def available(variant: str) -> bool:
    """Whether the installed package builds ``variant``."""
    try:
        make_strategy(variant)
    except (TypeError, ValueError, AttributeError):
        return False
    return True


# ---------------------------------------------------------------------- one rank
def worker(args: argparse.Namespace) -> None:
    """One rank of one launch (started by torchrun on every simulated node)."""
    import torch
    from _launch import cluster_trainer
    from lm_task import TrainWindows, corpus, lightning_module, val_batches
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)  # the simulated nodes share the machine's cores
    import lightning as L

    config = lm_config(args)
    train, val = corpus()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    L.seed_everything(args.seed)
    module = lightning_module(config)
    clock = clock_callback(args.budget, args.eval_seconds, val_batches(val, config.context, count=64))
    profile = profile_callback(os.environ["LM_PROFILE"]) if os.environ.get("LM_PROFILE") else None
    trainer = cluster_trainer(make_strategy(args.worker), args.max_steps, [clock] + [profile] * bool(profile))
    data = DataLoader(TrainWindows(train, config, rank, world, seed=args.seed + 1), batch_size=None)
    trainer.fit(module, data)
    if trainer.global_rank == 0:
        tokens = world * config.tokens_per_step
        result = {"variant": args.worker, "points": clock.points, "segments": clock.segments, "steps": clock.step_s}
        result["tokens_per_step"] = tokens
        if profile is not None:
            result["profile"] = profile.steps
            result["cpu"] = profile.cpu
        local = getattr(trainer.strategy, "local_sgd", None)
        if local is not None:  # the period in use ("auto": as chosen) and the time the loop waited for averages
            result["local_sgd"] = {
                "sync_every": local.sync_every,
                "delay": local.delay,
                "syncs": local.syncs,
                "exposed_seconds": local.exposed_seconds - clock.evaluation_waits,  # training's own waits
                "evaluation_waits": clock.evaluation_waits,
            }
        Path(args.out).write_text(json.dumps(result))


def lm_config(args: argparse.Namespace) -> Any:
    from lm_task import LMConfig

    return LMConfig(args.d_model, args.layers, args.heads, args.context, args.batch, args.lr, args.warmup)


def clock_callback(budget: float, eval_seconds: float, batches: list[Any]) -> Any:
    """A callback that keeps the training clock (evaluations left out), scores the averaged model every
    ``eval_seconds`` of it on ``batches`` (rank 0), and stops the fit once ``budget`` seconds have passed. Rank 0
    decides and broadcasts the decision every step, so the ranks agree. The score at step 0 runs on every rank: the
    ranks start the clock with the model's forward pass warmed up alike."""
    import lightning as L
    import torch
    import torch.distributed as dist
    from lm_task import averaged_state, held_out_loss

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.points: list[dict[str, float]] = []
            self.segments: list[list[float]] = []  # wall-time [start, end] of each stretch of training
            self.step_s: list[float] = []
            self.start = self.paused = self.last = self.next_eval = 0.0
            self.evaluation_waits = 0.0  # local SGD: what averaging the model for the evaluations added to its waits

        def elapsed(self) -> float:
            return time.perf_counter() - self.start - self.paused

        def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            dist.barrier()
            self.points.append(self.evaluate(trainer, module, 0, 0.0, everyone=True))
            dist.barrier()
            self.start, self.paused, self.next_eval = time.perf_counter(), 0.0, eval_seconds
            self.segments.append([time.time(), 0.0])

        def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *_: Any) -> None:
            now = self.elapsed()
            self.step_s.append(now - self.last)
            flags = torch.tensor([float(now >= self.next_eval), float(now >= budget)])
            dist.broadcast(flags, 0)
            if flags[0] or flags[1]:
                self.segments[-1][1] = time.time()
                pause = time.perf_counter()
                self.points.append(self.evaluate(trainer, module, trainer.global_step, now))
                dist.barrier()
                self.next_eval = now + eval_seconds
                self.paused += time.perf_counter() - pause
                trainer.should_stop = bool(flags[1])
                self.segments.append([time.time(), 0.0])
            self.last = self.elapsed()

        def on_train_end(self, *_: Any) -> None:
            self.segments.pop()  # the stretch opened after the last evaluation trained nothing

        def evaluate(
            self, trainer: L.Trainer, module: L.LightningModule, step: int, now: float, everyone: bool = False
        ) -> dict[str, Any]:
            """The averaged model's held-out loss, scored on rank 0; with ``everyone`` on every rank (before the clock
            starts, so that no rank's first forward pass is a cold one inside it), rank 0's kept."""
            local = getattr(trainer.strategy, "local_sgd", None)
            waited = 0.0 if local is None else local.exposed_seconds
            state = averaged_state(trainer, module)
            self.evaluation_waits += 0.0 if local is None else local.exposed_seconds - waited
            loss = held_out_loss(module, state, batches) if trainer.global_rank == 0 or everyone else float("nan")
            return {"step": step, "seconds": now, "val_loss": loss}

    return Clock()


def profile_callback(mode: str) -> Any:
    """``--profile``: per step, when the batch started, backward began, the last gradient was accumulated, backward
    returned (the gradients averaged), the optimizer stepped and the batch ended, and per gradient bucket when it
    was launched, when its reduction started and when it ended (seconds from the batch's start). The ring's buckets
    are timed on :class:`~lightning_dp_strategies.reducers.RingReducer`; ddp's through a communication hook (the
    default hook's work, timed) when ``mode`` is ``hooks``, else not at all."""
    import lightning as L
    import torch
    import torch.distributed as dist

    from lightning_dp_strategies.bucketing import GradientBuckets
    from lightning_dp_strategies.reducers import builtin

    now = time.perf_counter
    state: dict[str, Any] = {"t0": 0.0, "step": None}

    def record(key: str, **fields: Any) -> None:
        step = state["step"]
        if step is not None:
            relative = {k: (v - state["t0"] if k.startswith("t") else v) for k, v in fields.items()}
            step.setdefault(key, []).append(relative)

    launch, reduce = builtin.RingReducer.__call__, builtin.RingReducer.reduce

    def timed_call(self: Any, bucket: Any) -> Any:
        record("launch", t=now(), index=bucket.index, mb=bucket.buffer.numel() * bucket.buffer.element_size() / 1e6)
        return launch(self, bucket)

    def timed_reduce(self: Any, bucket: Any) -> Any:
        start = now()
        out = reduce(self, bucket)
        record("reduce", t_start=start, t_end=now(), index=bucket.index)
        return out

    builtin.RingReducer.__call__ = timed_call  # type: ignore[method-assign]
    builtin.RingReducer.reduce = timed_reduce  # type: ignore[method-assign]
    finish = GradientBuckets.finish

    def timed_finish(self: Any) -> None:  # the ring's wait for its buckets, after backward
        start = now()
        finish(self)
        record("finish", t_start=start, t_end=now())

    GradientBuckets.finish = timed_finish  # type: ignore[method-assign]

    class Profile(L.Callback):
        def __init__(self) -> None:
            self.steps: list[dict[str, Any]] = []
            self.cpu: dict[str, Any] = {}

        @staticmethod
        def cpu_times() -> dict[str, Any]:
            """CPU seconds so far of each thread of this process (by name and id), and the machine's (/proc/stat)."""
            tick = os.sysconf("SC_CLK_TCK")
            threads = {}
            for task in Path("/proc/self/task").iterdir():
                try:
                    name = (task / "comm").read_text().strip()
                    fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                threads[f"{name}/{task.name}"] = (int(fields[11]) + int(fields[12])) / tick
            machine = dict(
                zip(
                    ["user", "nice", "system", "idle", "iowait", "irq", "softirq"],
                    [int(x) / tick for x in Path("/proc/stat").read_text().split()[1:8]],
                    strict=True,
                )
            )
            return {"threads": threads, "machine": machine, "time": now()}

        def on_train_end(self, *_: Any) -> None:
            self.cpu["end"] = self.cpu_times()

        def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            self.cpu["start"] = self.cpu_times()
            for p in module.parameters():
                p.register_post_accumulate_grad_hook(lambda _: state.__setitem__("grad", now()))
            inner = getattr(module, "model", module)  # the network alone: when the forward starts and ends
            inner.register_forward_pre_hook(lambda *_: self.mark("t_forward"))
            inner.register_forward_hook(lambda *_: self.mark("t_forward_end"))
            model = trainer.strategy.model
            if mode == "hooks" and isinstance(model, torch.nn.parallel.DistributedDataParallel):
                model.register_comm_hook(None, self.ddp_hook)

        @staticmethod
        def ddp_hook(_, bucket):  # type: ignore[no-untyped-def]  # torch checks the annotations: none or GradBucket
            buffer, index, t = bucket.buffer(), bucket.index(), now()
            record("launch", t=t, index=index, mb=buffer.numel() * buffer.element_size() / 1e6)
            buffer.div_(dist.get_world_size())
            fut = dist.all_reduce(buffer, async_op=True).get_future()

            def done(f: Any) -> Any:
                record("reduce", t_start=t, t_end=now(), index=index)
                return f.value()[0]

            return fut.then(done)

        @staticmethod
        def mark(key: str) -> None:
            if state["step"] is not None and key not in state["step"]:
                state["step"][key] = now() - state["t0"]

        def on_train_batch_start(self, *_: Any) -> None:
            state["t0"], state["step"] = now(), {}

        def on_before_backward(self, *_: Any) -> None:
            state["step"]["t_backward"] = now() - state["t0"]

        def on_after_backward(self, *_: Any) -> None:
            state["step"]["t_grads"] = state.get("grad", state["t0"]) - state["t0"]
            state["step"]["t_averaged"] = now() - state["t0"]

        def on_before_optimizer_step(self, *_: Any) -> None:
            state["step"]["t_optimizer"] = now() - state["t0"]

        def on_train_batch_end(self, *_: Any) -> None:
            state["step"]["t_end"] = now() - state["t0"]
            self.steps.append(state["step"])
            state["step"] = None

    return Profile()


# ---------------------------------------------------------------------- launching
WORKER_SETTINGS = ("d_model", "layers", "heads", "context", "batch", "lr", "warmup", "budget", "eval_seconds")
WORKER_SETTINGS += ("max_steps", "seed")


def launch(variant: str, args: argparse.Namespace, folder: Path, nodes: int) -> dict[str, Any]:
    """One launch of ``variant`` on the cluster that is up, one process a node, its links sampled meanwhile."""
    import netsim
    from _launch import torchrun_on_cluster, worker_command

    out = folder / f"{variant}.json"
    sampler = netsim.LinkSampler(netsim.load(), interval=args.sample_interval).start()
    try:
        torchrun_on_cluster(1, worker_command(__file__, variant, out, args, WORKER_SETTINGS), folder, variant)
    finally:
        samples = sampler.stop()
    result: dict[str, Any] = json.loads(out.read_text())
    result.update(traffic(samples, result["segments"], nodes))
    return result


def traffic(samples: list[Any], segments: list[list[float]], nodes: int) -> dict[str, Any]:
    """Bytes each node sent while training (the stretches in ``segments``; set-up and evaluations left out), and the
    most one node sent in any one-second window of training time."""
    from netsim import peak_window

    def training(t: float) -> float | None:  # training time at wall time t, None outside the stretches
        done = 0.0
        for start, end in segments:
            if start <= t <= end:
                return done + t - start
            done += end - start
        return None

    clock: list[float] = []  # training time at the end of each sampled interval that lies in training
    sent: list[list[float]] = [[] for _ in range(nodes)]  # bytes each node sent, cumulative over those intervals
    for (t0, s0, _), (t1, s1, _) in itertools.pairwise(samples):
        at = training((t0 + t1) / 2)
        if at is None:
            continue
        if not clock:  # where the count starts: zero bytes one interval before the first
            clock.append(at - (t1 - t0) / 2)
            for series in sent:
                series.append(0.0)
        clock.append(at + (t1 - t0) / 2)
        for node in range(nodes):
            sent[node].append(sent[node][-1] + s1[node] - s0[node])
    totals = [series[-1] if series else 0.0 for series in sent]
    peaks = [peak_window(clock, series, 1.0) for series in sent]
    return {"sent_bytes": totals, "peak_bytes_1s": peaks, "samples": len(samples)}


def crossing(points: list[dict[str, Any]], target: float) -> float | None:
    """The training time at which the loss first reaches ``target``, interpolated linearly between the two
    evaluations around it; ``None`` if it never does.

    Examples:
        >>> crossing([{"seconds": 0, "val_loss": 5.0}, {"seconds": 10, "val_loss": 3.0}], 4.0)
        5.0
    """
    for before, after in itertools.pairwise(points):
        if after["val_loss"] <= target:
            drop = before["val_loss"] - after["val_loss"]
            share = (before["val_loss"] - target) / drop if drop > 0 else 1.0
            return float(before["seconds"] + share * (after["seconds"] - before["seconds"]))
    return None


def summarize(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """ddp's final loss as the target; per variant the time to reach it, the loss at the budget, steps and bytes."""
    target = runs["ddp"]["points"][-1]["val_loss"] if "ddp" in runs else None
    ddp_seconds = crossing(runs["ddp"]["points"], target) if target is not None else None
    rows = {}
    for variant, run in runs.items():
        points, last = run["points"], run["points"][-1]
        reached = crossing(points, target) if target is not None else None
        steps = max(1, last["step"])
        rows[variant] = {
            "steps": last["step"],
            "tokens": last["step"] * run["tokens_per_step"],
            "seconds": last["seconds"],
            "seconds_per_step": last["seconds"] / steps,
            "median_step_s": statistics.median(run["steps"][3:] or run["steps"]),
            "final_loss": last["val_loss"],
            "seconds_to_target": reached,
            "ratio_to_ddp": reached / ddp_seconds if reached is not None and ddp_seconds else None,
        }
        if "sent_bytes" in run:  # a run whose link counters were sampled
            rows[variant]["sent_mb_per_step"] = sum(run["sent_bytes"]) / len(run["sent_bytes"]) / steps / 1e6
            rows[variant]["sent_mb"] = sum(run["sent_bytes"]) / 1e6
            rows[variant]["peak_mb_per_s"] = max(run["peak_bytes_1s"]) / 1e6
    return {"target_loss": target, "ddp_seconds": ddp_seconds, "variants": rows}


def measure_cell(link: str, nodes: int, variants: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """Every variant on ``nodes`` nodes over ``link``, one after another."""
    from _launch import measured_cluster

    runs: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    load = round(os.getloadavg()[0], 2)  # before this cell's first launch
    with measured_cluster(nodes, link) as bandwidth, tempfile.TemporaryDirectory(prefix="lm-") as tmp:
        for variant in variants:
            try:
                runs[variant] = launch(variant, args, Path(tmp), nodes)
            except (RuntimeError, OSError) as failure:  # one failed variant does not lose the others
                failed[variant] = str(failure)[-2000:]
                print(f"  {link} {nodes} nodes {variant}: failed\n{failed[variant]}")
                continue
            last = runs[variant]["points"][-1]
            mb = sum(runs[variant]["sent_bytes"]) / 1e6
            print(f"  {link} {nodes} nodes {variant:22s} {last['step']:4d} steps {last['val_loss']:.4f} {mb:.0f} MB")
    cell = {"link": link, "nodes": nodes, "per_node": 1, "bandwidth": bandwidth, "runs": runs, "failed": failed}
    cell["load_average_at_start"] = load
    return {**cell, **summarize(runs)}


# ---------------------------------------------------------------------- tables and the figure
COLUMNS = ["link", "nodes", "variant", "steps", "s/step", "final loss", "s to ddp's loss", "/ ddp"]
COLUMNS += ["MB sent/step/node", "peak MB/s"]


def table(cells: list[dict[str, Any]]) -> list[list[Any]]:
    """One row per cell and variant."""
    rows = []
    for cell in cells:
        for variant, row in cell["variants"].items():
            reached, ratio = row["seconds_to_target"], row["ratio_to_ddp"]
            unreached = "not reached" if cell["target_loss"] is not None else "-"  # no ddp run: no target
            rows.append(
                [
                    cell["link"],
                    cell["nodes"],
                    variant,
                    row["steps"],
                    f"{row['seconds_per_step']:.2f}",
                    f"{row['final_loss']:.3f}",
                    f"{reached:.0f}" if reached is not None else unreached,
                    f"{ratio:.2f}" if ratio is not None else "-",
                    f"{row['sent_mb_per_step']:.2f}" if "sent_mb_per_step" in row else "-",
                    f"{row['peak_mb_per_s']:.1f}" if "peak_mb_per_s" in row else "-",
                ]
            )
    return rows


def plot(path: Path, figure: Path) -> None:
    """Validation loss against training time, one panel per link x nodes cell, from a stored result."""
    import matplotlib
    from _results import save_figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = json.loads(path.read_text())["cells"]
    fig, axes = plt.subplots(1, len(cells), figsize=(6 * len(cells), 4.2), squeeze=False)
    for ax, cell in zip(axes[0], cells, strict=True):
        for variant, run in cell["runs"].items():
            style = "-" if variant in ("ddp", "ring_allreduce", "ring_allreduce_auto", "powersgd") else "--"
            points = run["points"]
            label = variant.replace("_allreduce", "")
            ax.plot([p["seconds"] for p in points], [p["val_loss"] for p in points], style, lw=1.6, label=label)
        if cell["target_loss"] is not None:
            ax.axhline(cell["target_loss"], color="gray", lw=0.8)
        ax.set(title=f"{cell['nodes']} nodes over {cell['link']}", xlabel="training time (s)")
        ax.set(ylabel="held-out loss (nats/byte)")
        ax.legend(fontsize=8)
    save_figure(fig, figure)


# ---------------------------------------------------------------------- the command
def plan(args: argparse.Namespace, variants: list[str]) -> list[str]:
    """What a run would do, one line per cell."""
    lines = []
    for nodes in args.nodes:
        for link in args.links:
            lines.append(f"{link} x {nodes} nodes: {', '.join(variants)} ({args.budget:.0f} s of training each)")
    return lines


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--links", nargs="+", default=["200mbit", "1gbit"], help="tc rates of the links")
    parser.add_argument("--nodes", nargs="+", type=int, default=[2, 4], help="node counts (one process each)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--budget", type=float, default=60.0, help="training seconds of every variant")
    parser.add_argument("--eval-seconds", type=float, default=5.0, help="training seconds between evaluations")
    parser.add_argument("--max-steps", type=int, default=100_000, help="a cap on steps besides the budget")
    parser.add_argument("--d-model", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="windows a process and step")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate")
    parser.add_argument("--warmup", type=int, default=20, help="steps of linear learning-rate warm-up (0: none)")
    parser.add_argument("--sample-interval", type=float, default=0.05, help="seconds between link samples")
    parser.add_argument(
        "--seed", type=int, default=0, help="the model's initialisation (this seed) and the batches' (this seed + 1)"
    )
    parser.add_argument("--quick", action="store_true", help="one cell (200mbit x 2), ddp and local_sgd, 20 s each")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    parser.add_argument(
        "--profile",
        choices=["steps", "hooks"],
        help="record per-step and per-bucket timings in the JSON (hooks: ddp's buckets too, through a comm hook)",
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--add-to", type=Path, help="keep the other cells of this stored result in the new one")
    return parser


def main() -> None:
    from _launch import parse_or_work

    parser = arguments()
    args = parse_or_work(
        parser, worker, plot, figure=ROOT / "docs" / "figures" / "lm_loss_time.png", figure_from="lm.json"
    )
    if args is None:
        return
    if args.quick:
        args.links, args.nodes, args.variants, args.budget, args.eval_seconds = ["200mbit"], [2], [], 20.0, 5.0
        args.variants = ["ddp", "local_sgd"]
    skipped = [v for v in args.variants if not available(v)]
    variants = [v for v in args.variants if v not in skipped]
    for line in plan(args, variants) + [f"skipped (not in the installed package): {', '.join(skipped)}"] * bool(
        skipped
    ):
        print(line)
    if args.add_to is not None:  # before measuring: cells trained otherwise cannot share a table
        stored = json.loads(args.add_to.read_text())["settings"]
        check_same_training(stored, {k: getattr(args, k) for k in TRAINING}, args.add_to)
    if args.dry_run:
        return
    if args.profile:
        os.environ["LM_PROFILE"] = args.profile  # the workers inherit it
    if os.geteuid() != 0:
        print("bench_lm.py needs root for the simulated cluster (network namespaces and tc); nothing measured.")
        return
    from _results import machine

    started = machine()  # the load average before the first launch
    cells = [measure_cell(link, nodes, variants, args) for nodes in args.nodes for link in args.links]
    save(cells, args, skipped, started)


def save(
    cells: list[dict[str, Any]], args: argparse.Namespace, skipped: list[str], started: dict[str, Any] | None = None
) -> None:
    import lightning
    from _results import Report
    from lm_task import parameter_count

    settings: dict[str, Any] = {k: getattr(args, k) for k in ("links", "nodes", "variants", *TRAINING)}
    report = Report("lm", settings, started)
    report.data["machine"]["lightning"] = lightning.__version__
    if args.add_to is not None:
        stored = json.loads(args.add_to.read_text())
        done = {(c["link"], c["nodes"]) for c in cells}
        kept = [c for c in stored["cells"] if (c["link"], c["nodes"]) not in done]
        cells = [{**c, **summarize(c["runs"])} for c in kept + cells]  # every cell summarised the same way
        if kept:  # the command that measured the kept cells, then this one
            report.data["command"] = f"{stored['command']} && {report.data['command']}"
        covered = report.data["settings"]  # the links and node counts of every stored cell
        covered["links"] = list(dict.fromkeys(c["link"] for c in cells))
        covered["nodes"] = list(dict.fromkeys(c["nodes"] for c in cells))
    params = parameter_count(lm_config(args))
    notes = [cell_note(c) for c in cells]
    notes += local_notes(cells)
    report.note(
        f"{params / 1e6:.1f} M parameters; one process a node with one thread, a cell's nodes all on this machine's "
        f"{report.data['machine']['cores_usable']} cores (more nodes than cores take turns on them); every variant "
        f"{args.budget:.0f} s of training; variants not in the installed package: {', '.join(skipped) or 'none'}."
    )
    report.table("Time to ddp's held-out loss, bytes and peak bandwidth", COLUMNS, table(cells), notes)
    report.data["quotes"] = quotes(cells)
    report.data["cells_run"] = [f"{c['link']} x {c['nodes']}" for c in cells]
    report.data["skipped"] = skipped
    report.data["cells"] = cells
    for row in table(cells):
        print("  ".join(str(c) for c in row))
    for sentence in report.data["quotes"].values():
        print(sentence)
    report.save(args.json)
    if args.json is not None and args.figure is not None:  # a scratch run (not in benchmarks/results) draws none
        plot(args.json, args.figure)


TRAINING = ("budget", "eval_seconds", "d_model", "layers", "heads", "context", "batch", "lr", "warmup")
TRAINING += ("sample_interval", "seed")
"""The settings every cell of one stored result must share (``--add-to`` refuses a result that differs)."""

BEFORE_SETTING = {"seed": 0}
"""The value a setting had before it could be set: a stored result without it trained with this."""


def check_same_training(stored: dict[str, Any], new: dict[str, Any], path: Path) -> None:
    """Refuse to add cells to ``path`` when the stored cells trained or were measured otherwise (``SystemExit``
    naming the settings that differ); a result stored before a setting existed counts as differing in it, unless
    :data:`BEFORE_SETTING` holds the value it had then."""
    stored = {**BEFORE_SETTING, **stored}
    differ = [f"{k}: stored {stored.get(k)!r}, now {new[k]!r}" for k in TRAINING if stored.get(k) != new[k]]
    if differ:
        raise SystemExit(
            f"--add-to {path}: its cells were trained with other settings ({'; '.join(differ)}). Run every cell "
            "with the same settings: measure them all again, or pass the stored settings."
        )


# ---------------------------------------------------------------------- the sentences docs/slow_links.md quotes
NAMES = {
    "ring_allreduce_auto": "`ring_allreduce_auto`",
    "local_sgd": "local SGD (H = 8)",
    "diloco": "DiLoCo (H = 16, its Nesterov outer step)",
    "powersgd": "PowerSGD",
    "streaming_diloco": "`streaming_diloco`",
}
"""How the quoted sentences name the variants they compare with ddp."""


def quotes(cells: list[dict[str, Any]]) -> dict[str, str]:
    """The sentences ``docs/slow_links.md`` quotes (``render_docs.py`` fills them in). Per cell with a ddp run, keyed
    ``LINK_NODES`` (``200mbit_2``): ddp's step, what streaming DiLoCo sent and bought, the others' times to ddp's loss
    and the losses at ddp's step count; ``outer_LINK_NODES``: DiLoCo's outer Nesterov step against plain averaging.
    ``ring``: the package's ring against ddp in every such cell. A clause whose variants did not run is left out."""
    said: dict[str, str] = {}
    cells = [c for c in cells if "ddp" in c["variants"]]
    for cell in cells:
        key = f"{cell['link']}_{cell['nodes']}"
        clauses = [step_clause(cell), streaming_clause(cell), others_clause(cell), per_step_clause(cell)]
        said[key] = " ".join(c for c in clauses if c)
        outer = outer_clause(cell)
        if outer:
            said[f"outer_{key}"] = outer
    if cells and all("ring_allreduce" in c["variants"] for c in cells):
        said["ring"] = ring_quote(cells)
    return said


def _share(row: dict[str, Any]) -> str:
    """The row's time to ddp's loss as a share of ddp's, or that it did not get there."""
    ratio = row["ratio_to_ddp"]
    return f"{ratio:.2f}" if ratio is not None else "not reached"


def _and(items: list[str]) -> str:
    """``a, b and c``."""
    return " and ".join(filter(None, [", ".join(items[:-1]), items[-1]])) if items else ""


def loss_at(points: list[dict[str, Any]], step: float) -> float | None:
    """The held-out loss at ``step``, interpolated between the evaluations around it; ``None`` past the last.

    Examples:
        >>> loss_at([{"step": 0, "val_loss": 5.0}, {"step": 10, "val_loss": 3.0}], 5)
        4.0
    """
    for before, after in itertools.pairwise(points):
        if before["step"] <= step <= after["step"]:
            share = (step - before["step"]) / max(1, after["step"] - before["step"])
            return float(before["val_loss"] + share * (after["val_loss"] - before["val_loss"]))
    return None


def step_clause(cell: dict[str, Any]) -> str:
    """ddp's seconds a step, against the compute's (local SGD's median step, a step that sends nothing)."""
    rows = cell["variants"]
    said = f"Over {cell['link']} between {cell['nodes']} nodes, ddp took {rows['ddp']['seconds_per_step']:.2f} s"
    said += " a step"
    if "local_sgd" in rows:
        compute = rows["local_sgd"]["median_step_s"]
        said += f" where the compute takes about {compute:.2f} s (local SGD's median step, which sends nothing)"
    return said + "."


def streaming_clause(cell: dict[str, Any]) -> str:
    """``streaming_diloco``'s step, time to ddp's loss, bytes a step, peak (against DiLoCo's and local SGD's) and
    the share of its training time its loop waited for averages."""
    rows, run = cell["variants"], cell["runs"].get("streaming_diloco")
    row, int8 = rows.get("streaming_diloco"), rows.get("streaming_diloco_int8")
    if row is None or run is None or "peak_mb_per_s" not in row:
        return ""
    bursts = [f"{name}'s {rows[v]['peak_mb_per_s']:.0f} MB" for v, name in BURSTS.items() if v in rows]
    waited = run["local_sgd"]["exposed_seconds"] / row["seconds"]
    reached = f"reached ddp's final held-out loss in {_share(row)} of ddp's time"
    if row["ratio_to_ddp"] is None:
        reached = "did not reach ddp's final held-out loss within its budget"
    return (
        f"`streaming_diloco` took {row['seconds_per_step']:.2f} s a step, {reached}"
        + (f" (its int8 variant: {_share(int8)})" if int8 is not None else "")
        + ", "
        f"sent {row['sent_mb_per_step']:.2f} MB a step where ddp sends {rows['ddp']['sent_mb_per_step']:.0f} MB, and "
        f"never more than {row['peak_mb_per_s']:.1f} MB in one second"
        + (f", against {_and(bursts)}" if bursts else "")
        + f"; its loop waited for averages {100 * waited:.0f}% of its training time."
    )


BURSTS = {"diloco": "DiLoCo", "local_sgd": "local SGD"}
"""The variants whose peak bandwidth streaming DiLoCo's is set against (they send the whole model at once)."""


def others_clause(cell: dict[str, Any]) -> str:
    """The other variants' times to ddp's loss, as shares of ddp's."""
    rows = cell["variants"]
    chosen = [v for v in ("ring_allreduce_auto", "local_sgd", "diloco", "powersgd") if v in rows]
    shares = [f"{NAMES[v]} {_share(rows[v])}" for v in chosen]
    return f"As shares of ddp's time to its loss: {', '.join(shares)}." if shares else ""


def per_step_clause(cell: dict[str, Any]) -> str:
    """The held-out losses at ddp's final step count: ddp's, and those of the variants that took more steps."""
    rows, runs, steps = cell["variants"], cell["runs"], cell["variants"]["ddp"]["steps"]
    chosen = [v for v in ("streaming_diloco", "ring_allreduce_auto", "powersgd") if v in runs]
    losses = [(NAMES[v], loss_at(runs[v]["points"], steps)) for v in chosen]
    known = [f"{loss:.2f} for {name}" for name, loss in losses if loss is not None]
    if not known:
        return ""
    ddp = f"{rows['ddp']['final_loss']:.2f} for ddp"
    interpolated = "interpolated between evaluations"
    return f"At ddp's final step count ({steps}), {interpolated}, the held-out loss was {_and([ddp, *known])}."


def outer_clause(cell: dict[str, Any]) -> str:
    """DiLoCo's outer Nesterov step (``diloco``, ``streaming_nesterov``) against plain averaging (``local_sgd``,
    ``streaming_diloco``): their periods and times to ddp's loss, and which were faster to reach it."""
    rows, runs = cell["variants"], cell["runs"]
    if not all(v in rows for v in ("diloco", "streaming_nesterov", "local_sgd", "streaming_diloco")):
        return ""

    def period(v: str) -> int:
        return int(runs[v]["local_sgd"]["sync_every"])

    def seconds(v: str) -> float:
        reached = rows[v]["seconds_to_target"]
        return math.inf if reached is None else float(reached)

    nesterov = [seconds("diloco"), seconds("streaming_nesterov")]
    plain = [seconds("local_sgd"), seconds("streaming_diloco")]
    when = "neither consistently slower nor faster"
    if min(nesterov) > max(plain):
        when = "slower"
    elif max(nesterov) < min(plain):
        when = "faster"
    return (
        f"DiLoCo's outer Nesterov step at a period of {period('diloco')}, with the whole model (`diloco`, "
        f"{_share(rows['diloco'])}) or in fragments at {period('streaming_nesterov')} (`streaming_nesterov`, "
        f"{_share(rows['streaming_nesterov'])}), was {when} to reach ddp's loss than plain averaging at periods of "
        f"{period('local_sgd')} (local SGD, {_share(rows['local_sgd'])}) and {period('streaming_diloco')} "
        f'(`streaming_diloco`, as `"auto"` chose, {_share(rows["streaming_diloco"])}).'
    )


def ring_quote(cells: list[dict[str, Any]]) -> str:
    """The package's ring against ddp, a sentence a cell: seconds and bytes a step, whether and when the ring reached
    ddp's final loss, and how far apart their held-out losses were at the steps both evaluated."""
    said = []
    for cell in cells:
        ring, ddp = cell["variants"]["ring_allreduce"], cell["variants"]["ddp"]
        ratio = ring["seconds_per_step"] / ddp["seconds_per_step"]
        mb = sorted({round(ring["sent_mb_per_step"]), round(ddp["sent_mb_per_step"])})
        sent = f"both sending {mb[0]} MB a step" if len(mb) == 1 else f"sending {mb[0]}-{mb[1]} MB a step"
        if ring["ratio_to_ddp"] is not None:
            reached = f"reached ddp's final loss in {ring['ratio_to_ddp']:.2f} of ddp's time"
        else:
            reached = "did not reach ddp's final loss within its budget"
        losses = {p["step"]: p["val_loss"] for p in cell["runs"]["ring_allreduce"]["points"] if p["step"] > 0}
        apart = [abs(p["val_loss"] - losses[p["step"]]) for p in cell["runs"]["ddp"]["points"] if p["step"] in losses]
        detail = f"{ring['steps']} steps against ddp's {ddp['steps']}"
        if apart:  # evaluations come every so many seconds: at the same step only where the two steps took as long
            same = "identical" if max(apart) == 0 else f"at most {max(apart):.1e} apart"
            detail += f"; their held-out losses at the {len(apart)} steps both evaluated were {same}"
        said.append(
            f"Over {cell['link']} between {cell['nodes']} nodes, `ring_allreduce` took {ring['seconds_per_step']:.2f}"
            f" s a step against ddp's {ddp['seconds_per_step']:.2f} ({ratio:.2f}x), {sent}, and {reached} ({detail})."
        )
    return " ".join(said)


def cell_note(cell: dict[str, Any]) -> str:
    """The cell's target (ddp's final loss) and its link as measured; a cell without ddp has no target, and its time
    to ddp's loss and ratio to ddp stay blank."""
    where = f"{cell['link']} x {cell['nodes']}"
    if cell["target_loss"] is None:
        return f"{where}: ddp not run, so no target loss (s to ddp's loss and / ddp left blank); {cell['bandwidth']}"
    return f"{where}: ddp's loss {cell['target_loss']:.3f}; {cell['bandwidth']}"


def local_notes(cells: list[dict[str, Any]]) -> list[str]:
    """One line per local SGD variant: the period and delay it ran with (as ``"auto"`` chose them) and the share of
    its training time the loop waited for averages (the evaluations' own averages left out)."""
    lines = []
    for cell in cells:
        for variant, run in cell["runs"].items():
            local = run.get("local_sgd")
            if local is None:
                continue
            seconds, waited = run["points"][-1]["seconds"], local["exposed_seconds"]
            evaluations = local.get("evaluation_waits")  # outside the training clock
            more = f", and {evaluations:.1f} s more for the evaluations" if evaluations is not None else ""
            lines.append(
                f"{cell['link']} x {cell['nodes']} {variant}: sync_every={local['sync_every']}, "
                f"delay={local['delay']}, {local['syncs']} outer steps; waited for averages {waited:.1f} s of "
                f"{seconds:.0f} s ({100 * waited / seconds:.0f}%)" + more
            )
    return lines


if __name__ == "__main__":
    main()
