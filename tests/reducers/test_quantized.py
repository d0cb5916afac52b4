"""``reducer="int8"`` / ``"int4"``: a bucket's values in 8 or 4 bits (within the codec's bound of the exact result,
the same on every rank), its presence flags exact; local SGD's averaged change sent that way."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_dp_strategies.comm.quantized import error_bound
from lightning_dp_strategies.local_sgd import FlatAverager
from lightning_dp_strategies.reducers import GradBucket, QuantizedReducer, resolve_reducer
from tests.helpers.distributed import run_distributed


def values(rank: int, numel: int = 300) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(10 + rank))


def _bucket_with_flags(rank: int, world_size: int) -> None:
    mine = values(rank)
    buffer = torch.cat([mine, torch.ones(2)])  # two presence flags: every rank had both gradients
    QuantizedReducer(8)(GradBucket(buffer, num_flags=2, op="sum")).wait()
    everyone = [values(r) for r in range(world_size)]
    exact = torch.stack(everyone).sum(dim=0)
    bound = error_bound(everyone, bits=8) * world_size  # the bound of the mean, times N for the sum
    assert torch.all((buffer[:-2] - exact).abs() <= bound * (1 + 1e-5))
    assert buffer[-2:].tolist() == [float(world_size)] * 2  # the flags are summed exactly


def _local_sgd_change(rank: int, world_size: int, bits: int) -> None:
    averager = FlatAverager(resolve_reducer(f"int{bits}"))
    averager.setup(None, list(range(world_size)))
    changes = [values(rank, 200).view(10, 20), values(rank + 5, 50)]
    originals = [c.clone() for c in changes]
    averager.average(changes)
    flat = torch.cat([c.reshape(-1) for c in changes])
    everyone = [torch.cat([values(r, 200), values(r + 5, 50)]) for r in range(world_size)]
    exact = torch.stack(everyone).mean(dim=0)
    assert not torch.equal(flat, torch.cat([o.reshape(-1) for o in originals]))
    assert float((flat - exact).abs().max()) <= float(error_bound(everyone, bits=bits).max()) * 1.01
    same = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(same, flat)
    assert all(torch.equal(s, flat) for s in same)
    assert 0 < averager.counter.bytes_sent < 250 * 4 * (bits / 32) * 1.5  # the fp32 ring would send 250 * 4 bytes
    averager.close()


@pytest.mark.timeout(120)
def test_the_flags_are_reduced_exactly_beside_the_quantized_values() -> None:
    run_distributed(_bucket_with_flags, 2)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.timeout(120)
def test_local_sgd_sends_its_averaged_change_in_low_bits(bits: int) -> None:
    run_distributed(_local_sgd_change, 2, bits)


def test_the_names_and_a_bad_width() -> None:
    assert repr(resolve_reducer("int4")) == "QuantizedReducer(bits=4, block=128)"
    with pytest.raises(ValueError, match="8 or 4 bits"):
        QuantizedReducer(2)
