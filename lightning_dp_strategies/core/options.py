"""Validation of the options the multi-process strategies share; each error names the allowed values."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Generic, Literal, TypedDict, TypeVar, overload

import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment

from lightning_dp_strategies.reducers import (
    CommHook,
    NativeReducer,
    Reducer,
    RingReducer,
    check_comm_hook,
    check_reducer,
    make_reducer,
)

T = TypeVar("T")

__all__ = [
    "BucketedConfig",
    "ConfigOption",
    "ReductionOptions",
    "RingAllReduceConfig",
    "SharedOptions",
    "check_backend",
    "check_flag",
    "check_positive",
    "check_reducer",
    "check_start_method",
    "check_timeout",
    "default_timeout",
    "lightning_arguments",
]

START_METHODS = ("popen", "spawn", "fork", "forkserver")
CPU_DEFAULT_TIMEOUT = timedelta(minutes=5)
"""Default collective timeout on gloo: a dead rank makes the others fail within five minutes instead of hanging."""
ACCELERATOR_DEFAULT_TIMEOUT = timedelta(minutes=30)
"""Default collective timeout on NCCL and other accelerator backends (Lightning's own default)."""


def default_timeout(backend: str) -> timedelta:
    """The collective timeout when none was given: short on gloo (CPU), Lightning's default on accelerators."""
    return CPU_DEFAULT_TIMEOUT if backend == "gloo" else ACCELERATOR_DEFAULT_TIMEOUT


def check_positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(
            f"`{name}` must be a positive number of MiB (default {25 if name == 'bucket_cap_mb' else 1}),"
            f" got {value!r}."
        )
    return float(value)


def check_backend(backend: object) -> str | None:
    if backend is None:
        return None
    known = [b for b in dist.Backend.backend_list if b not in ("undefined", "fake")]
    parts = [p.split(":")[-1] for p in backend.split(",")] if isinstance(backend, str) else [backend]
    if not all(isinstance(p, str) and p.lower() in known for p in parts):
        raise ValueError(
            f"Unknown `process_group_backend` {backend!r}: use one of {known} (or 'cpu:gloo,cuda:nccl'), or leave it "
            "as None to pick gloo on CPU and nccl on CUDA."
        )
    missing = [p.lower() for p in parts if isinstance(p, str) and not dist.is_backend_available(p.lower())]
    if missing:
        available = [b for b in known if dist.is_backend_available(b)]
        raise ValueError(
            f"`process_group_backend` {backend!r} needs {missing}, which this PyTorch build does not have (it has "
            f"{available}). Use one of {available} (gloo on CPU), install a PyTorch build with {missing[0]}, or "
            "leave it as None to pick gloo on CPU and nccl on CUDA."
        )
    assert isinstance(backend, str)
    return backend


def check_flag(name: str, value: object) -> bool:
    """``value`` itself when it is a bool; a clear error otherwise (``"no"`` would silently mean True)."""
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be True or False, got {value!r}.")
    return value


def check_dim(dim: object) -> int:
    """``dim`` itself when it is a non-negative int (the batch dimension scatter/gather splits), else a clear error.

    Examples:
        >>> check_dim(1)
        1
        >>> check_dim(True)
        Traceback (most recent call last):
        ...
        ValueError: `dim` must be a non-negative int (the batch dimension, default 0), got True.
    """
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
        raise ValueError(f"`dim` must be a non-negative int (the batch dimension, default 0), got {dim!r}.")
    return dim


def check_timeout(timeout: object) -> timedelta | None:
    if timeout is None or isinstance(timeout, timedelta):
        if isinstance(timeout, timedelta) and timeout.total_seconds() <= 0:
            raise ValueError(f"`timeout` must be positive, got {timeout!r}.")
        return timeout
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0:
        return timedelta(seconds=float(timeout))
    raise ValueError(
        f"`timeout` must be a datetime.timedelta or a positive number of seconds, got {timeout!r}; None picks "
        f"{CPU_DEFAULT_TIMEOUT} on gloo and {ACCELERATOR_DEFAULT_TIMEOUT} on NCCL."
    )


def check_start_method(start_method: object) -> str:
    """``start_method`` itself, or a clear error listing the launchers."""
    if start_method not in START_METHODS:
        raise ValueError(f"Unknown `start_method` {start_method!r}: use one of {list(START_METHODS)}.")
    assert isinstance(start_method, str)
    return start_method


class ConfigOption(Generic[T]):
    """A read-only strategy attribute that reads the option of the same name from the strategy's ``config`` (or
    another frozen options object, named by ``source``).

    For the option names strategies exposed before their options moved into one frozen configuration object.
    """

    def __init__(self, source: str = "config") -> None:
        self.source = source

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.__doc__ = f"``{self.source}.{name}`` (read-only)."

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> ConfigOption[T]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...
    def __get__(self, obj: object | None, owner: type | None = None) -> ConfigOption[T] | T:
        if obj is None:
            return self
        value: T = getattr(getattr(obj, self.source), self.name)
        return value

    def __set__(self, obj: object, value: object) -> None:
        raise AttributeError(
            f"`{self.name}` is read-only: the options are fixed when the strategy is made; pass {self.name}=... to "
            f"{type(obj).__name__}(...)."
        )


@dataclass(frozen=True)
class BucketedConfig:
    """The bucket options every bucketed strategy has; a strategy's own options extend it (validated on creation).

    Examples:
        >>> BucketedConfig(bucket_cap_mb=10).first_bucket_cap_mb
        1.0
        >>> BucketedConfig(bucket_cap_mb=0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: `bucket_cap_mb` must be a positive number of MiB (default 25), got 0.
    """

    bucket_cap_mb: float = 25.0
    """Cap of every gradient bucket but the first, in MiB."""
    first_bucket_cap_mb: float = 1.0
    """Cap of the first bucket in MiB, small so that communication starts early in backward."""

    def __post_init__(self) -> None:
        for name in ("bucket_cap_mb", "first_bucket_cap_mb"):
            object.__setattr__(self, name, check_positive(name, getattr(self, name)))


@dataclass(frozen=True)
class RingAllReduceConfig(BucketedConfig):
    """The options of the ring all-reduce strategies, Trainer and Fabric (see their arguments)."""

    broadcast_buffers: bool = True
    log_comm_stats: bool = False
    two_level: bool | None = None
    """Reduce inside each node, then across nodes (``None``: when there are several nodes of several processes)."""
    shard_optimizer_state: bool = False
    """Each rank keeps and steps the optimizer state of its shard of the parameters only (ZeRO stage 1)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_flag("broadcast_buffers", self.broadcast_buffers)
        check_flag("log_comm_stats", self.log_comm_stats)
        check_flag("shard_optimizer_state", self.shard_optimizer_state)
        if self.two_level is not None and not isinstance(self.two_level, bool):
            raise TypeError(
                "`two_level` must be None (the default: one flat ring, or both measured by reducer='auto'), True or "
                f"False, got {self.two_level!r}."
            )


@dataclass(frozen=True)
class ReductionOptions:
    """How a bucket is reduced: the ``reducer=`` option or a torch DDP communication hook, validated on creation.

    Examples:
        >>> ReductionOptions(reducer="native").make_reducer().__class__.__name__
        'NativeReducer'
        >>> ReductionOptions(reducer="nope")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Unknown reducer 'nope': ...
    """

    reducer: str | Reducer | None = None
    ddp_comm_hook: CommHook | None = None
    ddp_comm_state: object = None
    ddp_comm_wrapper: Callable[[CommHook], CommHook] | None = None
    model_averaging_period: int | None = None
    """With ``PostLocalSGDState``: optimizer steps between parameter averages after the warm-up."""
    comm_hook: CommHook | None = field(init=False, repr=False, compare=False)
    """The hook to call: ``ddp_comm_wrapper(ddp_comm_hook)`` when a wrapper was given."""

    def __post_init__(self) -> None:
        check_reducer(self.reducer)
        hook = check_comm_hook(
            self.ddp_comm_hook, self.ddp_comm_state, self.ddp_comm_wrapper, self.reducer, self.model_averaging_period
        )
        object.__setattr__(self, "comm_hook", hook)

    def make_reducer(self) -> Reducer:
        """The hook's reducer when a hook was given, else the ``reducer=`` option's (a new one each call)."""
        return make_reducer(self.reducer, self.comm_hook, self.ddp_comm_state)

    @property
    def custom(self) -> str | None:
        """The reduction as written where it is not the plain fp32 ring or the backend's all-reduce (a hook, a
        compression, ``"auto"``, ...), else ``None``.

        Examples:
            >>> ReductionOptions(reducer="native").custom is None, ReductionOptions(reducer="auto").custom
            (True, "reducer='auto'")
        """
        if self.ddp_comm_hook is not None:
            return f"ddp_comm_hook={getattr(self.ddp_comm_hook, '__name__', self.ddp_comm_hook)}"
        if self.reducer is None or type(self.reducer) in (RingReducer, NativeReducer):
            return None
        if isinstance(self.reducer, str) and self.reducer in ("ring", "native"):
            return None
        return f"reducer={self.reducer!r}"


def check_sharding(config: RingAllReduceConfig, reduction: ReductionOptions) -> None:
    """A clear error when ``shard_optimizer_state=True`` meets an option it cannot honour.

    The shards are the ring's reduce-scatter chunks of each bucket, over one flat ring of every rank; a compression
    wrapper, another reducer, a communication hook or the two-level reduction reduce the buckets otherwise.

    Examples:
        >>> check_sharding(RingAllReduceConfig(shard_optimizer_state=True), ReductionOptions())
        >>> check_sharding(RingAllReduceConfig(shard_optimizer_state=True, two_level=True), ReductionOptions())
        Traceback (most recent call last):
        ...
        ValueError: `shard_optimizer_state=True` cannot be combined with `two_level=True`: ...
    """
    if not config.shard_optimizer_state:
        return
    fix = "Leave that option out, or pass `shard_optimizer_state=False`."
    shards = "the shards are the chunks a flat ring's reduce-scatter leaves on each rank"
    if config.two_level:
        raise ValueError(
            f"`shard_optimizer_state=True` cannot be combined with `two_level=True`: {shards}, and a two-level "
            f"reduction leaves whole shards per node instead. {fix}"
        )
    if reduction.reducer not in (None, "ring"):
        raise ValueError(
            f"`shard_optimizer_state=True` cannot be combined with `reducer={reduction.reducer!r}`: {shards}, which "
            f"is how it reduces the buckets (lossless, over the ring). {fix}"
        )
    if reduction.ddp_comm_hook is not None or reduction.model_averaging_period is not None:
        raise ValueError(
            "`shard_optimizer_state=True` cannot be combined with `ddp_comm_hook` or `model_averaging_period`: "
            f"{shards}, and a hook or model averaging needs whole buckets and whole optimizer state on every rank. "
            f"{fix}"
        )


class SharedOptions(TypedDict, total=False):
    """The keyword options the multi-process strategies share, Trainer and Fabric alike (each side adds its
    Lightning plugins: :class:`~lightning_dp_strategies.strategies.options.StrategyOptions`,
    :class:`~lightning_dp_strategies.fabric.options.FabricOptions`).

    - ``parallel_devices``, ``cluster_environment``, ``checkpoint_io``: Lightning's, as its ``DDPStrategy`` takes
      them (``checkpoint_io`` defaults to an :class:`~lightning_dp_strategies.AtomicCheckpointIO`).
    - ``nonfinite_grads``: check the reduced gradients for NaN/Inf before each optimizer step: ``None`` (no check,
      the default), ``"skip"`` (skip the step on every rank alike, counted in ``nonfinite.skipped_steps``) or
      ``"raise"`` (``FloatingPointError`` on every rank).
    - ``process_group_backend``: ``"gloo"``, ``"nccl"``, ...; ``None`` picks by device.
    - ``timeout``: collective timeout (``timedelta`` or seconds); ``None`` is 5 minutes on gloo, 30 on NCCL.
    - ``start_method``: ``"popen"`` (scripts, the default), ``"spawn"``, ``"fork"`` (notebooks) or ``"forkserver"``.

    Examples:
        >>> sorted(lightning_arguments("RingAllReduceStrategy", {"timeout": 60}, SharedOptions, ()))
        ['checkpoint_io', 'cluster_environment', 'parallel_devices', 'process_group_backend', 'start_method', 'timeout']
    """

    parallel_devices: list[Any] | None
    cluster_environment: ClusterEnvironment | None
    checkpoint_io: CheckpointIO | None
    nonfinite_grads: Literal["skip", "raise"] | None
    process_group_backend: str | None
    timeout: timedelta | float | None
    start_method: Literal["popen", "spawn", "fork", "forkserver"]


UNKNOWN_OPTION_HINTS = {
    "fault_tolerant": (
        ": going on without a lost rank is offered by the Trainer's RingAllReduceStrategy and LocalSGDStrategy "
        "only (under Fabric the training loop is yours, so the strategy cannot redo a step or take over a lost "
        "rank's share of the batch); here, restart from the last checkpoint instead (docs/fault_tolerance.md, "
        "'The recipe')"
    ),
}
"""Why an option that other strategies of the package take is not taken here, and what to do instead."""


def lightning_arguments(
    strategy: str, options: Mapping[str, Any], allowed: type, plugins: tuple[str, ...]
) -> dict[str, Any]:
    """``options`` checked against the keys of the ``allowed`` ``TypedDict`` (an unknown name is a ``TypeError``, as
    for any call) and turned into the arguments of Lightning's ``DDPStrategy``: the shared ones and ``plugins``."""
    unknown = sorted(set(options) - set(allowed.__annotations__) - set(SharedOptions.__annotations__))
    if unknown:
        hint = UNKNOWN_OPTION_HINTS.get(unknown[0], "")
        raise TypeError(f"{strategy}() got an unexpected keyword argument {unknown[0]!r}{hint}")
    start_method = options.get("start_method", "popen")
    check_start_method(start_method)
    lightning = ("parallel_devices", "cluster_environment", "checkpoint_io", *plugins)
    return {
        **{name: options.get(name) for name in lightning},
        "process_group_backend": check_backend(options.get("process_group_backend")),
        "timeout": check_timeout(options.get("timeout")),
        "start_method": start_method,
    }
