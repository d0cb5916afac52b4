"""Measure what reducing and compressing cost the CPU on this machine: the
:class:`~lightning_dp_strategies.plan.CpuCosts` the step model prices local work with.

Each figure is the mean over a stretch of runs back to back of the operation the reducers run, on buffers the size of a
gradient bucket (32 MiB by default: out of the cores' own caches, as a bucket is; buffers of a few MiB stay in cache
and cost about half as much a byte): summing a received chunk into the bucket (fp32 and bf16), the bf16 cast of a
compression wrapper there and back, and :class:`~lightning_dp_strategies.reducers.PowerSGD`'s own work on a bucket of
matrices (with an inner reducer that sends nothing); and how much a second thread adds to the process's throughput of
compute-bound work (``overlap``: whether the reduction's own thread gets a core beside the training's).

Run it in the process that trains, with the thread count it trains with, at the same time as the other processes of
the machine (started together, after a barrier), so that they share the cores as they will. Each operation is timed
for at least ``seconds``, the same stretch on every process, so that processes started together time the same
operation at the same time, and a stretch spans many of the scheduler's turns where processes outnumber cores.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch
from torch import Tensor
from torch.futures import Future

from lightning_dp_strategies.plan import CpuCosts
from lightning_dp_strategies.reducers.base import GradBucket, completed
from lightning_dp_strategies.reducers.powersgd import PowerSGD

__all__ = ["calibrate_cpu"]


def _seconds(work: Callable[[], object], repeats: int, seconds: float = 0.0) -> float:
    """Mean seconds of ``work`` over runs back to back, at least ``repeats`` of them and at least ``seconds`` in all,
    after one untimed run (allocation, page faults).

    A mean over the whole stretch, not a median of single runs: where processes share a core, the scheduler gives
    each turns of a few milliseconds, and a short run that fits in one turn would price the work at the whole core.
    """
    work()
    runs, start = 0, time.perf_counter()
    while True:
        work()
        runs += 1
        elapsed = time.perf_counter() - start
        if runs >= repeats and elapsed >= seconds:
            return elapsed / runs


def _nothing_sent(bucket: GradBucket) -> Future[Tensor]:
    return completed(bucket.buffer)


def _powersgd_seconds(rank: int, shape: tuple[int, int], count: int, repeats: int, seconds: float = 0.0) -> float:
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
        copy = _seconds(lambda: buffer.copy_(template), repeats, seconds / 4)
        return max(0.0, _seconds(reduce, repeats, seconds) - copy)
    finally:
        reducer.close()


def _products() -> tuple[Callable[[], object], Callable[[], object]]:
    """Two matrix products on their own outputs, about 10 ms each on one core: long enough that Python's lock between
    them costs next to nothing."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(1024, 1024, generator=gen), torch.randn(1024, 1024, generator=gen)
    first, second = torch.empty(1024, 1024), torch.empty(1024, 1024)
    return (lambda: torch.mm(a, b, out=first)), (lambda: torch.mm(a, b, out=second))


def _overlap(repeats: int, seconds: float, work: tuple[Callable[[], object], Callable[[], object]]) -> float:
    """How much a second thread running ``work[1]`` adds to this process's throughput of ``work[0]`` (the same
    operation), as a share of one thread's: 1 where it gets a core of its own, 0 where the two take turns on one."""
    mine, theirs = work
    alone = _seconds(mine, repeats, seconds)
    stop, beside = threading.Event(), [0]

    def second_thread() -> None:
        while not stop.is_set():
            theirs()
            beside[0] += 1

    helper = threading.Thread(target=second_thread, daemon=True)
    helper.start()
    try:
        mine()
        runs, first, start = 0, beside[0], time.perf_counter()
        while True:  # the same stretch as _seconds, counting the second thread's runs in it too
            mine()
            runs += 1
            elapsed = time.perf_counter() - start
            if runs >= repeats and elapsed >= seconds:
                break
        together = (runs + beside[0] - first) / elapsed
    finally:
        stop.set()
        helper.join()
    return min(1.0, max(0.0, together * alone - 1))  # runs a second with two threads, against one's, less one


def calibrate_cpu(
    nbytes: int = 32 * 1024 * 1024,
    rank: int = 4,
    matrix: tuple[int, int] = (1024, 1024),
    repeats: int = 3,
    seconds: float = 0.2,
) -> CpuCosts:
    """Measure this process's :class:`~lightning_dp_strategies.plan.CpuCosts` (about a second and a half: seven
    stretches of at least ``seconds`` each).

    Args:
        nbytes: fp32 bytes of the buffers the element-wise costs are timed on: the largest bucket's, ideally.
        rank: PowerSGD's rank.
        matrix: the shape PowerSGD's work is timed on (one of the model's typical weight matrices), in a bucket of as
            many of them as fill ``nbytes``.
        repeats: timed runs of each operation, at least (their mean counts).
        seconds: how long each operation is timed, at least: long enough to span many of the scheduler's turns where
            processes share cores, the same on every process that calibrates at the same time.

    Examples:
        >>> costs = calibrate_cpu(nbytes=1 << 20, matrix=(256, 256), repeats=2, seconds=0.0)
        >>> costs.add > 0 and costs.powersgd > 0 and 0 <= costs.overlap <= 1 and costs.powersgd_rank
        4
    """
    numel = nbytes // 4
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(numel, generator=gen), torch.randn(numel, generator=gen)
    low_a, low_b = a.to(torch.bfloat16), b.to(torch.bfloat16)
    add = _seconds(lambda: a.add_(b), repeats, seconds) / nbytes
    add_low = _seconds(lambda: low_a.add_(low_b), repeats, seconds) / (2 * numel)
    cast = _seconds(lambda: a.copy_(b.to(torch.bfloat16)), repeats, seconds) / nbytes
    count = max(1, nbytes // (4 * matrix[0] * matrix[1]))  # as many as fill a bucket of nbytes
    powersgd = _powersgd_seconds(rank, matrix, count, repeats, seconds) / (4 * count * matrix[0] * matrix[1])
    overlap = _overlap(repeats, seconds, _products())
    return CpuCosts(add=add, add_low=add_low, cast=cast, powersgd=powersgd, powersgd_rank=rank, overlap=overlap)
