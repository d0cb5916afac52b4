"""torch DDP communication hooks, run unchanged on this package's gradient buckets, on any device and backend.

A hook written for ``DistributedDataParallel.register_comm_hook(state, hook)`` (``allreduce_hook``,
``fp16_compress_hook``, ``bf16_compress_hook``, ``powerSGD_hook`` with a ``PowerSGDState``, ``batched_powerSGD_hook``,
the ``fp16_compress_wrapper`` / ``bf16_compress_wrapper`` wrappers, or your own) is called as ``hook(state, bucket)``
once per bucket, with a :class:`HookBucket` that answers the ``torch.distributed.GradBucket`` methods hooks call. As
in torch DDP, the bucket holds this rank's gradients *undivided*, the hook averages them and its future completes
with the averaged flat tensor, which is copied back into the bucket when it is another tensor.

The strategies take the hook through Lightning's ``DDPStrategy`` argument names (``ddp_comm_hook``,
``ddp_comm_state``, ``ddp_comm_wrapper``). A ``state`` of ``None`` means the strategy's gradient group, which is
what torch's default hooks take as their state.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_dp_strategies.plan.sizing import ring_bytes_per_rank
from lightning_dp_strategies.reducers.base import GradBucket, Reducer, ReducerBase, completed, set_event, views
from lightning_dp_strategies.reducers.builtin import resolve_reducer
from lightning_dp_strategies.reducers.thread import CommThread

__all__ = ["CommHook", "CommHookReducer", "HookBucket", "check_comm_hook", "hook_name", "make_reducer"]

CommHook = Callable[[Any, Any], Future[Any]]
"""``hook(state, bucket) -> Future[Tensor]``, the signature of torch DDP's communication hooks."""

_HOOK_SIGNATURE = "hook(state, bucket) -> torch.futures.Future[torch.Tensor]"
_CLOSE_CHECK_SECONDS = 0.05
"""How often the hook thread, waiting for a hook's future, checks whether the reducer is being closed."""


class HookBucket:
    """One gradient bucket as a torch DDP communication hook sees it: the methods of ``torch.distributed.GradBucket``.

    ``gradients()`` are views of the current ``buffer()`` (also after ``set_buffer``), as in torch.

    Examples:
        >>> w, b = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))
        >>> bucket = HookBucket(0, True, torch.arange(6.0), [w, b])
        >>> [tuple(g.shape) for g in bucket.gradients()], bucket.is_last(), bucket.index()
        ([(2, 2), (2,)], True, 0)
        >>> bucket.set_buffer(bucket.buffer().half()); bucket.gradients()[1]
        tensor([4., 5.], dtype=torch.float16)
    """

    def __init__(self, index: int, last: bool, buffer: Tensor, params: Sequence[Tensor]) -> None:
        self._index = index
        self._last = last
        self._buffer = buffer
        self._params = list(params)

    def index(self) -> int:
        """The bucket's position in the launch order, the same on every rank and step."""
        return self._index

    def is_last(self) -> bool:
        """Whether this is the last bucket of the backward pass (torch's PowerSGD counts iterations on it)."""
        return self._last

    def buffer(self) -> Tensor:
        """The flat gradients of the bucket (this rank's, undivided until the hook averages them)."""
        return self._buffer

    def set_buffer(self, buffer: Tensor) -> None:
        """Replace the flat tensor, e.g. with a compressed copy (torch's ``fp16_compress_wrapper``)."""
        self._buffer = buffer

    def gradients(self) -> list[Tensor]:
        """Views of ``buffer()`` shaped like the parameters, in order."""
        return views(self._buffer, [p.shape for p in self._params])

    def parameters(self) -> list[Tensor]:
        """The parameters whose gradients the bucket holds, in order."""
        return list(self._params)


def _takes_two_positional(fn: Callable[..., Any]) -> bool | None:
    """Whether ``fn(a, b)`` binds; ``None`` when the signature cannot be read (a builtin)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(object(), object())
    except TypeError:
        return False
    return True


def check_comm_hook(
    hook: object,
    state: object = None,
    wrapper: object = None,
    reducer: object = None,
    model_averaging_period: object = None,
) -> CommHook | None:
    """The hook to call, ``wrapper(hook)`` when a wrapper is given, or ``None`` without a hook; a clear error, at
    construction, for anything torch DDP would not accept or this package cannot honour.

    ``PostLocalSGDState`` (post-local SGD) needs ``model_averaging_period``, the steps between the parameter averages
    that follow the warm-up, as in Lightning's ``DDPStrategy``; a period without that state is refused too.

    Examples:
        >>> from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as default
        >>> check_comm_hook(default.allreduce_hook) is default.allreduce_hook
        True
        >>> check_comm_hook(None, state=object())  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: `ddp_comm_state` was given without `ddp_comm_hook`...
        >>> check_comm_hook(lambda bucket: bucket)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: `ddp_comm_hook` must be callable as hook(state, bucket) -> torch.futures.Future[torch.Tensor]...
    """
    if hook is None:
        for name, value in (("ddp_comm_state", state), ("ddp_comm_wrapper", wrapper)):
            if value is not None:
                raise ValueError(
                    f"`{name}` was given without `ddp_comm_hook`, so nothing would use it. Pass the hook too, e.g. "
                    "`ddp_comm_hook=powerSGD_hook` with `ddp_comm_state=PowerSGDState(...)`, or drop the argument."
                )
        return None
    if reducer is not None:
        raise ValueError(
            f"Both `reducer={reducer!r}` and `ddp_comm_hook` were given; a communication hook does its own "
            "communication, so it replaces the reducer. Pass only one of them."
        )
    if not callable(hook) or _takes_two_positional(hook) is False:
        raise TypeError(
            f"`ddp_comm_hook` must be callable as {_HOOK_SIGNATURE}, as torch DDP's `register_comm_hook` expects; "
            f"got {_describe(hook)}. Torch's hooks are in `torch.distributed.algorithms.ddp_comm_hooks`."
        )
    _check_post_local_sgd(state, model_averaging_period)
    if wrapper is None:
        return hook
    if not callable(wrapper):
        raise TypeError(f"`ddp_comm_wrapper` must be callable as wrapper(hook) -> hook, got {_describe(wrapper)}.")
    wrapped = wrapper(hook)
    if not callable(wrapped) or _takes_two_positional(wrapped) is False:
        raise TypeError(
            f"`ddp_comm_wrapper({_describe(hook)})` must return a hook callable as {_HOOK_SIGNATURE} (as torch's "
            f"`fp16_compress_wrapper` does), got {_describe(wrapped)}."
        )
    return wrapped


def _check_post_local_sgd(state: object, period: object) -> None:
    """``PostLocalSGDState`` and ``model_averaging_period`` come together (see :func:`check_comm_hook`)."""
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState

    post_local = isinstance(state, PostLocalSGDState)
    if post_local and period is None:
        raise ValueError(
            "`ddp_comm_state=PostLocalSGDState(...)` needs periodic model averaging after its warm-up: pass "
            "`model_averaging_period=N` (the optimizer steps between parameter averages) to RingAllReduceStrategy, "
            "as to Lightning's DDPStrategy. Or use LocalSGDStrategy(sync_every=N, warmup_steps=...)."
        )
    if period is not None and not post_local:
        raise ValueError(
            "`model_averaging_period` averages the parameters after post-local SGD's warm-up: pass it with "
            "`ddp_comm_state=PostLocalSGDState(...)` and `ddp_comm_hook=post_localSGD_hook`, or drop it."
        )
    if post_local and (isinstance(period, bool) or not isinstance(period, int) or period < 1):
        raise ValueError(f"`model_averaging_period` must be an int >= 1 (optimizer steps), got {period!r}.")


def calls_torch_powersgd(hook: object) -> bool:
    """Whether ``hook`` is torch's ``powerSGD_hook`` or ``batched_powerSGD_hook``, or a wrapper of one
    (``fp16_compress_wrapper(powerSGD_hook)``: found through the wrapper's closure)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    seen: set[int] = set()
    todo = [hook]
    while todo:
        fn = todo.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        if fn is powersgd.powerSGD_hook or fn is powersgd.batched_powerSGD_hook:
            return True
        todo += [cell.cell_contents for cell in getattr(fn, "__closure__", None) or () if callable(cell.cell_contents)]
        todo += [f for f in (getattr(fn, "func", None), getattr(fn, "__wrapped__", None)) if callable(f)]
    return False


_POWERSGD_ON_CPU = (
    " torch's PowerSGD hooks call torch.cuda.synchronize(device) with the bucket's device whenever CUDA is available,"
    " which fails for a bucket on the CPU ('Expected a cuda device, but got: cpu'): on a machine with a GPU, reduce"
    " CPU buckets with this package's `reducer=PowerSGD(...)`, or hide the GPU from the processes"
    " (CUDA_VISIBLE_DEVICES='')."
)
"""Added to a failed bucket's message where torch's PowerSGD hooks meet a process that sees a GPU."""


def _describe(obj: object) -> str:
    name = getattr(obj, "__qualname__", None) or repr(obj)
    try:
        return f"{name}{inspect.signature(obj)}"  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return str(name)


class CommHookReducer(ReducerBase):
    """A reducer (:class:`~lightning_dp_strategies.reducers.ReducerBase`) that runs a torch DDP communication hook.

    :class:`~lightning_dp_strategies.bucketing.GradientBuckets` hands it each bucket undivided and without the
    presence flags (its :attr:`hands_raw_gradients` is true), reduces the flags apart, and the hook averages, as in
    torch DDP.

    The hook runs on a thread of its own, one bucket at a time in launch order, each to completion, while backward
    goes on. So every collective a hook starts, also those it chains in callbacks on the backend's threads (torch's
    PowerSGD starts two more per bucket there), is issued in the same order on every rank: with several buckets in
    flight at once, gloo would otherwise see the ranks' collectives in different orders and abort. The
    bucket's counter gets one operation per bucket, the time from launch to completion, and the bytes a
    bandwidth-optimal all-reduce of the uncompressed bucket sends (an upper bound for compressing hooks, whose
    traffic the package cannot see).

    Args:
        hook: ``hook(state, bucket) -> Future[Tensor]``.
        state: the hook's first argument; ``None`` passes the bucket's process group (the strategy's gradient
            group), what torch's default hooks take. A state with a ``process_group`` of ``None`` (``PowerSGDState``)
            gets the gradient group in :meth:`setup` when that group is not the whole world, and its ``None`` back in
            :meth:`close`.

    Examples:
        >>> from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as default
        >>> reducer = CommHookReducer(default.allreduce_hook)
        >>> reducer(GradBucket(torch.ones(3), op="avg")).wait()  # one process: the hook is not needed
        tensor([1., 1., 1.])
    """

    def __init__(self, hook: CommHook, state: object = None) -> None:
        self.hook = hook
        self.state = state
        self._lent_group = False
        self._thread = CommThread("ldps-comm-hook")
        self._closing = False

    @property
    def hands_raw_gradients(self) -> bool:
        """``True``: the buckets give this reducer undivided gradients without the flags; the hook averages."""
        return True

    @property
    def failure_hint(self) -> str:
        """Appended to the error when a bucket fails or never completes."""
        return (
            f"The bucket was reduced by the communication hook {_describe(self.hook)}. A hook must return a "
            "torch.futures.Future that completes with the averaged flat gradient tensor (the size of "
            "`bucket.buffer()`), e.g. `dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: "
            "f.value()[0])`; a future that is never completed fails at the strategy's `timeout`. If the hook is "
            "correct, another rank most likely failed: look for the first error in the other ranks' logs."
        ) + (_POWERSGD_ON_CPU if torch.cuda.is_available() and calls_torch_powersgd(self.hook) else "")

    def setup(self, group: dist.ProcessGroup | None, ranks: Sequence[int], backend: str | None = None) -> None:
        """Check (or lend) the process group of a state that names one; called on every rank for every group."""
        if dist.get_rank() not in ranks or not hasattr(self.state, "process_group"):
            return
        own = getattr(self.state, "process_group")  # noqa: B009  # any state with this attribute, not one type
        world = list(range(dist.get_world_size()))
        if own is None:
            if list(ranks) != world:
                self.state.process_group = group  # put back to None in close()
                self._lent_group = True
            return
        if sorted(dist.get_process_group_ranks(own)) != sorted(ranks):
            raise ValueError(
                f"`ddp_comm_state.process_group` spans ranks {sorted(dist.get_process_group_ranks(own))}, but this "
                f"rank averages its gradients with ranks {sorted(ranks)}. Leave `process_group=None` in the state: "
                "the strategy then gives the hook its own gradient group."
            )

    def close(self) -> None:
        """Stop the hook thread (a hook whose future never completes is given up), and give the state its
        ``process_group=None`` back if :meth:`setup` lent it the gradient group."""
        self._closing = True
        self._thread.close()
        self._closing = False
        if self._lent_group:
            self.state.process_group = None  # type: ignore[attr-defined]
            self._lent_group = False

    def __call__(self, bucket: GradBucket) -> Future[Tensor]:
        if bucket.world_size == 1:
            return completed(bucket.buffer)
        return self._thread.submit(functools.partial(self._run, bucket), bucket.buffer.device)

    def _run(self, bucket: GradBucket) -> Tensor:
        """Call the hook on ``bucket`` and wait for its future (on the hook thread); returns the averaged buffer."""
        buffer, world = bucket.buffer, bucket.world_size
        state = self.state if self.state is not None else bucket.group
        start = time.perf_counter()
        future = self.hook(state, HookBucket(bucket.index, bucket.last, buffer, bucket.params))
        if not all(callable(getattr(future, name, None)) for name in ("then", "wait", "done", "add_done_callback")):
            raise TypeError(
                f"The communication hook {_describe(self.hook)} returned {type(future).__name__}, not a "
                f"torch.futures.Future. A hook is {_HOOK_SIGNATURE}: return e.g. "
                "`dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])`."
            )
        done = threading.Event()
        future.add_done_callback(functools.partial(set_event, done))
        while not done.wait(_CLOSE_CHECK_SECONDS):
            if self._closing:  # the buckets gave up on it (their timeout) and are being torn down
                raise RuntimeError(f"closed before the hook's future for bucket {bucket.index} completed")
        value = future.wait()
        result = value[0] if isinstance(value, (list, tuple)) and len(value) == 1 else value
        if not isinstance(result, Tensor) or result.numel() != buffer.numel():
            got = f"a tensor of {result.numel()} elements" if isinstance(result, Tensor) else type(value).__name__
            raise ValueError(
                f"the communication hook's future for bucket {bucket.index} completed with {got}; it must complete "
                f"with the averaged flat gradients, a tensor of {buffer.numel()} elements (`bucket.buffer()`)."
            )
        if result.data_ptr() != buffer.data_ptr() or result.dtype != buffer.dtype:
            buffer.copy_(result.view(-1))
        bucket.counter.operations += 1
        bucket.counter.bytes_sent += int(ring_bytes_per_rank(buffer.numel() * buffer.element_size(), world))
        bucket.counter.seconds += time.perf_counter() - start
        return buffer


def make_reducer(reducer: str | Reducer | None, comm_hook: CommHook | None, comm_state: object = None) -> Reducer:
    """The reducer of a strategy's buckets: the communication hook when there is one, else the ``reducer=`` option
    (:func:`~lightning_dp_strategies.reducers.resolve_reducer`).

    Examples:
        >>> from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as default
        >>> type(make_reducer(None, default.allreduce_hook)).__name__, type(make_reducer("native", None)).__name__
        ('CommHookReducer', 'NativeReducer')
    """
    if comm_hook is not None:
        return CommHookReducer(comm_hook, comm_state)
    return resolve_reducer(reducer)


def hook_name(hook: Callable[..., Any] | None) -> str | None:
    """A stable name of ``hook`` for the ranks' agreement check (``None`` without one).

    Examples:
        >>> from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as default
        >>> hook_name(default.allreduce_hook)
        'torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook'
    """
    if hook is None:
        return None
    return f"{getattr(hook, '__module__', '')}.{getattr(hook, '__qualname__', type(hook).__qualname__)}"
