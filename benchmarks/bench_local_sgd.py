"""Local SGD and DiLoCo against ddp and ring+PowerSGD on a simulated cluster (``benchmarks/netsim.py``): time to loss.

A held-out teacher-student task: a fixed random teacher (``width -> 64 -> 16``, tanh) labels Gaussian inputs, and a
12.6 M-parameter student MLP (12 layers of 1024, tanh; the model of ``bench_cluster.py``) learns it with Adam (lr
``--lr``, batch 32 per rank) under mean-squared error. Every ``--eval-every`` optimizer steps the ranks' averaged
model (for local SGD mid-period: the mean of the ranks' parameters, computed into a copy, so training is not
disturbed) is scored on 2048 held-out samples; the time spent evaluating is left out of the wall time. Variants:

    ddp             Lightning's own DDP (gradients all-reduced every step)
    powersgd        RingAllReduceStrategy(reducer=PowerSGD("ring", rank=4)), gradients compressed every step
    local_sgd_H     LocalSGDStrategy(sync_every=H): plain averaging every H steps
    diloco_H        LocalSGDStrategy(sync_every=H, outer_optimizer=diloco_outer_optimizer())
    NAME_ft         a local SGD or DiLoCo variant with ``fault_tolerant=True`` (opt-in: what the hand-over of Adam's
                    state at every synchronisation costs)

For each layout (nodes over one link, one process a node) every variant trains once, ``ddp`` for ``--ddp-steps``
steps and the others for ``--steps``. Lightning gives a lone process a node every core of the machine, so the
simulated nodes' OpenMP teams share the same cores; ``--one-thread`` sets ``OMP_NUM_THREADS=1`` on every node
instead, so that a variant's time is not set by how its ranks' compute phases happen to overlap. The table gives
ddp's final validation loss (the target), each variant's wall time to reach it (at an evaluation point), its ratio
to ddp's, and the loss at ddp's sample count. Needs root (network namespaces); without it the script says so and
exits with status 0. Always leaves the cluster down.
``--plot`` draws validation loss against wall time from a stored JSON file.

Usage::

    python benchmarks/bench_local_sgd.py --layouts 2 --json benchmarks/results/local_sgd.json
    python benchmarks/bench_local_sgd.py --plot benchmarks/results/local_sgd.json --figure docs/figures/local_sgd.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# ``_launch`` is imported where it is used: tests load this file by its path, without benchmarks/ on sys.path
ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("ddp", "powersgd", "local_sgd_4", "local_sgd_8", "local_sgd_16", "local_sgd_32", "diloco_8", "diloco_16")
OUT_DIM, TEACHER_HIDDEN, VAL_SAMPLES = 16, 64, 2048


def make_strategy(variant: str) -> Any:
    """The Trainer's ``strategy=`` for ``variant``."""
    from lightning_dp_strategies import LocalSGDStrategy, PowerSGD, RingAllReduceStrategy
    from lightning_dp_strategies.core.local_sgd import diloco_outer_optimizer

    if variant == "ddp":
        return "ddp"
    if variant == "powersgd":
        return RingAllReduceStrategy(two_level=False, reducer=PowerSGD("ring", rank=4))
    tolerant = variant.endswith("_ft")
    kind, _, every = variant.removesuffix("_ft").rpartition("_")
    outer = diloco_outer_optimizer() if kind == "diloco" else None
    return LocalSGDStrategy(sync_every=int(every), outer_optimizer=outer, fault_tolerant=tolerant)


def make_task(width: int, samples: int) -> tuple[Any, Any, Any, Any]:
    """``(x_train, y_train, x_val, y_val)`` of the teacher-student task: the teacher and the held-out set are the same
    whatever ``samples`` is; the targets are standardised with the held-out set's statistics."""
    import torch
    from torch import nn

    gen = torch.Generator().manual_seed(7)
    teacher = nn.Sequential(nn.Linear(width, TEACHER_HIDDEN), nn.Tanh(), nn.Linear(TEACHER_HIDDEN, OUT_DIM))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        x_val = torch.randn(VAL_SAMPLES, width, generator=torch.Generator().manual_seed(8))
        x = torch.randn(samples, width, generator=torch.Generator().manual_seed(9))
        y_val = teacher(x_val)
        mean, std = y_val.mean(0), y_val.std(0)
        return x, (teacher(x) - mean) / std, x_val, (y_val - mean) / std


def worker(args: argparse.Namespace) -> None:
    """One rank of one launch (started by torchrun on every simulated node)."""
    import lightning as L
    import torch
    from _launch import cluster_trainer
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    torch.set_num_threads(1)  # Lightning's launcher sets it again from OMP_NUM_THREADS (see --one-thread)
    world = int(os.environ["WORLD_SIZE"])
    steps = args.ddp_steps if args.worker == "ddp" else args.steps
    x, y, x_val, y_val = make_task(args.width, steps * args.batch * world)

    class Student(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            layers = [m for _ in range(args.depth) for m in (nn.Linear(args.width, args.width), nn.Tanh())]
            self.net = nn.Sequential(*layers, nn.Linear(args.width, OUT_DIM))

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=args.lr)

    L.seed_everything(0)
    model = Student()
    curve = curve_callback(args.eval_every, x_val, y_val, args.batch * world)
    trainer = cluster_trainer(make_strategy(args.worker), steps, [curve])  # one process a node
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=args.batch))
    if trainer.global_rank == 0:
        Path(args.out).write_text(json.dumps({"variant": args.worker, "points": curve.points}))


def curve_callback(every: int, x_val: Any, y_val: Any, samples_per_step: int) -> Any:
    """A callback that, every ``every`` steps, scores the averaged model on the held-out set at the training wall
    time so far (the time it spends is left out)."""
    import copy

    import lightning as L
    import torch
    import torch.distributed as dist
    from torch import nn

    class Curve(L.Callback):
        def __init__(self) -> None:
            self.points: list[dict[str, float]] = []
            self.start = self.paused = 0.0

        def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            dist.barrier()
            self.start, self.paused = time.perf_counter(), 0.0
            self.points.append(self.evaluate(trainer, module, 0, 0.0))

        def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *_: Any) -> None:
            step = trainer.global_step
            if step % every == 0 or step == trainer.max_steps:
                pause = time.perf_counter()
                self.points.append(self.evaluate(trainer, module, step, pause - self.start - self.paused))
                dist.barrier()
                self.paused += time.perf_counter() - pause

        def evaluate(self, trainer: L.Trainer, module: L.LightningModule, step: int, elapsed: float) -> dict[str, Any]:
            local = getattr(trainer.strategy, "local_sgd", None)
            state = module.state_dict() if local is None else local.averaged_state(module.state_dict())
            model = copy.deepcopy(module)
            model.load_state_dict(state)
            with torch.no_grad():
                loss = nn.functional.mse_loss(model.net(x_val), y_val).item()
            return {"step": step, "samples": step * samples_per_step, "seconds": elapsed, "val_loss": loss}

    return Curve()


WORKER_SETTINGS = ("width", "depth", "steps", "ddp_steps", "batch", "lr", "eval_every")
"""The settings a rank is started with."""


def launch(variant: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """One launch of ``variant`` on the cluster that is up, one process a node; rank 0's curve.

    Without ``--one-thread`` the thread count is left to torchrun and Lightning: Lightning gives a lone process a
    node every core of the machine.
    """
    from _launch import torchrun_on_cluster, worker_command

    out = folder / f"{variant}.json"
    script = worker_command(__file__, variant, out, args, WORKER_SETTINGS)
    torchrun_on_cluster(1, script, folder, variant, one_thread=args.one_thread)
    return json.loads(out.read_text())


def summarize(curves: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """ddp's final loss as the target; per variant the time to reach it and the loss at ddp's sample count."""
    ddp = curves["ddp"]
    target, ddp_seconds, ddp_samples = ddp[-1]["val_loss"], ddp[-1]["seconds"], ddp[-1]["samples"]
    rows = {}
    for variant, points in curves.items():
        reached = next((p for p in points if p["val_loss"] <= target), None)
        at_samples = min(points, key=lambda p: abs(p["samples"] - ddp_samples))
        rows[variant] = {
            "seconds_to_target": reached["seconds"] if reached else None,
            "steps_to_target": reached["step"] if reached else None,
            "ratio_to_ddp": reached["seconds"] / ddp_seconds if reached else None,
            "loss_at_ddp_samples": at_samples["val_loss"],
            "final_loss": points[-1]["val_loss"],
            "seconds_per_step": points[-1]["seconds"] / max(1, points[-1]["step"]),
        }
    return {"target_loss": target, "ddp_seconds": ddp_seconds, "ddp_samples": ddp_samples, "variants": rows}


def measure_layout(nodes: int, args: argparse.Namespace) -> dict[str, Any]:
    from _launch import measured_cluster

    with measured_cluster(nodes, args.link) as bandwidth:
        curves = {}
        with tempfile.TemporaryDirectory(prefix="local-sgd-") as tmp:
            for variant in args.variants:
                curves[variant] = launch(variant, args, Path(tmp))["points"]
                last = curves[variant][-1]
                print(
                    f"  {nodes} nodes {variant:13s} {last['step']} steps {last['seconds']:.1f} s {last['val_loss']:.4f}"
                )
    settings = {"steps": args.steps, "ddp_steps": args.ddp_steps, "command": " ".join(sys.argv)}
    return {
        "nodes": nodes,
        "link": args.link,
        "bandwidth": bandwidth,
        **settings,
        "curves": curves,
        **summarize(curves),
    }


def table(cells: list[dict[str, Any]]) -> list[list[Any]]:
    rows = []
    for cell in cells:
        for variant, row in cell["variants"].items():
            ratio, seconds = row["ratio_to_ddp"], row["seconds_to_target"]
            rows.append(
                [
                    f"{cell['nodes']} x 1",
                    variant,
                    round(1e3 * row["seconds_per_step"]),
                    f"{seconds:.1f}" if seconds is not None else "not reached",
                    f"{ratio:.2f}" if ratio is not None else "-",
                    f"{row['loss_at_ddp_samples']:.4f}",
                    f"{row['final_loss']:.4f}",
                ]
            )
    return rows


COLUMNS = ["nodes x procs", "variant", "ms/step", "s to ddp's loss", "/ ddp", "loss at ddp's samples", "final loss"]


def plot(path: Path, figure: Path) -> None:
    """Validation loss against training wall time, one panel per layout, from a stored result."""
    import matplotlib
    from _results import save_figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = json.loads(path.read_text())["cells"]
    fig, axes = plt.subplots(1, len(cells), figsize=(6.5 * len(cells), 4.2), squeeze=False)
    for ax, cell in zip(axes[0], cells, strict=True):
        for variant, points in cell["curves"].items():
            style = "-" if variant.startswith(("ddp", "powersgd")) else ("--" if "diloco" in variant else ":")
            width = 2.5 if variant in ("ddp", "local_sgd_8") else 1.4
            ax.plot([p["seconds"] for p in points], [p["val_loss"] for p in points], style, lw=width, label=variant)
        ax.axhline(cell["target_loss"], color="gray", lw=0.8)
        ax.set(title=f"{cell['nodes']} nodes over {cell['link']}", xlabel="training wall time (s)")
        ax.set(ylabel="held-out MSE", yscale="log")
        ax.legend(fontsize=8)
    save_figure(fig, figure)


def main() -> None:
    from _launch import add_mlp_arguments, parse_or_work

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", type=int, default=[2, 4], help="nodes (one process each)")
    parser.add_argument("--link", default="1gbit", help="tc rate of the links")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=192, help="optimizer steps of every variant but ddp")
    parser.add_argument("--ddp-steps", type=int, default=64, help="ddp's optimizer steps (its loss is the target)")
    parser.add_argument("--eval-every", type=int, default=8, help="steps between evaluations")
    add_mlp_arguments(parser)
    parser.add_argument("--lr", type=float, default=3e-4, help="Adam's learning rate")
    parser.add_argument(
        "--one-thread", action="store_true", help="OMP_NUM_THREADS=1 on every node (default: Lightning's choice)"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--add-to", type=Path, help="keep the other layouts of this stored result in the new one")
    args = parse_or_work(
        parser, worker, plot, figure=ROOT / "docs" / "figures" / "local_sgd.png", figure_from="local_sgd.json"
    )
    if args is None:
        return None
    if "ddp" not in args.variants:
        parser.error("--variants must include ddp: its final loss is the target")
    if os.geteuid() != 0:
        print("bench_local_sgd.py needs root for the simulated cluster (network namespaces and tc); nothing measured.")
        return None
    from _results import Report

    keys = (
        "layouts",
        "link",
        "variants",
        "steps",
        "ddp_steps",
        "eval_every",
        "width",
        "depth",
        "batch",
        "lr",
        "one_thread",
        "add_to",
    )
    report = Report("local_sgd", {k: str(v) if isinstance(v := getattr(args, k), Path) else v for k in keys})
    cells = [measure_layout(nodes, args) for nodes in args.layouts]
    if args.add_to is not None:  # the layouts measured by an earlier run first (each cell keeps its settings)
        cells = [c for c in json.loads(args.add_to.read_text())["cells"] if c["nodes"] not in args.layouts] + cells
    rows = table(cells)
    for row in rows:
        print("  ".join(str(c) for c in row))
    notes = [
        f"{c['nodes']} nodes: ddp's loss {c['target_loss']:.4f} after {c['ddp_samples']} samples, the others "
        f"{c.get('steps', args.steps)} steps; {c['bandwidth']}"
        for c in cells
    ]
    report.table("Time to ddp's held-out loss on the simulated cluster", COLUMNS, rows, notes)
    report.data["cells"] = cells
    report.save(args.json)
    if args.json is not None and args.figure is not None:  # a scratch run (not in benchmarks/results) draws none
        plot(args.json, args.figure)
    return None


if __name__ == "__main__":
    main()
