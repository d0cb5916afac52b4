"""Measure what reducing and compressing cost the CPU on this machine: the
:class:`~lightning_dp_strategies.plan.CpuCosts` the step model prices local work with.

Each figure is the median of a few timed runs of the operation the reducers run, on buffers of a few MiB (large enough
that the per-byte cost dominates): summing a received chunk into the bucket (fp32 and bf16), the bf16 cast of a
compression wrapper there and back, and :class:`~lightning_dp_strategies.reducers.PowerSGD`'s own work on a matrix
(with an inner reducer that sends nothing). Run it in the process that trains, with the thread count it trains with,
at the same time as the other processes of the machine, so that they share the cores as they will.
"""

from __future__ import annotations

import statistics
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
    work()  # first touch: allocation and page faults
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _nothing_sent(bucket: GradBucket) -> Future[Tensor]:
    return completed(bucket.buffer)


def _powersgd_seconds(rank: int, shape: tuple[int, int], repeats: int) -> float:
    """Seconds of PowerSGD's local work on one ``shape`` fp32 matrix, error feedback included."""
    reducer = PowerSGD(_nothing_sent, rank=rank)
    gen = torch.Generator().manual_seed(0)
    template = torch.randn(shape[0] * shape[1], generator=gen)
    buffer = template.clone()

    def reduce() -> None:
        buffer.copy_(template)
        reducer(GradBucket(buffer, shapes=[torch.Size(shape)])).wait()

    try:
        reduce()  # the first call has no error feedback yet
        copy = _seconds(lambda: buffer.copy_(template), repeats)
        return max(0.0, _seconds(reduce, repeats) - copy)
    finally:
        reducer.close()


def calibrate_cpu(
    nbytes: int = 8 * 1024 * 1024, rank: int = 4, matrix: tuple[int, int] = (1024, 1024), repeats: int = 5
) -> CpuCosts:
    """Measure this process's :class:`~lightning_dp_strategies.plan.CpuCosts` (about a second).

    Args:
        nbytes: fp32 bytes of the buffers the element-wise costs are timed on.
        rank: PowerSGD's rank.
        matrix: the shape PowerSGD's work is timed on (one of the model's typical weight matrices).
        repeats: timed runs of each operation (the median counts).

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
    powersgd = _powersgd_seconds(rank, matrix, repeats) / (4 * matrix[0] * matrix[1])
    return CpuCosts(add=add, add_low=add_low, cast=cast, powersgd=powersgd, powersgd_rank=rank)
