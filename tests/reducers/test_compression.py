"""Compression wrappers: what they cost in accuracy (stated tolerances) and what they save in counted bytes.

Tolerances against the uncompressed average of unit-scale (randn) gradients, as ``rtol = atol``: fp16 2e-3 (11-bit
mantissa, two roundings), bf16 1.6e-2 (8-bit mantissa, two roundings). PowerSGD: exact (1e-5) on gradients of rank
<= r; its error feedback loses nothing over time: compressed gradients plus the final error sum to the true ones (1e-4).
"""

from __future__ import annotations

import pytest
import torch

from lightning_dp_strategies.comm import CommCounter, reference_all_reduce
from lightning_dp_strategies.reducers import (
    CastCompression,
    GradBucket,
    PowerSGD,
    bf16_compress,
    completed,
    fp16_compress,
)
from tests.helpers.distributed import run_distributed

# numerically sensitive: CI runs this file again under other CPU kernel paths and thread counts
pytestmark = pytest.mark.numerics


SHAPES = [torch.Size([16, 24]), torch.Size([24]), torch.Size([8, 3, 4])]
NUMEL = 16 * 24 + 24 + 8 * 3 * 4


def _bucket(rank: int, scale: float = 1.0) -> GradBucket:
    generator = torch.Generator().manual_seed(7 + rank)
    buffer = torch.randn(NUMEL + len(SHAPES), generator=generator) * scale
    buffer[NUMEL:] = torch.tensor([1.0, float(rank == 0), 0.0])
    return GradBucket(buffer, shapes=list(SHAPES), num_flags=len(SHAPES))


def _check_casts(rank: int, world_size: int) -> None:
    for wrap, rtol in ((fp16_compress, 2e-3), (bf16_compress, 1.6e-2)):
        for inner in ("ring", "native"):
            bucket = _bucket(rank)
            expected = reference_all_reduce(bucket.buffer.clone(), "avg")
            plain = GradBucket(bucket.buffer.clone(), counter=CommCounter())
            reducer = wrap(inner)
            reducer(bucket).wait()
            torch.testing.assert_close(bucket.buffer, expected, rtol=rtol, atol=rtol, msg=f"{wrap} {inner}")
            flags = bucket.flags
            assert flags[0] > 0 and flags[1] > 0 and flags[2] == 0, "presence flags survive the cast"
            reducer.inner(plain).wait()  # the same reducer uncompressed, for the byte count
            assert bucket.counter.bytes_sent * 2 == pytest.approx(plain.counter.bytes_sent, abs=16), (
                f"{wrap.__name__}({inner}) sends half the bytes"
            )
            reducer.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_cast_compression_is_close_and_sends_half_the_bytes(world_size: int) -> None:
    run_distributed(_check_casts, world_size)


def _check_fp16_division_before_sum(rank: int, world_size: int) -> None:
    """Gradients of 40000 on 3 ranks: their sum (120000) overflows fp16 (max 65504); their average does not."""
    bucket = GradBucket(torch.full((10,), 40000.0))
    fp16_compress("ring")(bucket).wait()
    assert torch.isfinite(bucket.buffer).all(), "fp16 sum overflowed: the division must come before the sum"
    torch.testing.assert_close(bucket.buffer, torch.full((10,), 40000.0), rtol=1e-3, atol=0)


@pytest.mark.timeout(120)
def test_fp16_divides_before_the_sum_so_it_cannot_overflow() -> None:
    run_distributed(_check_fp16_division_before_sum, 3)


def _low_rank_bucket(rank: int) -> tuple[GradBucket, torch.Tensor]:
    """A rank-2 16x24 gradient that differs per rank only within a shared 2-dimensional row space, plus a bias."""
    generator = torch.Generator().manual_seed(0)
    right = torch.randn(2, 24, generator=generator)
    left = torch.randn(16, 2, generator=torch.Generator().manual_seed(10 + rank))
    weight, bias = left @ right, torch.randn(24, generator=torch.Generator().manual_seed(20 + rank))
    buffer = torch.cat([weight.flatten(), bias, torch.ones(2)])
    return GradBucket(buffer, shapes=[weight.shape, bias.shape], num_flags=2), buffer.clone()


def _check_powersgd_exact_on_low_rank(rank: int, world_size: int) -> None:
    bucket, original = _low_rank_bucket(rank)
    expected = reference_all_reduce(original, "avg")
    reducer = PowerSGD("ring", rank=2)
    reducer(bucket).wait()
    torch.testing.assert_close(bucket.buffer, expected, atol=1e-5, rtol=1e-5)
    # counted bytes: P (16 x 2) and Q (24 x 2) instead of the 16 x 24 matrix; the bias and flags uncompressed
    plain = 16 * 24 + 24 + 2
    compressed = 2 * (16 + 24) + 24 + 2
    ring = 2 * (world_size - 1) / world_size * 4
    assert bucket.counter.bytes_sent == pytest.approx(compressed * ring, abs=4 * world_size * 2)
    assert bucket.counter.bytes_sent < plain * ring / 3
    reducer.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_powersgd_is_exact_on_low_rank_gradients_and_sends_the_factors(world_size: int) -> None:
    run_distributed(_check_powersgd_exact_on_low_rank, world_size)


def test_powersgd_error_feedback_loses_nothing_over_time() -> None:
    """sum_t compressed_t = sum_t grad_t - error_T: what rank 1 drops is carried, not lost (one process)."""
    reducer = PowerSGD(lambda b: completed(b.buffer), rank=1)
    generator = torch.Generator().manual_seed(3)
    true_sum, sent_sum = torch.zeros(32, 20), torch.zeros(32, 20)
    for _ in range(12):
        grad = torch.randn(32, 20, generator=generator)
        bucket = GradBucket(grad.flatten().clone(), shapes=[grad.shape])
        reducer(bucket).wait()
        true_sum += grad
        sent_sum += bucket.buffer.view(32, 20)
    error = reducer.error[(0, 0)]
    torch.testing.assert_close(sent_sum + error, true_sum, atol=1e-4, rtol=1e-5)
    assert error.norm() > 1e-2, "rank 1 of a random 32x20 matrix is lossy: the check above has something to carry"
    reducer.close()


def _check_error_feedback_across_ranks(rank: int, world_size: int, op: str) -> None:
    """sum_t averaged_t = sum_t mean(grad_t) - (error_T summed over ranks, scaled as the inputs are)."""
    import torch.distributed as dist

    reducer = PowerSGD("ring", rank=1)
    generator = torch.Generator().manual_seed(11 + rank)
    true_sum, sent_sum = torch.zeros(32, 20), torch.zeros(32, 20)
    for _ in range(8):
        grad = torch.randn(32, 20, generator=generator)
        true_sum += reference_all_reduce(grad.clone(), "avg")
        # the strategies divide every gradient by the world size on its way into the bucket and ask for the sum
        given = grad / world_size if op == "sum" else grad
        bucket = GradBucket(given.flatten().clone(), shapes=[grad.shape], op=op)  # type: ignore[arg-type]
        reducer(bucket).wait()
        sent_sum += bucket.buffer.view(32, 20)
    error = reducer.error[(0, 0)].clone()
    dist.all_reduce(error)  # every rank's error, in the scale of its inputs
    carried = error if op == "sum" else error / world_size
    torch.testing.assert_close(sent_sum + carried, true_sum, atol=1e-4, rtol=1e-5)
    assert carried.norm() > 1e-2, "rank 1 of random 32x20 matrices is lossy: the check has something to carry"
    reducer.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_powersgd_error_feedback_loses_nothing_across_four_ranks(op: str) -> None:
    """With the strategies' pre-divided "sum" buckets too: the error a rank keeps is its share of what the average
    lost, so the averaged gradients delivered plus the carried errors add up to the true averages (1e-4)."""
    run_distributed(_check_error_feedback_across_ranks, 4, op)


def test_powersgd_leaves_vectors_and_small_matrices_uncompressed() -> None:
    reducer = PowerSGD(rank=4)
    assert not reducer.compresses(torch.Size([100]))
    assert not reducer.compresses(torch.Size([6, 6])), "4 * (6 + 6) > 36: factors would be larger"
    assert reducer.compresses(torch.Size([64, 3, 3, 3]))


def test_bad_compression_options_name_the_allowed_values() -> None:
    with pytest.raises(ValueError, match=r"torch\.float16 or torch\.bfloat16"):
        CastCompression("ring", torch.int8)
    with pytest.raises(ValueError, match="integer >= 1"):
        PowerSGD(rank=0)
    with pytest.raises(ValueError, match="use one of"):
        bf16_compress("tree")  # type: ignore[arg-type]
