"""Where a data-parallel step's time goes: forward, backward, the wait after backward, and the optimizer step.

Plain PyTorch, no Lightning: 2 processes on CPU/gloo, identical MLPs (the ~21 M parameter model of
``bench_ring_allreduce.py`` part (b)), each contender wrapped its own way, all stepping in turn inside the same two
processes (the order flipped every step), so each step of one is compared with the neighbouring step of the others.

Contenders:

- ``buckets+<reducer>``: :class:`~lightning_dp_strategies.bucketing.GradientBuckets` as ``ring_allreduce`` uses them,
  with the ``ring`` or ``native`` reducer, or ``noop`` (a reducer that returns at once: hooks and copies only);
- ``ddp``: torch's ``DistributedDataParallel`` as Lightning's ``"ddp"`` configures it; ``ddp+noop`` with a
  communication hook that returns at once; ``ddp+view`` and ``ddp+noop+view`` with ``gradient_as_bucket_view=True``.

The no-op contenders isolate the cost of the bucketing itself, which is how the page faults described in
``docs/benchmarks.md`` were found. Usage::

    python benchmarks/bench_step_phases.py
    python benchmarks/bench_step_phases.py --contenders buckets+noop,ddp+noop+view --steps 60
    python benchmarks/bench_step_phases.py --json benchmarks/results/step_phases.json   # also store the table
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from _launch import run_ranks
from torch import nn

PHASES = ("forward", "backward", "wait", "step", "total")


def _mlp(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def _noop_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations (future import)
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def _contender(name: str, width: int, depth: int) -> Callable[[torch.Tensor, torch.Tensor], list[float]]:
    """A function running one training step and returning the times at which its phases ended."""
    from lightning_dp_strategies.bucketing import GradientBuckets
    from lightning_dp_strategies.reducers import completed

    model = _mlp(width, depth)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    kind, *options = name.split("+")
    if kind == "ddp":
        ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view="view" in options)
        if "noop" in options:
            ddp.register_comm_hook(None, _noop_hook)

        def ddp_step(x: torch.Tensor, y: torch.Tensor) -> list[float]:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(ddp(x), y)
            marks = [time.perf_counter()]
            loss.backward()  # DDP waits for its buckets inside backward
            marks += [time.perf_counter()] * 2
            optimizer.step()
            return [*marks, time.perf_counter()]

        return ddp_step
    reducer = options[0] if options else "ring"
    buckets = GradientBuckets(
        model.named_parameters(), reducer=(lambda b: completed(b.buffer)) if reducer == "noop" else reducer
    )

    def bucket_step(x: torch.Tensor, y: torch.Tensor) -> list[float]:
        optimizer.zero_grad()
        buckets.arm()
        loss = nn.functional.cross_entropy(model(x), y)
        marks = [time.perf_counter()]
        loss.backward()
        marks.append(time.perf_counter())
        buckets.finish()
        marks.append(time.perf_counter())
        optimizer.step()
        return [*marks, time.perf_counter()]

    return bucket_step


def _worker(rank: int, world: int, names: list[str], steps: int, width: int, depth: int, out: str) -> None:
    torch.set_num_threads(1)  # one core per process, as Lightning sets it for CPU ranks here
    contenders = {name: _contender(name, width, depth) for name in names}
    generator = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, width, generator=generator), torch.randint(0, 10, (32,), generator=generator)
    times: dict[str, dict[str, list[float]]] = {n: {p: [] for p in PHASES} for n in names}
    for i in range(steps):
        for name in names if i % 2 == 0 else names[::-1]:
            dist.barrier()
            start = time.perf_counter()
            marks = [start, *contenders[name](x, y)]
            if i >= 3:  # warm-up: DDP rebuilds its buckets, the allocator settles
                for k, phase in enumerate(PHASES[:-1]):
                    times[name][phase].append(marks[k + 1] - marks[k])
                times[name]["total"].append(marks[-1] - start)
    if rank == 0:
        med = {n: {p: statistics.median(t) * 1e3 for p, t in phases.items()} for n, phases in times.items()}
        base = med["ddp"]["total"] if "ddp" in med else None
        title = f"median ms per phase, 2 processes on CPU/gloo, {steps - 3} steps each, interleaved"
        print(title)
        print(f"  {'contender':<22}" + "".join(f"{p:>10}" for p in PHASES) + ("  total/ddp" if base else ""))
        rows = []
        for name, m in med.items():
            ratio = f"  {m['total'] / base:9.3f}" if base else ""
            print(f"  {name:<22}" + "".join(f"{m[p]:10.1f}" for p in PHASES) + ratio)
            rows.append([name, *(f"{m[p]:.1f}" for p in PHASES), *([f"{m['total'] / base:.3f}"] if base else [])])
        columns = ["contender", *PHASES, *(["total/ddp"] if base else [])]
        Path(out).write_text(json.dumps({"title": title, "columns": columns, "rows": rows}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--contenders", default="buckets+noop,ddp+noop,ddp+noop+view,buckets+ring,buckets+native,ddp,ddp+view"
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--width", type=int, default=1536)
    parser.add_argument("--depth", type=int, default=9)
    parser.add_argument("--json", type=Path, help="also write the results here (see benchmarks/render_docs.py)")
    args = parser.parse_args()
    from _results import Report

    report = Report("step_phases", vars(args))
    names = args.contenders.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "table.json")
        run_ranks(_worker, 2, names, args.steps, args.width, args.depth, out)
        table = json.loads(Path(out).read_text())
    report.table(table["title"], table["columns"], table["rows"])
    report.save(args.json)


if __name__ == "__main__":
    main()
