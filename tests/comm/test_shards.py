"""The ring's halves on their own: each rank's owned chunk after the reduce-scatter equals the backend's all-reduce
there, and the all-gather hands every rank every owned chunk (gloo, 2 and 3 ranks, with and without the duplex)."""

from __future__ import annotations

import pytest
import torch

from lightning_dp_strategies.comm import (
    CommCounter,
    chunk_range,
    new_duplex_group,
    owned_chunk,
    reference_all_reduce,
    ring_all_gather_flat,
    ring_reduce_scatter_flat,
)
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.numerics

# shorter than the world, odd, and one large enough to move in several pieces (8 MiB chunks)
LENGTHS = (0, 1, 5, 1001, 4_200_001)


def _halves(rank: int, world_size: int, use_duplex: bool) -> None:
    duplex = new_duplex_group() if use_duplex else None
    for length in LENGTHS:
        gen = torch.Generator().manual_seed(100 * rank + length)
        data = torch.randn(length, generator=gen)
        expected = reference_all_reduce(data.clone().double(), "avg")
        counter = CommCounter()
        start, stop = ring_reduce_scatter_flat(data, average=True, counter=counter, duplex=duplex)
        assert (start, stop) == chunk_range(length, world_size, owned_chunk(rank, world_size))
        torch.testing.assert_close(data[start:stop].double(), expected[start:stop], rtol=1e-6, atol=1e-6)
        # reduce-scatter sends (N-1)/N of the bytes, the all-gather as much again: together an all-reduce
        half = (world_size - 1) / world_size * length * 4
        assert abs(counter.bytes_sent - half) < world_size * 4, (counter, half)
        gathered = torch.full((length,), float("nan"))
        gathered[start:stop] = data[start:stop]
        ring_all_gather_flat(gathered, counter=counter, duplex=duplex)
        torch.testing.assert_close(gathered.double(), expected, rtol=1e-6, atol=1e-6)
        assert abs(counter.bytes_sent - 2 * half) < 2 * world_size * 4, (counter, half)


@pytest.mark.parametrize(("world_size", "use_duplex"), [(2, False), (2, True), (3, False)])
@pytest.mark.timeout(180)
def test_reduce_scatter_then_all_gather_equal_the_all_reduce(world_size: int, use_duplex: bool) -> None:
    run_distributed(_halves, world_size, use_duplex)


def test_chunks_cover_the_tensor_once_and_every_rank_owns_one() -> None:
    for numel in (0, 1, 7, 10, 1001):
        for world in (1, 2, 3, 4):
            ranges = [chunk_range(numel, world, i) for i in range(world)]
            assert [len(c) for c in torch.arange(numel).tensor_split(world)] == [b - a for a, b in ranges]
            assert ranges[0][0] == 0 and ranges[-1][1] == numel
            assert all(ranges[i][1] == ranges[i + 1][0] for i in range(world - 1))
            assert sorted(owned_chunk(r, world) for r in range(world)) == list(range(world))
