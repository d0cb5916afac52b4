"""The gradient-reduction contract: a :class:`GradBucket` in, a future out, with an optional setup and close."""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_dp_strategies.comm import (
    CommCounter,
)

__all__ = ["GradBucket", "ReduceKind", "Reducer", "close_reducer", "completed", "set_event", "setup_reducer", "views"]


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


@runtime_checkable
class Reducer(Protocol):
    """``reducer(bucket) -> Future``: reduce ``bucket.buffer`` in place; the future completes when it holds the result.

    Optional: a ``setup(group, ranks, backend)`` method that makes the process groups the reducer needs for buckets
    reduced over ``group`` (called through :func:`setup_reducer`, on every rank, before the first bucket), and a
    ``close()`` method, called when the buckets are torn down (stop threads, destroy those groups, free state).

    A callback chained on a backend's future (``work.get_future().then(...)``) runs, and is released, on the
    backend's own thread: let it capture the buffer and counter, never ``bucket`` or its ``group``. Releasing a
    process group's last reference there makes the group join that very thread, and the process aborts. The callback
    runs when the collective failed too: call ``future.value()`` in it first, or the chained future completes as if
    all went well.

    Examples:
        >>> def doubling(bucket: GradBucket) -> Future[Tensor]:  # a toy reducer: synchronous, then done
        ...     bucket.buffer.mul_(2)
        ...     return completed(bucket.buffer)
        >>> isinstance(doubling, Reducer), doubling(GradBucket(torch.ones(2))).wait()
        (True, tensor([2., 2.]))
    """

    def __call__(self, bucket: GradBucket) -> Future[Any]: ...


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


def completed(value: Any = None) -> Future[Any]:
    """A future that is already done, for reducers that work synchronously.

    Examples:
        >>> completed(3).wait()
        3
    """
    future: Future[Any] = Future()
    future.set_result(value)
    return future


def setup_reducer(
    reducer: Reducer, group: dist.ProcessGroup | None, ranks: Sequence[int] | None = None, backend: str | None = None
) -> None:
    """Run ``reducer``'s optional ``setup(group, ranks, backend)``: where it makes the groups it needs for ``group``.

    Making a process group is collective over the whole world, so call this on *every* rank (also those outside
    ``ranks``, which get torch's placeholder for ``group``), once per group the reducer will serve, in the same order
    everywhere. ``ranks`` are ``group``'s global ranks (``None``: the world); ``backend`` is the backend of the groups
    to make (``None``: the default group's).

    Examples:
        >>> class Counting:
        ...     def __init__(self) -> None:
        ...         self.groups = []
        ...     def __call__(self, bucket: GradBucket) -> Future[Tensor]:
        ...         return completed(bucket.buffer)
        ...     def setup(self, group, ranks, backend) -> None:
        ...         self.groups.append(ranks)  # a real reducer would call dist.new_group(...) here
        >>> reducer = Counting()
        >>> setup_reducer(reducer, None, ranks=[0, 1]); reducer.groups
        [[0, 1]]
        >>> from lightning_dp_strategies.reducers import NativeReducer, RingReducer
        >>> setup_reducer(NativeReducer(), None, ranks=[0, 1])  # no setup step: nothing happens
    """
    setup = getattr(reducer, "setup", None)
    if callable(setup):
        members = list(ranks) if ranks is not None else list(range(dist.get_world_size()))
        setup(group, members, backend)


def close_reducer(reducer: object) -> None:
    """Call ``reducer.close()`` where it has one.

    Examples:
        >>> from lightning_dp_strategies.reducers import RingReducer
        >>> close_reducer(RingReducer()); close_reducer(lambda bucket: completed(bucket.buffer))
    """
    close = getattr(reducer, "close", None)
    if callable(close):
        close()
