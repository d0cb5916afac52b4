"""The planner's bytes under a reduction (``plan.buckets_traffic``, the figures ``predict`` shows for a reduction)
against what the reducers themselves count sending, on 4 gloo processes: one flat ring, or 2 nodes of 2."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_dp_strategies.plan import Link, Reduction, Topology, buckets_traffic
from lightning_dp_strategies.reducers import GradBucket, PowerSGD, RingReducer, bf16_compress, setup_reducer
from lightning_dp_strategies.reducers.base import close_reducer
from lightning_dp_strategies.reducers.two_level import TwoLevelReducer
from tests.helpers.distributed import run_distributed

SHAPES = [torch.Size([64, 48]), torch.Size([48])]
"""A matrix PowerSGD compresses and a bias it sends whole: 3120 values, divisible by every chunk count here."""
LINK = Link(latency_s=0.0, bandwidth_bytes_per_s=1.25e8)

CASES = {
    "flat plain": (lambda: RingReducer(), Reduction(), 1),
    "flat bf16": (lambda: bf16_compress("ring"), Reduction("bf16"), 1),
    "flat powersgd r2": (lambda: PowerSGD("ring", rank=2), Reduction("powersgd", rank=2), 1),
    "two-level plain": (lambda: TwoLevelReducer(per_node=2), Reduction(two_level=True), 2),
    "two-level bf16": (lambda: TwoLevelReducer(2, bf16_compress("ring")), Reduction("bf16", two_level=True), 2),
}


def _count(rank: int, world_size: int, case: str) -> None:
    make, how, per_node = CASES[case]
    reducer = make()
    setup_reducer(reducer, None, list(range(world_size)))
    numel = sum(s.numel() for s in SHAPES)
    bucket = GradBucket(torch.randn(numel, generator=torch.Generator().manual_seed(rank)), shapes=list(SHAPES))
    reducer(bucket).wait()
    sent = torch.tensor([float(bucket.counter.bytes_sent)], dtype=torch.float64)
    dist.all_reduce(sent)  # PowerSGD's factors split into uneven chunks: the ranks' total is exact
    topology = Topology(nodes=world_size // per_node, per_node=per_node, inter=LINK, intra=LINK)
    predicted, _ = buckets_traffic([(4.0 * numel, SHAPES)], topology, how)
    assert sent.item() == pytest.approx(world_size * predicted, rel=1e-12), (case, bucket.counter)
    if case != "flat plain":  # each case sends other bytes than the plain ring: the comparison can tell them apart
        plain, _ = buckets_traffic([(4.0 * numel, SHAPES)], topology, Reduction())
        assert predicted != plain or how.two_level
    close_reducer(reducer)
    dist.barrier()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.timeout(120)
def test_predicted_bytes_are_what_the_reducer_counts(case: str) -> None:
    run_distributed(_count, 4, case)
