"""Averaging tensors across ranks in one flat all-reduce through any reducer, and torch's periodic model averaging.

Local SGD, DiLoCo and post-local SGD all average a set of tensors (parameter changes, parameters, buffers) now and
then, outside backward. :class:`FlatAverager` packs them into one flat fp32 buffer, hands it to a reducer as a
:class:`~lightning_dp_strategies.reducers.GradBucket` (so ``bf16_compress("ring")`` halves what is sent) and unpacks
the average; :class:`PeriodicAverager` is torch's ``PeriodicModelAverager`` schedule on top of it.

A lossy reducer (a low precision on the wire, a compression) is for the parameter changes only: values themselves
(buffers, the averaged model a checkpoint or an evaluation takes) are averaged exactly, through the averager's
``exact`` companion (:func:`outer_averager`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dp_strategies.comm import CommCounter
from lightning_dp_strategies.comm.failures import PeerLostError, guarded
from lightning_dp_strategies.reducers import (
    GradBucket,
    NativeReducer,
    QuantizedReducer,
    Reducer,
    RingReducer,
    bf16_compress,
    close_reducer,
    setup_reducer,
)
from lightning_dp_strategies.reducers.bucket import wait_for
from lightning_dp_strategies.reducers.thread import close_in_background

__all__ = ["FlatAverager", "PeriodicAverager", "averageable", "outer_averager", "outer_reducer"]


def averageable(tensor: Tensor) -> bool:
    """Whether a buffer is averaged: floating point (``num_batches_tracked`` and other counters are not)."""
    return tensor.is_floating_point() or tensor.is_complex()


def outer_reducer(precision: str, reducer: Reducer) -> Reducer:
    """The reducer that sends the outer gradient in ``precision``: ``reducer`` itself (``"fp32"``), ``reducer`` on a
    bf16 copy (``"bf16"``), or the 8- or 4-bit :class:`~lightning_dp_strategies.reducers.QuantizedReducer`.

    Examples:
        >>> from lightning_dp_strategies.reducers import NativeReducer
        >>> outer_reducer("int4", NativeReducer())
        QuantizedReducer(bits=4, block=128)
    """
    if precision == "bf16":
        return bf16_compress(reducer)
    if precision in ("int8", "int4"):
        return QuantizedReducer(int(precision[3:]))
    return reducer


def outer_averager(precision: str, reducer: Reducer) -> FlatAverager:
    """The averager of local SGD's changes in ``precision`` (:func:`outer_reducer`), with an ``exact`` companion (the
    backend's fp32 all-reduce, counted with it) for values unless the changes already travel exactly (``"fp32"``
    through the package's ring or the backend's all-reduce).

    Examples:
        >>> from lightning_dp_strategies.reducers import RingReducer
        >>> exact = outer_averager("int4", RingReducer()).exact
        >>> outer_averager("fp32", RingReducer()).exact is None, type(exact.reducer).__name__
        (True, 'NativeReducer')
    """
    averager = FlatAverager(outer_reducer(precision, reducer))
    if precision != "fp32" or not isinstance(reducer, (RingReducer, NativeReducer)):
        averager.exact = FlatAverager(NativeReducer())
        averager.exact.counter = averager.counter
    return averager


class FlatAverager:
    """Averages lists of tensors over a process group in one reduction of one flat fp32 buffer.

    Configuration: the reducer and the group (:meth:`setup`). Runtime state: the flat buffer, kept between calls (the
    largest size yet). Statistics: ``counter`` (what the reducer sent) and ``reductions``.

    Examples:
        >>> from lightning_dp_strategies.reducers import NativeReducer
        >>> averager = FlatAverager(NativeReducer())
        >>> a, b = torch.ones(2, 2), torch.arange(3.0)
        >>> averager.average([a, b])  # one process: the average is the tensors themselves
        >>> b.tolist(), averager.reductions
        ([0.0, 1.0, 2.0], 1)
    """

    def __init__(self, reducer: Reducer) -> None:
        self.reducer = reducer
        self.group: dist.ProcessGroup | None = None
        self.counter = CommCounter()
        self.reductions = 0
        self.interrupt: Callable[[], str | None] | None = None
        """Polled while an average is waited for: why it cannot complete (a peer known lost), or ``None``."""
        self.exact: FlatAverager | None = None
        """Where the tensors that must not go through a lossy ``reducer`` are averaged (``None``: it is exact)."""
        self._buffer: Tensor | None = None

    def setup(self, group: dist.ProcessGroup | None, ranks: Sequence[int], backend: str | None = None) -> None:
        """Average over ``group`` (global ``ranks``); runs the reducer's own setup step. Collective: every rank."""
        self.group = group
        setup_reducer(self.reducer, group, ranks, backend)
        if self.exact is not None:
            self.exact.setup(group, ranks, backend)

    def close(self) -> None:
        close_reducer(self.reducer)
        self._buffer = None
        if self.exact is not None:
            self.exact.close()

    def regroup(self, group: dist.ProcessGroup | None, ranks: Sequence[int], reducer: Reducer) -> None:
        """After a peer failure: average over ``group`` (global ``ranks``) with a fresh ``reducer`` from now on. The
        old reducer is closed in a background thread: a reduction it still runs on the failed group ends with that
        group's timeout. Collective over ``group``."""
        old, self.reducer, self._buffer = self.reducer, reducer, None
        close_in_background(functools.partial(close_reducer, old))
        if self.exact is not None:
            self.exact.reducer, self.exact._buffer = NativeReducer(), None
        self.setup(group, ranks, "gloo")

    @property
    def world_size(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.group)

    def average(self, tensors: Sequence[Tensor], lossy: int | None = None) -> None:
        """Replace every tensor of ``tensors`` by its average over the group (collective): in one reduction, or, with
        an ``exact`` companion, the first ``lossy`` tensors (all when ``None``) through the reducer and the rest
        exactly, in a second reduction."""
        tensors = list(tensors)
        if self.exact is not None and lossy is not None and lossy < len(tensors):
            if lossy:
                self.average(tensors[:lossy])
            self.exact.interrupt = self.interrupt
            self.exact.average(tensors[lossy:])
            return
        total = sum(t.numel() for t in tensors)
        device = tensors[0].device if tensors else torch.device("cpu")
        if self._buffer is None or self._buffer.numel() < total or self._buffer.device != device:
            self._buffer = torch.empty(total, dtype=torch.float32, device=device)
        buffer = self._buffer[:total]  # one buffer, the largest yet, for lists of every size (fragments differ)
        if tensors:
            torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors], out=buffer)
        bucket = GradBucket(buffer, self.group, self.counter, shapes=[t.shape for t in tensors], op="avg", last=True)
        if self.world_size > 1:
            result = self._reduce(bucket)
            if isinstance(result, (list, tuple)) and len(result) == 1:
                result = result[0]
            if isinstance(result, Tensor) and result.data_ptr() != buffer.data_ptr():
                buffer.copy_(result.view(-1))
        start = 0
        for tensor in tensors:
            n = tensor.numel()
            tensor.detach().copy_(buffer[start : start + n].view_as(tensor))
            start += n
        self.reductions += 1

    def maximum(self, tensor: Tensor) -> None:
        """Replace ``tensor`` by its element-wise maximum over the group (collective; the ranks agreeing on their
        slowest timings); a peer's failure raised as :meth:`average` raises it."""
        if self.world_size > 1:
            self._guarded(lambda: dist.all_reduce(tensor, dist.ReduceOp.MAX, self.group))

    def _reduce(self, bucket: GradBucket) -> Any:
        """The reducer's result for ``bucket``, :meth:`_guarded`: whether the reducer raises a peer's failure (one
        that exchanges before it returns its future, as the quantized one does) or its future does."""

        def reduce() -> Any:
            future = self.reducer(bucket)
            gave_up = None if self.interrupt is None else wait_for(future, None, self.interrupt)
            if gave_up is not None:
                raise PeerLostError(f"An average over the ranks was given up: {gave_up}.")
            return future.wait()

        return self._guarded(reduce)

    def _guarded(self, collective: Callable[[], Any]) -> Any:
        """``collective()``; a peer's failure in it logged at once and raised with what it most likely means (outside
        ``fault_tolerant``, which recovers from it)."""
        if self.interrupt is not None:
            return collective()
        return guarded(f"Averaging over {self.world_size} ranks", collective)


class PeriodicAverager:
    """torch's ``PeriodicModelAverager`` schedule on a :class:`FlatAverager`: after optimizer step ``k`` (counted from
    0), the parameters are averaged when ``k >= warmup_steps`` and ``(k - warmup_steps) % period == 0``.

    The strategies run it for ``ddp_comm_state=PostLocalSGDState(...)`` with ``model_averaging_period=period``, as
    Lightning's ``DDPStrategy`` runs torch's averager (on CUDA only).

    Examples:
        >>> from lightning_dp_strategies.reducers import NativeReducer
        >>> averager = PeriodicAverager(FlatAverager(NativeReducer()), period=4, warmup_steps=2)
        >>> [averager.after_step([torch.ones(1)]) for _ in range(8)]
        [False, False, True, False, False, False, True, False]
    """

    def __init__(self, averager: FlatAverager, period: int, warmup_steps: int) -> None:
        self.averager = averager
        self.period = period
        self.warmup_steps = warmup_steps
        self.step = 0

    def after_step(self, params: Sequence[Tensor]) -> bool:
        """Call after every optimizer step with its parameters; returns whether they were averaged now."""
        due = self.step >= self.warmup_steps and (self.step - self.warmup_steps) % self.period == 0
        if due:
            self.averager.average(params)
        self.step += 1
        return due
