"""What a reducer is handed (:class:`GradBucket`: a flat buffer, its layout, its group) and the small helpers
reducers use on buffers and futures."""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_dp_strategies.comm import CommCounter

__all__ = ["TIMED_OUT", "GradBucket", "ReduceKind", "completed", "set_event", "views", "wait_for"]


ReduceKind = Literal["avg", "sum"]


@dataclass
class GradBucket:
    """What a reducer is handed: one flat, contiguous buffer to reduce in place over ``group``.

    The buffer holds the gradients of ``shapes`` back to back, then ``num_flags`` extra elements (the presence flags of
    :class:`~lightning_dp_strategies.bucketing.GradientBuckets`; reduce them like everything else).

    Examples:
        >>> bucket = GradBucket(torch.arange(7.0), shapes=[torch.Size([2, 2]), torch.Size([2])], num_flags=1)
        >>> [tuple(g.shape) for g in bucket.gradients()], bucket.flags.tolist(), bucket.world_size
        ([(2, 2), (2,)], [6.0], 1)
    """

    buffer: Tensor
    group: dist.ProcessGroup | None = None
    counter: CommCounter = field(default_factory=CommCounter)
    index: int = 0
    """Position in the launch order (the same bucket has the same index on every rank and every step)."""
    shapes: list[torch.Size] = field(default_factory=list)
    num_flags: int = 0
    op: ReduceKind = "avg"
    duplex: dist.ProcessGroup | None = None
    """Deprecated: a second group over ``group``'s ranks for the ring. :class:`RingReducer` now makes its own in
    :meth:`RingReducer.setup`; one given here still takes precedence. Other reducers ignore it."""
    params: list[Tensor] = field(default_factory=list)
    """The parameters whose gradients the buffer holds, in order (what torch DDP's hooks see as
    ``bucket.parameters()``)."""
    last: bool = False
    """Whether this is the last bucket launched in the backward pass."""

    @property
    def world_size(self) -> int:
        """Ranks in ``group`` (1 when ``torch.distributed`` is not initialised)."""
        return dist.get_world_size(self.group) if dist.is_available() and dist.is_initialized() else 1

    @property
    def flags(self) -> Tensor:
        """The trailing ``num_flags`` elements."""
        return self.buffer[self.buffer.numel() - self.num_flags :]

    def gradients(self) -> list[Tensor]:
        """Views of the buffer shaped like ``shapes``, in order."""
        return views(self.buffer, self.shapes)

    def with_buffer(self, buffer: Tensor, op: ReduceKind | None = None, keep_layout: bool = True) -> GradBucket:
        """The same bucket (group, counter, index) over another buffer, e.g. a compressed copy."""
        if keep_layout:
            return replace(self, buffer=buffer, op=op or self.op)
        return replace(self, buffer=buffer, op=op or self.op, shapes=[], num_flags=0)


def views(buffer: Tensor, shapes: Sequence[Sequence[int]]) -> list[Tensor]:
    """Consecutive views of a flat ``buffer`` shaped like ``shapes``, in order.

    Examples:
        >>> [tuple(v.shape) for v in views(torch.arange(7.0), [(2, 3), (1,)])]
        [(2, 3), (1,)]
    """
    out, start = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(buffer[start : start + n].view(*shape))
        start += n
    return out


def set_event(event: threading.Event, _: object) -> None:
    """A future's done-callback that wakes whoever waits on ``event`` (``add_done_callback(partial(set_event, e))``)."""
    event.set()


TIMED_OUT = "timed out"
INTERRUPT_POLL_S = 0.1
"""How often :func:`wait_for` polls its ``interrupt``."""


def wait_for(
    future: Future[Any], timeout: float | None, interrupt: Callable[[], str | None] | None = None
) -> str | None:
    """Wait until ``future`` is done; ``None`` once it is, else why the wait gave up: :data:`TIMED_OUT` after
    ``timeout`` seconds, or what ``interrupt()`` (polled every ``INTERRUPT_POLL_S``) returned instead of ``None``.

    Examples:
        >>> wait_for(completed(1), 1.0), wait_for(Future(), 0.01), wait_for(Future(), None, lambda: "a peer is gone")
        (None, 'timed out', 'a peer is gone')
    """
    done = threading.Event()
    future.add_done_callback(functools.partial(set_event, done))
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        poll = left if interrupt is None else INTERRUPT_POLL_S if left is None else min(left, INTERRUPT_POLL_S)
        if done.wait(poll):
            return None
        if deadline is not None and time.monotonic() >= deadline:
            return TIMED_OUT
        reason = interrupt() if interrupt is not None else None
        if reason is not None:
            return reason


def completed(value: Any = None) -> Future[Any]:
    """A future that is already done, for reducers that work synchronously.

    Examples:
        >>> completed(3).wait()
        3
    """
    future: Future[Any] = Future()
    future.set_result(value)
    return future
