"""Measure what reducing and compressing cost on this machine: the :class:`~lightning_dp_strategies.plan.CpuCosts` the
step model prices local work with.

It times the operations the reducers run, each over a stretch of runs back to back, on buffers the size of a gradient
bucket (32 MiB by default: out of the cores' own caches, as a bucket is; buffers of a few MiB stay in cache and cost
about half as much a byte): summing a received chunk into the bucket (fp32 and bf16), the bf16 cast of a compression
wrapper there and back, and :class:`~lightning_dp_strategies.reducers.PowerSGD`'s own work on a bucket of matrices
(with an inner reducer that sends nothing); and how much a second thread adds to the process's throughput of
compute-bound work (``overlap``: whether the reduction's own thread gets a core beside the training's).

On the CPU a figure is the CPU time of a run divided by the share of the cores the process got over the whole
calibration. Run it in the process that trains, with the thread count it trains with, at the same time as the other
processes of the machine (started together, after a barrier): they share the cores as their steps will, and the share
says so. CPU time keeps a stretch in which the process lost its core for a while (the scheduler's doing, not the
operation's) from pricing that operation; the share counts such stretches once, spread over every operation. On a GPU
a figure is the device's time, to the end of the work queued. Each operation is timed for at least ``seconds``, the
same on every process, so that processes started together time the same operation at the same time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.futures import Future

from lightning_dp_strategies.plan import CpuCosts
from lightning_dp_strategies.reducers.base import GradBucket, completed
from lightning_dp_strategies.reducers.powersgd import PowerSGD

__all__ = ["calibrate_cpu"]


@dataclass(frozen=True)
class _Stretch:
    """Runs of an operation back to back: their wall seconds and the process's CPU seconds (all its threads)."""

    runs: int
    wall: float
    cpu: float


def _stretch(
    work: Callable[[], object], repeats: int, seconds: float = 0.0, sync: Callable[[], object] = lambda: None
) -> _Stretch:
    """Run ``work`` back to back, in rounds of ``repeats`` until at least ``seconds`` have passed, after one untimed
    run (allocation, page faults); ``sync()`` waits for queued device work before each look at the clock."""
    work()
    sync()
    runs, start, cpu = 0, time.perf_counter(), time.process_time()
    while True:
        for _ in range(max(1, repeats)):
            work()
        runs += max(1, repeats)
        sync()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return _Stretch(runs, elapsed, time.process_time() - cpu)


def _seconds(
    work: Callable[[], object], repeats: int, seconds: float = 0.0, sync: Callable[[], object] = lambda: None
) -> float:
    """Mean wall seconds of ``work`` over a :func:`_stretch`.

    A mean over the whole stretch, not a median of single runs: where processes share a core, the scheduler gives
    each turns of a few milliseconds, and a short run that fits in one turn would price the work at the whole core.
    """
    stretch = _stretch(work, repeats, seconds, sync)
    return stretch.wall / stretch.runs


def _nothing_sent(bucket: GradBucket) -> Future[Tensor]:
    return completed(bucket.buffer)


class _PowerSGDWork:
    """PowerSGD's local work on a bucket of ``count`` ``shape`` fp32 matrices (error feedback included), and the copy
    that refills the bucket before each run: ``reduce()`` less ``copy()`` is PowerSGD's own."""

    def __init__(self, rank: int, shape: tuple[int, int], count: int, device: torch.device) -> None:
        self.reducer = PowerSGD(_nothing_sent, rank=rank)
        gen = torch.Generator().manual_seed(0)
        self.template = torch.randn(count * shape[0] * shape[1], generator=gen).to(device)
        self.buffer = self.template.clone()
        self.shapes = [torch.Size(shape)] * count
        self.sync = _sync(device)
        self.reduce()  # the first call has no error feedback yet

    def copy(self) -> None:
        self.buffer.copy_(self.template)

    def reduce(self) -> None:
        self.copy()
        self.reducer(GradBucket(self.buffer, shapes=self.shapes)).wait()
        self.sync()  # PowerSGD's thread queues its device work: the next bucket starts once it is done


def _sync(device: torch.device) -> Callable[[], object]:
    """What waits for ``device``'s queued work (nothing on the CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


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


def _per_run(stretches: dict[str, list[_Stretch]], device: torch.device) -> dict[str, float]:
    """Each operation's seconds a run, the lowest of its stretches: on the CPU its CPU time, at the share of the cores
    the process got over all the stretches; on a device, the time to the end of its queued work."""
    if device.type != "cpu":
        return {name: min(t.wall / t.runs for t in timed) for name, timed in stretches.items()}
    every = [stretch for timed in stretches.values() for stretch in timed]
    share = max(1e-3, sum(t.cpu for t in every) / sum(t.wall for t in every))
    return {name: min(t.cpu / t.runs for t in timed) / share for name, timed in stretches.items()}


def calibrate_cpu(
    nbytes: int = 32 * 1024 * 1024,
    rank: int = 4,
    matrix: tuple[int, int] = (1024, 1024),
    repeats: int = 3,
    seconds: float = 0.2,
    device: torch.device | str | None = None,
    rounds: int = 2,
) -> CpuCosts:
    """Measure this process's :class:`~lightning_dp_strategies.plan.CpuCosts` (about a second and a half a round:
    seven stretches of at least ``seconds`` each) on ``device``, where the reducers will do the work.

    Args:
        nbytes: fp32 bytes of the buffers the element-wise costs are timed on: the largest bucket's, ideally.
        rank: PowerSGD's rank.
        matrix: the shape PowerSGD's work is timed on (one of the model's typical weight matrices), in a bucket of as
            many of them as fill ``nbytes``.
        repeats: timed runs of each operation, at least (their mean counts).
        seconds: how long each operation is timed, at least: long enough to span many of the scheduler's turns where
            processes share cores, the same on every process that calibrates at the same time.
        device: where the gradient buckets live (default the CPU). On a GPU the operations run there, timed to their
            end, and ``overlap`` is 1: the reduction's kernels are queued beside backward's, on no core it needs.
        rounds: how often every operation is timed, in turn; each figure is the lowest of its rounds, ``overlap`` too.

    Examples:
        >>> costs = calibrate_cpu(nbytes=1 << 20, matrix=(256, 256), repeats=2, seconds=0.0)
        >>> costs.add > 0 and costs.powersgd > 0 and 0 <= costs.overlap <= 1 and costs.powersgd_rank
        4
    """
    where = torch.device(device) if device is not None else torch.device("cpu")
    sync = _sync(where)
    numel = nbytes // 4
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(numel, generator=gen).to(where), torch.randn(numel, generator=gen).to(where)
    low_a, low_b = a.to(torch.bfloat16), b.to(torch.bfloat16)
    count = max(1, nbytes // (4 * matrix[0] * matrix[1]))  # as many as fill a bucket of nbytes
    powersgd_work = _PowerSGDWork(rank, matrix, count, where)
    operations: dict[str, tuple[Callable[[], object], float]] = {  # what is timed, and for how long at least
        "add": (lambda: a.add_(b), seconds),
        "add_low": (lambda: low_a.add_(low_b), seconds),
        "cast": (lambda: a.copy_(b.to(torch.bfloat16)), seconds),
        "copy": (powersgd_work.copy, seconds / 4),
        "powersgd": (powersgd_work.reduce, seconds),
    }
    stretches: dict[str, list[_Stretch]] = {name: [] for name in operations}
    overlap = 1.0
    try:
        for _ in range(max(1, rounds)):  # every operation in turn, then again
            for name, (work, at_least) in operations.items():
                stretches[name].append(_stretch(work, repeats, at_least, sync))
            if where.type == "cpu":
                overlap = min(overlap, _overlap(repeats, seconds, _products()))
    finally:
        powersgd_work.reducer.close()
    best = _per_run(stretches, where)
    add = best["add"] / nbytes
    add_low = best["add_low"] / (2 * numel)
    cast = best["cast"] / nbytes
    powersgd = max(0.0, best["powersgd"] - best["copy"]) / (4 * count * matrix[0] * matrix[1])
    return CpuCosts(add=add, add_low=add_low, cast=cast, powersgd=powersgd, powersgd_rank=rank, overlap=overlap)
