"""Measure what reducing and compressing cost the CPU on this machine: the
:class:`~lightning_dp_strategies.plan.CpuCosts` the step model prices local work with.

Each figure is the mean of a few runs back to back of the operation the reducers run, on buffers the size of a gradient
bucket (32 MiB by default: out of the cores' own caches, as a bucket is; buffers of a few MiB stay in cache and cost
about half as much a byte): summing a received chunk into the bucket (fp32 and bf16), the bf16 cast of a compression
wrapper there and back, and :class:`~lightning_dp_strategies.reducers.PowerSGD`'s own work on a bucket of matrices
(with an inner reducer that sends nothing). Run it in the process that trains, with the thread count it trains with,
at the same time as the other processes of the machine, so that they share the cores as they will.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import Tensor
from torch.futures import Future

from lightning_dp_strategies.plan import CpuCosts
from lightning_dp_strategies.reducers.base import GradBucket, completed
from lightning_dp_strategies.reducers.powersgd import PowerSGD

__all__ = ["calibrate_cpu"]


def _seconds(work: Callable[[], object], repeats: int) -> float:
    """Mean seconds of ``work`` over ``repeats`` runs back to back, after one untimed run (allocation, page faults).

    A mean over the whole stretch, not a median of single runs: where processes share a core, the scheduler gives
    each turns of a few milliseconds, and a short run that fits in one turn would price the work at the whole core.
    """
    work()
    start = time.perf_counter()
    for _ in range(repeats):
        work()
    return (time.perf_counter() - start) / repeats


def _nothing_sent(bucket: GradBucket) -> Future[Tensor]:
    return completed(bucket.buffer)


def _powersgd_seconds(rank: int, shape: tuple[int, int], count: int, repeats: int) -> float:
    """Seconds of PowerSGD's local work on a bucket of ``count`` ``shape`` fp32 matrices, error feedback included."""
    reducer = PowerSGD(_nothing_sent, rank=rank)
    gen = torch.Generator().manual_seed(0)
    template = torch.randn(count * shape[0] * shape[1], generator=gen)
    buffer = template.clone()

    def reduce() -> None:
        buffer.copy_(template)
        reducer(GradBucket(buffer, shapes=[torch.Size(shape)] * count)).wait()

    try:
        reduce()  # the first call has no error feedback yet
        copy = _seconds(lambda: buffer.copy_(template), repeats)
        return max(0.0, _seconds(reduce, repeats) - copy)
    finally:
        reducer.close()


def calibrate_cpu(
    nbytes: int = 32 * 1024 * 1024, rank: int = 4, matrix: tuple[int, int] = (1024, 1024), repeats: int = 5
) -> CpuCosts:
    """Measure this process's :class:`~lightning_dp_strategies.plan.CpuCosts` (about a second).

    Args:
        nbytes: fp32 bytes of the buffers the element-wise costs are timed on: the largest bucket's, ideally.
        rank: PowerSGD's rank.
        matrix: the shape PowerSGD's work is timed on (one of the model's typical weight matrices), in a bucket of as
            many of them as fill ``nbytes``.
        repeats: timed runs of each operation (their mean counts).

    Examples:
        >>> costs = calibrate_cpu(nbytes=1 << 20, matrix=(256, 256), repeats=2)
        >>> costs.add > 0 and costs.powersgd > 0 and costs.powersgd_rank
        4
    """
    numel = nbytes // 4
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(numel, generator=gen), torch.randn(numel, generator=gen)
    low_a, low_b = a.to(torch.bfloat16), b.to(torch.bfloat16)
    add = _seconds(lambda: a.add_(b), repeats) / nbytes
    add_low = _seconds(lambda: low_a.add_(low_b), repeats) / (2 * numel)
    cast = _seconds(lambda: a.copy_(b.to(torch.bfloat16)), repeats) / nbytes
    count = max(1, nbytes // (4 * matrix[0] * matrix[1]))  # as many as fill a bucket of nbytes
    powersgd = _powersgd_seconds(rank, matrix, count, repeats) / (4 * count * matrix[0] * matrix[1])
    return CpuCosts(add=add, add_low=add_low, cast=cast, powersgd=powersgd, powersgd_rank=rank)
