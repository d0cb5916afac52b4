"""The step model (``plan.step``) against hand-computed cases, and ``predict``'s ``step_seconds``."""

from __future__ import annotations

import pytest
import torch

from lightning_dp_strategies.plan import (
    CpuCosts,
    Link,
    Reduction,
    Topology,
    Workload,
    buckets_step,
    measure_compute,
    predict,
    ring_step,
)

MB = 1e6
GBE = Link(latency_s=0.0, bandwidth_bytes_per_s=125 * MB)  # 1 Gbit/s, no latency: the bytes alone
FAST = Link(latency_s=0.0, bandwidth_bytes_per_s=1e15)  # inside a node, next to free


def one_bucket(nbytes: float, shapes: list[tuple[int, ...]] | None = None) -> list[tuple[float, list[tuple[int, ...]]]]:
    return [(nbytes, shapes or [])]


def test_a_flat_ring_sends_2_n_minus_1_over_n_of_the_bucket_after_backward() -> None:
    # 4 ranks on 4 nodes, 100 MB, no overlap: 1.5 x 100 MB at 125 MB/s = 1.2 s after 0.1 s of compute
    t = buckets_step(one_bucket(100 * MB), 0.1, 0.0, Topology(4, 1, GBE), Reduction())
    assert t.comm_seconds == pytest.approx(1.2)
    assert t.step_seconds == pytest.approx(1.3)


def test_two_levels_send_one_gradient_over_the_node_link_where_a_flat_ring_sends_one_and_a_half() -> None:
    # 2 nodes x 2 processes: a flat ring crosses each node's link with 2(N-1)/N = 1.5 x 100 MB; two levels send
    # 2(M-1)/M = 1 x 100 MB from a node (its 2 processes each send half a gradient's shard over the shared link)
    topology = Topology(2, 2, GBE, intra=FAST)
    flat = buckets_step(one_bucket(100 * MB), 0.0, 0.0, topology, Reduction())
    two = buckets_step(one_bucket(100 * MB), 0.0, 0.0, topology, Reduction(two_level=True, piece_mb=1e6))
    assert flat.comm_seconds == pytest.approx(1.2)
    assert two.comm_seconds == pytest.approx(0.8)


def test_pieces_let_the_phases_overlap_inside_one_bucket() -> None:
    # inside and across the node equally fast: one piece runs the 3 phases one after the other; 10 pieces pipeline them
    link = Link(0.0, 125 * MB)
    topology = Topology(2, 2, link, intra=link)
    whole = buckets_step(one_bucket(100 * MB), 0.0, 0.0, topology, Reduction(two_level=True, piece_mb=1e6))
    pieces = buckets_step(one_bucket(100 * MB), 0.0, 0.0, topology, Reduction(two_level=True, piece_mb=100 / 10.48576))
    # phases: reduce-scatter 0.4 s, across 0.8 s, all-gather 0.4 s for the whole bucket
    assert whole.comm_seconds == pytest.approx(1.6)
    assert pieces.comm_seconds == pytest.approx(0.04 + 0.8 + 0.04)


def test_bf16_halves_the_wire_and_pays_its_cast() -> None:
    cpu = CpuCosts(cast=1e-9)  # 1 ns per fp32 byte: 0.1 s for 100 MB
    t = buckets_step(one_bucket(100 * MB), 0.0, 0.0, Topology(2, 1, GBE), Reduction("bf16"), cpu)
    assert t.comm_seconds == pytest.approx(100 * MB / 2 / (125 * MB) + 0.1)


def test_powersgd_sends_its_factors_in_two_rounds_and_pays_its_local_work() -> None:
    shapes = [(1000, 1000), (1000,)]
    nbytes = 4 * (1000 * 1000 + 1000)
    cpu = CpuCosts(powersgd=1e-9)
    t = buckets_step(one_bucket(nbytes, shapes), 0.0, 0.0, Topology(2, 1, GBE), Reduction("powersgd", rank=4), cpu)
    sent = 4 * (4 * 2000 + 1000)  # r(n + m) of the matrix, the vector whole
    local = 1e-9 * 4 * 1000 * 1000
    # two rounds, each a ring over 2 ranks of half the payload: 2 x (half of the payload) at 125 MB/s
    assert t.comm_seconds == pytest.approx(local + sent / (125 * MB))


def test_backward_hides_what_ends_before_it() -> None:
    buckets = [(10 * MB, [])] * 10  # 10 buckets of 10 MB, each 0.08 s on the wire between 2 nodes
    t = buckets_step(buckets, compute_seconds=2.0, backward_seconds=1.5, topology=Topology(2, 1, GBE), how=Reduction())
    # bucket k is ready at 0.15 (k + 1) s and done 0.08 s later: all but the last bucket's 0.08 s hidden
    assert t.exposed_seconds == pytest.approx(0.08)
    assert t.step_seconds == pytest.approx(2.08)


def test_local_work_beside_backward_takes_its_cpu_where_the_process_has_no_core_to_spare() -> None:
    # two buckets of one 5000 x 2500 matrix (50 MB, 0.05 s of PowerSGD work each) over a free wire; backward 0.1 s
    # hands the first over at 0.05 s and the second at its end. With a core to spare (overlap 1) the first bucket's
    # work hides behind backward; with none (overlap 0) it takes 0.05 s from backward, which ends (and hands over
    # the second bucket) that much later; half of it at overlap 0.5. The second bucket's work starts when backward
    # is done: it takes nothing from it either way.
    buckets = [(50 * MB, [(5000, 2500)])] * 2
    topology, how = Topology(2, 1, FAST), Reduction("powersgd", rank=1)
    steps = {
        overlap: buckets_step(buckets, 0.2, 0.1, topology, how, CpuCosts(powersgd=1e-9, overlap=overlap))
        for overlap in (1.0, 0.5, 0.0)
    }
    assert steps[1.0].step_seconds == pytest.approx(0.25, abs=1e-6)  # the second bucket's 0.05 s after backward
    assert steps[0.5].step_seconds == pytest.approx(0.275, abs=1e-6)
    assert steps[0.0].step_seconds == pytest.approx(0.30, abs=1e-6)
    assert steps[0.0].exposed_seconds == pytest.approx(0.05, abs=1e-6)  # measured from backward's later end
    last_only = [(50 * MB, [(5000, 2500)])]  # one bucket, handed over as backward ends
    alone = [buckets_step(last_only, 0.2, 0.1, topology, how, CpuCosts(powersgd=1e-9, overlap=o)) for o in (0, 1)]
    assert alone[0].step_seconds == pytest.approx(alone[1].step_seconds)
    with pytest.raises(ValueError, match="`overlap` is a share in"):
        CpuCosts(overlap=1.5)


def test_ring_step_cuts_buckets_as_the_strategies_do() -> None:
    sizes = [4 * 2**20] * 12
    t = ring_step(sizes, [(1024, 1024)] * 12, 0.0, 0.0, Topology(2, 1, GBE), Reduction(), caps=(25.0, 1.0))
    assert t.comm_seconds == pytest.approx(sum(sizes) / (125 * MB))


def test_predict_keeps_its_old_answers_and_adds_a_step_with_compute_seconds() -> None:
    sizes = (4 * 2**20,) * 12
    old = predict("ring_allreduce", Workload(gradient_bytes=sum(sizes), tensor_bytes=sizes), 2, GBE)
    assert old.step_seconds is None and "step_ms" not in old.as_row()
    work = Workload(sum(sizes), tensor_bytes=sizes, compute_seconds=0.05, backward_seconds=0.03)
    new = predict("ring_allreduce", work, 2, GBE)
    assert new.bytes_per_rank == old.bytes_per_rank and new.comm_seconds == old.comm_seconds
    expected = ring_step(sizes, (), 0.05, 0.03, Topology(1, 2, GBE), Reduction())
    assert new.step_seconds == pytest.approx(expected.step_seconds)
    bf16 = predict("ring_allreduce", work, 2, GBE, reduction=Reduction("bf16"))
    assert bf16.step_seconds is not None and bf16.step_seconds < new.step_seconds


def test_with_compute_the_rings_row_is_the_step_it_predicts() -> None:
    """One bucket, handed over when backward ends: nothing of it hides, so the row's exposed time is all of its
    communication and the step is compute plus that (the formula alone would hide backward's 30 ms of it)."""
    sizes = (4 * 2**20, 40 * 1024)
    plain = Workload(sum(sizes), tensor_bytes=sizes)
    formula = predict("ring_allreduce", plain, 2, GBE)
    assert formula.exposed_seconds == pytest.approx(formula.comm_seconds)  # no backward given: nothing hidden
    work = Workload(sum(sizes), tensor_bytes=sizes, compute_seconds=0.05, backward_seconds=0.03)
    row = predict("ring_allreduce", work, 2, GBE)
    assert row.step_seconds == pytest.approx(0.05 + row.exposed_seconds)
    assert row.exposed_seconds == pytest.approx(row.comm_seconds) and row.exposed_seconds > formula.comm_seconds - 0.03
    assert (row.bytes_per_rank, row.messages_per_rank) == (formula.bytes_per_rank, formula.messages_per_rank)


def test_other_strategies_add_compute_to_their_exposed_time() -> None:
    work = Workload(gradient_bytes=10**6, compute_seconds=0.2)
    p = predict("scatter_gather", work, 2, GBE)
    assert p.step_seconds == pytest.approx(0.2 + p.exposed_seconds)


def test_a_topology_of_another_size_a_reduction_of_another_strategy_and_bad_values_are_refused() -> None:
    work = Workload(gradient_bytes=10**6, compute_seconds=0.1, topology=Topology(2, 2, GBE))
    with pytest.raises(ValueError, match="predict at world_size=4"):
        predict("ring_allreduce", work, 8, GBE)
    with pytest.raises(ValueError, match="`reduction` applies to bucketed strategies"):
        predict("scatter_gather", Workload(gradient_bytes=10**6), 2, GBE, reduction=Reduction("bf16"))
    with pytest.raises(ValueError, match="no two-level form"):
        Reduction("powersgd", two_level=True)
    with pytest.raises(ValueError, match="Unknown compression 'fp8'"):
        Reduction("fp8")
    with pytest.raises(ValueError, match="`per_node` must be an integer >= 1"):
        Topology(2, 0, GBE)
    with pytest.raises(ValueError, match="CpuCosts `add` must be >= 0"):
        CpuCosts(add=-1.0)
    with pytest.raises(ValueError, match="cannot exceed compute_seconds"):
        buckets_step(one_bucket(MB), 0.1, 0.2, Topology(2, 1, GBE), Reduction())


def test_measure_compute_times_a_copy_and_leaves_the_module_alone() -> None:
    net = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    before = [p.detach().clone() for p in net.parameters()]
    times = measure_compute(net, torch.randn(16, 32), loss_fn=lambda m, x: m(x).square().mean(), steps=3, warmup=1)
    assert times.forward > 0 and times.backward > 0 and times.optimizer > 0
    assert times.total == pytest.approx(times.forward + times.backward + times.optimizer)
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))
    assert all(p.grad is None for p in net.parameters())


def test_a_probed_link_holds_the_rings_fp32_adds_so_they_are_not_priced_again() -> None:
    cpu = CpuCosts(add=1e-9)  # would be 0.05 s more for 100 MB summed by 2 ranks, were it charged
    t = buckets_step(one_bucket(100 * MB), 0.0, 0.0, Topology(2, 1, GBE), Reduction(), cpu)
    assert t.comm_seconds == pytest.approx(100 * MB / (125 * MB))


def test_bf16_pays_what_its_16_bit_adds_cost_beyond_fp32s() -> None:
    cpu = CpuCosts(add=1e-10, add_low=5e-10)  # per byte summed: 4e-10 more for bf16
    t = buckets_step(one_bucket(100 * MB), 0.0, 0.0, Topology(2, 1, GBE), Reduction("bf16"), cpu)
    summed = 1 / 2 * 50 * MB  # (N - 1) / N of the 50 MB of bf16 on the wire
    assert t.comm_seconds == pytest.approx(50 * MB / (125 * MB) + summed * 4e-10)


def test_two_level_phases_take_turns_on_the_cpu_where_it_sets_the_pace() -> None:
    # the case of test_pieces_let_the_phases_overlap_inside_one_bucket, with every ring keeping the CPU busy the
    # whole time: the three phases of each piece run one after the other (0.04 + 0.08 + 0.04 s a piece, 10 pieces)
    link = Link(0.0, 125 * MB)
    how = Reduction(two_level=True, piece_mb=100 / 10.48576)
    free = buckets_step(one_bucket(100 * MB), 0.0, 0.0, Topology(2, 2, link, intra=link), how)
    busy = Topology(2, 2, link, intra=link, inter_busy=1.0, intra_busy=1.0)
    turns = buckets_step(one_bucket(100 * MB), 0.0, 0.0, busy, how)
    assert free.comm_seconds == pytest.approx(0.04 + 0.8 + 0.04)
    assert turns.comm_seconds == pytest.approx(1.6)
    # the hop across nodes busy half its time: 0.04 + 0.04 + 0.04 s of CPU a piece, 1.2 s for ten, still more than
    # the 0.88 s pipeline; busy 5% of its time (0.84 s of CPU in all), the pipeline sets the pace again
    half = Topology(2, 2, link, intra=link, inter_busy=0.5, intra_busy=1.0)
    assert buckets_step(one_bucket(100 * MB), 0.0, 0.0, half, how).comm_seconds == pytest.approx(1.2)
    light = Topology(2, 2, link, intra=link, inter_busy=0.05, intra_busy=1.0)
    assert buckets_step(one_bucket(100 * MB), 0.0, 0.0, light, how).comm_seconds == pytest.approx(0.88)


def test_the_flat_ring_runs_at_the_flat_link_where_one_was_measured() -> None:
    flat = Link(0.0, 62.5 * MB)  # every rank in the ring: half of what one stream a node got
    topology = Topology(2, 2, GBE, intra=FAST, flat=flat)
    t = buckets_step(one_bucket(100 * MB), 0.0, 0.0, topology, Reduction())
    assert t.comm_seconds == pytest.approx(1.5 * 100 * MB / (62.5 * MB))
    assert Topology(2, 2, GBE).flat_link == GBE and Topology(1, 2, GBE, intra=FAST).flat_link == FAST


def test_two_levels_with_one_process_a_node_run_a_ring_per_piece() -> None:
    # the reducer cuts a bucket into pieces whatever the layout: 100 MB in 4 MiB pieces are 24 rings of 2 messages
    link = Link(latency_s=1e-3, bandwidth_bytes_per_s=125 * MB)
    topology = Topology(2, 1, link)
    flat = buckets_step(one_bucket(100 * MB), 0.0, 0.0, topology, Reduction())
    two = buckets_step(one_bucket(100 * MB), 0.0, 0.0, topology, Reduction(two_level=True, piece_mb=4.0))
    assert flat.comm_seconds == pytest.approx(0.8 + 2e-3)
    assert two.comm_seconds == pytest.approx(0.8 + 24 * 2e-3)


def test_a_busy_share_outside_0_and_1_is_refused() -> None:
    with pytest.raises(ValueError, match=r"Topology `intra_busy` is a share of a ring's time in \[0, 1\], got 1.5"):
        Topology(2, 2, GBE, intra_busy=1.5)
