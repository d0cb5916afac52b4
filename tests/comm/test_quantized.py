"""The low-bit all-reduce: 8 and 4 bits with a scale a block, summed in fp32; the same result on every rank, within
its stated error bound of the exact mean, at a quarter (8 bits) or an eighth (4 bits) of the fp32 ring's bytes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_dp_strategies.comm import CommCounter, ring_all_reduce
from lightning_dp_strategies.comm.quantized import dequantize, error_bound, quantize, quantized_all_reduce
from lightning_dp_strategies.comm.shards import chunk_range
from tests.helpers.distributed import run_distributed

NUMEL = 1000  # not a multiple of the block or of the world: uneven chunks and a short last block


def contribution(rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(rank)
    values = torch.randn(NUMEL, generator=generator) * (rank + 1)
    values[::97] *= 50  # outliers: the scale is per block, so they cost precision only in their own block
    return values


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [32, 128])
def test_quantize_moves_each_value_at_most_half_its_block_scale(bits: int, block: int) -> None:
    x = contribution(0)
    q = quantize(x, bits, block)
    error = (dequantize(q) - x).abs()
    qmax = 127 if bits == 8 else 7
    scales = q.scales.repeat_interleave(block)[:NUMEL]
    assert torch.all(error <= scales / 2 * (1 + 1e-6))
    assert torch.all(scales * qmax >= x.abs() * (1 - 1e-6))  # the largest value of a block sets its scale
    assert q.nbytes == (NUMEL if bits == 8 else NUMEL // 2) + 4 * -(-NUMEL // block)


def test_zeros_and_an_odd_count_of_nibbles_come_back_exactly() -> None:
    x = torch.tensor([0.0, 0.0, 0.0, 7.0, -7.0])
    assert dequantize(quantize(x, 4, block=4)).tolist() == x.tolist()


def test_a_width_other_than_8_or_4_bits_is_refused() -> None:
    with pytest.raises(ValueError, match="8 or 4 bits"):
        quantize(torch.ones(3), bits=2)


def _reduce(rank: int, world_size: int, bits: int) -> None:
    mine = contribution(rank)
    tensor = mine.clone()
    counter = CommCounter()
    quantized_all_reduce(tensor, bits=bits, counter=counter)
    everyone = [contribution(r) for r in range(world_size)]
    exact = torch.stack(everyone).mean(dim=0)
    bound = error_bound(everyone, bits=bits)
    assert torch.all((tensor - exact).abs() <= bound * (1 + 1e-5)), float(((tensor - exact).abs() - bound).max())
    assert float((tensor - exact).abs().max()) > 0  # it did quantize: the bound is not met by an exact copy
    a, b = chunk_range(NUMEL, world_size, rank)  # this rank's chunk: its own part summed unrounded, the others' sent
    total = mine[a:b].clone()
    for step in range(1, world_size):  # summed in the order they arrive: from rank - 1, rank - 2, ...
        total += dequantize(quantize(everyone[(rank - step) % world_size][a:b], bits))
    assert torch.equal(tensor[a:b], dequantize(quantize(total / world_size, bits)))
    same = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(same, tensor)
    assert all(torch.equal(other, tensor) for other in same)  # every rank dequantizes the same bytes
    fp32 = CommCounter()
    ring_all_reduce(mine.clone(), "avg", counter=fp32)
    ratio = counter.bytes_sent / fp32.bytes_sent
    expected = (1 if bits == 8 else 0.5) / 4
    assert expected < ratio < expected * 1.2, ratio  # the integers, plus one fp32 scale a block of 128


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.timeout(120)
def test_the_reduction_is_within_its_bound_the_same_everywhere_and_small_on_the_wire(bits: int, world: int) -> None:
    run_distributed(_reduce, world, bits)
