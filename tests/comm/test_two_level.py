"""The two-level all-reduce against the backend's own all-reduce (the oracle), and what it sends across nodes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_dp_strategies.comm import CommCounter, reference_all_reduce
from lightning_dp_strategies.comm.two_level import NodeLayout, new_two_level_groups, two_level_all_reduce
from lightning_dp_strategies.reducers import GradBucket, bf16_compress, setup_reducer
from lightning_dp_strategies.reducers.two_level import TwoLevelReducer
from tests.helpers.distributed import run_distributed

# numerically sensitive: CI runs this file again under other CPU kernel paths and thread counts
pytestmark = pytest.mark.numerics

LENGTHS = (1, 3, 7, 1001)


def _check_against_oracle(rank: int, world_size: int, nodes: int) -> None:
    groups = new_two_level_groups(NodeLayout(nodes, world_size // nodes))
    for length in LENGTHS:
        for op in ("sum", "avg"):
            data = torch.randn(length, generator=torch.Generator().manual_seed(100 * rank + length))
            expected = reference_all_reduce(data.clone().double(), op)
            counter = CommCounter()
            assert two_level_all_reduce(data, op, groups, counter) is data
            torch.testing.assert_close(data.double(), expected, rtol=1e-6, atol=1e-6, msg=f"{length} {op}")
            assert counter.operations == 1 and counter.inter_node_bytes <= counter.bytes_sent


@pytest.mark.parametrize("nodes", [1, 2, 4])
@pytest.mark.timeout(180)
def test_two_level_all_reduce_matches_the_oracle(nodes: int) -> None:
    run_distributed(_check_against_oracle, 4, nodes)


def _check_bytes(rank: int, world_size: int) -> None:
    nodes, per_node = 2, 2
    groups = new_two_level_groups(NodeLayout(nodes, per_node))
    data = torch.ones(1000)  # 4000 bytes, shards of 2000
    counter = CommCounter()
    two_level_all_reduce(data, "sum", groups, counter)
    assert torch.equal(data, torch.full_like(data, world_size))
    # across nodes: 2(n-1)/n of one shard; inside the node: 2(L-1)/L of the tensor
    assert counter.inter_node_bytes == 2 * (nodes - 1) / nodes * 2000
    assert counter.bytes_sent - counter.inter_node_bytes == 2 * (per_node - 1) / per_node * 4000


@pytest.mark.timeout(120)
def test_a_rank_sends_one_shard_across_nodes_so_a_node_sends_the_tensor_once() -> None:
    """2 nodes x 2 processes: each node sends 2 x 1000 bytes across, 1x the tensor (a flat ring: 1.5x)."""
    run_distributed(_check_bytes, 4)


def _check_reducer(rank: int, world_size: int, compress: bool) -> None:
    reducer = TwoLevelReducer(per_node=2, inter_node=bf16_compress("ring") if compress else None)
    setup_reducer(reducer, None, list(range(world_size)))
    data = torch.randn(257, generator=torch.Generator().manual_seed(rank))
    expected = reference_all_reduce(data.clone().double(), "sum")
    bucket = GradBucket(data, op="sum")
    reducer(bucket).wait()
    tol = 3e-2 if compress else 1e-6  # bf16 across nodes: about 1e-2 relative per element
    torch.testing.assert_close(data.double(), expected, rtol=tol, atol=tol)
    # local rank l owns shard (l + 1) % 2 of 129 + 128 elements; across 2 nodes a ring sends it once, bf16 at half
    shard_bytes = 4 * 128 if rank % 2 == 0 else 4 * 129
    assert bucket.counter.inter_node_bytes == shard_bytes // (2 if compress else 1)
    reducer.close()
    dist.barrier()


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.timeout(120)
def test_the_reducer_compresses_only_the_hop_across_nodes(compress: bool) -> None:
    run_distributed(_check_reducer, 4, compress)


def _check_buckets_in_flight(rank: int, world_size: int, piece_mb: float) -> None:
    reducer = TwoLevelReducer(per_node=2, piece_mb=piece_mb)
    setup_reducer(reducer, None, list(range(world_size)))
    for _ in range(3):  # each bucket's phases overlap the next one's: all launched before any is waited for
        data = [torch.randn(n, generator=torch.Generator().manual_seed(10 * rank + n)) for n in (1001, 7, 4096, 64)]
        expected = [reference_all_reduce(d.clone().double(), "avg") for d in data]
        buckets = [GradBucket(d, op="avg", index=i) for i, d in enumerate(data)]
        futures = [reducer(b) for b in buckets]
        for future, bucket, want in zip(futures, buckets, expected, strict=True):
            assert future.wait() is bucket.buffer
            torch.testing.assert_close(bucket.buffer.double(), want, rtol=1e-6, atol=1e-6)
            assert bucket.counter.operations == 1 and bucket.counter.inter_node_bytes > 0
    reducer.close()
    dist.barrier()


@pytest.mark.parametrize("piece_mb", [4.0, 0.001])
@pytest.mark.timeout(120)
def test_buckets_in_flight_at_once_each_reduce_to_the_average(piece_mb: float) -> None:
    """The phases of consecutive buckets run at the same time on their own threads and groups; with pieces of 1048
    bytes, the larger buckets go through the phases in several pieces, each bucket still one operation."""
    run_distributed(_check_buckets_in_flight, 4, piece_mb)


def test_a_layout_that_does_not_cover_the_ranks_is_refused() -> None:
    with pytest.raises(ValueError, match="every node must run the same number of processes"):
        NodeLayout(nodes=2, per_node=2, ranks=(0, 1, 2))
    with pytest.raises(ValueError, match="per_node"):
        TwoLevelReducer(per_node=0)
    with pytest.raises(ValueError, match="`piece_mb` must be a positive number of MiB"):
        TwoLevelReducer(per_node=2, piece_mb=0)
