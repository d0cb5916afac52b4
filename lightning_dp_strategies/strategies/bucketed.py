"""The base of the multi-process strategies whose gradients are averaged by gradient buckets.

A subclass says *which ranks average together* and *which parameters this rank averages*; the base does the rest:
the shared options and their validation, the default collective timeout, one dedicated process group per averaging
group (and the reducer's own groups, made in its setup step), the buckets, arming them around backward (skipped on
accumulation steps and inside ``no_backward_sync``), abort on an exception, the per-step statistics, and teardown::

    setup_distributed ──▶ grad_group_ranks() ──▶ one group each ──▶ setup_reducer(reducer, group, ranks)
    configure_ddp ──▶ ranks agree ──▶ rank 0's weights ──▶ _build_buckets(bucketed_parameters())
    pre_backward: arm (or skip)  ─ backward ─  post_backward: finish (.grad holds the average)
    teardown ──▶ close buckets and reducer ──▶ destroy the groups

Contract for a subclass:

- ``grad_group_ranks()``: the world split into the lists of global ranks that average together (default: the
  whole world, one group). Called on every rank, it must give every rank the same lists.
- ``bucketed_parameters()``: the ``(name, parameter)`` pairs this rank averages (default: the whole module's).
- ``configure_reducer()``: how a bucket is reduced (default: the ``reducer=`` option or the communication hook).
- the base's ``configure_ddp`` checks that the ranks agree, broadcasts rank 0's weights and attaches the buckets; a
  strategy that places its module otherwise overrides it and calls ``self._build_buckets()`` once the module is in
  place, and one that runs backward itself arms and finishes ``self.grad_sync`` there.
- its own options go in a frozen dataclass derived from :class:`BucketedConfig`, passed as ``config=``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, ClassVar, Literal

import lightning.pytorch as pl
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dp_strategies.bucketing.sync import GradientSync, HoldsGradientSync
from lightning_dp_strategies.core.agreement import bucketed_options, check_ranks_agree, model_fingerprint
from lightning_dp_strategies.core.launch import check_interactive_launch
from lightning_dp_strategies.core.module_state import sync_module_states
from lightning_dp_strategies.core.options import (
    BucketedConfig,
    ConfigOption,
    ReductionOptions,
    check_backend,
    check_start_method,
    check_timeout,
    default_timeout,
)
from lightning_dp_strategies.core.registry import register_with_launchers
from lightning_dp_strategies.plan import RING_ALLREDUCE, CostModel
from lightning_dp_strategies.reducers import CommHook, Reducer
from lightning_dp_strategies.strategies._model_averaging import PeriodicModelAveraging
from lightning_dp_strategies.strategies._nonfinite import NonfiniteCheck
from lightning_dp_strategies.strategies._resume import CheckpointAndResume, RestartSafeGroups

__all__ = ["BucketedConfig", "BucketedDataParallel"]


class BucketedDataParallel(
    CheckpointAndResume, RestartSafeGroups, HoldsGradientSync, PeriodicModelAveraging, NonfiniteCheck, DDPStrategy
):
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
        model_averaging_period: with ``ddp_comm_state=PostLocalSGDState(...)``: average the parameters every this
            many optimizer steps after the state's warm-up (post-local SGD, as Lightning's DDP on CUDA).

    Examples:
        >>> from lightning_dp_strategies.reducers import NativeReducer
        >>> class NativeDDP(BucketedDataParallel):  # a complete strategy: DDP on the package's buckets
        ...     def configure_reducer(self) -> Reducer:
        ...         return NativeReducer()
        >>> NativeDDP(config=BucketedConfig(bucket_cap_mb=5)).config.bucket_cap_mb
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
    compared_as: ClassVar[str | None] = None
    """The name the comparison (``lightning-dp-strategies compare``) runs it under when no strategies are named;
    ``None``: only when named."""

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
        model_averaging_period: int | None = None,
    ) -> None:
        check_start_method(start_method)
        reduction = ReductionOptions(reducer, ddp_comm_hook, ddp_comm_state, ddp_comm_wrapper, model_averaging_period)
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
        self.reduction = reduction
        self._init_nonfinite(nonfinite_grads)
        # runtime state and statistics
        self.grad_sync = GradientSync()

    # ------------------------------------------------------------------ what a subclass says
    def grad_group_ranks(self) -> list[list[int]]:
        """The world split into the global ranks that average gradients together (default: one group, the world)."""
        return [list(range(self.world_size))]

    def bucketed_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The ``(name, parameter)`` pairs this rank's buckets average (default: the whole module's)."""
        module = self.lightning_module
        assert module is not None
        return list(module.named_parameters())

    def configure_reducer(self) -> Reducer:
        """The reducer of the gradient buckets, called once at setup: override it to reduce another way.

        The default is the communication hook's (:class:`~lightning_dp_strategies.reducers.CommHookReducer`) when
        ``ddp_comm_hook`` was given, else the ``reducer=`` option's (see :mod:`lightning_dp_strategies.reducers`).

        Examples:
            >>> from lightning_dp_strategies import NativeReducer, RingAllReduceStrategy
            >>> class NativeStrategy(RingAllReduceStrategy):
            ...     def configure_reducer(self) -> Reducer:
            ...         return NativeReducer()
            >>> type(NativeStrategy().configure_reducer()).__name__
            'NativeReducer'
        """
        return self.reduction.make_reducer()

    # ------------------------------------------------------------------ names and launch
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if cls.registered_name is not None:
            register_with_launchers(strategy_registry, cls.registered_name, cls, cls.registered_description)

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        check_interactive_launch(self, self._launcher, self._start_method, self.registered_name, "Trainer")

    # ------------------------------------------------------------------ setup
    @override
    def setup_distributed(self) -> None:
        if self._timeout is None:
            self._timeout = default_timeout(self._get_process_group_backend())
        super().setup_distributed()
        self.grad_sync.make_groups(
            self.grad_group_ranks(), self.global_rank, self._process_group_backend, self.configure_reducer()
        )

    @override
    def configure_ddp(self) -> None:
        """Check that the ranks agree, broadcast rank 0's parameters and buffers, then attach the gradient buckets
        (instead of wrapping the module in torch DDP)."""
        module = self.lightning_module
        assert module is not None
        self._require_trainable("train with `strategy='auto'`")
        self._check_ranks_agree()  # before the broadcast below, which mismatched shapes would hang
        sync_module_states(module)
        self._build_buckets()

    def _build_buckets(
        self, named_params: Sequence[tuple[str, nn.Parameter]] | None = None, allow_no_trainable: bool = False
    ) -> None:
        """Attach the gradient buckets to ``named_params`` (default: :meth:`bucketed_parameters`).

        ``allow_no_trainable``: a rank may own no trainable parameter (every rank of its group alike)."""
        self.grad_sync.attach(
            self.bucketed_parameters() if named_params is None else named_params,
            self.config.bucket_cap_mb,
            self.config.first_bucket_cap_mb,
            allow_no_trainable=allow_no_trainable,
            timeout=self._timeout,
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

    def _fingerprint_options(self) -> dict[str, Any]:
        """What every rank must agree on besides the model; subclasses add their own options."""
        module = self.lightning_module
        assert module is not None
        trainer = module.trainer
        return {
            **bucketed_options(self, self.reduction, self.config, module, self.precision_plugin),
            "accumulate_grad_batches": getattr(trainer, "accumulate_grad_batches", None),
            "gradient_clip_val": getattr(trainer, "gradient_clip_val", None),
        }

    def _check_ranks_agree(self) -> None:
        """Fail on every rank, before anything else is communicated, if the ranks' models or options differ."""
        module = self.lightning_module
        assert module is not None
        check_ranks_agree(model_fingerprint(module, self._fingerprint_options()))

    # ------------------------------------------------------------------ one step
    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Backward passes inside this context accumulate gradients locally and do not communicate.

        Lightning enters it on gradient-accumulation steps; in manual optimization use it as ``no_sync``::

            with self.trainer.strategy.no_backward_sync():
                self.manual_backward(loss)   # local only
            self.manual_backward(loss2)      # averages the accumulated gradients
        """
        with self.grad_sync.no_sync():
            yield None

    no_backward_sync = block_backward_sync

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        self.grad_sync.arm_or_skip()

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        self.grad_sync.finish()

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | Any | None = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._after_step(optimizer)
        self.grad_sync.record_step()
        self._log_step()
        return output

    def _after_step(self, optimizer: Optimizer) -> None:
        """Called after every optimizer step, before its statistics are recorded; the default does nothing."""

    def _log_step(self) -> None:
        """Called after every optimizer step; the default logs nothing."""

    def _should_log(self, enabled: bool) -> bool:
        """Whether to log now: ``enabled``, a logger exists, and this is a ``log_every_n_steps`` step."""
        module = self.lightning_module
        if not enabled or module is None or module.logger is None:
            return False
        every = int(getattr(module.trainer, "log_every_n_steps", 1))
        return every > 0 and module.trainer.global_step % every == 0

    # ------------------------------------------------------------------ teardown
    @override
    def on_exception(self, exception: BaseException) -> None:
        self.grad_sync.abort()
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        self.grad_sync.close()
        super().teardown()
        self.grad_sync.destroy_groups()

    # ------------------------------------------------------------------ options (read-only)
    reducer = ConfigOption[str | Reducer | None]("reduction")
    ddp_comm_hook = ConfigOption[CommHook | None]("reduction")
    ddp_comm_state = ConfigOption[object]("reduction")
    ddp_comm_wrapper = ConfigOption[Callable[[CommHook], CommHook] | None]("reduction")
