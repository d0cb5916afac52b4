"""Step time of ``strategy="dp"`` against single-device training on the same batch, measured side by side.

Run: ``python benchmarks/bench_scatter_gather.py [--batch 1024] [--steps 20] [--rounds 3] [--json PATH]`` (``--json``
also stores the tables for ``benchmarks/render_docs.py``, e.g. ``benchmarks/results/scatter_gather.json``)

Two measurements of the same MLP (about 12.6 M parameters by default) on the same fixed batch, ratio ``dp / single``
(target: <= 1.15 on 2 CPU replicas):

1. *Lightning*: whole ``Trainer.fit`` runs, ``strategy="dp", devices=2`` against ``strategy="auto", devices=1``; the
   step time is the median over the steady-state steps (after ``--warmup``), and the runs alternate over
   ``--rounds`` so background load hits both.
2. *paired*: the strategy's own ``parallel_forward`` against a plain forward call, each followed by backward and the
   optimizer step, alternating step by step in one process (robust against background load on shared machines), for
   several batch sizes: on one CPU every replica writes its own partial weight gradient and autograd adds them, a
   cost that grows with the parameters, not the batch, so the ratio falls as the batch grows.

Where two or more GPUs are present it also times ``dp`` on them against a plain loop over ``torch.nn.DataParallel``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from _launch import QUIET_TRAINER
from _results import Report
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from lightning_dp_strategies import ScatterGatherStrategy


def make_mlp(width: int, depth: int, features: int) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(features, width), nn.GELU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    layers.append(nn.Linear(width, features))
    return nn.Sequential(*layers)


class Net(L.LightningModule):
    def __init__(self, width: int, depth: int, features: int) -> None:
        super().__init__()
        self.net = make_mlp(width, depth, features)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class SameBatch(Dataset):
    """``length`` times the same batch (the DataLoader runs with ``batch_size=None``)."""

    def __init__(self, batch: tuple[Tensor, Tensor], length: int) -> None:
        self.batch, self.length = batch, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return self.batch


class StepTimer(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self._start)


def time_lightning(args: argparse.Namespace, strategy: str, accelerator: str, devices: Any) -> float:
    torch.manual_seed(0)
    model = Net(args.width, args.depth, args.features)
    batch = (torch.randn(args.batch, args.features), torch.randn(args.batch, args.features))
    timer = StepTimer()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator=accelerator,
        devices=devices,
        max_steps=args.warmup + args.steps,
        callbacks=[timer],
        **QUIET_TRAINER,
    )
    loader = DataLoader(SameBatch(batch, args.warmup + args.steps), batch_size=None)
    trainer.fit(model, loader)
    return statistics.median(timer.times[args.warmup :])


def time_torch_data_parallel(args: argparse.Namespace, device_ids: list[int]) -> float:
    torch.manual_seed(0)
    model = nn.DataParallel(make_mlp(args.width, args.depth, args.features).cuda(device_ids[0]), device_ids)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(args.batch, args.features, device=f"cuda:{device_ids[0]}")
    y = torch.randn_like(x)
    times = []
    for _ in range(args.warmup + args.steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[args.warmup :])


def time_paired(args: argparse.Namespace, devices: list[str], batch: int) -> tuple[float, float]:
    """Median step times (single, dp), the two kinds of step alternating, after ``--warmup`` of each."""
    torch.manual_seed(0)
    model = Net(args.width, args.depth, args.features).to(devices[0])
    strategy = ScatterGatherStrategy(parallel_devices=devices)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(batch, args.features, device=devices[0])
    y = torch.randn_like(x)

    def step(parallel: bool) -> float:
        start = time.perf_counter()
        optimizer.zero_grad()
        out = strategy.parallel_forward(model, x) if parallel else model(x)
        nn.functional.mse_loss(out, y).backward()
        optimizer.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - start

    single, dp = [], []
    for i in range(args.warmup + args.steps * args.rounds):
        a, b = step(False), step(True)
        if i >= args.warmup:
            single.append(a)
            dp.append(b)
    return statistics.median(single), statistics.median(dp)


def compare(label: str, runs: dict[str, Any], rounds: int, report: Report | None = None) -> dict[str, float]:
    """Median over rounds of each run's steady-state step time; the runs alternate inside every round."""
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            samples[name].append(run())
    medians = {name: statistics.median(values) for name, values in samples.items()}
    print(f"\n{label}")
    for name, value in medians.items():
        print(
            f"  {name:<34} {value * 1e3:9.2f} ms/step   (rounds: {', '.join(f'{v * 1e3:.1f}' for v in samples[name])})"
        )
    if report is not None:
        rows = [
            [name, f"{value * 1e3:.2f}", ", ".join(f"{v * 1e3:.1f}" for v in samples[name])]
            for name, value in medians.items()
        ]
        report.table(label, ["run", "ms/step (median)", "rounds"], rows)
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--batch", type=int, default=1024, help="batch size of the Lightning runs (the overhead falls as it grows)"
    )
    parser.add_argument("--paired-batches", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--features", type=int, default=1024)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=2, help="hidden width x width layers")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the results here (see benchmarks/render_docs.py)")
    args = parser.parse_args()
    report = Report("scatter_gather", vars(args))

    params = sum(p.numel() for p in make_mlp(args.width, args.depth, args.features).parameters())
    print(
        f"model: MLP {args.features}->{args.width}x{args.depth + 1}->{args.features}, {params / 1e6:.1f} M parameters; "
        f"batch {args.batch}; torch {torch.__version__}, {torch.get_num_threads()} intra-op threads"
    )
    cpu = compare(
        "CPU: single device vs dp with 2 logical CPU replicas",
        {
            "single device (strategy='auto')": lambda: time_lightning(args, "auto", "cpu", 1),
            "dp, devices=2 (CPU replicas)": lambda: time_lightning(args, "dp", "cpu", 2),
        },
        args.rounds,
        report,
    )
    ratio = cpu["dp, devices=2 (CPU replicas)"] / cpu["single device (strategy='auto')"]
    print(f"  ratio dp / single = {ratio:.3f}  (target <= 1.15)")
    report.data["tables"][-1]["notes"].append(f"ratio dp / single = {ratio:.3f} (target <= 1.15)")
    paired: list[list[str]] = []
    print("\nCPU, paired steps in one process: plain forward vs ScatterGatherStrategy.parallel_forward on 2 replicas")
    for batch in args.paired_batches:
        single, dp = time_paired(args, ["cpu", "cpu"], batch)
        print(
            f"  batch {batch:5d}: single {single * 1e3:8.2f} ms/step, dp {dp * 1e3:8.2f} ms/step, "
            f"ratio dp / single = {dp / single:.3f}"
        )
        paired.append([str(batch), f"{single * 1e3:.2f}", f"{dp * 1e3:.2f}", f"{dp / single:.3f}"])
    title = "CPU, paired steps in one process: plain forward vs ScatterGatherStrategy.parallel_forward on 2 replicas"
    report.table(title, ["batch", "single ms/step", "dp ms/step", "dp / single"], paired)

    gpus = torch.cuda.device_count()
    if gpus >= 2:
        ids = list(range(gpus))
        cuda = compare(
            f"CUDA: dp vs torch.nn.DataParallel on {gpus} GPUs",
            {
                "single GPU (strategy='auto')": lambda: time_lightning(args, "auto", "cuda", 1),
                f"dp, devices={ids}": lambda: time_lightning(args, "dp", "cuda", ids),
                f"torch.nn.DataParallel({ids})": lambda: time_torch_data_parallel(args, ids),
            },
            args.rounds,
            report,
        )
        dp, tdp = cuda[f"dp, devices={ids}"], cuda[f"torch.nn.DataParallel({ids})"]
        print(f"  ratio dp / torch.nn.DataParallel = {dp / tdp:.3f}")
        report.data["tables"][-1]["notes"].append(f"ratio dp / torch.nn.DataParallel = {dp / tdp:.3f}")
    else:
        print(f"\nCUDA comparison with torch.nn.DataParallel skipped: {gpus} GPU(s) here, it needs 2 or more.")
        report.note(f"CUDA comparison with torch.nn.DataParallel skipped: {gpus} GPU(s) here, it needs 2 or more.")
    report.save(args.json)


if __name__ == "__main__":
    main()
