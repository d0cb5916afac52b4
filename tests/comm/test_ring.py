"""Ring collectives against the backend's own all-reduce (the oracle), at world sizes 1-4 and odd lengths."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_dp_strategies.comm import CommCounter, divide, divide_, is_average, reference_all_reduce, ring_all_reduce
from tests.helpers.distributed import point_to_point_log, run_distributed

# Lengths: shorter than the world, not divisible by 2, 3 or 4, and a multi-chunk one; empty is a no-op.
# numerically sensitive: CI runs this file again under other CPU kernel paths and thread counts
pytestmark = pytest.mark.numerics


LENGTHS = (0, 1, 3, 7, 1001)
# fp32/fp64 agree with the oracle to rounding; fp16/bf16 sums round per hop, so compare in their own precision.
TOLERANCE = {torch.float32: 1e-6, torch.float64: 1e-12, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def _check_against_oracle(rank: int, world_size: int) -> None:
    for dtype, tol in TOLERANCE.items():
        for length in LENGTHS:
            for op in ("sum", "avg"):
                gen = torch.Generator().manual_seed(1000 * rank + length)
                data = torch.randn(length, generator=gen).to(dtype)
                expected = reference_all_reduce(data.clone().double(), op)
                counter = CommCounter()
                out = ring_all_reduce(data, op, counter=counter)
                assert out is data, "ring_all_reduce must work in place"
                torch.testing.assert_close(data.double(), expected, rtol=tol, atol=tol, msg=f"{dtype} {length} {op}")
                # bytes: 2(N-1) chunks of ceil/floor(L/N) elements, i.e. 2(N-1)/N of the bytes within N elements
                ideal = 2 * (world_size - 1) / world_size * length * data.element_size()
                assert abs(counter.bytes_sent - ideal) < world_size * data.element_size(), (counter, ideal)
                assert counter.operations == 1


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.timeout(180)
def test_ring_all_reduce_matches_oracle(world_size: int) -> None:
    run_distributed(_check_against_oracle, world_size)


def _check_exact_bytes(rank: int, world_size: int) -> None:
    # length divisible by N: every chunk is L/N, so the count is exactly 2(N-1)/N of the bytes.
    data = torch.ones(world_size * 250, dtype=torch.float32)
    counter = CommCounter()
    ring_all_reduce(data, "sum", counter=counter)
    assert counter.bytes_sent == 2 * (world_size - 1) * 250 * 4
    assert counter.messages == 2 * (world_size - 1)
    assert torch.equal(data, torch.full_like(data, world_size))


@pytest.mark.timeout(120)
def test_ring_sends_exactly_2_n_minus_1_over_n_of_the_bytes() -> None:
    run_distributed(_check_exact_bytes, 3)


def _check_subgroups(rank: int, world_size: int) -> None:
    # two disjoint groups {0, 2} and {1, 3}: each averages only over its own members
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mine = groups[rank % 2]
    data = torch.arange(5, dtype=torch.float64) + 10 * rank
    ring_all_reduce(data, "avg", group=mine)
    members = (0, 2) if rank % 2 == 0 else (1, 3)
    expected = torch.arange(5, dtype=torch.float64) + 10 * sum(members) / 2
    torch.testing.assert_close(data, expected, rtol=0, atol=1e-12)
    # a non-contiguous tensor is reduced in place too
    matrix = torch.full((4, 3), float(rank)).t()
    ring_all_reduce(matrix, "sum", group=mine)
    assert torch.equal(matrix, torch.full((3, 4), float(sum(members))))


@pytest.mark.timeout(120)
def test_ring_over_subgroups_and_non_contiguous() -> None:
    run_distributed(_check_subgroups, 4)


_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_divide_gives_the_bits_of_torch_div(dtype: torch.dtype) -> None:
    """The average's division: a reciprocal multiply only where it is exact (powers of two), so the ring, the buckets
    and the native reducer average bit for bit as ``div_`` would, subnormals, infinities and NaN included."""
    specials = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 1e-45, 3e38, 65504.0])
    values = torch.cat([torch.randn(20000) * 1e3, torch.randn(2000) * 1e-40, specials]).to(dtype)
    if dtype == torch.float64:
        values = torch.cat([values, torch.randn(2000, dtype=dtype) * 1e-310])
    bits = _BITS[values.element_size()]
    for divisor in (1, 2, 3, 4, 6, 8, 1024):
        expected = values.div(divisor).view(bits)
        assert torch.equal(divide(values, divisor).view(bits), expected), divisor
        out = torch.empty_like(values)
        assert divide(values, divisor, out=out) is out and torch.equal(out.view(bits), expected), divisor
        in_place = values.clone()
        assert divide_(in_place, divisor) is in_place and torch.equal(in_place.view(bits), expected), divisor


def test_reduce_op_validation() -> None:
    assert is_average("avg") and is_average(dist.ReduceOp.AVG) and not is_average("sum")
    with pytest.raises(ValueError, match="use 'sum' or 'avg'"):
        is_average("max")
    with pytest.raises(ValueError, match="use 'sum' or 'avg'"):
        is_average(dist.ReduceOp.MAX)


def _check_integer_sum_and_float_only_average(rank: int, world_size: int) -> None:
    data = torch.arange(7, dtype=torch.int64) * (rank + 1)
    ring_all_reduce(data, "sum")
    assert torch.equal(data, torch.arange(7) * 3)
    with pytest.raises(TypeError, match="use op='sum'"):
        ring_all_reduce(torch.ones(3, dtype=torch.int32), "avg")
    # complex tensors: averaged as complex numbers
    z = torch.complex(torch.arange(5.0) + rank, torch.full((5,), 2.0 * rank))
    ring_all_reduce(z, "avg")
    torch.testing.assert_close(z, torch.complex(torch.arange(5.0) + 0.5, torch.ones(5)), rtol=0, atol=1e-6)


@pytest.mark.timeout(120)
def test_integer_sum_complex_average_and_average_needs_floats() -> None:
    run_distributed(_check_integer_sum_and_float_only_average, 2)


def _check_step_by_step_ring(rank: int, world_size: int) -> None:
    # ring_reduce_scatter + ring_all_gather: the public step-by-step form (the path NCCL takes), with pieces
    from lightning_dp_strategies.comm import ring, ring_all_gather, ring_reduce_scatter

    ring.PIPELINE_PIECE_BYTES = 256  # each reduce-scatter step moves several pieces with their own tags
    length = 1003
    data = torch.randn(length, generator=torch.Generator().manual_seed(rank))
    expected = reference_all_reduce(data.clone().double(), "sum")
    chunks = list(data.tensor_split(world_size))
    assert ring._pieces(chunks[0]) > 1
    counter = CommCounter()
    owned = ring_reduce_scatter(chunks, counter=counter)
    assert owned == (rank + 1) % world_size
    torch.testing.assert_close(chunks[owned].double(), expected.tensor_split(world_size)[owned], rtol=1e-6, atol=1e-6)
    ring_all_gather(chunks, counter=counter)
    torch.testing.assert_close(data.double(), expected, rtol=1e-6, atol=1e-6)
    assert counter.messages > 2 * (world_size - 1)


@pytest.mark.timeout(120)
def test_step_by_step_reduce_scatter_and_all_gather_match_oracle() -> None:
    run_distributed(_check_step_by_step_ring, 3)


def _check_streamed_pieces_and_slots(rank: int, world_size: int) -> None:
    from lightning_dp_strategies.comm import ring, ring_workspace_numel

    ring.PIPELINE_PIECE_BYTES = 64  # tiny pieces: several per chunk, so every piece/slot/tag path runs
    length = 1003  # chunks of 251/251/251/250 elements: pieces of unequal length
    for dtype, tol in ((torch.float32, 1e-6), (torch.float16, 1e-2)):
        for op in ("sum", "avg"):
            data = torch.randn(length, generator=torch.Generator().manual_seed(rank)).to(dtype)
            expected = reference_all_reduce(data.clone().double(), op)
            workspace = torch.full((ring_workspace_numel(length, world_size),), float("nan"), dtype=dtype)
            counter = CommCounter()
            ring_all_reduce(data, op, counter=counter, workspace=workspace)
            torch.testing.assert_close(data.double(), expected, rtol=tol, atol=tol, msg=f"{dtype} {op}")
            pieces = ring._pieces(data[:251])
            assert pieces > 1, pieces
            # every hop of every piece is its own message: 2(N-1) steps x P pieces, the bytes unchanged
            assert counter.messages == 2 * (world_size - 1) * pieces, counter
            assert abs(counter.bytes_sent - 2 * (world_size - 1) / world_size * length * data.element_size()) < (
                world_size * data.element_size()
            )
            assert not workspace.isnan().all(), "the workspace passed in was not used"
    # a workspace too small (or of another dtype) is not used: a fresh scratch instead, same result
    data = torch.full((length,), float(rank))
    ring_all_reduce(data, "sum", workspace=torch.empty(3))
    assert torch.equal(data, torch.full((length,), float(sum(range(world_size)))))


@pytest.mark.timeout(120)
def test_streamed_ring_with_many_pieces_and_reused_scratch_slots() -> None:
    # world 4: three reduce-scatter steps, so the double-buffered scratch slots are re-posted
    run_distributed(_check_streamed_pieces_and_slots, 4)


def _all_gather_posting(calls: list[tuple[str, dist.ProcessGroup, int]], first_gather_tag: int) -> str:
    """``"up front"`` if every all-gather receive was posted before this rank's first send, ``"late"`` if after."""
    first_send = next(i for i, (name, _, _) in enumerate(calls) if name == "send")
    gathers = [i for i, (name, _, tag) in enumerate(calls) if name == "recv" and tag >= first_gather_tag]
    assert gathers, "no all-gather receive was posted"
    return "up front" if max(gathers) < first_send else "late" if min(gathers) > first_send else "mixed"


def _check_duplex(rank: int, world_size: int) -> None:
    from lightning_dp_strategies.comm import ring, ring_workspace_numel

    world = dist.group.WORLD
    duplex = dist.new_group(list(range(world_size)))
    for pieces_bytes in (ring.PIPELINE_PIECE_BYTES, 64):  # one piece per chunk, then several
        ring.PIPELINE_PIECE_BYTES = pieces_bytes
        for dtype in (torch.float32, torch.bfloat16):
            for op in ("sum", "avg"):
                data = torch.randn(1001, generator=torch.Generator().manual_seed(rank)).to(dtype)
                with point_to_point_log() as one:
                    alone = ring_all_reduce(data.clone(), op)  # one group: the reference for the bits
                workspace = torch.empty(ring_workspace_numel(data.numel(), world_size), dtype=dtype)
                with point_to_point_log() as two:
                    ring_all_reduce(data, op, workspace=workspace, duplex=duplex)
                assert torch.equal(data, alone), f"a second connection changed the result ({dtype} {op})"
                sent = {group for name, group, _ in two if name == "send"}
                received = {group for name, group, _ in two if name == "recv"}
                if world_size == 2:  # rank 1 -> rank 0 over the duplex group, rank 0 -> rank 1 over the world
                    assert sent == {duplex if rank == 1 else world}, (rank, sent)
                    assert received == {duplex if rank == 0 else world}, (rank, received)
                else:  # every neighbour has its own connection already: the duplex group is not used
                    assert sent == received == {world}, (rank, sent, received)
                # all-gather receives: up front where sends and receives use two connections, late over one
                first_gather_tag = (world_size - 1) * ring._pieces(data[: -(-data.numel() // world_size)])
                assert _all_gather_posting(two, first_gather_tag) == "up front"
                expected = "late" if world_size == 2 else "up front"
                assert _all_gather_posting(one, first_gather_tag) == expected, (world_size, rank)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.timeout(120)
def test_duplex_group_carries_one_direction_at_two_ranks_and_gives_the_same_bits(world_size: int) -> None:
    run_distributed(_check_duplex, world_size)


def _check_bad_duplex(rank: int, world_size: int) -> None:
    only_rank_0 = dist.new_group([0])  # rank 0: a group over other ranks; rank 1: a placeholder, not a group
    for duplex in (only_rank_0, "world"):
        with pytest.raises(ValueError, match=r"dist\.new_group\(ranks\) with the ranks of `group`"):
            ring_all_reduce(torch.ones(8), "sum", duplex=duplex)  # type: ignore[arg-type]
    data = torch.ones(8)
    ring_all_reduce(data, "sum", duplex=dist.group.WORLD)  # the group itself: allowed, nothing changes
    assert torch.equal(data, torch.full((8,), 2.0))


@pytest.mark.timeout(120)
def test_a_duplex_group_over_other_ranks_is_refused_on_every_rank_before_anything_is_sent() -> None:
    run_distributed(_check_bad_duplex, 2)
