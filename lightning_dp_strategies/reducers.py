"""The gradient-reduction contract (a bucket in, a future out) and the built-in reducers.

A reducer is any callable ``reducer(bucket) -> torch.futures.Future`` (the shape of torch DDP's communication hooks).
It must leave ``bucket.buffer`` holding the average (``bucket.op == "avg"``) or the sum (``"sum"``) of every rank's
buffer over ``bucket.group`` by the time the future completes, add what it sent to ``bucket.counter``, and be called
in the same order on every rank (:class:`~lightning_dp_strategies.bucketing.GradientBuckets` guarantees that: buckets
launch strictly in index order). A reducer that needs process groups of its own (a second connection, a
hierarchy's intra- and inter-node groups) makes them in an optional ``setup`` step (see :func:`setup_reducer`), and
releases them in ``close``. The strategies' buckets ask for ``"sum"``: every gradient is divided by the world
size on its way into the bucket (fused into that copy, as torch DDP does), so the sum is the average; ``"avg"`` is
for direct callers. Compression wraps a reducer (:mod:`lightning_dp_strategies.compression`).

==============  ==============================================================  ==========================
name            what it does                                                    runs on
==============  ==============================================================  ==========================
``ring``        this package's ring all-reduce (reduce-scatter + all-gather)    a communication thread
``native``      the backend's ``all_reduce`` (gloo's ring, NCCL's ring/tree)     the backend's own threads
``per_tensor``  one blocking ``all_reduce`` per gradient: the naive reference   the caller (blocks backward)
==============  ==============================================================  ==========================
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_dp_strategies.comm import (
    CommCounter,
    divide_,
    new_duplex_group,
    ring_all_reduce,
    ring_workspace_numel,
)
from lightning_dp_strategies.sizing import ring_bytes_per_rank

__all__ = [
    "REDUCERS",
    "GradBucket",
    "NativeReducer",
    "PerTensorReducer",
    "Reducer",
    "RingReducer",
    "check_reducer",
    "close_reducer",
    "completed",
    "resolve_reducer",
    "setup_reducer",
]

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
        >>> setup_reducer(NativeReducer(), None, ranks=[0, 1])  # no setup step: nothing happens
    """
    setup = getattr(reducer, "setup", None)
    if callable(setup):
        members = list(ranks) if ranks is not None else list(range(dist.get_world_size()))
        setup(group, members, backend)


def close_reducer(reducer: object) -> None:
    """Call ``reducer.close()`` where it has one.

    Examples:
        >>> close_reducer(RingReducer()); close_reducer(lambda bucket: completed(bucket.buffer))
    """
    close = getattr(reducer, "close", None)
    if callable(close):
        close()


def _init_comm_thread(device: torch.device, intra_op_threads: int) -> None:
    """Give the communication thread its creator's device and intra-op thread count.

    OpenMP keeps the thread count per thread: without this, a process limited to one intra-op thread
    (``torch.set_num_threads(1)``) would still start a full OpenMP team for every ``add_`` of the ring, whose
    spinning threads compete with autograd for the same cores.
    """
    torch.set_num_threads(intra_op_threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)


class CommThread:
    """One worker thread, started on first use with its creator's device and intra-op thread count; runs work in
    submission order and hands each result (or exception) to a future. Reducers that work in the background use one.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._executor: ThreadPoolExecutor | None = None

    def submit(self, work: Callable[[], Tensor], device: torch.device) -> Future[Tensor]:
        """Run ``work()`` on the thread after everything submitted before; its result completes the future."""
        if self._executor is None:
            init = functools.partial(_init_comm_thread, device, torch.get_num_threads())
            self._executor = ThreadPoolExecutor(1, thread_name_prefix=self.name, initializer=init)
        future: Future[Tensor] = Future()

        def run() -> None:
            try:
                value = work()
            except BaseException as error:  # handed to whoever waits
                future.set_exception(error)  # type: ignore[arg-type]  # the stub wants the result type
            else:
                future.set_result(value)

        self._executor.submit(run)
        return future

    def close(self) -> None:
        """Stop the thread after the work already submitted."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


class RingReducer:
    """The default reducer (``"ring"``): :func:`~lightning_dp_strategies.comm.ring_all_reduce` on its own thread.

    Buckets are reduced one at a time, in call order, on one communication thread (started on first use with the
    caller's device and intra-op thread count), so backward goes on while they travel. One scratch workspace per dtype
    and device is reused: a fresh half-bucket buffer per reduction costs page faults on large buckets. Its
    :meth:`setup` gives a two-rank gloo ring a second connection (see :meth:`setup`).

    Examples:
        >>> reducer = RingReducer()
        >>> reducer(GradBucket(torch.ones(4))).wait()  # one process: nothing to exchange
        tensor([1., 1., 1., 1.])
        >>> reducer.close()
    """

    def __init__(self) -> None:
        self._workspaces: dict[tuple[torch.dtype, torch.device], Tensor] = {}
        self._thread = CommThread("ldps-grad-comm")
        self._duplex: dict[object, dist.ProcessGroup] = {}  # the group a bucket names -> its second connection

    def setup(self, group: dist.ProcessGroup | None, ranks: Sequence[int], backend: str | None = None) -> None:
        """Make the second group over ``ranks`` that a two-rank ring on gloo sends one direction over, so each
        direction has its own connection (:func:`~lightning_dp_strategies.comm.new_duplex_group`; nothing is made at
        other sizes or on other backends). Call it through :func:`setup_reducer`, on every rank."""
        duplex = new_duplex_group(list(ranks), backend)
        if duplex is not None and dist.get_rank() in ranks:
            self._duplex[group] = duplex

    def duplex_group(self, group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
        """The second connection :meth:`setup` made for buckets over ``group``, or ``None``."""
        return self._duplex.get(group)

    def __call__(self, bucket: GradBucket) -> Future[Tensor]:
        return self._thread.submit(functools.partial(self.reduce, bucket), bucket.buffer.device)

    def reduce(self, bucket: GradBucket) -> Tensor:
        """Reduce ``bucket`` now, in the calling thread; returns its buffer."""
        buffer = bucket.buffer
        if bucket.world_size == 1:
            return buffer
        needed = ring_workspace_numel(buffer.numel(), bucket.world_size)
        key = (buffer.dtype, buffer.device)
        workspace = self._workspaces.get(key)
        if workspace is None or workspace.numel() < needed:
            workspace = self._workspaces[key] = torch.empty(needed, dtype=buffer.dtype, device=buffer.device)
        duplex = bucket.duplex if bucket.duplex is not None else self._duplex.get(bucket.group)
        return ring_all_reduce(
            buffer, bucket.op, group=bucket.group, counter=bucket.counter, workspace=workspace, duplex=duplex
        )

    def close(self) -> None:
        """Stop the communication thread (after the reductions already queued), destroy the groups :meth:`setup`
        made and drop the workspaces; closing twice does nothing more."""
        self._thread.close()
        self._workspaces.clear()
        duplex, self._duplex = list(self._duplex.values()), {}
        if dist.is_initialized():
            for group in duplex:
                dist.destroy_process_group(group)


class NativeReducer:
    """``"native"``: the backend's own asynchronous ``all_reduce`` (gloo's ring, NCCL's ring or tree).

    The sum runs on the backend's threads (or CUDA streams); averaging divides once it completes. The backend does
    not report what it sends, so ``counter.bytes_sent`` records the bandwidth-optimal estimate, 2(N-1)/N of the
    payload, and ``counter.seconds`` the time from launch to completion.

    Examples:
        >>> NativeReducer()(GradBucket(torch.ones(3))).wait()  # one process
        tensor([1., 1., 1.])
    """

    def __call__(self, bucket: GradBucket) -> Future[Tensor]:
        world = bucket.world_size
        if world == 1:
            return completed(bucket.buffer)
        start = time.perf_counter()
        work = dist.all_reduce(bucket.buffer, dist.ReduceOp.SUM, group=bucket.group, async_op=True)
        assert work is not None
        # The callback runs, and is released, on the backend's thread. It must not hold the process group (nor the
        # bucket, which does): if that released the group's last reference, the group would join that very thread
        # ("terminate called after throwing std::system_error: Resource deadlock avoided", seen after teardown).
        buffer, counter, average = bucket.buffer, bucket.counter, bucket.op == "avg"
        nbytes = int(ring_bytes_per_rank(buffer.numel() * buffer.element_size(), world))

        def done(future: Future[Any]) -> Tensor:
            future.value()  # a failed all-reduce raises here: a callback that ignores it turns it into a success
            if average:
                divide_(buffer, world)
            counter.bytes_sent += nbytes
            counter.operations += 1
            counter.seconds += time.perf_counter() - start
            return buffer

        return work.get_future().then(done)


class PerTensorReducer:
    """``"per_tensor"``: one blocking ``all_reduce`` per gradient (and one for the flags): the naive reference.

    Nothing overlaps and nothing is bucketed; keep it as a test oracle, as picotron keeps its naive paths. Counts bytes
    as :class:`NativeReducer` does.

    Examples:
        >>> bucket = GradBucket(torch.ones(5), shapes=[torch.Size([2, 2])], num_flags=1)
        >>> PerTensorReducer()(bucket).wait()
        tensor([1., 1., 1., 1., 1.])
    """

    def __call__(self, bucket: GradBucket) -> Future[Tensor]:
        world = bucket.world_size
        if world == 1:
            return completed(bucket.buffer)
        start = time.perf_counter()
        tensors = [*bucket.gradients(), bucket.flags] if bucket.shapes else [bucket.buffer]
        covered = sum(t.numel() for t in tensors)
        if covered != bucket.buffer.numel():  # a layout that does not describe the whole buffer: reduce it whole
            tensors = [bucket.buffer]
        for tensor in tensors:
            if tensor.numel() == 0:
                continue
            dist.all_reduce(tensor, dist.ReduceOp.SUM, group=bucket.group)
            bucket.counter.bytes_sent += int(ring_bytes_per_rank(tensor.numel() * tensor.element_size(), world))
            bucket.counter.operations += 1
        if bucket.op == "avg":
            divide_(bucket.buffer, world)
        bucket.counter.seconds += time.perf_counter() - start
        return completed(bucket.buffer)


REDUCERS: dict[str, Callable[[], Reducer]] = {
    "ring": RingReducer,
    "native": NativeReducer,
    "per_tensor": PerTensorReducer,
}
"""The built-in reducers by name, as the strategies' ``reducer=`` option accepts them."""


def check_reducer(reducer: object) -> None:
    """A clear error unless ``reducer`` is ``None`` (the ring), a name in :data:`REDUCERS` or a callable; builds
    nothing (no thread, no group), so options can be validated at construction.

    Examples:
        >>> check_reducer("native"); check_reducer(None)
        >>> check_reducer(42)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: `reducer` must be one of ['ring', 'native', 'per_tensor'] or a callable ...
    """
    if reducer is None:
        return
    if isinstance(reducer, str):
        if reducer not in REDUCERS:
            raise ValueError(
                f"Unknown reducer {reducer!r}: use one of {list(REDUCERS)}, or pass a callable "
                "reducer(bucket) -> torch.futures.Future (see lightning_dp_strategies.reducers)."
            )
        return
    if not callable(reducer):
        raise TypeError(
            f"`reducer` must be one of {list(REDUCERS)} or a callable reducer(bucket) -> torch.futures.Future, "
            f"got {reducer!r}."
        )


def resolve_reducer(reducer: str | Reducer | None) -> Reducer:
    """A reducer from a name in :data:`REDUCERS`, a reducer itself, or ``None`` (a new :class:`RingReducer`).

    Examples:
        >>> type(resolve_reducer("native")).__name__, type(resolve_reducer(None)).__name__
        ('NativeReducer', 'RingReducer')
        >>> resolve_reducer("tree")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Unknown reducer 'tree': use one of ['ring', 'native', 'per_tensor'], or pass a callable ...
    """
    check_reducer(reducer)
    if reducer is None:
        return RingReducer()
    if isinstance(reducer, str):
        return REDUCERS[reducer]()
    return reducer
