"""Planning before renting, checked: a step predicted from one local machine against the step on a simulated cluster.

The planning path: the link's nominal bandwidth (``Link.nominal(125e6)`` for 1 GbE, ``1.25e9`` for 10 GbE, latency
50 us), one process's compute (:func:`~lightning_dp_strategies.plan.measure_compute`) and its CPU's per-byte costs
(:func:`~lightning_dp_strategies.reducers.calibrate_cpu`), measured here with one thread as a rank trains, go into
:func:`~lightning_dp_strategies.plan.predict` for the default ``ring_allreduce`` (one flat ring). Then both
``"ring_allreduce"`` and ``RingAllReduceStrategy(two_level=False)`` train on the simulated cluster
(``benchmarks/netsim.py``: root, Linux, iproute2) over each link and layout (2 nodes x 2 processes, and 2 x 1),
``OMP_NUM_THREADS=1``, the two variants' launches interleaved; a launch's figure is rank 0's median step after the
warm-up, a cell's the median over launches.

The workload is not the other benchmarks' MLP: a Transformer encoder classifier (4 layers, width 256, 4 heads,
feed-forward 1024, 3.4 M parameters, 13.8 MB of fp32 gradients) on random tokens (sequences of 64, batch 16 a rank),
SGD. The simulated nodes share this machine's cores: at 2 x 2, 4 processes on 2 cores compute about half as fast as
one process alone, which a real cluster's nodes would not. So each cell also holds the prediction from compute and
CPU costs measured in as many processes at once as the cell runs (``shared_cores``), which tells the model's error
from the simulation's, and the wire-only prediction (``wire``: no CPU costs, what a nominal link was priced at before
the step model added the ring's adds and socket copies to it).

Usage::

    python benchmarks/bench_planning.py --json benchmarks/results/planning.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _launch import (
    cluster_trainer,
    launch_order,
    measured_cluster,
    parse_or_work,
    run_ranks,
    torchrun_on_cluster,
    worker_command,
)

VARIANTS = ("default", "flat")
NOMINAL = {"1gbit": 125e6, "10gbit": 1.25e9, "100mbit": 12.5e6, "500mbit": 62.5e6}
"""Each link's nominal bandwidth, bytes per second: what a planner reads off the data sheet."""
LATENCY_S = 5e-5
WORKER_SETTINGS = ("steps", "warmup", "batch", "seq")


def build_model(seq: int) -> Any:
    """The Transformer encoder classifier (a LightningModule): embedding, 4 encoder layers, mean pool, 10 classes."""
    import lightning as L
    import torch
    from torch import nn

    class Encoder(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(1024, 256)
            self.position = nn.Parameter(torch.zeros(seq, 256))
            layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
            self.head = nn.Linear(256, 10)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(self.encoder(self.embed(tokens) + self.position).mean(dim=1))

        def training_step(self, batch: Any, _: int = 0) -> torch.Tensor:
            tokens, labels = batch
            return nn.functional.cross_entropy(self(tokens), labels)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Encoder()


def batches(count: int, batch: int, seq: int) -> Any:
    """``count`` random batches of ``batch`` token sequences and labels (seed 1)."""
    import torch
    from torch.utils.data import TensorDataset

    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 1024, (count * batch, seq), generator=gen)
    return TensorDataset(tokens, torch.randint(0, 10, (count * batch,), generator=gen))


def make_strategy(variant: str) -> Any:
    """``"ring_allreduce"`` as a user names it (the default: one flat ring), or the flat ring asked for."""
    from lightning_dp_strategies import RingAllReduceStrategy

    return "ring_allreduce" if variant == "default" else RingAllReduceStrategy(two_level=False)


def worker(args: argparse.Namespace) -> None:
    """One rank of one launch on the simulated cluster: rank 0 writes its median step after the warm-up."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_end(self, *_: Any) -> None:
            self.times.append(time.perf_counter())

    L.seed_everything(0)
    module, timer = build_model(args.seq), Timer()
    data = batches(args.steps * int(os.environ["WORLD_SIZE"]), args.batch, args.seq)
    trainer = cluster_trainer(make_strategy(args.worker), args.steps, [timer])
    trainer.fit(module, DataLoader(data, batch_size=args.batch))
    steps = [b - a for a, b in zip(timer.times, timer.times[1:], strict=False)][args.warmup :]
    if trainer.global_rank == 0:
        Path(args.out).write_text(json.dumps({"variant": args.worker, "step_ms": 1e3 * statistics.median(steps)}))


def measure_locally(seq: int, batch: int) -> dict[str, Any]:
    """One process's compute (:func:`measure_compute`, 10 steps after 3) and CPU costs (:func:`calibrate_cpu`), one
    thread, as seconds and seconds per byte."""
    import torch

    from lightning_dp_strategies import calibrate_cpu
    from lightning_dp_strategies.plan import measure_compute

    torch.set_num_threads(1)
    torch.manual_seed(0)
    module = build_model(seq)
    one = batches(1, batch, seq).tensors
    compute = measure_compute(module, one, loss_fn=lambda m, b: m.training_step(b), steps=10, warmup=3)
    cpu = calibrate_cpu()
    return {"compute_s": compute.total, "backward_s": compute.backward, "cpu": vars(cpu)}


def _measure_rank(rank: int, world_size: int, seq: int, batch: int, folder: str) -> None:
    """:func:`measure_locally` in one of ``world_size`` processes started together (the cores shared)."""
    Path(folder, f"{rank}.json").write_text(json.dumps(measure_locally(seq, batch)))


def measure_shared(processes: int, seq: int, batch: int) -> dict[str, Any]:
    """:func:`measure_locally` in ``processes`` processes at once (as the simulated cluster shares the cores); the
    median over them of compute and backward, rank 0's CPU costs."""
    with tempfile.TemporaryDirectory(prefix="planning-") as tmp:
        run_ranks(_measure_rank, processes, seq, batch, tmp, timeout=600)
        ranks = [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(processes)]
    return {
        "compute_s": statistics.median(r["compute_s"] for r in ranks),
        "backward_s": statistics.median(r["backward_s"] for r in ranks),
        "cpu": ranks[0]["cpu"],
    }


def predict_ms(local: dict[str, Any], bandwidth: float, nodes: int, per_node: int, seq: int, with_cpu: bool) -> float:
    """The default ring's step (ms) predicted from ``local`` measurements and a nominal link of ``bandwidth``."""
    from lightning_dp_strategies.plan import CpuCosts, Link, Reduction, Topology, Workload, predict

    link = Link.nominal(bandwidth, LATENCY_S)
    work = Workload.from_module(
        build_model(seq),
        compute_seconds=local["compute_s"],
        backward_seconds=local["backward_s"],
        cpu=CpuCosts(**local["cpu"]) if with_cpu else None,
        topology=Topology(nodes, per_node, inter=link),
    )
    return 1e3 * predict("ring_allreduce", work, nodes * per_node, link, reduction=Reduction()).step_seconds


def measure_cell(link: str, nodes: int, per_node: int, args: argparse.Namespace) -> dict[str, Any]:
    """Both variants on ``nodes`` x ``per_node`` simulated processes over ``link``, their launches interleaved."""
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    with measured_cluster(nodes, link) as bandwidth, tempfile.TemporaryDirectory(prefix="planning-") as tmp:
        for index in range(args.launches):
            for variant in launch_order(VARIANTS, index):
                out = Path(tmp) / f"{variant}-{index}.json"
                command = worker_command(__file__, variant, out, args, WORKER_SETTINGS)
                torchrun_on_cluster(per_node, command, Path(tmp), variant)
                times[variant].append(json.loads(out.read_text())["step_ms"])
                print(f"  {link} {nodes}x{per_node} {variant:8s} launch {index}: {times[variant][-1]:.0f} ms")
    return {"link": link, "nodes": nodes, "per_node": per_node, "bandwidth": bandwidth, "launches_ms": times}


PREDICTIONS = {
    "wire": "nominal link, measure_compute, no CpuCosts: the wire alone (what the model gave a nominal link before)",
    "planned": "nominal link, measure_compute and calibrate_cpu of one process: the planning path",
    "shared_cores": "as planned, compute and CPU costs measured in as many processes at once as the cell runs",
}
"""The predictions each cell holds, by key."""


def add_predictions(cell: dict[str, Any], local: dict[str, Any], shared: dict[str, Any], seq: int) -> None:
    """Add the medians, the ratio default / flat and the predictions (:data:`PREDICTIONS`) with their errors
    against the default's measured step to ``cell``."""
    step = {v: statistics.median(t) for v, t in cell["launches_ms"].items()}
    nominal = NOMINAL[cell["link"]]
    layout = (cell["nodes"], cell["per_node"], seq)
    predicted = {
        "wire": predict_ms(local, nominal, *layout, with_cpu=False),
        "planned": predict_ms(local, nominal, *layout, with_cpu=True),
        "shared_cores": predict_ms(shared, nominal, *layout, with_cpu=True),
    }
    cell.update(
        measured_ms=step,
        ratio_default_flat=step["default"] / step["flat"],
        nominal_bytes_per_s=nominal,
        predicted_ms=predicted,
        error={k: p / step["default"] - 1 for k, p in predicted.items()},
    )


def rows(cells: list[dict[str, Any]]) -> list[list[Any]]:
    """One row a cell: measured default and flat, their ratio, each prediction and its error."""
    table = []
    for c in cells:
        row = [c["link"], f"{c['nodes']} x {c['per_node']}", round(c["measured_ms"]["default"])]
        row += [round(c["measured_ms"]["flat"]), f"{c['ratio_default_flat']:.2f}"]
        for key in PREDICTIONS:
            row += [round(c["predicted_ms"][key]), f"{c['error'][key]:+.0%}"]
        table.append(row)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--links", nargs="+", default=["1gbit", "10gbit"], choices=sorted(NOMINAL))
    parser.add_argument("--layouts", nargs="+", default=["2x2", "2x1"], help="NODESxPROCESSES a node")
    parser.add_argument("--launches", type=int, default=2, help="launches of each variant, interleaved")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps a launch")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    parser.add_argument("--batch", type=int, default=16, help="sequences a rank and step")
    parser.add_argument("--seq", type=int, default=64, help="tokens a sequence")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parse_or_work(parser, worker)
    if args is None:
        return
    if os.geteuid() != 0:
        print("bench_planning.py needs root for the simulated cluster (benchmarks/netsim.py); nothing measured.")
        return
    from _results import Report

    layouts = [tuple(int(n) for n in layout.split("x")) for layout in args.layouts]
    local = measure_locally(args.seq, args.batch)
    shared = {n * k: measure_shared(n * k, args.seq, args.batch) for n, k in layouts}
    for processes, measured in shared.items():
        alone, together = 1e3 * local["compute_s"], 1e3 * measured["compute_s"]
        print(f"compute: 1 process {alone:.0f} ms, {processes} at once {together:.0f} ms")
    keys = ("links", "layouts", "launches", "steps", "warmup", "batch", "seq")
    report = Report("planning", {**{k: getattr(args, k) for k in keys}, "latency_s": LATENCY_S})
    cells = [measure_cell(link, n, k, args) for link in args.links for n, k in layouts]
    for cell in cells:
        add_predictions(cell, local, shared[cell["nodes"] * cell["per_node"]], args.seq)
    report.data.update(local=local, shared_cores={str(n): m for n, m in shared.items()}, predictions=PREDICTIONS)
    report.data["cells"] = cells
    columns = ["link", "nodes x procs", "default ms", "flat ms", "default / flat"]
    columns += [f"{key} {what}" for key in PREDICTIONS for what in ("ms", "error")]
    table = rows(cells)
    for row in table:
        print("  ".join(str(x) for x in row))
    notes = [f"{c['link']} {c['nodes']}x{c['per_node']}: measured {c['bandwidth']}" for c in cells]
    notes += [f"{key}: {what}" for key, what in PREDICTIONS.items()]
    report.table("The default ring: predicted from a nominal link against measured", columns, table, notes)
    report.save(args.json)


if __name__ == "__main__":
    main()
