"""The gradient-reduction contract: a :class:`GradBucket` in, a future out; optional steps declared by a base class."""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch  # noqa: F401  # the doctests build tensors
import torch.distributed as dist
from torch.futures import Future

from lightning_dp_strategies.comm.failures import PEER_FAILURE_HINT
from lightning_dp_strategies.reducers.bucket import (  # what a reducer is handed, importable from here too
    GradBucket as GradBucket,
    ReduceKind as ReduceKind,
    completed as completed,
    set_event as set_event,
    views as views,
)

__all__ = [
    "CallableReducer",
    "GradBucket",
    "ReduceKind",
    "Reducer",
    "ReducerBase",
    "ReducerWrapper",
    "StepTiming",
    "as_reducer",
    "close_reducer",
    "completed",
    "set_event",
    "setup_reducer",
    "views",
]


@runtime_checkable
class Reducer(Protocol):
    """``reducer(bucket) -> Future``: reduce ``bucket.buffer`` in place; the future completes when it holds the result.

    The shape of any reducer, a plain function included. A reducer with optional steps (a setup that makes process
    groups, a close, a look at every step) declares them by subclassing :class:`ReducerBase`; the package reads every
    reducer through :func:`as_reducer`, which adapts a plain callable.

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


@dataclass(frozen=True)
class StepTiming:
    """One optimizer step as the gradient sync saw it (seconds): from one step's end to the next, the backward
    passes that communicated, and the time spent waiting for their reduction after backward
    (:meth:`ReducerBase.observe_step` is handed one after every optimizer step).

    Examples:
        >>> timing = StepTiming(interval=0.5, backward=0.03, exposed=0.42)
        >>> round(timing.interval - timing.exposed, 2)  # the compute: what the step did besides waiting
        0.08
    """

    interval: float
    backward: float
    exposed: float


class ReducerBase(ABC):
    """The declared reducer contract: :meth:`__call__`, and optional steps whose defaults do nothing.

    Subclass it and implement :meth:`__call__`; override an optional step only where the reducer needs it:

    ===========================  ==========================================================  ========================
    step                         when the package uses it                                    default
    ===========================  ==========================================================  ========================
    :meth:`setup`                once per group the buckets reduce over, on every rank,      nothing
                                 before the first bucket (:func:`setup_reducer`)
    :meth:`close`                when the buckets are torn down (:func:`close_reducer`)      nothing
    :meth:`observe_step`         after every optimizer step, with the step's timing          nothing
    :attr:`hands_raw_gradients`  read once by the buckets: hand undivided gradients          ``False``
                                 without the presence flags, the reducer averages
    :attr:`scatters`             read once by the buckets: only this rank's chunk is         ``False``
                                 reduced, so ``.grad`` stays unset
    :attr:`failure_hint`         appended to the error when a bucket fails or times out      another rank failed
    ===========================  ==========================================================  ========================

    A reducer around another one subclasses :class:`ReducerWrapper`, which hands every optional step on.

    Examples:
        >>> class Halving(ReducerBase):
        ...     def __call__(self, bucket: GradBucket) -> Future[Tensor]:
        ...         return completed(bucket.buffer.div_(2))
        >>> reducer = Halving()
        >>> reducer(GradBucket(torch.ones(2))).wait(), reducer.scatters, reducer.hands_raw_gradients
        (tensor([0.5000, 0.5000]), False, False)
        >>> setup_reducer(reducer, None, ranks=[0, 1]); reducer.close()  # the default steps: nothing happens
    """

    @abstractmethod
    def __call__(self, bucket: GradBucket) -> Future[Any]:
        """Reduce ``bucket.buffer`` in place over ``bucket.group`` (its average for ``bucket.op == "avg"``, its sum
        for ``"sum"``), add what was sent to ``bucket.counter``, and return at once a future that completes, with the
        buffer, when it holds the result. Called strictly in bucket order, the same on every rank."""

    def setup(self, group: dist.ProcessGroup | None, ranks: Sequence[int], backend: str | None = None) -> None:  # noqa: B027  # optional: a no-op by default
        """Make the process groups the reducer needs for buckets reduced over ``group`` (global ``ranks``), with
        ``backend``. Collective over the whole world: called through :func:`setup_reducer` on every rank, also those
        outside ``ranks``, once per group, in the same order everywhere. The default makes none."""

    def close(self) -> None:  # noqa: B027  # optional: a no-op by default
        """Release what :meth:`setup` and the reductions made (threads, groups, state). The default has nothing."""

    def observe_step(self, timing: StepTiming) -> None:  # noqa: B027  # optional: a no-op by default
        """After every optimizer step, on every rank of the group: how the step went. The default ignores it."""

    @property
    def hands_raw_gradients(self) -> bool:
        """Whether the buckets hand this reducer every gradient undivided and without the presence flags (it
        averages itself, as a torch DDP communication hook does; the flags are then summed apart)."""
        return False

    @property
    def scatters(self) -> bool:
        """Whether only this rank's chunk of the gradients is reduced (reduce-scatter), so the buckets leave
        ``.grad`` unset and a sharded optimizer takes the chunk."""
        return False

    @property
    def failure_hint(self) -> str:
        """Appended to the error when a bucket fails or never completes: what most likely went wrong."""
        return PEER_FAILURE_HINT


class ReducerWrapper(ReducerBase):
    """A reducer around another one, ``inner``: every optional step is handed on to it.

    ``setup``, ``close``, ``observe_step`` and the properties are ``inner``'s; a subclass overrides
    :meth:`__call__` (the default hands the bucket on unchanged) and, where it changes what a step means, that step.
    The compression wrappers (:class:`~lightning_dp_strategies.reducers.CastCompression`,
    :class:`~lightning_dp_strategies.reducers.PowerSGD`) are built on it.

    Args:
        inner: the wrapped reducer; a plain callable is adapted (:func:`as_reducer`). To name a built-in reducer
            (``"ring"``), pass :func:`~lightning_dp_strategies.reducers.resolve_reducer`'s result.

    Examples:
        >>> class Counting(ReducerWrapper):
        ...     calls = 0
        ...     def __call__(self, bucket: GradBucket) -> Future[Any]:
        ...         self.calls += 1
        ...         return self.inner(bucket)
        >>> from lightning_dp_strategies.reducers import RingReducer
        >>> reducer = Counting(RingReducer())
        >>> reducer(GradBucket(torch.ones(2))).wait(), reducer.calls  # one process: nothing to exchange
        (tensor([1., 1.]), 1)
        >>> reducer.close()  # closes the ring's thread too
    """

    def __init__(self, inner: Reducer) -> None:
        self.inner: ReducerBase = as_reducer(inner)

    def __call__(self, bucket: GradBucket) -> Future[Any]:
        """Hand ``bucket`` to ``inner`` unchanged."""
        return self.inner(bucket)

    def setup(self, group: dist.ProcessGroup | None, ranks: Sequence[int], backend: str | None = None) -> None:
        """``inner``'s setup step."""
        self.inner.setup(group, ranks, backend)

    def close(self) -> None:
        """Close ``inner``."""
        self.inner.close()

    def observe_step(self, timing: StepTiming) -> None:
        """Tell ``inner`` how the step went."""
        self.inner.observe_step(timing)

    @property
    def hands_raw_gradients(self) -> bool:
        """``inner``'s."""
        return self.inner.hands_raw_gradients

    @property
    def scatters(self) -> bool:
        """``inner``'s."""
        return self.inner.scatters

    @property
    def failure_hint(self) -> str:
        """``inner``'s."""
        return self.inner.failure_hint


_OPTIONAL_STEPS = ("setup", "close", "observe_step", "hands_raw_gradients", "scatters", "failure_hint")


class CallableReducer(ReducerBase):
    """A reducer given as a plain callable ``reducer(bucket) -> Future``, as a :class:`ReducerBase`.

    The callable reduces; the optional steps keep their defaults. An object that is not a :class:`ReducerBase` but
    has members named like the optional steps still has them used, with a ``DeprecationWarning``: subclass
    :class:`ReducerBase` to declare them.

    Examples:
        >>> adapted = CallableReducer(lambda bucket: completed(bucket.buffer))
        >>> adapted(GradBucket(torch.ones(2))).wait(), adapted.scatters
        (tensor([1., 1.]), False)
    """

    def __init__(self, fn: Reducer) -> None:
        self.fn = fn
        self._undeclared = {name: getattr(fn, name) for name in _OPTIONAL_STEPS if hasattr(fn, name)}
        if self._undeclared:
            warnings.warn(
                f"The reducer {type(fn).__qualname__} has {', '.join(self._undeclared)} without subclassing "
                "lightning_dp_strategies.reducers.ReducerBase (or ReducerWrapper, for a reducer around another): "
                "subclass it so these steps are declared. They are still used for now.",
                DeprecationWarning,
                stacklevel=3,
            )

    def __call__(self, bucket: GradBucket) -> Future[Any]:
        return self.fn(bucket)

    def setup(self, group: dist.ProcessGroup | None, ranks: Sequence[int], backend: str | None = None) -> None:
        self._undeclared_step("setup", group, ranks, backend)

    def close(self) -> None:
        self._undeclared_step("close")

    def observe_step(self, timing: StepTiming) -> None:
        self._undeclared_step("observe_step", timing)

    def _undeclared_step(self, name: str, *args: object) -> None:
        step = self._undeclared.get(name)
        if callable(step):
            step(*args)

    @property
    def hands_raw_gradients(self) -> bool:
        return bool(self._undeclared.get("hands_raw_gradients", False))

    @property
    def scatters(self) -> bool:
        return bool(self._undeclared.get("scatters", False))

    @property
    def failure_hint(self) -> str:
        return str(self._undeclared.get("failure_hint", PEER_FAILURE_HINT))


def as_reducer(reducer: Reducer) -> ReducerBase:
    """``reducer`` as the declared contract: a :class:`ReducerBase` as it is, a plain callable adapted
    (:class:`CallableReducer`). Every optional step the package takes goes through this.

    Examples:
        >>> from lightning_dp_strategies.reducers import NativeReducer
        >>> native = NativeReducer()
        >>> as_reducer(native) is native, type(as_reducer(lambda bucket: completed(bucket.buffer))).__name__
        (True, 'CallableReducer')
        >>> as_reducer(42)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: A reducer is a ReducerBase subclass or a callable reducer(bucket) -> torch.futures.Future, got 42...
    """
    if isinstance(reducer, ReducerBase):
        return reducer
    if not callable(reducer):
        raise TypeError(
            "A reducer is a ReducerBase subclass or a callable reducer(bucket) -> torch.futures.Future, got "
            f"{reducer!r}. Pass a name such as 'ring' to the strategy's `reducer=` option, or see "
            "lightning_dp_strategies.reducers."
        )
    return CallableReducer(reducer)


def setup_reducer(
    reducer: Reducer, group: dist.ProcessGroup | None, ranks: Sequence[int] | None = None, backend: str | None = None
) -> None:
    """Run ``reducer``'s setup step (:meth:`ReducerBase.setup`): where it makes the groups it needs for ``group``.

    Making a process group is collective over the whole world, so call this on *every* rank (also those outside
    ``ranks``, which get torch's placeholder for ``group``), once per group the reducer will serve, in the same order
    everywhere. ``ranks`` are ``group``'s global ranks (``None``: the world); ``backend`` is the backend of the groups
    to make (``None``: the default group's).

    Examples:
        >>> class Counting(ReducerBase):
        ...     def __init__(self) -> None:
        ...         self.groups = []
        ...     def __call__(self, bucket: GradBucket) -> Future[Tensor]:
        ...         return completed(bucket.buffer)
        ...     def setup(self, group, ranks, backend=None) -> None:
        ...         self.groups.append(ranks)  # a real reducer would call dist.new_group(...) here
        >>> reducer = Counting()
        >>> setup_reducer(reducer, None, ranks=[0, 1]); reducer.groups
        [[0, 1]]
        >>> from lightning_dp_strategies.reducers import NativeReducer
        >>> setup_reducer(NativeReducer(), None, ranks=[0, 1])  # no setup step of its own: nothing happens
    """
    if ranks is None:  # the world (one process without torch.distributed)
        ranks = range(dist.get_world_size()) if dist.is_available() and dist.is_initialized() else [0]
    as_reducer(reducer).setup(group, list(ranks), backend)


def close_reducer(reducer: Reducer) -> None:
    """Run ``reducer``'s close step (:meth:`ReducerBase.close`; a plain callable has none).

    Examples:
        >>> from lightning_dp_strategies.reducers import RingReducer
        >>> close_reducer(RingReducer()); close_reducer(lambda bucket: completed(bucket.buffer))
    """
    as_reducer(reducer).close()
