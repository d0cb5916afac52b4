"""The shard layout: every element of every bucket is stepped by exactly one rank, the one the ring's
reduce-scatter leaves it reduced on."""

from __future__ import annotations

import pytest
import torch
from torch.nn import Parameter

from lightning_dp_strategies.comm import chunk_range, owned_chunk
from lightning_dp_strategies.sharding import ShardLayout


def _buckets(*shapes_per_bucket: list[tuple[int, ...]]) -> list[list[Parameter]]:
    return [[Parameter(torch.zeros(shape)) for shape in shapes] for shapes in shapes_per_bucket]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_every_element_is_stepped_once_by_the_rank_that_owns_its_chunk(world: int) -> None:
    buckets = _buckets([(3, 5), (1,), (2, 2)], [(7,)], [()])  # a scalar parameter, a bucket smaller than the world
    layout = ShardLayout(buckets, world)
    for b, params in enumerate(buckets):
        numel = sum(p.numel() for p in params)
        covered = torch.zeros(numel, dtype=torch.long)
        for piece in (p for p in layout.pieces if p.bucket == b):
            covered[piece.offset : piece.offset + piece.numel] += 1
            lo, hi = chunk_range(numel, world, owned_chunk(piece.rank, world))
            assert lo <= piece.offset and piece.offset + piece.numel <= hi, piece
        assert covered.tolist() == [1] * numel
    for i, param in enumerate(layout.params):
        pieces = layout.pieces_of_param(i)
        assert [p.start for p in pieces] == [0, *(p.stop for p in pieces[:-1])]
        assert pieces[-1].stop == param.numel()
    assert sum(layout.owned_fraction(r) for r in range(world)) == pytest.approx(1.0)


def test_a_parameter_on_a_chunk_boundary_is_cut_between_two_ranks() -> None:
    layout = ShardLayout(_buckets([(2, 4), (2,)]), world_size=2)  # 10 elements, chunks [0:5] and [5:10]
    cut = layout.pieces_of_param(0)
    assert [(p.rank, p.start, p.stop) for p in cut] == [(1, 0, 5), (0, 5, 8)]
    assert [(p.rank, p.start, p.stop, p.offset) for p in layout.pieces_of_param(1)] == [(0, 0, 2, 8)]
