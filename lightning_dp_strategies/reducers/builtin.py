"""The built-in reducers by name (``ring``, ``native``, ``per_tensor``) and how a ``reducer=`` option resolves."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_dp_strategies.comm import (
    divide_,
    new_duplex_group,
    ring_all_reduce,
    ring_workspace_numel,
)
from lightning_dp_strategies.plan.sizing import ring_bytes_per_rank
from lightning_dp_strategies.reducers.base import GradBucket, Reducer, ReducerBase, completed
from lightning_dp_strategies.reducers.thread import CommThread

__all__ = ["REDUCERS", "NativeReducer", "PerTensorReducer", "RingReducer", "check_reducer", "resolve_reducer"]


class RingReducer(ReducerBase):
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


class NativeReducer(ReducerBase):
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


class PerTensorReducer(ReducerBase):
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
"""The built-in reducers by name, as the strategies' ``reducer=`` option accepts them (and ``"auto"``,
:class:`~lightning_dp_strategies.reducers.AutoReducer`, added by the package)."""


def check_reducer(reducer: object) -> None:
    """A clear error unless ``reducer`` is ``None`` (the ring), a name in :data:`REDUCERS` or a callable; builds
    nothing (no thread, no group), so options can be validated at construction.

    Examples:
        >>> check_reducer("native"); check_reducer(None)
        >>> check_reducer(42)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: `reducer` must be one of ['ring', 'native', ...] or a callable ...
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
        ValueError: Unknown reducer 'tree': use one of ['ring', 'native', ...], or pass a callable ...
    """
    check_reducer(reducer)
    if reducer is None:
        return RingReducer()
    if isinstance(reducer, str):
        return REDUCERS[reducer]()
    return reducer
