"""The benchmark scripts still run end to end (on a tiny model) and print the ratios the docs quote, and every
benchmark command the docs show (under a stored result, or for a user to run) is one the script accepts.

Nothing here asserts on speed: the figures themselves are measured by running the scripts (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.distributed import run_script

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
TINY = ["--width", "32", "--depth", "1"]


def _run(script: str, *args: str) -> str:
    """``python benchmarks/SCRIPT ARGS...``: its output (stdout and stderr); fails on a non-zero exit status."""
    return run_script([str(BENCHMARKS / script), *args], timeout=240)


@pytest.mark.timeout(300)
def test_collective_benchmark_prints_ratio_range_and_plain_p2p_per_size() -> None:
    out = _run("bench_ring_allreduce.py", "--part", "a", "--launches", "2", "--repeats", "3", "--sizes-kib", "4", "64")
    assert "2 launches" in out, out
    # ring, torch and p2p ms; the median ratio; its min-max across launches; one/torch; p2p/torch; two bandwidths
    ms, ratio, spread = r"(\s+\d+\.\d{3}){3}", r"\s+\d+\.\d\d", r"\s+\d+\.\d\d-\d+\.\d\d"
    bus = r"(\s+\d+\.\d\d GB/s){2}"
    for size in ("4 KiB", "64 KiB"):
        row = rf"^\s+{size}{ms}{ratio}{spread}{ratio}{ratio}{bus}$"
        assert re.search(row, out, re.M), out


@pytest.mark.timeout(300)
def test_strategy_benchmark_pairs_rounds_in_one_launch_and_prints_the_ratio() -> None:
    out = _run("bench_ring_allreduce.py", "--part", "b", "--rounds", "2", "--steps", "3", *TINY)
    rounds = re.search(r"per-round ratios ((?:\d+\.\d+ ?)+)", out)
    assert rounds is not None and len(rounds.group(1).split()) == 2, out
    assert re.search(r"ratio ring_allreduce / ddp = \d+\.\d{3} \(median of the per-round ratios, IQR", out), out
    assert "MB sent" in out, out


@pytest.mark.timeout(300)
def test_reducer_benchmark_prints_reducers_and_torch_hooks_against_ring_and_ddp_and_when_compression_pays() -> None:
    tiny = ["--rounds", "1", "--steps", "3", *TINY, "--link-sizes-kib", "64", "256"]
    out = _run("bench_ring_allreduce.py", "--part", "c", *tiny)
    # MB/step, counted/payload, bytes/ring, ms/step, time/ring and its IQR, time/ddp and its IQR
    number = r"\s+\d+\.\d+"
    for label in ('"ring"', '"native"', 'PowerSGD("native", rank=4)', "hook powerSGD_hook r=4", 'Lightning "ddp"'):
        assert re.search(rf"^\s+{re.escape(label)}{number}\s+(counted|payload){number * 6}$", out, re.M), out
    assert re.search(r"loopback link fitted on gloo all-reduces .* bandwidth \d+\.\d\d GB/s", out), out
    # k, extra compute, break-even bandwidth, t0, t1, verdict, predicted and measured ratios
    row = rf"^\s+hook powerSGD_hook r=4\s+3{number}\s+(\d+\.\d+|inf){number * 2}\s+(pays|costs){number * 2}$"
    assert re.search(row, out, re.M), out
    assert re.search(r"^\s+fp16_compress\(\"ring\"\)(\s+[+-]\d+\.\d){3}\s+(\d+\.\d+|inf)$", out, re.M), out


@pytest.mark.timeout(300)
def test_step_phase_benchmark_prints_every_contender_against_ddp() -> None:
    out = _run("bench_step_phases.py", "--steps", "5", "--contenders", "buckets+noop,buckets+ring,ddp", *TINY)
    for name in ("buckets+noop", "buckets+ring", "ddp"):
        assert re.search(rf"^\s+{re.escape(name)}\s+(\d+\.\d\s+){{5}}\s*\d+\.\d{{3}}$", out, re.M), out


@pytest.mark.timeout(300)
def test_schedule_benchmark_prints_step_bubble_and_activations_per_schedule() -> None:
    out = _run("bench_pipeline_schedules.py", "--schedules", "zbv", "--micro", "2", "--steps", "2", "--width", "32")
    assert re.search(r"one device: \d+\.\d ms/step", out), out
    # step, ideal, ideal/measured, compute, compute/(T1/S), bubble, formula (0.143 for zbv at M=2), diff, p2p
    number = r"\s+[+-]?\d+\.\d+"
    assert re.search(rf"^\s+zbv\s+2{number * 6}\s+0\.143{number * 2}$", out, re.M), out
    assert re.search(r"^\s+zbv\s+2\s+\d+\.\d\d\s+\S+\s+\[3, 4\]$", out, re.M), out  # M, MiB, / 1f1b, model
    # (c): the stage's compute per M against M=1 (exactly 1.00 there) and its ceiling; one row per weight count
    # and the same pieces in 1F1B's order, and with one weight-gradient pass, each over GPipe's order
    # (the last two are timing ratios of sub-millisecond work: a hiccup of the machine can make them 10 or more)
    assert re.search(r"^\s+1\s+\d+\.\d\s+1\.00\s+1\.00\s+\d+\.\d\d\s+\d+\.\d\d$", out, re.M), out
    assert re.search(r"^\s+2\s+\d+\.\d\s+\d+\.\d\d\s+\d+\.\d\d\s+\d+\.\d\d\s+\d+\.\d\d$", out, re.M), out
    assert len(re.findall(r"^  weights cycled through:\s+(1|4|8) \(.*\): \d+\.\d\d$", out, re.M)) == 3, out


def test_cluster_benchmark_builds_every_variant_without_a_cluster() -> None:
    """The simulated cluster needs root and is never started here: only the script's variants are checked, each a
    strategy the Trainer takes (a typo in one would fail after minutes of netsim set-up)."""
    sys.path.insert(0, str(BENCHMARKS))
    import bench_cluster

    from lightning_dp_strategies import HybridPipelineStrategy, RingAllReduceStrategy

    strategies = {v: bench_cluster.make_strategy(v) for v in bench_cluster.VARIANTS}
    assert strategies.pop("ddp") == "ddp"
    assert isinstance(strategies.pop("hybrid_pipeline"), HybridPipelineStrategy)
    assert all(isinstance(s, RingAllReduceStrategy) for s in strategies.values())
    assert strategies["two_level"].two_level and strategies["ring"].two_level is False
    assert strategies["auto"].reducer == "auto" and strategies["torch_powersgd"].ddp_comm_hook is not None
    assert "--links" in _run("bench_cluster.py", "--help")


def test_streaming_variants_register_names_that_build_their_options() -> None:
    """The names ``store_compare.py --streaming`` compares build local SGD with each name's options (the period
    ``"streaming_diloco"`` chooses on a slow link, fixed)."""
    sys.path.insert(0, str(BENCHMARKS))
    import streaming_variants
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_dp_strategies import LocalSGDStrategy

    try:
        built = {name: StrategyRegistry.get(name) for name in streaming_variants.VARIANTS}
    finally:  # the names stay out of the other tests' registry
        for name in streaming_variants.VARIANTS:
            StrategyRegistry.remove(name)
    assert all(isinstance(s, LocalSGDStrategy) for s in built.values())
    delays = {name: (s.local_config.delay, s.local_config.mixing) for name, s in built.items()}
    assert delays == {"streaming_delay_1": (1, 0.0), "streaming_delay_0": (0, 0.0), "streaming_mixing_half": (1, 0.5)}
    configs = {(s.local_config.sync_every, s.local_config.fragments) for s in built.values()}
    assert configs == {(4, 4)} and {s.local_config.outer_precision for s in built.values()} == {"int4"}


def test_local_sgd_benchmark_variants_turn_fault_tolerance_on_by_suffix() -> None:
    sys.path.insert(0, str(BENCHMARKS))
    import bench_local_sgd

    from lightning_dp_strategies import LocalSGDStrategy

    plain, tolerant = bench_local_sgd.make_strategy("local_sgd_8"), bench_local_sgd.make_strategy("diloco_16_ft")
    assert isinstance(plain, LocalSGDStrategy) and isinstance(tolerant, LocalSGDStrategy)
    assert plain.survival is None and tolerant.survival is not None
    assert plain.local_config.sync_every == 8 and tolerant.local_config.sync_every == 16
    assert tolerant.local_config.outer_optimizer is not None and plain.local_config.outer_optimizer is None


@pytest.mark.parametrize("one_thread", [True, False])
def test_local_sgd_benchmark_sets_one_thread_a_node_only_when_asked(
    one_thread: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sys.path.insert(0, str(BENCHMARKS))
    import _launch
    import bench_local_sgd

    calls: list[bool] = []

    def torchrun_on_cluster(per_node: int, script: list[str], folder: Path, what: str, one_thread: bool) -> None:
        calls.append(one_thread)
        (folder / "ddp.json").write_text('{"points": []}')

    monkeypatch.setattr(_launch, "torchrun_on_cluster", torchrun_on_cluster)
    settings = dict.fromkeys(bench_local_sgd.WORKER_SETTINGS, 1)
    args = bench_local_sgd.argparse.Namespace(**settings, one_thread=one_thread)
    assert bench_local_sgd.launch("ddp", args, tmp_path) == {"points": []}
    assert calls == [one_thread]


def test_zero_benchmark_builds_its_variants_and_tables_without_launching() -> None:
    """The ZeRO benchmark launches torchrun (and netsim) for minutes, so only its variants and its tables over a
    made-up cell are checked here."""
    sys.path.insert(0, str(BENCHMARKS))
    import bench_zero

    from lightning_dp_strategies import RingAllReduceStrategy

    ring, zero = bench_zero.make_strategy("ring"), bench_zero.make_strategy("zero")
    assert bench_zero.make_strategy("ddp") == "ddp"
    assert isinstance(ring, RingAllReduceStrategy) and isinstance(zero, RingAllReduceStrategy)
    assert zero.shard_optimizer_state and not ring.shard_optimizer_state and ring.two_level is zero.two_level is False

    def run(variant: str, ms: float, state: list[int]) -> dict[str, object]:
        ranks = [{"state_bytes": s, "param_bytes": 100, "step_ms": ms, "peak_rss_mb": 300.0} for s in state]
        for rank in ranks:
            rank.update(dict.fromkeys(bench_zero.PHASES, 1.0), bytes_sent_per_step=1e6, comm_ms_per_step=5.0)
        return {"ranks": ranks, "step_ms": ms, "max_param_diff_vs_ring": 0.0}

    runs = {"ring": [run("ring", 100.0, [800, 800])], "zero": [run("zero", 104.0, [404, 396])]}
    cell = {
        "link": "1gbit",
        "nodes": 2,
        "per_node": 1,
        "summary": {v: bench_zero.summarize(r) for v, r in runs.items()},
    }
    rows = bench_zero.memory_and_time_rows([cell])
    assert rows[1][:8] == ["1gbit", "2 x 1", "zero", "0.0", "0.505", 104, "1.04", "1.04-1.04"], rows
    assert len(bench_zero.phase_rows([cell])[1]) == len(bench_zero.PHASE_COLUMNS)
    assert "--layouts" in _run("bench_zero.py", "--help")


def test_netsim_plans_namespaces_veths_and_shaping_both_ways_without_running_anything(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--dry-run up 2 1gbit`` prints the ip/tc commands and runs none (no root needed): a bridge namespace, per node
    a namespace whose veth pair is made straight inside the namespaces, its address, and tbf on both ends."""
    sys.path.insert(0, str(BENCHMARKS))
    import netsim

    assert netsim.main(["--dry-run", "up", "2", "1gbit"]) == 0
    plan = capsys.readouterr().out.splitlines()
    prefix = netsim.prefix()
    assert plan[0] == f"ip netns add {prefix}br"
    for node in (0, 1):
        veth = f"ip link add n{node} netns {prefix}{node} type veth peer name b{node} netns {prefix}br"
        assert veth in plan
        assert f"ip -n {prefix}{node} addr add 10.77.0.{node + 1}/24 dev n{node}" in plan
        tbf = "root tbf rate 1gbit burst 256kb latency 50ms"
        assert f"tc -n {prefix}{node} qdisc add dev n{node} {tbf}" in plan  # what the node sends
        assert f"tc -n {prefix}br qdisc add dev b{node} {tbf}" in plan  # what it receives
    assert not any(line.startswith("ip link add") and "netns" not in line for line in plan)  # nothing left in ours
    assert netsim.down_plan(netsim.Cluster(prefix, 2))[-1] == ["ip", "netns", "del", f"{prefix}br"]
    env = netsim.node_env(netsim.Cluster(prefix, 2), 1)
    assert (env["MASTER_ADDR"], env["NODE_RANK"], env["NNODES"]) == ("10.77.0.1", "1", "2")
    assert (env["NETSIM_ADDR"], env["GLOO_SOCKET_IFNAME"]) == ("10.77.0.2", "n1")
    # a node lost to the network (bench_restart.py's outage): its own end of its link, inside its namespace
    cluster = netsim.Cluster(prefix, 2)
    assert netsim.link_plan(cluster, 1, "down") == [["ip", "-n", f"{prefix}1", "link", "set", "n1", "down"]]
    with pytest.raises(SystemExit):
        netsim.link_plan(cluster, 2, "down")  # no node 2: a refusal naming the nodes and states it takes
    assert "'up' or 'down'" in capsys.readouterr().err


def test_netsim_refuses_at_once_without_root_or_iproute2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without root, or without ``ip``/``tc``, every command that would touch the network stops before doing anything
    and says how to fix it; the benchmarks' launcher uses this simulator unless ``$NETSIM`` names another."""
    sys.path.insert(0, str(BENCHMARKS))
    import _launch
    import netsim

    monkeypatch.setattr(netsim.os, "geteuid", lambda: 1000)
    ran: list[object] = []
    monkeypatch.setattr(netsim.subprocess, "run", lambda *a, **k: ran.append(a))
    for command in (["up", "2", "1gbit"], ["down"], ["bandwidth"], ["torchrun", "1", "x.py"]):
        with pytest.raises(SystemExit) as refused:
            netsim.main(command)
        assert refused.value.code == 2
        assert "needs root" in capsys.readouterr().err
    monkeypatch.setattr(netsim.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netsim.shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/ip")
    with pytest.raises(SystemExit):
        netsim.main(["up", "2", "1gbit"])
    assert "tc not found: install iproute2" in capsys.readouterr().err
    assert ran == []
    if "NETSIM" not in os.environ:
        assert _launch.NETSIM == BENCHMARKS / "netsim.py" and _launch.NETSIM_COMMAND[0] == sys.executable


def test_measured_cluster_measures_the_link_once_up_and_always_takes_the_cluster_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``measured_cluster`` gives the block the link as ``netsim bandwidth`` measured it, between ``up`` and ``down``;
    a failing block still takes the cluster down."""
    sys.path.insert(0, str(BENCHMARKS))
    import _launch

    calls: list[tuple[str, ...]] = []

    def fake_netsim(*argv: str, env: object = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 0, stdout=" 118.4 MB/s\n" if argv == ("bandwidth",) else "")

    monkeypatch.setattr(_launch, "netsim", fake_netsim)
    with _launch.measured_cluster(2, "1gbit") as bandwidth:
        assert bandwidth == "118.4 MB/s" and calls == [("up", "2", "1gbit"), ("bandwidth",)]
    assert calls[-1] == ("down",)
    calls.clear()
    with pytest.raises(KeyError), _launch.measured_cluster(3, "100mbit"):
        raise KeyError("a failed launch")
    assert calls == [("up", "3", "100mbit"), ("bandwidth",), ("down",)]


def test_cluster_benchmark_quick_mode_never_writes_the_stored_results() -> None:
    """``--quick`` fills in one link, one layout and a small model, and refuses a ``--json`` in benchmarks/results."""
    done = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "bench_cluster.py"),
            "--quick",
            "--json",
            str(BENCHMARKS / "results" / "x.json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2 and "--quick does not write into" in done.stderr, done.stderr


def test_planning_benchmark_prices_a_nominal_link_with_the_cpu_costs_without_a_cluster() -> None:
    """The planning benchmark's prediction from made-up local measurements: the wire alone, then with the CPU's costs
    (a nominal link adds the ring's adds and socket copies), then with compute twice as slow; no cluster started."""
    sys.path.insert(0, str(BENCHMARKS))
    import bench_planning

    cpu = {"add": 2e-10, "add_low": 3e-10, "cast": 3e-10, "powersgd": 1e-9, "powersgd_rank": 4, "overlap": 1.0}
    local = {"compute_s": 0.2, "backward_s": 0.13, "cpu": cpu}
    wire = bench_planning.predict_ms(local, 1.25e9, 2, 2, 8, with_cpu=False)
    planned = bench_planning.predict_ms(local, 1.25e9, 2, 2, 8, with_cpu=True)
    assert 200 < wire < planned
    cell = {"link": "10gbit", "nodes": 2, "per_node": 2, "launches_ms": {"default": [300.0], "flat": [310.0]}}
    bench_planning.add_predictions(cell, local, {**local, "compute_s": 0.4, "backward_s": 0.26}, seq=8)
    assert cell["predicted_ms"]["planned"] == pytest.approx(planned)
    assert cell["error"]["wire"] == pytest.approx(wire / 300 - 1)
    assert cell["predicted_ms"]["shared_cores"] > planned + 150
    assert bench_planning.rows([cell])[0][:5] == ["10gbit", "2 x 2", 300, 310, "0.97"]
    assert "--layouts" in _run("bench_planning.py", "--help")


def test_survive_benchmark_parses_quick_and_summarizes_a_run_from_its_files(tmp_path: Path) -> None:
    """The fault-tolerance benchmark's options (``--quick`` among them) and what it makes of a run's files: the
    victim's step start as the failure, the survivors' recoveries as detection/agreement/formation, the cost over
    the reference, the table row and the quoted sentence; in ``join``, the replacement's start, admission and first
    step, its parameters counted in the run's; no cluster started, no torchrun."""
    sys.path.insert(0, str(BENCHMARKS))
    import bench_survive
    import torch

    args = bench_survive.parse_args(["--quick"])
    assert (args.steps, args.fail_at, args.width, args.epoch_steps) == (12, 4, 256, 4)
    assert args.json.name == "survive_quick.json" and "join" in args.runs
    assert args.figure is None and bench_survive.parse_args([]).figure == bench_survive.FIGURE
    with pytest.raises(SystemExit):
        bench_survive.parse_args(["--quick", "--json", str(bench_survive.RESULTS / "survive.json")])
    with pytest.raises(SystemExit):  # no epoch start left after the failure for the replacement to join at
        bench_survive.parse_args(["--steps", "12", "--fail-at", "4", "--epoch-steps", "8"])
    command = bench_survive.agent_command(2, tmp_path, args, kill=True)
    assert command[command.index("--node-rank") + 1] == "2" and command[command.index("--max-restarts") + 1] == "0"
    assert "--rdzv-backend" not in command and command[command.index("--kill-at") + 1] == "4"
    assert command[command.index("--epoch-steps") + 1] == "4"

    args.fail_at = 2
    start, params = 1000.0, {"w": torch.zeros(3)}
    runs = []
    for name, lost in (("uninterrupted", False), ("kill", True), ("join", True)):
        out = tmp_path / name
        out.mkdir()
        for rank in range(3):
            steps = range(2 if lost and rank == 1 else 12)
            lines = [f"start {s} {start + s + 0.1}\nend {s} {start + s + 1}\n" for s in steps]
            if name == "join" and rank == 0:
                lines.insert(8, f"joined 8 {start + 8.05}\n")
            (out / f"rank{rank}.steps").write_text("".join(lines) + (f"start 2 {start + 2.1}\n" if lost else ""))
            if lost and rank == 1:
                continue
            torch.save({"w": params["w"] + (1e-7 if lost else 0.0)}, out / f"rank{rank}.pt")
            recovery = {"step": 2, "lost": [1], "members": [0, 2], "reason": "Connection reset by peer"}
            recovery.update(agreement_s=5.0, formation_s=0.02, at=start + 2.1 + 0.4 + 5.02)
            done = start + (17 if lost else 12)
            result = {"global_step": 12, "recoveries": [recovery] if lost else [], "done_at": done}
            (out / f"rank{rank}.json").write_text(json.dumps(result))
        logs = ["worker group successfully finished"] * 3
        if lost:
            logs[1] = "Root Cause (first observed failure):\n  exitcode  : -9 (pid: 7)  (SIGKILL)"
        spare = None
        if name == "join":  # started 3.0 s after launch, admitted 5.0 s later at step 8, done at 17.5 s
            lines = [f"start {s} {start + s + 0.1}\nend {s} {start + s + 1}\n" for s in range(8, 12)]
            (out / "rank1-join.steps").write_text("".join(lines))
            admitted = {"admitted_at": start + 8.0, "epoch": 2, "leader": 0, "joining": [1]}
            admitted.update(train_start_at=start + 8.02, global_step=8)
            (out / "rank1-join.admitted").write_text(json.dumps(admitted))
            (out / "rank1-join.json").write_text(json.dumps({"global_step": 12, "done_at": start + 17.5}))
            torch.save({"w": params["w"] + 2e-7}, out / "rank1-join.pt")
            spare = {"started_s": 3.0, "code": 0, "exited_s": 18.0, "log": "worker group successfully finished"}
        job = bench_survive.Job(start, [0, 1, 0], [13.0, 3.0, 13.0], logs, replacement=spare)
        reference = None if name == "uninterrupted" else tmp_path / "uninterrupted"
        runs.append(bench_survive.summarize(name, job, out, reference, args))
    report = bench_survive.report(runs, args, "118 MB/s")
    started = {**report.data["machine"], "load_average_at_start": 0.25}  # as main takes it before the first run
    assert bench_survive.report(runs, args, "118 MB/s", started).data["machine"]["load_average_at_start"] == 0.25
    kill = runs[1]
    assert kill["seconds"] == 17 and kill["cost_s"] == 5.0 and kill["failure_s"] == 2.1 and kill["finished"] == [0, 2]
    assert kill["recoveries"][0]["detection_s"] == pytest.approx(0.4) and kill["max_param_diff"] == pytest.approx(1e-7)
    rows = report.data["tables"][0]["rows"]
    assert rows[1][:9] == ["kill", "17.0", "+5.0", "0 -9 0", "1.0e-07", "1.00 / 1.00 / 1.00", "0.40", "5.000", "0.020"]
    assert rows[1][-2:] == ["-", "yes"]
    assert rows[0][-1] == "yes"  # the reference's ranks agree
    assert "noticed it within 0.4 s" in report.data["quotes"]["kill"] and "(+5.0 s)" in report.data["quotes"]["kill"]

    join = runs[2]
    spare = join["replacement"]
    assert (spare["start_to_admitted_s"], spare["start_to_first_step_s"], spare["admitted_step"]) == (5.0, 6.0, 8)
    assert spare["survivors_joined"] == [[8, 8.05]] and spare["join_step_s"] == 1.0 and spare["epoch"] == 2
    assert join["seconds"] == 17.5 and join["finished"] == [0, 1, 2] and join["failure_s"] == 2.1
    assert join["max_param_diff"] == pytest.approx(2e-7)  # the replacement's parameters counted
    assert rows[2][0] == "join" and rows[2][-1] == "yes"
    assert rows[2][-2].startswith("started 3.0 s; admitted 5.0 s later (step 8); first step done 6.0 s")
    said = report.data["quotes"]["join"]
    assert "admitted at the start of step 8" in said and "5.0 s after its agent started" in said
    assert "(+5.5 s)" in said and "0.9 s after the kill" in said
    spare["start_to_admitted_s"] = bench_survive.JOIN_TARGET_S + 1  # admitted too late: the run fails
    assert not bench_survive.ok(join, args)


def test_survive_benchmark_passes_local_sgd_and_its_sync_interval_to_the_workers(tmp_path: Path) -> None:
    """``--strategy local_sgd``: its own figure and quick result, ``--sync-every`` carried to every worker's command
    line (after the worker script, where ``survive_worker.py`` reads it and builds the strategy from it), named in the
    table's title and notes; an unknown strategy or a non-integer interval refused. No cluster started, no torchrun."""
    sys.path.insert(0, str(BENCHMARKS))
    import bench_survive
    import survive_worker

    from lightning_dp_strategies import LocalSGDStrategy

    args = bench_survive.parse_args(["--strategy", "local_sgd", "--sync-every", "4"])
    assert (args.strategy, args.sync_every) == ("local_sgd", 4)
    assert args.figure == bench_survive.ROOT / "docs" / "figures" / "survive_local_sgd_steps.png"
    assert args.figure != bench_survive.FIGURE  # the ring's figure is left alone
    assert bench_survive.parse_args(["--strategy", "local_sgd"]).sync_every == 8
    quick = bench_survive.parse_args(["--quick", "--strategy", "local_sgd"])
    assert quick.json.name == "survive_local_sgd_quick.json" and quick.figure is None and quick.sync_every == 8
    with pytest.raises(SystemExit):  # a quick run replaces no stored result
        stored = bench_survive.RESULTS / "survive_local_sgd.json"
        bench_survive.parse_args(["--quick", "--strategy", "local_sgd", "--json", str(stored)])
    with pytest.raises(SystemExit):
        bench_survive.parse_args(["--strategy", "diloco"])
    with pytest.raises(SystemExit):
        bench_survive.parse_args(["--strategy", "local_sgd", "--sync-every", "auto"])
    with pytest.raises(SystemExit):
        bench_survive.parse_args(["--strategy", "local_sgd", "--sync-every", "0"])
    # join needs an epoch start that is also a synchronisation after the failure: 40 for 8 and 10, none for 7 and 10
    assert bench_survive.admission_steps(args) == [40]
    with pytest.raises(SystemExit):
        bench_survive.parse_args(["--strategy", "local_sgd", "--sync-every", "7"])
    assert bench_survive.parse_args(["--strategy", "local_sgd", "--sync-every", "7", "--runs", "kill"]).sync_every == 7

    for kill in (False, True):
        command = bench_survive.agent_command(1, tmp_path, args, kill=kill)
        worker_args = command[command.index(str(bench_survive.WORKER)) + 1 :]
        assert worker_args[worker_args.index("--strategy") + 1] == "local_sgd"
        assert worker_args[worker_args.index("--sync-every") + 1] == "4"
        assert "--sync-every" not in command[: command.index(str(bench_survive.WORKER))]  # not torchrun's
        worker = survive_worker.parse(worker_args)
        assert (worker.strategy, worker.sync_every, worker.out) == ("local_sgd", 4, tmp_path)
        assert worker.kill_rank == (bench_survive.VICTIM if kill else None)
        built = survive_worker.strategy(worker)
        assert isinstance(built, LocalSGDStrategy) and built.sync_every == 4

    assert bench_survive.strategy_text(args.strategy, args.sync_every) == (
        "LocalSGDStrategy(sync_every=4, fault_tolerant=True)"
    )
    notes = bench_survive.table_notes(args)
    assert any("every 4 steps" in note for note in notes)
    assert not any("every 4 steps" in note for note in bench_survive.table_notes(bench_survive.parse_args([])))


def test_a_report_made_after_the_runs_states_the_load_average_taken_before_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A benchmark that builds its report once its runs are over passes the machine taken before them: the load
    average its page calls the start's is not the one its own processes left behind."""
    sys.path.insert(0, str(BENCHMARKS))
    import _results

    monkeypatch.setattr(os, "getloadavg", lambda: (0.5, 0.0, 0.0))
    started = _results.machine()
    monkeypatch.setattr(os, "getloadavg", lambda: (3.5, 0.0, 0.0))  # the benchmark's own processes, at the end
    assert _results.Report("demo", {}, started).data["machine"]["load_average_at_start"] == 0.5
    assert _results.Report("demo", {}).data["machine"]["load_average_at_start"] == 3.5


def test_every_report_names_the_processor(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    sys.path.insert(0, str(BENCHMARKS))
    import _results

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: Made Up\nmodel name\t: Made Up CPU 9000\n")
    real = _results.Path
    monkeypatch.setattr(_results, "Path", lambda p: real(cpuinfo) if p == "/proc/cpuinfo" else real(p))
    assert _results.Report("demo", {}).data["machine"]["cpu"] == "Made Up CPU 9000"


class _Parsed(Exception):
    """Raised in place of running a benchmark once its command line is parsed."""


def _stored_commands() -> list[Any]:
    """Every step of every stored result's command, and the command each page shows where a result is missing (with
    the ``--json`` the page appends), each with its result file's name as the test's id."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    import render_docs

    steps = [
        pytest.param(step, id=f"{path.stem}: {step}")
        for path in sorted((BENCHMARKS / "results").glob("*.json"))
        for step in json.loads(path.read_text())["command"].split(" && ")
    ]
    missing = [
        pytest.param(f"{command} --json benchmarks/results/{name}.json", id=f"{name} (when missing): {command}")
        for name, command in render_docs.COMMANDS.items()
    ]
    return steps + missing


def _documented_commands() -> list[Any]:
    """Every ``python benchmarks/...`` command the README and the docs give (in code spans and code blocks), each step
    of a chain on its own, comments and line continuations removed, each with its page as the test's id."""
    root = BENCHMARKS.parent
    found: dict[str, str] = {}
    for page in [root / "README.md", *sorted((root / "docs").rglob("*.md"))]:
        text = re.sub(r"\\\n\s*", " ", page.read_text())
        for command in re.findall(r"(?:^|`)(python benchmarks/[^`\n]*)", text, re.M):
            for step in command.split(" && "):
                found.setdefault(step.split(" #")[0].strip(), f"{page.relative_to(root)}: {step.strip()}")
    return [pytest.param(command, id=label) for command, label in sorted(found.items(), key=lambda item: item[1])]


def _check_parses(command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Run ``command``'s script as ``__main__`` until it has parsed its arguments, and stop there."""
    import argparse
    import runpy
    import shlex

    python, script, *argv = shlex.split(command)
    assert python == "python" and script.startswith("benchmarks/"), command
    assert (BENCHMARKS.parent / script).is_file(), f"no {script} in the repository"
    parse = argparse.ArgumentParser.parse_args

    def parsed(self: argparse.ArgumentParser, args: object = None, namespace: object = None) -> None:
        raise _Parsed(parse(self, args, namespace))  # type: ignore[arg-type]

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parsed)
    monkeypatch.setattr(sys, "argv", [script, *argv])
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    environ, threads = dict(os.environ), torch.get_num_threads()
    try:
        runpy.run_path(str(BENCHMARKS.parent / script), run_name="__main__")
    except _Parsed:
        return
    except SystemExit as refused:  # argparse's error(): the message is on stderr
        raise AssertionError(f"{command}: refused ({refused.code}): {capsys.readouterr().err}") from None
    finally:  # what a script sets as it loads (one sets torch's thread count) stays out of the other tests
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads(threads)
    raise AssertionError(f"{command}: {script} ran without parsing a command line")


@pytest.mark.parametrize("command", _stored_commands())
def test_every_stored_command_still_parses(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command a page shows under a result (and the one it shows where the result is missing) is accepted by the
    script in this repository: a flag renamed or removed since the run fails here, not in a user's rerun."""
    _check_parses(command, monkeypatch, capsys)


@pytest.mark.parametrize("command", _documented_commands())
def test_every_documented_benchmark_command_parses(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A benchmark command the README or the docs tell a user to run is accepted by the script as written."""
    _check_parses(command, monkeypatch, capsys)


def test_a_run_draws_the_docs_figure_only_for_the_result_it_shows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A scratch run (``--json`` outside ``benchmarks/results``) draws no figure unless ``--figure`` names one, and
    neither does another stored result of the same script (``local_sgd_ft.json`` beside ``local_sgd.json``), so
    neither overwrites the figure the docs show; the stored result it shows, and ``--plot``, draw it by default."""
    import argparse

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from _launch import RESULTS, parse_or_work

    default, drawn = Path("docs/figures/example.png"), []

    def parsed(*argv: str) -> Any:
        parser = argparse.ArgumentParser()
        parser.add_argument("--json", type=Path)
        monkeypatch.setattr(sys, "argv", ["bench", *argv])
        draw = lambda stored, figure: drawn.append(figure)  # noqa: E731
        return parse_or_work(parser, lambda _: None, draw, figure=default, figure_from="example.json")

    assert parsed("--json", "/tmp/scratch.json").figure is None
    assert parsed().figure is None
    assert parsed("--json", str(RESULTS / "example.json")).figure == default
    assert parsed("--json", str(RESULTS / "example_ft.json")).figure is None
    assert parsed("--json", "/tmp/scratch.json", "--figure", "/tmp/mine.png").figure == Path("/tmp/mine.png")
    assert parsed("--plot", str(RESULTS / "example.json")) is None and drawn == [default]
