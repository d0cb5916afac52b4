"""A worker SIGKILLed mid-epoch on a simulated 2-node cluster under ``torchrun --max-restarts 1`` (c10d rendezvous).

Needs root: ``benchmarks/netsim.py`` makes two nodes (10.77.0.1, 10.77.0.2) joined by a shaped link, and each node's
torchrun agent is started on its own node with ``netsim exec`` (elastic runs cannot use ``netsim torchrun``)::

    node i: torchrun --nnodes 2 --nproc-per-node 1 --max-restarts 1 --rdzv-backend c10d
                     --rdzv-endpoint 10.77.0.1:PORT --rdzv-conf is_host=<1 on node 0> --local-addr 10.77.0.<i+1>
                     -m tests.reliability.restart_scenario STRATEGY OUTDIR mid_epoch VICTIM

For each strategy: one uninterrupted run (the reference), then ``--tries`` runs in which the worker of global rank
``VICTIM`` (alternately 1 and 0, i.e. the worker on node 1, then the one on node 0 whose agent hosts the store)
SIGKILLs itself at the 4th batch of epoch 1. A try passes when both agents exit 0 within ``--deadline`` seconds after
one restart, resumed from ``last.ckpt``, with parameters within 1e-6 of the reference's. ``--outage S`` adds runs in
which node 1's link goes down for S seconds mid-training (``ip link set down``), once with a collective timeout
longer than the outage and once with a shorter one. Lightning's ``ddp`` can run alongside, for comparison::

    python benchmarks/bench_restart.py --tries 4 --json benchmarks/results/restart.json
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _launch import NETSIM, child_env, netsim, run_together, simulated_cluster

PORT = 29577
TOLERANCE = 1e-6


def agent(node: int, strategy: str, outdir: Path, kill: str, victim: int) -> list[str]:
    """The command that starts node ``node``'s torchrun agent inside its namespace."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
    torchrun += ["--max-restarts", "1", "--monitor-interval", "0.2", "--rdzv-backend", "c10d"]
    torchrun += ["--rdzv-endpoint", f"10.77.0.1:{PORT}", "--rdzv-conf", f"is_host={int(node == 0)}"]
    torchrun += ["--local-addr", f"10.77.0.{node + 1}"]
    scenario = ["-m", "tests.reliability.restart_scenario", strategy, str(outdir), kill, str(victim)]
    return [str(NETSIM), "exec", str(node), *torchrun, *scenario]


def run_job(
    strategy: str, outdir: Path, kill: str, victim: int, deadline: float, env: dict[str, str]
) -> dict[str, Any]:
    """Both agents of one job, started together and killed at ``deadline``; their exit codes, output and wall time."""
    outdir.mkdir(parents=True, exist_ok=True)
    done = run_together([agent(node, strategy, outdir, kill, victim) for node in range(2)], deadline, env)
    return {
        "seconds": round(done.seconds, 1),
        "codes": done.codes,
        "timed_out": done.timed_out,
        "output": "\n".join(done.outputs),
    }


def max_diff(path: Path, reference: dict[str, Any]) -> float | None:
    """The largest absolute difference between ``path``'s parameters and ``reference``'s (``None``: no file)."""
    import torch

    if not path.exists():
        return None
    final = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    return max((final[k].float() - v.float()).abs().max().item() for k, v in reference.items())


def summarize(job: dict[str, Any], outdir: Path, reference: dict[str, Any] | None) -> dict[str, Any]:
    """What one job shows: finished, restarts, resumed, the parameter difference, the first connection error."""
    output = job["output"]
    restarts = re.findall(r"rank \d finished \(restart (\d+)\)", output)
    refused = re.search(r"(Connection refused[^\n]{0,80}|connectFullMesh failed[^\n]{0,120})", output)
    resumed = "Restored all states" in output or "resumed from last.ckpt" in output
    diff = max_diff(outdir / "final.ckpt", reference) if reference is not None else None
    ok = job["codes"] == [0, 0] and not job["timed_out"] and len(restarts) == 2
    return {
        "seconds": job["seconds"],
        "exit_codes": job["codes"],
        "timed_out": job["timed_out"],
        "killed": (outdir / "killed").exists(),
        "worker_restart_counts": [int(r) for r in restarts],
        "resumed_from_checkpoint": resumed,
        "max_param_diff": diff,
        "finished": ok,
        "first_connect_error": refused.group(1) if refused else None,
    }


def link_outage(seconds: float, outdir: Path) -> None:
    """Once the job has written its first checkpoint, take node 1's link down for ``seconds``, then up again."""
    while not (outdir / "last.ckpt").exists():
        time.sleep(0.1)
    netsim("link", "1", "down")
    time.sleep(seconds)
    netsim("link", "1", "up")


def try_strategy(strategy: str, args: argparse.Namespace, folder: Path, env: dict[str, str]) -> list[dict[str, Any]]:
    """The reference run and the killed tries of one strategy; one row per run."""
    import torch

    rows = []
    base = folder / f"{strategy}-reference"
    job = run_job(strategy, base, "none", 1, args.deadline, env)
    reference_path = base / "final.ckpt"
    reference = torch.load(reference_path, weights_only=False)["state_dict"] if reference_path.exists() else None
    rows.append({"strategy": strategy, "run": "uninterrupted", "victim": None, **summarize(job, base, reference)})
    print(f"{strategy} uninterrupted: {rows[-1]['seconds']} s, exit {job['codes']}", flush=True)
    if reference is None:  # the setup itself is broken: no point in killing workers
        print(job["output"][-6000:], flush=True)
        return rows
    tries = args.ddp_tries if strategy == "ddp" else args.tries
    for index in range(tries):
        victim = 1 if index % 2 == 0 else 0
        outdir = folder / f"{strategy}-try{index}"
        job = run_job(strategy, outdir, "mid_epoch", victim, args.deadline, env)
        row = {"strategy": strategy, "run": f"try {index + 1}", "victim": victim, **summarize(job, outdir, reference)}
        rows.append(row)
        print(f"{strategy} try {index + 1} (victim rank {victim}): {row}", flush=True)
    return rows


def try_outage(args: argparse.Namespace, folder: Path, env: dict[str, str]) -> list[dict[str, Any]]:
    """Node 1's link down for ``--outage`` seconds mid-training: a timeout longer than the outage, then shorter."""
    rows = []
    for timeout in (60.0, max(2.0, args.outage / 3)):
        outdir = folder / f"outage-timeout{timeout:.0f}"
        outdir.mkdir(parents=True)
        run_env = {**env, "SCENARIO_TIMEOUT_S": str(timeout), "SCENARIO_STEP_S": "0.5"}
        cut = threading.Thread(target=link_outage, args=(args.outage, outdir), daemon=True)
        cut.start()
        job = run_job("ring_allreduce", outdir, "none", 1, args.deadline + 2 * timeout, run_env)
        row: dict[str, Any] = {
            "strategy": "ring_allreduce",
            "run": f"link down {args.outage:g} s, timeout {timeout:.2g} s",
        }
        row.update(summarize(job, outdir, None), victim=None)
        failure = re.search(r"(Reducing gradient bucket[^\n]{0,300})", job["output"])
        row["failure"] = failure.group(1) if failure else None
        rows.append(row)
        print(f"outage: {row}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--strategies",
        nargs="*",
        default=["ring_allreduce", "hybrid_pipeline", "local_sgd", "fabric_ring_allreduce", "ddp"],
    )
    parser.add_argument("--tries", type=int, default=4, help="killed runs of each of this package's strategies")
    parser.add_argument("--ddp-tries", type=int, default=3, help="killed runs of Lightning's ddp (for comparison)")
    parser.add_argument("--link", default="1gbit")
    parser.add_argument("--deadline", type=float, default=240.0, help="seconds a job may take, restart included")
    parser.add_argument("--outage", type=float, default=8.0, help="seconds node 1's link is down (0: no outage runs)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    from _results import Report

    report = Report("restart", vars(args))
    env = child_env(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    rows: list[dict[str, Any]] = []
    with simulated_cluster(2, args.link), tempfile.TemporaryDirectory(prefix="restart-") as tmp:
        for strategy in args.strategies:
            rows += try_strategy(strategy, args, Path(tmp), env)
        if args.outage > 0:
            rows += try_outage(args, Path(tmp), env)
    report_rows(report, rows, args)
    report.save(args.json)


def report_rows(report: Any, rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """One table of every run, and a note per strategy: how many killed tries passed."""
    columns = ["strategy", "run", "victim rank", "s", "exit codes", "restarts", "resumed", "max |param diff|", "ok"]
    table = []
    for row in rows:
        diff = row["max_param_diff"]
        passed = row["finished"] and (diff is None or diff <= TOLERANCE) and row["seconds"] <= args.deadline
        row["passed"] = passed
        table.append(
            [
                row["strategy"],
                row["run"],
                "-" if row["victim"] is None else row["victim"],
                row["seconds"],
                " ".join(map(str, row["exit_codes"])),
                " ".join(map(str, row["worker_restart_counts"])) or "-",
                "yes" if row["resumed_from_checkpoint"] else "no",
                "-" if diff is None else f"{diff:.1e}",
                "yes" if passed else "no",
            ]
        )
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        tried = [r for r in rows if r["strategy"] == strategy and r["run"].startswith("try")]
        if tried:
            good = sum(r["passed"] for r in tried)
            worst = max(r["seconds"] for r in tried)
            report.note(
                f"{strategy}: {good} of {len(tried)} killed runs finished after one restart (slowest {worst} s)"
            )
    notes = [
        "restarts: each worker's TORCHELASTIC_RESTART_COUNT at the end. torchrun counts per node: an agent counts a "
        "restart when its own worker failed, not when it restarts a healthy worker for another node's new round.",
        "max |param diff|: the final parameters against the uninterrupted run of the same strategy.",
        "The last two rows: node 1's link down mid-training, with a collective timeout longer, then shorter, than it.",
    ]
    title = f"2 nodes x 1 process over {args.link}, worker SIGKILLed mid-epoch, torchrun --max-restarts 1"
    report.table(title, columns, table, notes)
    report.data["runs"] = [{k: v for k, v in r.items()} for r in rows]
    for line in report.data["notes"]:
        print(line)


if __name__ == "__main__":
    main()
