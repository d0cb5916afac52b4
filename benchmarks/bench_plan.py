"""Validate the cost model (``lightning_dp_strategies.plan``) against ``ring_all_reduce`` measured on this machine.

One 3-process gloo group on loopback and its 2-rank subgroup time ``ring_all_reduce`` (fp32, average, one tensor =
one bucket) from 64 KiB to 64 MiB, round robin over sizes and world sizes so background load hits all alike; each
figure is the fastest of ``--repeats`` calls (the least disturbed). A ``Link`` is fitted on world 2 at 256 KiB, 4 MiB
and 64 MiB against what ``CommCounter`` counted (bytes) in 2(N-1) ring steps; every other row is a prediction, world 3
entirely so (its 2(N-1) steps and 2(N-1)/N of the bytes come from the model).

Loopback transfers are copies made by the CPU: when ranks outnumber cores they share them, so predictions are divided
by ``min(1, cores / N)`` (on 2 cores, world 3 runs 1.5x slower than one core per rank would). The model assumes a
link per rank; this factor is the machine's, printed separately.

Usage::

    python benchmarks/bench_plan.py               # about a minute
    python benchmarks/bench_plan.py --repeats 15  # steadier
    python benchmarks/bench_plan.py --json benchmarks/results/plan.json  # also store it (benchmarks/render_docs.py)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _launch import run_ranks
from _results import Report

from lightning_dp_strategies.comm import CommCounter, ring_all_reduce
from lightning_dp_strategies.plan import Link, Workload, predict

KiB, MiB = 1024, 1024 * 1024
SIZES = [64 * KiB * 4**k for k in range(6)]  # 64 KiB, 256 KiB, 1 MiB, 4 MiB, 16 MiB, 64 MiB
CALIBRATION = (256 * KiB, 4 * MiB, 64 * MiB)  # world 2 only
ONE_BUCKET = {"bucket_cap_mb": 1e6, "first_bucket_cap_mb": 1e6}


def _measure(rank: int, world_size: int, out: str, repeats: int) -> None:
    torch.set_num_threads(1)
    pair = dist.new_group([0, 1])
    data = {nbytes: torch.randn(nbytes // 4) for nbytes in SIZES}
    workspace = torch.empty(SIZES[-1] // 4 // 2)  # reused, as the strategy's RingReducer does
    seconds: dict[tuple[int, int], list[float]] = {(n, b): [] for n in (2, 3) for b in SIZES}
    counters = {key: CommCounter() for key in seconds}
    for repeat in range(repeats + 2):  # two warm-up rounds
        for nbytes in SIZES:  # round robin over sizes and world sizes: background load hits all alike
            for n, group in ((2, pair), (3, None)):
                dist.barrier()
                start = time.perf_counter()
                if rank < n:
                    counter = counters[n, nbytes] if repeat >= 2 else None
                    ring_all_reduce(data[nbytes], "avg", group=group, counter=counter, workspace=workspace)
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the collective ends with its slowest rank
                if repeat >= 2:
                    seconds[n, nbytes].append(elapsed.item())
    results = []
    for (n, nbytes), times in sorted(seconds.items(), key=lambda item: (item[0][1], item[0][0])):
        sent = torch.tensor([counters[n, nbytes].bytes_sent / repeats if rank < n else 0.0], dtype=torch.float64)
        dist.all_reduce(sent, op=dist.ReduceOp.MAX)
        best, median = min(times), statistics.median(times)
        results.append({"world": n, "bytes": nbytes, "sent": sent.item(), "best": best, "median": median})
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def _size(nbytes: int) -> str:
    return f"{nbytes // KiB} KiB" if nbytes < MiB else f"{nbytes // MiB} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=9, help="timed calls per size and world size")
    parser.add_argument("--json", type=Path, help="also write the results here (see benchmarks/render_docs.py)")
    args = parser.parse_args()
    report = Report("plan", vars(args))
    table: list[list[str]] = []
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    print(f"torch {torch.__version__}, {cores} CPU cores, load average {os.getloadavg()[0]:.1f}, gloo on loopback")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        run_ranks(_measure, 3, str(out), args.repeats, timeout=300)
        rows = json.loads(out.read_text())

    fit_rows = [r for r in rows if r["world"] == 2 and r["bytes"] in CALIBRATION]
    link = Link.fit([(2, r["sent"], r["best"]) for r in fit_rows])
    fitted_link = (
        f"Link fitted on world 2 at {', '.join(_size(b) for b in CALIBRATION)}: "
        f"latency {link.latency_s * 1e6:.0f} us/step, bandwidth {link.bandwidth_bytes_per_s / 1e9:.2f} GB/s"
    )
    print(fitted_link + "\n")
    report.note(fitted_link)
    print(f"{'world':>5} {'size':>7} {'predicted ms':>12} {'measured ms':>11} {'(median)':>9} {'error':>6}  sent/model")
    errors: dict[int, list[tuple[int, float]]] = {2: [], 3: []}
    for r in rows:
        p = predict("ring_allreduce", Workload(gradient_bytes=r["bytes"]), r["world"], link, **ONE_BUCKET)
        predicted = p.comm_seconds / min(1.0, cores / r["world"])
        error = predicted / r["best"] - 1
        fitted = r in fit_rows
        if not fitted:
            errors[r["world"]].append((r["bytes"], error))
        print(
            f"{r['world']:>5} {_size(r['bytes']):>7} {predicted * 1e3:12.3f} {r['best'] * 1e3:11.3f}"
            f" {r['median'] * 1e3:9.3f} {error:+6.0%}  {r['sent'] / p.bytes_per_rank:.4f}{'  (fit)' if fitted else ''}"
        )
        table.append(
            [
                str(r["world"]),
                _size(r["bytes"]),
                f"{predicted * 1e3:.3f}",
                f"{r['best'] * 1e3:.3f}",
                f"{r['median'] * 1e3:.3f}",
                f"{error:+.0%}",
                f"{r['sent'] / p.bytes_per_rank:.4f}",
                "fit" if fitted else "predicted",
            ]
        )
    summary: list[str] = []
    print()
    for world, pairs in errors.items():
        everything = [abs(e) for _, e in pairs]
        large = [abs(e) for b, e in pairs if b >= MiB]
        line = (
            f"world {world}, predicted rows: median |error| {statistics.median(everything):.0%}, "
            f"max {max(everything):.0%} (>= 1 MiB: median {statistics.median(large):.0%}, max {max(large):.0%})"
        )
        print(line)
        summary.append(line)
    if cores < 3:
        share = min(1.0, cores / 3)
        line = f"world 3 predictions include the core-sharing factor 1/{share:.2f} (without it: {share:.2f}x these)"
        print(line)
        summary.append(line)
    columns = ["world", "size", "predicted ms", "measured ms (best)", "median ms", "error", "sent / model", "row"]
    report.table("ring_all_reduce: predicted against measured", columns, table, summary)
    report.save(args.json)


if __name__ == "__main__":
    main()
