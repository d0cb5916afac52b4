"""``fault_tolerant=True`` on a simulated 3-node cluster: a rank killed, a node's link cut, and the survivors going on.

Needs root: ``benchmarks/netsim.py`` makes three nodes (10.77.0.1-3) joined by shaped links, and each node's torchrun
agent is started in its own namespace with ``netsim exec``, under torchrun's default static rendezvous and no
restarts (node 0's agent hosts the job's store)::

    node i: torchrun --nnodes 3 --nproc-per-node 1 --max-restarts 0 --node-rank i
                     --master-addr 10.77.0.1 --master-port PORT --local-addr 10.77.0.<i+1>
                     benchmarks/survive_worker.py --out DIR --steps 60 --epoch-steps 10 ...

Every rank trains the cluster benchmarks' 12.6 M-parameter MLP (``_launch.mlp``, batch 32 a rank) with
``Trainer(strategy=RingAllReduceStrategy(fault_tolerant=True), num_nodes=3, devices=1, max_steps=60)`` on data of
``--epoch-steps`` steps an epoch (10: a replacement is taken in at an epoch's start); ``--strategy local_sgd`` trains
with ``LocalSGDStrategy(sync_every=8, fault_tolerant=True)`` instead (``--sync-every``; a replacement is taken in at
an epoch's start where the ranks are in sync), drawn into ``docs/figures/survive_local_sgd_steps.png``. Runs:

1. ``uninterrupted``: the reference (final parameters and each step's wall-clock time on every rank);
2. ``kill``: node 1's worker SIGKILLs itself at the start of step ``--fail-at`` (``FailureInjector``);
3. ``cut``: node 1's link down for ``--cut-s`` seconds from the moment node 0's worker starts step ``--fail-at``
   (``netsim.py link 1 down``, then ``up``); node 1's worker should exit with an error naming the cause;
4. ``join``: as ``kill``, and as soon as node 1's torchrun agent has exited (its worker died, no restarts) the same
   agent command is started again on node 1 with ``LDPS_JOIN=1`` in its environment: a second agent for node rank 1
   against the running job (node 0's agent still hosts the store). Its worker asks to join and is admitted at the
   survivors' next epoch start, healed from the leader; all three ranks must end on the reference's parameters.

For each: the workers' exit codes (from their agents' logs), the survivors' largest parameter difference from the
reference (must be <= 1e-6), the wall time from launch until the last survivor's ``fit`` returned, the failure's cost
(that time minus the reference's), and for each recovery the survivors' detection (the failure until they began to
agree), agreement and group-formation times, with each rank's steps against time; for ``join``, when the replacement's
agent started, when its worker was admitted (its setup over, the step it went on from), the seconds from its start
to its first trained step, and when the survivors took it in. The survivors' torchrun agents wait in torchrun's exit
barrier (300 s, not configurable from the command line) for the lost node's agent, which never arrives (in ``join``
the replacement's agent arrives instead): they are given ``--agent-grace`` seconds after their workers ended, then
stopped, and the table says so. ``--quick`` is a reviewer's short run (a small MLP, 12 steps of 4 an epoch, a 20 s
cut; a few minutes on 2 cores), written to ``--json`` (by default in the temporary folder; never into
``benchmarks/results``). Always leaves the cluster down::

    python benchmarks/bench_survive.py --json benchmarks/results/survive.json   # and docs/figures/survive_steps.png
    python benchmarks/bench_survive.py --strategy local_sgd --json benchmarks/results/survive_local_sgd.json
    python benchmarks/bench_survive.py --quick
    python benchmarks/bench_survive.py --plot benchmarks/results/survive.json   # the figure again (its strategy's)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _launch import (
    NETSIM_COMMAND,
    RESULTS,
    ROOT,
    add_mlp_arguments,
    apply_quick,
    child_env,
    measured_cluster,
    netsim,
)
from survive_worker import STRATEGIES, add_strategy_arguments

NODES = 3
PORT = 29577
TOLERANCE = 1e-6
VICTIM = 1
"""The rank (and node: one process a node) that fails; node 0's agent hosts the store, so it must stay."""
RUNS = ("uninterrupted", "kill", "cut", "join")
JOIN_TARGET_S = 30.0
"""The issue's target: the replacement admitted within this many seconds of its agent's start."""
FIGURES = {name: ROOT / "docs" / "figures" / f"survive_{name}_steps.png" for name in STRATEGIES}
FIGURES["ring_allreduce"] = FIGURE = ROOT / "docs" / "figures" / "survive_steps.png"
"""Each strategy's figure (``--plot``: the stored result's strategy's)."""
WORKER = Path(__file__).resolve().with_name("survive_worker.py")
QUICK = {"steps": 12, "fail_at": 4, "epoch_steps": 4, "cut_s": 20.0, "width": 256, "depth": 4, "agent_grace": 10.0}
"""What ``--quick`` sets, where the command line left the default."""


# ---------------------------------------------------------------------- the command line
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's options, ``--quick``'s settings applied (it refuses a ``--json`` among the stored results)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=RUNS, help="the reference always runs")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps of every run")
    parser.add_argument("--fail-at", type=int, default=20, help="the step at whose start node 1 is lost")
    parser.add_argument("--cut-s", type=float, default=60.0, help="seconds node 1's link is down in the cut run")
    parser.add_argument("--epoch-steps", type=int, default=10, help="steps an epoch (replacements join at its start)")
    parser.add_argument("--link", default="1gbit")
    add_mlp_arguments(parser)
    add_strategy_arguments(parser)
    parser.add_argument("--deadline", type=float, default=600.0, help="seconds a run may take before it is stopped")
    parser.add_argument("--agent-grace", type=float, default=20.0, help="seconds agents get after their workers end")
    parser.add_argument("--quick", action="store_true", help="a short run: small MLP, 12 steps, a 20 s cut")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, help="draw the figure from this stored result and exit")
    parser.add_argument("--figure", type=Path, default=None, help=f"default: {FIGURE.relative_to(ROOT)} (not quick)")
    args = parser.parse_args(argv)
    if args.quick:
        named = "" if args.strategy == "ring_allreduce" else f"_{args.strategy}"
        apply_quick(args, parser, QUICK, f"survive{named}_quick.json")
    if args.figure is None and args.plot is None and not args.quick:
        args.figure = FIGURES[args.strategy]
    if not 0 < args.fail_at < args.steps:
        parser.error(f"--fail-at must be a step of the run (1..{args.steps - 1}), got {args.fail_at}")
    if args.sync_every < 1:
        parser.error(f"--sync-every must be a positive number of steps, got {args.sync_every}")
    if "join" in args.runs and args.fail_at + args.epoch_steps >= args.steps:
        parser.error("join: the run needs an epoch start after --fail-at (lower --epoch-steps or raise --steps)")
    if "join" in args.runs and args.strategy == "local_sgd" and not admission_steps(args):
        parser.error(
            "join: local SGD admits a replacement at an epoch start where the ranks are in sync (a multiple of "
            f"--sync-every {args.sync_every} and of --epoch-steps {args.epoch_steps}), and none falls after "
            f"--fail-at {args.fail_at} before step {args.steps}: change one of them or raise --steps"
        )
    return args


def admission_steps(args: argparse.Namespace) -> list[int]:
    """The steps after the failure at which local SGD can take a replacement in: epoch starts that are also
    synchronisations."""
    steps = range(args.fail_at + 1, args.steps)
    return [s for s in steps if s % args.epoch_steps == 0 and s % args.sync_every == 0]


# ---------------------------------------------------------------------- one job on the cluster
def agent_command(node: int, out: Path, args: argparse.Namespace, kill: bool) -> list[str]:
    """The command that starts node ``node``'s torchrun agent in its namespace (static rendezvous, no restarts)."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--nproc-per-node", "1"]
    torchrun += ["--max-restarts", "0", "--node-rank", str(node), "--master-addr", "10.77.0.1"]
    torchrun += ["--master-port", str(PORT), "--local-addr", f"10.77.0.{node + 1}"]
    worker = [str(WORKER), "--out", str(out), "--steps", str(args.steps), "--mark-at", str(args.fail_at)]
    worker += ["--width", str(args.width), "--depth", str(args.depth), "--batch", str(args.batch)]
    worker += ["--epoch-steps", str(args.epoch_steps), "--strategy", args.strategy]
    worker += ["--sync-every", str(args.sync_every)]
    if kill:
        worker += ["--kill-rank", str(VICTIM), "--kill-at", str(args.fail_at)]
    return [*NETSIM_COMMAND, "exec", str(node), *torchrun, *worker]


@dataclass
class Job:
    """What the benchmark process saw of one run: when it started, each agent's exit status and time (``None``:
    stopped by the benchmark), their logs, when node 1's link went down and up again, and node 1's replacement
    agent (``join``: when it started, seconds since the launch, its exit status and time and its log)."""

    started: float
    codes: list[int | None]
    exited_s: list[float | None]
    logs: list[str]
    cut: list[float] = field(default_factory=list)
    replacement: dict[str, Any] | None = None


def cut_link(out: Path, seconds: float, times: list[float], stop: threading.Event) -> None:
    """Once node 0's worker starts the failure step (``OUT/reached``), node 1's link down for ``seconds``, then up."""
    while not (out / "reached").exists():
        if stop.wait(0.05):
            return
    netsim("link", str(VICTIM), "down")
    times.append(time.time())
    time.sleep(seconds)
    netsim("link", str(VICTIM), "up")
    times.append(time.time())


def settled(out: Path, name: str, agent_done: bool) -> bool:
    """Whether the worker writing ``name`` (``rank1``, ``rank1-join``) is over: it wrote its result or its error, or
    its agent exited."""
    return agent_done or (out / f"{name}.json").exists() or (out / f"{name}.error").exists()


def run_job(out: Path, args: argparse.Namespace, env: dict[str, str], kill: bool, cut: bool, join: bool) -> Job:
    """The three agents of one run, started together (``join``: node 1's agent started again with ``LDPS_JOIN=1``
    as soon as the first one exited). Once every worker is over, agents still running get ``--agent-grace`` seconds,
    then their process groups are killed; so is everything at ``--deadline``."""
    out.mkdir(parents=True)
    stop, cut_times = threading.Event(), list[float]()
    cutter = threading.Thread(target=cut_link, args=(out, args.cut_s, cut_times, stop), daemon=True)
    names = [f"agent{node}" for node in range(NODES)] + (["agent1-join"] if join else [])
    logs = {name: open(out / f"{name}.log", "w") for name in names}

    def start(node: int, log: str, **extra: str) -> subprocess.Popen[bytes]:
        command = agent_command(node, out, args, kill)
        kwargs: dict[str, Any] = {"stdout": logs[log], "stderr": subprocess.STDOUT, "start_new_session": True}
        return subprocess.Popen(command, cwd=ROOT, env={**env, **extra}, **kwargs)

    started = time.time()
    procs = [start(node, f"agent{node}") for node in range(NODES)]
    if cut:
        cutter.start()
    exited: list[float | None] = [None] * NODES
    spare: subprocess.Popen[bytes] | None = None
    spare_row: dict[str, Any] = {"started_s": None, "code": None, "exited_s": None}
    over_at = None
    try:
        while time.time() - started < args.deadline:
            for node, proc in enumerate(procs):
                if exited[node] is None and proc.poll() is not None:
                    exited[node] = time.time() - started
            if join and spare is None and exited[VICTIM] is not None:
                spare = start(VICTIM, "agent1-join", LDPS_JOIN="1")
                spare_row["started_s"] = time.time() - started
            if spare is not None and spare_row["exited_s"] is None and spare.poll() is not None:
                spare_row.update(code=spare.returncode, exited_s=time.time() - started)
            every = [*procs, *([spare] if join else [])]
            if all(p is not None and p.poll() is not None for p in every):
                break
            done = [settled(out, f"rank{n}", exited[n] is not None) for n in range(NODES)]
            if join:
                done.append(spare is not None and settled(out, "rank1-join", spare_row["exited_s"] is not None))
            if over_at is None and all(done):
                over_at = time.time()
            if over_at is not None and time.time() - over_at > args.agent_grace:
                break
            time.sleep(0.1)
    finally:
        for proc in [*procs, *([spare] if spare is not None else [])]:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        stop.set()
        if cutter.is_alive():
            cutter.join()  # the link always comes back up before the next run
        for log in logs.values():
            log.close()
    codes = [proc.returncode if exited[node] is not None else None for node, proc in enumerate(procs)]
    texts = [(out / f"agent{node}.log").read_text(errors="replace") for node in range(NODES)]
    replacement = None
    if join:
        spare_row["log"] = (out / "agent1-join.log").read_text(errors="replace")
        replacement = spare_row
    return Job(started, codes, exited, texts, cut_times, replacement)


# ---------------------------------------------------------------------- what a run shows
def read_steps(path: Path, started: float) -> list[list[float]]:
    """``[step, seconds since launch]`` for every step a rank finished (its ``rank{R}.steps`` file)."""
    if not path.exists():
        return []
    found = re.findall(r"^end (\d+) ([\d.]+)$", path.read_text(), re.M)
    return [[int(step), round(float(t) - started, 3)] for step, t in found]


def joined(path: Path, started: float) -> list[list[float]]:
    """``[step, seconds since launch]`` for each time a survivor took replacements in (``joined`` lines: it went on
    with ``step`` then)."""
    if not path.exists():
        return []
    found = re.findall(r"^joined (\d+) ([\d.]+)$", path.read_text(), re.M)
    return [[int(step), round(float(t) - started, 3)] for step, t in found]


def step_started(path: Path, step: int) -> float | None:
    """When a rank began ``step`` (``time.time()``), from its ``rank{R}.steps`` file."""
    if not path.exists():
        return None
    found = re.findall(rf"^start {step} ([\d.]+)$", path.read_text(), re.M)
    return float(found[0]) if found else None


def worker_status(log: str) -> str:
    """The worker's exit as its agent logged it: ``"0"``, the failed worker's exit code, or ``"?"``."""
    failed = re.search(r"exitcode\s*:\s*(-?\d+)", log)
    if failed:
        return failed.group(1)
    return "0" if re.search(r"worker group successfully finished", log) else "?"


def params_diff(path: Path, reference: Path) -> float | None:
    """The largest absolute difference between two saved state dicts (``None``: either missing)."""
    import torch

    if not (path.exists() and reference.exists()):
        return None
    a, b = torch.load(path, weights_only=True), torch.load(reference, weights_only=True)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def summarize(name: str, job: Job, out: Path, reference: Path | None, args: argparse.Namespace) -> dict[str, Any]:
    """One run as the JSON stores it (``reference``: the uninterrupted run's folder; ``None`` for that run); in
    ``join``, ``seconds`` and ``finished`` count the replacement with the survivors."""
    ranks: dict[str, Any] = {}
    for rank in range(NODES):
        exited = job.exited_s[rank]
        result = out / f"rank{rank}.json"
        error = out / f"rank{rank}.error"
        row: dict[str, Any] = {
            "worker_exit": worker_status(job.logs[rank]),
            "agent_exit": job.codes[rank],
            "agent_exited_s": None if exited is None else round(exited, 1),
            "in_exit_barrier": job.codes[rank] is None and "Waiting" in job.logs[rank],
            "steps": read_steps(out / f"rank{rank}.steps", job.started),
        }
        if result.exists():
            data = json.loads(result.read_text())
            row.update(done_s=round(data["done_at"] - job.started, 2), global_step=data["global_step"])
            row["recoveries"] = data["recoveries"]
        if error.exists():
            row["error"] = error.read_text().strip()
            row["error_s"] = round(error.stat().st_mtime - job.started, 1)
        if reference is not None:
            row["max_param_diff"] = params_diff(out / f"rank{rank}.pt", reference / f"rank{rank}.pt")
        else:  # the reference itself: every rank against rank 0 (data parallelism keeps them equal)
            row["max_param_diff"] = params_diff(out / f"rank{rank}.pt", out / "rank0.pt")
        ranks[str(rank)] = row
    survivors = [r for r in ranks.values() if "done_s" in r]
    failure_at = None
    if name in ("kill", "join"):
        failure_at = step_started(out / f"rank{VICTIM}.steps", args.fail_at)
    elif name == "cut" and job.cut:
        failure_at = job.cut[0]
    summary: dict[str, Any] = {
        "run": name,
        "seconds": max((r["done_s"] for r in survivors), default=None),
        "finished": [int(k) for k, r in ranks.items() if r.get("global_step") == args.steps],
        "failure_s": None if failure_at is None else round(failure_at - job.started, 2),
        "cut_s": [round(t - job.started, 2) for t in job.cut],
        "ranks": ranks,
    }
    summary["recoveries"] = recovery_times(ranks, failure_at)
    if job.replacement is not None:  # its time and its steps count with the survivors'
        spare = summary["replacement"] = replacement_summary(job, out, reference, args)
        summary["seconds"] = _worst([summary["seconds"], spare.get("done_s")])
        if spare.get("global_step") == args.steps:
            summary["finished"] = sorted([*summary["finished"], VICTIM])
    return summary


def replacement_summary(job: Job, out: Path, reference: Path | None, args: argparse.Namespace) -> dict[str, Any]:
    """Node 1's replacement in a ``join`` run: its agent (started, exit), its worker's admission (the membership
    epoch, the leader, the step it went on from and when), its steps, its start until admitted and until its first
    trained step, when the survivors took it in (rank 0's ``joined`` line), its parameters against the reference's
    rank 1, and its exit as its agent logged it."""
    spare = job.replacement
    assert spare is not None

    def since(t: float | None) -> float | None:
        return None if t is None else round(t - job.started, 2)

    began = spare["started_s"]
    row: dict[str, Any] = {
        "agent_started_s": None if began is None else round(began, 2),
        "agent_exit": spare["code"],
        "agent_exited_s": None if spare["exited_s"] is None else round(spare["exited_s"], 1),
        "worker_exit": worker_status(spare["log"]) if began is not None else "-",
        "steps": read_steps(out / "rank1-join.steps", job.started),
        "survivors_joined": joined(out / "rank0.steps", job.started),
    }
    admitted = out / "rank1-join.admitted"
    if admitted.exists():
        data = json.loads(admitted.read_text())
        row.update(epoch=data["epoch"], leader=data["leader"], joining=data["joining"])
        row.update(admitted_s=since(data["admitted_at"]), train_start_s=since(data.get("train_start_at")))
        row["admitted_step"] = data.get("global_step")
    result = out / "rank1-join.json"
    if result.exists():
        data = json.loads(result.read_text())
        row.update(done_s=round(data["done_at"] - job.started, 2), global_step=data["global_step"])
    error = out / "rank1-join.error"
    if error.exists():
        row["error"] = error.read_text().strip()
    if reference is not None:
        row["max_param_diff"] = params_diff(out / "rank1-join.pt", reference / f"rank{VICTIM}.pt")
    first = row["steps"][0][1] if row["steps"] else None
    if began is not None:
        row["start_to_admitted_s"] = None if row.get("admitted_s") is None else round(row["admitted_s"] - began, 2)
        row["start_to_first_step_s"] = None if first is None else round(first - began, 2)
    if row["survivors_joined"]:  # rank 0's step that took it in: the world re-formed and the state sent
        step = row["survivors_joined"][0][0]
        row["join_step_s"] = step_times(read_steps(out / "rank0.steps", job.started), step)["failed_step_s"]
    return row


def recovery_times(ranks: dict[str, Any], failure_at: float | None) -> list[dict[str, Any]]:
    """Each survivor's recoveries, with ``detection_s``: the failure until the survivors began to agree."""
    found = []
    for rank, row in ranks.items():
        for rec in row.get("recoveries", []):
            began = rec["at"] - rec["agreement_s"] - rec["formation_s"]
            detection = None if failure_at is None else round(began - failure_at, 2)
            times = {k: round(rec[k], 3) for k in ("agreement_s", "formation_s")}
            found.append({"rank": int(rank), "step": rec["step"], "lost": rec["lost"], "reason": rec["reason"]})
            found[-1].update(detection_s=detection, **times)
    return found


# ---------------------------------------------------------------------- tables, sentences, figure
def _worst(values: list[Any]) -> Any:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def step_times(steps: list[list[float]], fail_at: int) -> dict[str, float | None]:
    """From ``[step, seconds]`` ends: the median step before ``fail_at`` (its first step, start-up, left out), the
    time ``fail_at`` itself took, and the median step after it."""
    ends = dict((int(step), t) for step, t in steps)
    took = {step: t - ends[step - 1] for step, t in ends.items() if step - 1 in ends}

    def median(values: list[float]) -> float | None:
        return round(statistics.median(values), 3) if values else None

    return {
        "step_s_before": median([t for step, t in took.items() if step < fail_at]),
        "failed_step_s": None if fail_at not in took else round(took[fail_at], 3),
        "step_s_after": median([t for step, t in took.items() if step > fail_at]),
    }


def costs(runs: list[dict[str, Any]], fail_at: int) -> None:
    """Each run's ``cost_s`` (its wall time minus the uninterrupted run's), worst parameter difference, and rank 0's
    step times around the step it redid (``fail_at`` where it redid none; :func:`step_times`)."""
    base = next((r["seconds"] for r in runs if r["run"] == "uninterrupted"), None)
    for run in runs:
        redone = [r["step"] for r in run["ranks"]["0"].get("recoveries", [])]  # where the failure hit rank 0
        run["failed_step"] = min(redone, default=fail_at)
        run.update(step_times(run["ranks"]["0"]["steps"], run["failed_step"]))
        known = base is not None and run["seconds"] is not None
        run["cost_s"] = round(run["seconds"] - base, 1) if known else None
        diffs = [r.get("max_param_diff") for r in run["ranks"].values() if "done_s" in r]
        spare = run.get("replacement")
        if spare is not None:  # a replacement that never finished has no parameters: the run fails ``ok``
            diffs.append(spare.get("max_param_diff") if "done_s" in spare else None)
        run["max_param_diff"] = _worst(diffs)


def ok(run: dict[str, Any], args: argparse.Namespace) -> bool:
    """A run passes when every survivor finished every step within ``TOLERANCE`` of the reference, and node 1 (in a
    failure run) ended with an error, not a hang; in ``join``, when the replacement finished every step too, within
    ``TOLERANCE`` (part of the run's worst difference), admitted within :data:`JOIN_TARGET_S` of its agent's start."""
    survivors = [0, 2] if run["run"] != "uninterrupted" else [0, 1, 2]
    diff = run["max_param_diff"]
    good = all(r in run["finished"] for r in survivors) and (diff is not None and diff <= TOLERANCE)
    if run["run"] != "uninterrupted":
        victim = run["ranks"][str(VICTIM)]
        good = good and victim["worker_exit"] not in ("0", "?") and len(run["recoveries"]) >= len(survivors)
    if run["run"] == "join":
        spare = run.get("replacement", {})
        admitted = spare.get("start_to_admitted_s")
        good = good and spare.get("global_step") == args.steps and admitted is not None and admitted <= JOIN_TARGET_S
    return good


def table_rows(runs: list[dict[str, Any]], args: argparse.Namespace) -> list[list[Any]]:
    """One row a run: the numbers of the docs' table."""
    rows = []
    for run in runs:
        recs = run["recoveries"]
        exits = " ".join(run["ranks"][str(r)]["worker_exit"] for r in range(NODES))
        victim = run["ranks"][str(VICTIM)]
        ended = "-"
        if run["run"] != "uninterrupted":
            ended = victim.get("error", f"exit {victim['worker_exit']}")
            ended = ended if len(ended) < 90 else ended[:87] + "..."
            if run["run"] == "cut" and "error_s" in victim and run["failure_s"] is not None:
                ended += f" ({victim['error_s'] - run['failure_s']:.1f} s after the cut)"
        rows.append(
            [
                run["run"],
                _fmt(run["seconds"], ".1f"),
                _fmt(run["cost_s"], "+.1f") if run["run"] != "uninterrupted" else "-",
                exits,
                _fmt(run["max_param_diff"], ".1e"),
                f"{_fmt(run['step_s_before'], '.2f')} / {_fmt(run['failed_step_s'], '.2f')} / "
                f"{_fmt(run['step_s_after'], '.2f')}",
                _fmt(_worst([r["detection_s"] for r in recs]), ".2f"),
                _fmt(_worst([r["agreement_s"] for r in recs]), ".3f"),
                _fmt(_worst([r["formation_s"] for r in recs]), ".3f"),
                ended,
                replacement_cell(run.get("replacement")),
                "yes" if ok(run, args) else "no",
            ]
        )
    return rows


def replacement_cell(spare: dict[str, Any] | None) -> str:
    """The ``join`` run's replacement in the table: its agent's start (since launch), admitted (seconds after that
    start, at which step), its first step's end (after that start), the step that took it in on rank 0."""
    if spare is None:
        return "-"
    if spare.get("agent_started_s") is None:
        return "never started"
    admitted, step = _fmt(spare.get("start_to_admitted_s"), ".1f"), _fmt(spare.get("admitted_step"), "d")
    first, took = _fmt(spare.get("start_to_first_step_s"), ".1f"), _fmt(spare.get("join_step_s"), ".2f")
    started = spare["agent_started_s"]
    return f"started {started:.1f} s; admitted {admitted} s later (step {step}); first step done {first} s; " + (
        f"that step {took} s on rank 0"
    )


COLUMNS = ["run", "s", "cost s", "worker exits (rank 0 1 2)", "max |param diff|", "step s: before / failed / after"]
COLUMNS += ["detection s", "agreement s"]
COLUMNS += ["formation s", "node 1's worker", "node 1's replacement", "ok"]


def strategy_text(strategy: str, sync_every: int) -> str:
    """The strategy as the workers built it."""
    if strategy == "local_sgd":
        return f"LocalSGDStrategy(sync_every={sync_every}, fault_tolerant=True)"
    return "RingAllReduceStrategy(fault_tolerant=True)"


def on_cluster(args: argparse.Namespace, more: str = "") -> str:
    """How a quote begins: the cluster, the run's length (and ``more``), the strategy where it is not the ring."""
    cluster = f"the simulated 3-node cluster ({args.link}, {args.steps} steps{more})"
    if args.strategy == "local_sgd":
        return f"With `{strategy_text(args.strategy, args.sync_every)}` on {cluster}"
    return f"On {cluster}"


def quotes(runs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, str]:
    """The sentences the page quotes, one a failure run (rendered into ``docs/fault_tolerance.md``)."""
    said = {}
    base = next((r for r in runs if r["run"] == "uninterrupted"), None)
    for run in runs:
        if run["run"] == "uninterrupted" or base is None or run["seconds"] is None:
            continue
        recs = run["recoveries"]
        if run["run"] == "join":
            said["join"] = join_quote(run, base, args)
            continue
        what = {
            "kill": f"node 1's worker SIGKILLed at the start of step {args.fail_at}",
            "cut": f"node 1's link cut for {args.cut_s:g} s from step {args.fail_at}",
        }[run["run"]]
        met, hit = "", "the failure's step"
        if args.strategy == "local_sgd":  # inner steps send nothing: the failure is met at the next synchronisation
            met, hit = f" at the synchronisation of step {run['failed_step']}", "that step"
        said[run["run"]] = (
            f"{on_cluster(args)}, with {what}, the two survivors noticed it{met} within "
            f"{_fmt(_worst([r['detection_s'] for r in recs]), '.1f')} s, agreed in "
            f"{_fmt(_worst([r['agreement_s'] for r in recs]), '.2f')} s and formed their groups in "
            f"{_fmt(_worst([r['formation_s'] for r in recs]), '.3f')} s; {hit} took "
            f"{_fmt(run['failed_step_s'], '.1f')} s against {_fmt(run['step_s_before'], '.2f')} s before it and "
            f"{_fmt(run['step_s_after'], '.2f')} s after, and they finished in {run['seconds']:.1f} s "
            f"against {base['seconds']:.1f} s uninterrupted ({run['cost_s']:+.1f} s), within "
            f"{_fmt(run['max_param_diff'], '.0e')} of its parameters."
        )
    return said


def join_quote(run: dict[str, Any], base: dict[str, Any], args: argparse.Namespace) -> str:
    """The sentence on the ``join`` run: when the replacement started, was admitted and trained, and the end."""
    spare = run.get("replacement", {})
    lost = run["ranks"][str(VICTIM)].get("agent_exited_s")
    gap = None if lost is None or run["failure_s"] is None else spare.get("agent_started_s", 0) - run["failure_s"]
    return (
        f"{on_cluster(args, f', {args.epoch_steps} steps an epoch')}, with node 1's worker SIGKILLed at the start of "
        f"step {args.fail_at} and the same torchrun command started again on node 1 with `LDPS_JOIN=1` as soon as its "
        f"agent had exited ({_fmt(gap, '.1f')} s after the kill), the "
        f"replacement was admitted at the start of step {_fmt(spare.get('admitted_step'), 'd')} (membership epoch "
        f"{_fmt(spare.get('epoch'), 'd')}), {_fmt(spare.get('start_to_admitted_s'), '.1f')} s after its agent "
        f"started (target: {JOIN_TARGET_S:g} s), and finished its first step "
        f"{_fmt(spare.get('start_to_first_step_s'), '.1f')} s after it started; the step that took it in took "
        f"{_fmt(spare.get('join_step_s'), '.1f')} s on rank 0, and the three ranks finished in {run['seconds']:.1f} s "
        f"against {base['seconds']:.1f} s uninterrupted ({run['cost_s']:+.1f} s), within "
        f"{_fmt(run['max_param_diff'], '.0e')} of its parameters (the replacement's included)."
    )


def restart_quote(path: Path) -> str | None:
    """The restart benchmark's cost of a killed ``ring_allreduce`` worker (its stored result), stated with its own
    setting: the comparison the page draws, not measured side by side."""
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    rows = [r for r in data.get("runs", []) if r["strategy"] == "ring_allreduce" and r["victim"] is not None]
    base = next((r["seconds"] for r in data.get("runs", []) if r["strategy"] == "ring_allreduce"), None)
    if not rows or base is None:
        return None
    extra = [r["seconds"] - base for r in rows]
    settings = data.get("settings", {})
    return (
        f"For comparison, torchrun's restart (`benchmarks/bench_restart.py`: 2 nodes x 1 process over "
        f"{settings.get('link', '1gbit')}, a small model, `--max-restarts 1`, c10d rendezvous) cost "
        f"{min(extra):.1f}-{max(extra):.1f} s over the uninterrupted {base:.1f} s in its {len(rows)} killed "
        "`ring_allreduce` runs: a different setting, not measured side by side with the runs above."
    )


def plot(path: Path, figure: Path) -> None:
    """Step against wall time on rank 0 for every run of a stored result, the failure marked."""
    import matplotlib
    from _results import save_figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(path.read_text())
    fig, ax = plt.subplots(figsize=(7, 4))
    for run in data["runs"]:
        steps = run["ranks"]["0"]["steps"]
        (line,) = ax.plot([t for _, t in steps], [s + 1 for s, _ in steps], label=run["run"])
        victim = run["ranks"][str(VICTIM)]["steps"]
        if run["run"] != "uninterrupted" and victim:
            ax.plot([t for _, t in victim], [s + 1 for s, _ in victim], ":", color=line.get_color(), lw=1)
        if run["failure_s"] is not None:
            label = f"{run['run']}: node 1 lost"
            ax.axvline(run["failure_s"], color=line.get_color(), ls="--", lw=0.8, label=label)
        if len(run["cut_s"]) == 2:
            ax.axvspan(*run["cut_s"], color=line.get_color(), alpha=0.08, label="cut: link down")
        spare = run.get("replacement")
        if spare and spare["steps"]:
            ax.plot([t for _, t in spare["steps"]], [s + 1 for s, _ in spare["steps"]], ":", color=line.get_color())
        if spare and spare.get("agent_started_s") is not None:
            label = f"{run['run']}: replacement started"
            ax.axvline(spare["agent_started_s"], color=line.get_color(), ls="-.", lw=0.8, label=label)
    settings = data["settings"]
    what = "fault_tolerant=True, "
    if settings.get("strategy") == "local_sgd":  # a longer name: the title's second line says the rest
        what = strategy_text("local_sgd", settings["sync_every"]) + "\n"
    ax.set_xlabel("seconds since launch")
    ax.set_ylabel("optimizer steps done (rank 0)")
    ax.set_title(f"{what}3 nodes x 1 process over {settings['link']} (dotted: node 1)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    save_figure(fig, figure)


def package_version() -> dict[str, Any]:
    """The commit the package was measured at, and its files that differed from it (uncommitted edits), listed
    only where there were any."""
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=False).stdout.strip()
    status = [*git, "status", "--porcelain", "--", "lightning_dp_strategies"]
    changed = subprocess.run(status, capture_output=True, text=True, check=False).stdout.splitlines()
    found: dict[str, Any] = {"commit": head or None}
    if changed:
        found["package_files_changed"] = [line[3:] for line in changed]
    return found


def report(
    runs: list[dict[str, Any]], args: argparse.Namespace, bandwidth: str, started: dict[str, Any] | None = None
) -> Any:
    """The stored result: the table, the quoted sentences, every run's detail (``started``: the machine before the
    first run)."""
    from _results import Report

    keys = ("runs", "steps", "fail_at", "cut_s", "epoch_steps", "link", "width", "depth", "batch", "agent_grace")
    keys += ("quick", "strategy", "sync_every")
    settings = {k: getattr(args, k) for k in keys}
    settings.update(nodes=NODES, processes_per_node=1, **package_version())
    result = Report("survive", settings, started)
    costs(runs, args.fail_at)
    result.note(f"link: {args.link}, measured {bandwidth}")
    title = (
        f"{strategy_text(args.strategy, args.sync_every)}, {NODES} nodes x 1 process over {args.link}, "
        f"{args.steps} steps, node 1 lost at step {args.fail_at}"
    )
    result.table(title, COLUMNS, table_rows(runs, args), table_notes(args))
    result.data["quotes"] = quotes(runs, args)
    restart = restart_quote(RESULTS / "restart.json")
    if restart is not None and args.strategy == "ring_allreduce":  # the restart runs are the ring's
        result.data["quotes"]["restart"] = restart
    result.data["runs"] = runs
    return result


def table_notes(args: argparse.Namespace) -> list[str]:
    """The table's notes: its columns, the failure step as the strategy meets a failure, ``join`` where it ran."""
    failed, after = "(detection, agreement, formation and the step redone)", "over a two-rank ring"
    if args.strategy == "local_sgd":
        failed = (
            "(the step whose synchronisation met the failure: agreement, formation, the lost rank's replica started "
            "- replaying the period's micro-batches where no survivor had the average - and the synchronisation "
            "finished or redone)"
        )
        after = "in the replica of the survivor that took node 1's logical rank over"
    notes = [
        "s: launch until the last survivor's fit returned (join: the replacement's too); cost s: that minus the "
        "uninterrupted run's.",
        "worker exits: as each node's torchrun agent logged them; max |param diff|: the survivors' final parameters "
        "against the same ranks' in the uninterrupted run.",
        "The uninterrupted run's max |param diff|: its ranks against its rank 0.",
        f"step s: rank 0's median step before the failure step (start-up left out), the failure step itself {failed}, "
        f"and the median step after it (the survivors train the lost rank's micro-batch too, {after}).",
        "detection s: the failure (the victim's step start, or the link going down) until the survivors began to "
        "agree; agreement and formation: as the strategy's recoveries record them. The slowest survivor's each.",
        "The survivors' torchrun agents then wait in torchrun's exit barrier (300 s) for node 1's agent, which "
        f"exited without reaching it; the benchmark stopped them {args.agent_grace:g} s after their workers ended.",
    ]
    if args.strategy == "local_sgd":
        notes.append(
            f"Local SGD: inner steps send nothing, so the survivors meet a failure at the next synchronisation (every "
            f"{args.sync_every} steps), and detection includes the inner steps until then."
        )
    if "join" in args.runs:
        notes.append(
            f"join: as kill, and node 1's agent command started again with LDPS_JOIN=1 once the first agent exited "
            f"(data of {args.epoch_steps} steps an epoch, in every run). node 1's replacement: its agent's start "
            "(since launch); admitted: its setup over, the join answered (seconds after that start), at the step it "
            "went on from; first step done: its first step's end after that start; that step: rank 0's step that "
            "took it in (world re-formed, state sent). max |param diff| includes the replacement's parameters "
            f"against the reference's rank 1; ok needs it admitted within {JOIN_TARGET_S:g} s and finished."
        )
    return notes


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.plot is not None:
        stored = json.loads(args.plot.read_text())["settings"].get("strategy", "ring_allreduce")
        plot(args.plot, args.figure or FIGURES[stored])
        return
    if os.geteuid() != 0:
        print("bench_survive.py needs root for the simulated cluster (network namespaces and tc); nothing measured.")
        return
    env = child_env(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", LOGLEVEL="INFO")
    runs: list[dict[str, Any]] = []
    folder = Path(tempfile.mkdtemp(prefix="survive-"))  # kept: the agents' logs and the steps files
    print(f"logs in {folder}", flush=True)
    from _results import machine

    started = machine()  # the load average before the first run
    with measured_cluster(NODES, args.link) as bandwidth:
        reference = folder / "uninterrupted"
        for name in ("uninterrupted", *[r for r in args.runs if r != "uninterrupted"]):
            out = folder / name
            job = run_job(out, args, env, kill=name in ("kill", "join"), cut=name == "cut", join=name == "join")
            run = summarize(name, job, out, None if name == "uninterrupted" else reference, args)
            runs.append(run)
            if name != "uninterrupted":
                for saved in out.glob("rank*.pt"):
                    saved.unlink()
            exits = [r["worker_exit"] for r in run["ranks"].values()]
            print(f"{name}: {run['seconds']} s, worker exits {exits}", flush=True)
            for rank, row in run["ranks"].items():
                if "done_s" not in row or row.get("error"):
                    keep = [line for line in job.logs[int(rank)].splitlines() if line.strip()][-25:]
                    print(f"--- node {rank}'s agent log (last lines) ---\n" + "\n".join(keep), flush=True)
            spare = run.get("replacement")
            if spare is not None:
                print(f"join: replacement {replacement_cell(spare)}", flush=True)
                if "done_s" not in spare or spare.get("error"):
                    keep = [line for line in job.replacement["log"].splitlines() if line.strip()][-40:]
                    print("--- node 1's replacement agent log (last lines) ---\n" + "\n".join(keep), flush=True)
    for saved in reference.glob("rank*.pt"):
        saved.unlink()
    result = report(runs, args, bandwidth, started)
    for row in result.data["tables"][0]["rows"]:
        print("  ".join(str(c) for c in row))
    for sentence in result.data["quotes"].values():
        print(sentence)
    result.save(args.json)
    if args.json is not None and args.figure is not None:
        plot(args.json, args.figure)


if __name__ == "__main__":
    main()
