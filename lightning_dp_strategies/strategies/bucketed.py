"""The base of the multi-process strategies whose gradients are averaged by gradient buckets.

A subclass says *which ranks average together* and *which parameters this rank averages*; the base does the rest:
the shared options and their validation, the default collective timeout, one dedicated process group per averaging
group (and the reducer's own groups, made in its setup step), the buckets, arming them around backward (skipped on
accumulation steps and inside ``no_backward_sync``), abort on an exception, the per-step statistics, and teardown::

    setup_distributed ──▶ grad_group_ranks() ──▶ one group each ──▶ setup_reducer(reducer, group, ranks)
    setup / configure_ddp ──▶ _build_buckets(bucketed_parameters())
    pre_backward: arm (or skip)  ─ backward ─  post_backward: finish (.grad holds the average)
    teardown ──▶ close buckets and reducer ──▶ destroy the groups

Contract for a subclass:

- ``grad_group_ranks()``: the world split into the lists of global ranks that average together (default: the
  whole world, one group). Called on every rank, it must give every rank the same lists.
- ``bucketed_parameters()``: the ``(name, parameter)`` pairs this rank averages (default: the whole module's).
- call ``self._build_buckets()`` once the module is in place (``RingAllReduceStrategy`` does it in
  ``configure_ddp``); a strategy that runs backward itself arms and finishes ``self.buckets`` there.
- its own options go in a frozen dataclass derived from :class:`BucketedConfig`, passed as ``config=``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar, Literal

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.imports import _IS_INTERACTIVE
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn
from typing_extensions import override

from lightning_dp_strategies.comm_hooks import CommHook
from lightning_dp_strategies.plan import RING_ALLREDUCE, CostModel
from lightning_dp_strategies.reducers import Reducer
from lightning_dp_strategies.strategies._grad_sync import BucketedGradSync
from lightning_dp_strategies.strategies._options import (
    check_backend,
    check_positive,
    check_reducer,
    check_start_method,
    check_timeout,
    default_timeout,
)
from lightning_dp_strategies.strategies._registry import register_with_launchers
from lightning_dp_strategies.strategies._resume import CheckpointAndResume

__all__ = ["BucketedConfig", "BucketedDataParallel"]


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


class BucketedDataParallel(CheckpointAndResume, BucketedGradSync, DDPStrategy):
    """Base of the strategies whose gradients ``GradientBuckets`` average over groups of ranks (see the module doc).

    Lightning's launchers, cluster environments and process-group setup come from
    :class:`~lightning.pytorch.strategies.DDPStrategy`; the module is never wrapped.

    Args:
        config: the strategy's options (a :class:`BucketedConfig` or a subclass of it).
        reducer: how a bucket is averaged: ``"ring"`` (default), ``"native"``, ``"per_tensor"`` or a callable
            ``reducer(bucket) -> Future`` (see :mod:`lightning_dp_strategies.reducers`).
        nonfinite_grads: ``None``, ``"skip"`` or ``"raise"`` on NaN/Inf in the averaged gradients.
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; ``None`` picks by device.
        timeout: collective timeout (``timedelta`` or seconds); ``None`` is 5 minutes on gloo, 30 on NCCL.
        start_method: ``"popen"``, ``"spawn"``, ``"fork"`` (notebooks) or ``"forkserver"``.
        ddp_comm_hook: a torch DDP communication hook ``hook(state, bucket) -> Future`` that averages each bucket
            instead of the reducer, on any device and backend (see :mod:`lightning_dp_strategies.comm_hooks`).
        ddp_comm_state: the hook's ``state``; ``None`` gives it the strategy's gradient group.
        ddp_comm_wrapper: applied to the hook once, ``ddp_comm_wrapper(ddp_comm_hook)``, as in Lightning's DDP.

    Examples:
        >>> class EveryRank(BucketedDataParallel):  # the smallest complete strategy: DDP on the package's buckets
        ...     def configure_ddp(self) -> None:
        ...         self._build_buckets()
        >>> EveryRank(config=BucketedConfig(bucket_cap_mb=5)).config.bucket_cap_mb
        5.0
    """

    config: BucketedConfig
    cost_model: ClassVar[CostModel] = RING_ALLREDUCE
    """Its per-step communication formula (:mod:`lightning_dp_strategies.plan`); a subclass that communicates
    otherwise sets its own."""
    registered_name: ClassVar[str | None] = None
    """The name :meth:`register_strategies` gives Lightning, with ``{name}_spawn`` and ``{name}_notebook`` (the fork
    launcher, for Jupyter) beside it; ``None`` registers nothing."""
    registered_description: ClassVar[str] = ""

    @classmethod
    def launched_processes(cls, devices: int) -> int:
        """Processes a run on ``devices`` devices starts: one per device."""
        return devices

    def __init__(
        self,
        config: BucketedConfig | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[Any] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        reducer: str | Reducer | None = None,
        nonfinite_grads: Literal["skip", "raise"] | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        ddp_comm_state: object = None,
        ddp_comm_hook: CommHook | None = None,
        ddp_comm_wrapper: Callable[[CommHook], CommHook] | None = None,
    ) -> None:
        check_start_method(start_method)
        check_reducer(reducer)
        self._init_comm_hook(reducer, ddp_comm_hook, ddp_comm_state, ddp_comm_wrapper)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=check_backend(process_group_backend),
            timeout=check_timeout(timeout),
            start_method=start_method,
        )
        # configuration
        self.config = config if config is not None else BucketedConfig()
        self.reducer = reducer
        # runtime state (buckets, no-sync flag) and statistics (step_stats)
        self._init_grad_sync(nonfinite_grads)
        self._grad_groups: list[dist.ProcessGroup] = []
        self._grad_group: dist.ProcessGroup | None = None
        self._reducer: Reducer | None = None

    # ------------------------------------------------------------------ what a subclass says
    def grad_group_ranks(self) -> list[list[int]]:
        """The world split into the global ranks that average gradients together (default: one group, the world)."""
        return [list(range(self.world_size))]

    def bucketed_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The ``(name, parameter)`` pairs this rank's buckets average (default: the whole module's)."""
        module = self.lightning_module
        assert module is not None
        return list(module.named_parameters())

    # ------------------------------------------------------------------ names and launch
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if cls.registered_name is not None:
            register_with_launchers(strategy_registry, cls.registered_name, cls, cls.registered_description)

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if _IS_INTERACTIVE and self._launcher is not None and not self._launcher.is_interactive_compatible:
            name = f"Trainer(strategy='{self.registered_name}_notebook')` or `" if self.registered_name else ""
            raise MisconfigurationException(
                f"{type(self).__name__}(start_method={self._start_method!r}) cannot launch processes inside Jupyter "
                f"or an interactive shell. Use `{name}{type(self).__name__}(start_method='fork')` there, or run your "
                "code as a script."
            )

    # ------------------------------------------------------------------ setup
    @override
    def setup_distributed(self) -> None:
        if self._timeout is None:
            self._timeout = default_timeout(self._get_process_group_backend())
        super().setup_distributed()
        self._setup_grad_groups()

    def _setup_grad_groups(self) -> None:
        """One dedicated group per averaging group, then the reducer's own groups, on every rank in the same order
        (see :meth:`~._grad_sync.GradSync._make_grad_groups`, which the Fabric strategies share)."""
        self._make_grad_groups(self.grad_group_ranks(), self.global_rank, self._process_group_backend)

    def _build_buckets(
        self, named_params: Sequence[tuple[str, nn.Parameter]] | None = None, allow_no_trainable: bool = False
    ) -> None:
        """Attach the gradient buckets to ``named_params`` (default: :meth:`bucketed_parameters`).

        ``allow_no_trainable``: a rank may own no trainable parameter (every rank of its group alike)."""
        self._attach_buckets(
            self.bucketed_parameters() if named_params is None else named_params,
            self.config.bucket_cap_mb,
            self.config.first_bucket_cap_mb,
            allow_no_trainable=allow_no_trainable,
        )

    def _require_trainable(self, fix: str) -> None:
        """A clear error, on every rank, when the module has no parameter that requires grad."""
        module = self.lightning_module
        assert module is not None
        if not any(p.requires_grad for p in module.parameters()):
            raise ValueError(
                f"{type(module).__name__} has no parameter that requires grad, so {type(self).__name__} has nothing "
                f"to train. Unfreeze at least one parameter before `trainer.fit`, or {fix}."
            )

    @override
    def _fingerprint_options(self) -> dict[str, Any]:
        return {**super()._fingerprint_options(), **vars(self.config)}

    # ------------------------------------------------------------------ one step
    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        self._arm_or_skip()

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        if self.buckets is not None:
            self.buckets.finish()

    # ------------------------------------------------------------------ teardown
    @override
    def on_exception(self, exception: BaseException) -> None:
        if self.buckets is not None:
            self.buckets.abort()
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        self._close_reducer_and_buckets()
        super().teardown()
        self._destroy_grad_groups()
