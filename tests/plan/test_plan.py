"""The cost model: its formulas against literal values and the package's own code, then against measurement."""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_dp_strategies.bucketing import assign_buckets
from lightning_dp_strategies.comm import CommCounter, ring_all_reduce
from lightning_dp_strategies.pipeline import clock_table, table_bubble
from lightning_dp_strategies.plan import (
    STRATEGIES,
    Link,
    MiB,
    Workload,
    bucket_count,
    format_table,
    plan,
    predict,
)
from tests.helpers.distributed import run_distributed

UNIT = Link(latency_s=0.0, bandwidth_bytes_per_s=1.0)  # comm_seconds == bytes
ONE_BUCKET = {"bucket_cap_mb": 1e6, "first_bucket_cap_mb": 1e6}


# ------------------------------------------------------------------------------------------------ ring_allreduce
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8, 64, 512])
def test_ring_sends_2_n_minus_1_over_n_of_the_bytes_in_2_n_minus_1_steps_per_bucket(world: int) -> None:
    nbytes = 512 * 3 * 5 * 7 * 1000  # divisible by every world here
    p = predict("ring_allreduce", Workload(gradient_bytes=nbytes), world, UNIT)
    assert p.bytes_per_rank == Fraction(2 * (world - 1), world) * nbytes
    assert p.comm_seconds == p.bytes_per_rank
    buckets = 1 + -(-(nbytes - MiB) // (25 * MiB))
    assert p.messages_per_rank == buckets * 2 * (world - 1)
    latency_only = predict("ring_allreduce", Workload(gradient_bytes=nbytes), world, Link(1e-3, 1e30))
    assert latency_only.comm_seconds == pytest.approx(buckets * 2 * (world - 1) * 1e-3)
    assert p.bubble_fraction == 0.0 and p.stages == 1


def test_ring_time_is_alpha_times_steps_plus_bytes_over_beta() -> None:
    link = Link(latency_s=5e-6, bandwidth_bytes_per_s=2e10)
    p = predict("ring_allreduce", Workload(gradient_bytes=100 * MiB), 8, link)
    # 100 MiB: a 1 MiB first bucket, then 4 of <= 25 MiB; 2 * 7 steps each; 14/8 of the bytes
    assert p.messages_per_rank == 5 * 14
    assert p.comm_seconds == pytest.approx(70 * 5e-6 + 14 / 8 * 100 * MiB / 2e10, rel=1e-12)


def test_backward_hides_ring_communication_up_to_its_length() -> None:
    link = Link(latency_s=0.0, bandwidth_bytes_per_s=1e9)
    work = Workload(gradient_bytes=10**9, backward_seconds=0.5)  # 1 s of traffic at world 2
    p = predict("ring_allreduce", work, 2, link, **ONE_BUCKET)
    assert (p.comm_seconds, p.exposed_seconds) == (pytest.approx(1.0), pytest.approx(0.5))
    hidden = predict("ring_allreduce", Workload(gradient_bytes=10**8, backward_seconds=0.5), 2, link)
    assert hidden.exposed_seconds == 0.0


def test_bucket_count_forms_buckets_as_assign_buckets_does() -> None:
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.choice([1, 100, 40_000, 300_000, 2_000_000]) * 4 for _ in range(rng.randint(1, 30))]
        cap, first = rng.choice([1.0, 2.5, 25.0]), rng.choice([0.5, 1.0])
        tensors = [torch.empty(n // 4) for n in sizes]
        assert bucket_count(sizes, cap, first) == len(assign_buckets(tensors, cap, first)), (sizes, cap, first)
    assert bucket_count(0) == 0 and bucket_count(MiB) == 1 and bucket_count(MiB + 1) == 2
    assert bucket_count(26 * MiB) == 2 and bucket_count(26 * MiB + 1) == 3


def test_workload_from_module_counts_buckets_per_parameter() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(1000, 1000), torch.nn.Linear(1000, 10))  # 4.0 MB, 4 tensors
    work = Workload.from_module(model, batch_size=8)
    assert work.gradient_bytes == 4 * sum(p.numel() for p in model.parameters())
    p = predict("ring_allreduce", work, 2, UNIT)
    # one bucket: the first takes the three small tensors and the 4 MB weight that takes it past its 1 MiB cap
    assert p.messages_per_rank == 2 * len(assign_buckets(list(model.parameters()))) == 2


# ------------------------------------------------------------------------------------------------ scatter_gather
def test_scatter_gather_root_sends_and_receives_replicas_batch_and_gradients() -> None:
    work = Workload(
        gradient_bytes=1000, parameter_bytes=1200, batch_size=8, input_bytes_per_sample=10, output_bytes_per_sample=5
    )
    p = predict("dp", work, 4, UNIT)
    assert p.strategy == "scatter_gather"
    assert p.bytes_per_rank == 3 * (1200 + 1000) + 8 * 15 * 3 / 4
    assert p.messages_per_rank == 4 * 3
    assert predict("scatter_gather", work, 1, UNIT).comm_seconds == 0.0


# ------------------------------------------------------------------------------------------------ hybrid_pipeline
# (S, M) -> bubble (S-1)/(M+S-1)
BUBBLES = {(1, 1): 0, (2, 1): Fraction(1, 2), (2, 4): Fraction(1, 5), (4, 4): Fraction(3, 7), (4, 16): Fraction(3, 19)}


@pytest.mark.parametrize(("stages", "micro_batches"), list(BUBBLES))
def test_pipeline_bubble_matches_the_literal_table_and_the_simulated_clock(stages: int, micro_batches: int) -> None:
    p = predict("hybrid_pipeline", Workload(gradient_bytes=0), 2 * stages, UNIT, stages, micro_batches)
    assert p.bubble_fraction == pytest.approx(float(BUBBLES[stages, micro_batches]), abs=1e-15)
    for schedule in ("gpipe", "1f1b"):
        if schedule == "1f1b" and micro_batches < stages:
            continue
        assert p.bubble_fraction == pytest.approx(table_bubble(clock_table(schedule, stages, micro_batches)))


@pytest.mark.parametrize(("stages", "hops"), [(1, 0), (2, 1), (3, 2), (8, 2)])
def test_pipeline_p2p_and_per_stage_gradient_ring(stages: int, hops: int) -> None:
    work = Workload(gradient_bytes=stages * 6 * 1000, batch_size=16, activation_bytes_per_sample=100)
    p = predict("hybrid_pipeline", work, stages * 3, UNIT, stages, micro_batches=4, **ONE_BUCKET)
    # busiest stage: M forwards out and M gradients back (one direction at the ends), then a ring over D=3 replicas
    assert p.messages_per_rank == hops * 4 + 2 * 2
    assert p.bytes_per_rank == pytest.approx(hops * 16 * 100 + 4 / 3 * 6 * 1000)
    alone = predict("hybrid_pipeline", work, stages, UNIT, stages, micro_batches=4)  # D = 1: no gradient traffic
    assert alone.bytes_per_rank == hops * 16 * 100


# ------------------------------------------------------------------------------------------------ Link.fit
def test_link_fit_recovers_latency_and_bandwidth() -> None:
    true = Link(latency_s=3e-5, bandwidth_bytes_per_s=1.2e9)
    shapes = [(2, 64 * 1024), (4, 256 * 1024), (2, 4 * MiB), (4, 64 * MiB), (8, 1024)]
    fitted = Link.fit([(m, b, true.seconds(m, b)) for m, b in shapes])
    assert fitted.latency_s == pytest.approx(3e-5, rel=1e-9)
    assert fitted.bandwidth_bytes_per_s == pytest.approx(1.2e9, rel=1e-9)
    rng = random.Random(1)  # 5 % multiplicative noise: within 10 %
    noisy = Link.fit([(m, b, true.seconds(m, b) * rng.uniform(0.95, 1.05)) for m, b in shapes * 4])
    assert noisy.latency_s == pytest.approx(3e-5, rel=0.1)
    assert noisy.bandwidth_bytes_per_s == pytest.approx(1.2e9, rel=0.1)


def test_link_fit_clamps_a_negative_latency_to_zero() -> None:
    fitted = Link.fit([(2, 1e6, 0.9e-3), (2, 1e7, 1.0e-2)])  # the line through them crosses below zero
    assert fitted.latency_s == 0.0 and fitted.bandwidth_bytes_per_s == pytest.approx(1e9, rel=0.1)


# ------------------------------------------------------------------------------------------------ plan, table
def test_plan_predicts_every_strategy_at_every_world_size_and_formats_a_table() -> None:
    rows = plan(Workload(gradient_bytes=400 * MiB), Link(5e-6, 2.5e10))
    assert [(p.strategy, p.world_size) for p in rows] == [(s, w) for w in (8, 64, 512) for s in STRATEGIES]
    table = format_table(rows).splitlines()
    assert len(table) == 10 and table[0].split()[:2] == ["strategy", "world"]
    assert format_table([]) == ""
    ring = [p for p in rows if p.strategy == "ring_allreduce"]
    dp = [p for p in rows if p.strategy == "scatter_gather"]
    assert ring[0].bytes_per_rank < ring[-1].bytes_per_rank < 2 * 400 * MiB  # bounded in N
    assert dp[-1].bytes_per_rank / dp[0].bytes_per_rank == pytest.approx(511 / 7)  # linear in N


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: predict("ring_allreduce", Workload(gradient_bytes=1), 0, UNIT), "world_size must be an integer >= 1"),
        (lambda: predict("hybrid_pipeline", Workload(gradient_bytes=1), 6, UNIT, 4), r"pick stages from \[1, 2, 3, 6"),
        (lambda: predict("ring_allreduce", Workload(gradient_bytes=1), 4, UNIT, 2), "'hybrid_pipeline' only"),
        (lambda: predict("hybrid_pipeline", Workload(gradient_bytes=1), 4, UNIT, 2, 0), "micro_batches must be >= 1"),
        (lambda: predict("ddp", Workload(gradient_bytes=1), 4, UNIT), "choose one of ring_allreduce"),
        (lambda: Link(1e-6, 0.0), "Link.fit"),
        (lambda: Link(1e-6, -1.0), "positive, finite"),
        (lambda: Link(-1.0, 1e9), "latency must be >= 0"),
        (lambda: Link.fit([(2, 100, 1e-3)]), "two or more"),
        (lambda: Workload(gradient_bytes=-1), "must be >= 0"),
        (lambda: Workload(gradient_bytes=10, tensor_bytes=(4, 4)), "from_module"),
        (lambda: bucket_count(10, bucket_cap_mb=0), "bucket caps must be > 0"),
    ],
)
def test_bad_input_names_the_fix(call: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()  # type: ignore[operator]


# ------------------------------------------------------------------------------------------------ vs ring_all_reduce
def _count(rank: int, world_size: int) -> None:
    from lightning_dp_strategies.comm import ring

    piece = ring.PIPELINE_PIECE_BYTES // 4
    for numel in (world_size * 1000, world_size * 2 * piece, 1001):  # 2 pieces per chunk: every step sends 2 messages
        counter = CommCounter()
        ring_all_reduce(torch.ones(numel), "sum", counter=counter)
        model = predict("ring_allreduce", Workload(gradient_bytes=4 * numel), world_size, UNIT, **ONE_BUCKET)
        if numel % world_size == 0:  # equal chunks: every rank sends exactly the model's bytes
            assert counter.bytes_sent == model.bytes_per_rank, (numel, counter)
        total = torch.tensor([counter.bytes_sent], dtype=torch.float64)  # uneven chunks: the ranks' total is exact
        dist.all_reduce(total)
        assert total.item() == pytest.approx(world_size * model.bytes_per_rank, abs=1e-6)
        # the model counts ring steps; a chunk of P pieces moves as P messages per step
        pieces = ring._pieces(torch.ones(numel).tensor_split(world_size)[0])
        assert counter.messages == model.messages_per_rank * pieces, (numel, pieces, counter)
        assert (pieces > 1) == (numel == world_size * 2 * piece)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.timeout(120)
def test_commcounter_counts_what_the_model_predicts(world_size: int) -> None:
    run_distributed(_count, world_size)


SIZES = tuple(MiB * 2**k for k in range(6))  # 1 MiB .. 32 MiB: large enough for the scheduler's noise to matter less
CALIBRATION_SIZES = (1 * MiB, 4 * MiB, 16 * MiB)  # world 2 only; the rest of world 2 and all of world 3 are predicted
TOLERANCE = 1.5


def _time_pair_and_triple(rank: int, world_size: int, out: str, repeats: int) -> None:
    torch.set_num_threads(1)
    pair = dist.new_group([0, 1])
    data = {nbytes: torch.randn(nbytes // 4) for nbytes in SIZES}
    seconds: dict[tuple[int, int], list[float]] = {(n, b): [] for n in (2, 3) for b in SIZES}
    counters = {key: CommCounter() for key in seconds}
    for repeat in range(repeats + 1):  # the first round is warm-up
        for nbytes in SIZES:  # round robin over sizes and world sizes: background load hits all alike
            for n, group in ((2, pair), (3, None)):
                dist.barrier()
                start = time.perf_counter()
                if rank < n:
                    counter = counters[n, nbytes] if repeat else None
                    ring_all_reduce(data[nbytes], "avg", group=group, counter=counter)
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # done when the slowest rank is
                if repeat:
                    seconds[n, nbytes].append(elapsed.item())
    results = []
    for (n, nbytes), times in seconds.items():
        sent = torch.tensor([counters[n, nbytes].bytes_sent / repeats if rank < n else 0.0], dtype=torch.float64)
        dist.all_reduce(sent, op=dist.ReduceOp.MAX)
        results.append({"world": n, "bytes": nbytes, "sent": sent.item(), "seconds": min(times)})
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def _predicted_over_measured(rows: list[dict[str, float]]) -> tuple[dict[int, float], str]:
    """Fit the link on world 2's calibration sizes; per world, the median of predicted / measured over the rest."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    calibration = [r for r in rows if r["world"] == 2 and r["bytes"] in CALIBRATION_SIZES]
    link = Link.fit([(2, r["sent"], r["seconds"]) for r in calibration])
    ratios: dict[int, list[float]] = {2: [], 3: []}
    report = [f"fitted {link} on {cores} cores"]
    for r in rows:
        if r in calibration:
            continue
        p = predict("ring_allreduce", Workload(gradient_bytes=int(r["bytes"])), int(r["world"]), link, **ONE_BUCKET)
        predicted = p.comm_seconds / min(1.0, cores / r["world"])
        ratios[int(r["world"])].append(predicted / r["seconds"])
        report.append(f"world {r['world']} {r['bytes']:>9} B: predicted {predicted:.5f} s, measured {r['seconds']:.5f}")
    return {world: statistics.median(values) for world, values in ratios.items()}, "\n".join(report)


@pytest.mark.skipif(
    not os.environ.get("LDPS_TIMING_TESTS"),
    reason="asserts on wall time, which the default suite never does: run with LDPS_TIMING_TESTS=1 "
    "(benchmarks/bench_plan.py prints the same comparison)",
)
@pytest.mark.timeout(300)
def test_prediction_lands_within_a_factor_of_1_5_of_measured_ring_all_reduce(tmp_path: Path) -> None:
    """Fit a Link on world 2 at 1, 4 and 16 MiB; predict 2, 8, 32 MiB at world 2 and 1-32 MiB at world 3.

    Measured: ``ring_all_reduce`` (fp32, one bucket) on a 3-process gloo group and its 2-rank subgroup, round robin
    over sizes and world sizes so background load hits all alike; the fastest of 7 calls each (the least disturbed).
    The link is fitted against what was *counted* (the bytes ``CommCounter`` saw, in 2(N-1) ring steps), not against
    the model, so a wrong bytes formula is not calibrated away. Ranks beyond the machine's cores share them
    (loopback copies are the cores' work): predictions are divided by ``min(1, cores / N)``.

    Tolerance: at each world size the median over sizes of predicted / measured lies within ``[1/1.5, 1.5]``
    (generous: observed 0.71-1.38 on 2 cores under a load average of 4-7), in one of up to 3 measurement rounds
    (a round disturbed by other processes is measured again). A model sending N x the bytes per rank instead of
    2(N-1)/N is 2x off at world 2 and 2.25x at world 3 (observed 1.8-2.1 and 2.8-3.3), one sending (N-1)/N (no
    all-gather) 0.5x (observed 0.49-0.59 at world 2): outside. ``test_commcounter_counts_what_the_model_predicts``
    is exact and catches what timing cannot.
    """
    reports = []
    for attempt in range(3):
        out = tmp_path / f"times{attempt}.json"
        run_distributed(_time_pair_and_triple, 3, str(out), 7, timeout=90)
        medians, report = _predicted_over_measured(json.loads(out.read_text()))
        reports.append(f"round {attempt}: predicted/measured medians {medians}\n{report}")
        if all(1 / TOLERANCE <= m <= TOLERANCE for m in medians.values()):
            return
    pytest.fail("\n".join(reports))


def test_a_strategy_class_brings_its_own_cost_model_so_subclasses_plan_like_their_base() -> None:
    from lightning_dp_strategies import HybridPipelineStrategy, RingAllReduceStrategy, ScatterGatherStrategy
    from lightning_dp_strategies.plan import cost_model_of

    class MyRing(RingAllReduceStrategy):  # a user's subclass, registered under any name
        pass

    work = Workload(gradient_bytes=64 * MiB)
    mine, builtin = predict(MyRing, work, 8, UNIT), predict("ring_allreduce", work, 8, UNIT)
    assert mine.strategy == "MyRing" and (mine.bytes_per_rank, mine.comm_seconds) == (
        builtin.bytes_per_rank,
        builtin.comm_seconds,
    )
    assert cost_model_of(ScatterGatherStrategy).name == "scatter_gather"
    assert cost_model_of(HybridPipelineStrategy).pipelined
    rows = plan(work, UNIT, world_sizes=(8,), strategies=[MyRing, HybridPipelineStrategy], stages=4, micro_batches=8)
    assert [(p.strategy, p.stages) for p in rows] == [("MyRing", 1), ("HybridPipelineStrategy", 4)]
    with pytest.raises(ValueError, match="has no `cost_model`"):
        predict(object, work, 8, UNIT)


def test_bucket_count_is_the_number_of_buckets_the_strategies_build() -> None:
    """The cost model counts buckets with the function that cuts real parameters into buckets: they cannot drift."""
    from lightning_dp_strategies.bucketing import assign_buckets

    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        numels = torch.randint(1, 600_000, (int(torch.randint(1, 30, (1,), generator=generator)),), generator=generator)
        tensors = [torch.empty(int(n)) for n in numels]
        sizes = [t.numel() * t.element_size() for t in tensors]
        assert bucket_count(sizes, 2, 0.5) == len(assign_buckets(tensors, 2, 0.5))
