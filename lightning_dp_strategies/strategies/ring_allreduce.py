"""DDP-style data parallelism whose gradients are averaged by bucketed ring all-reduce, overlapped with backward."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import lightning.pytorch as pl
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import Unpack, override

from lightning_dp_strategies.core.fault_tolerance import FaultTolerance, Survivors, check_fault_tolerance
from lightning_dp_strategies.core.module_state import broadcast_module_buffers
from lightning_dp_strategies.core.options import ConfigOption, RingAllReduceConfig, check_sharding
from lightning_dp_strategies.core.registry import register_name
from lightning_dp_strategies.core.topology import check_two_level, layout_reducer
from lightning_dp_strategies.reducers import CommHook, Reducer, ScatterReducer
from lightning_dp_strategies.strategies._trainer import (
    check_no_finetuning,
    check_no_lottery_ticket,
    should_log,
    warn_gradient_hooks,
)
from lightning_dp_strategies.strategies.options import StrategyOptions
from lightning_dp_strategies.strategies.survival import TrainerSurvival
from lightning_dp_strategies.strategies.surviving import SurvivingDataParallel, as_fault_tolerance

__all__ = ["RingAllReduceConfig", "RingAllReduceStrategy"]


SHARDED_FINETUNING = (
    "it looks the optimizer's parameters up among the module's and adds parameter groups while training, and the "
    "sharded optimizer steps this rank's pieces of the parameters instead, which a group added later would never "
    "reach. Train with shard_optimizer_state=False (strategy='ring_allreduce')."
)
SHARDED_LOTTERY_TICKET = (
    "and the sharded optimizer steps views of the storage the parameters had at setup. Pass "
    "ModelPruning(use_lottery_ticket_hypothesis=False), or train with shard_optimizer_state=False."
)
SHARDED_GRADIENTS = (
    "will find no gradient in the module's parameters with shard_optimizer_state=True: their `.grad` is None there, "
    "since each rank holds the averaged gradient of its pieces of the parameters only (in the optimizer's parameter "
    "groups), so reading it finds nothing and changing it changes nothing. Clip with the Trainer's "
    "`gradient_clip_val` (by the norm over every rank's pieces), or train with shard_optimizer_state=False."
)


class RingAllReduceStrategy(SurvivingDataParallel):
    """One process per device; gradients averaged by this package's bucketed ring all-reduce during backward.

    Lightning's launchers, cluster environments (torchrun, SLURM, ...) and process-group setup are reused from
    :class:`~lightning.pytorch.strategies.DDPStrategy`; torch DDP's reducer is replaced by
    :class:`~lightning_dp_strategies.bucketing.GradientBuckets`. The module is not wrapped, so checkpoints hold the
    plain ``state_dict``. Unused parameters need no flag.

    Args:
        bucket_cap_mb: cap of each gradient bucket in MiB (default 25, as torch DDP).
        first_bucket_cap_mb: cap of the first bucket in MiB (default 1), so communication starts early in backward.
        reducer: how a bucket is averaged: ``"ring"`` (default, this package's ring all-reduce), ``"native"`` (the
            backend's ``all_reduce``), ``"per_tensor"`` (naive reference), ``"auto"`` (measure the link and the step,
            then keep the fastest of the plain ring, bf16 on the wire and PowerSGD, one or two levels:
            :class:`~lightning_dp_strategies.reducers.AutoReducer`; ``AutoReducer(allow="lossless")`` keeps it
            exact), or any callable ``reducer(bucket) -> Future``, e.g. a compression wrapper; see
            :mod:`lightning_dp_strategies.reducers`.
        broadcast_buffers: broadcast module buffers (BatchNorm statistics) from rank 0 before every training step,
            as torch DDP does.
        log_comm_stats: log the per-step communication statistics (``comm/bytes_sent``, ...) to the
            LightningModule's logger every ``log_every_n_steps`` steps.
        ddp_comm_hook: a torch DDP communication hook ``hook(state, bucket) -> Future`` (``allreduce_hook``,
            ``fp16_compress_hook``, ``powerSGD_hook``, ...) that averages each bucket instead of ``reducer``, on any
            device and backend, CPU/gloo included (see :mod:`lightning_dp_strategies.comm_hooks`).
        ddp_comm_state: the hook's ``state`` (e.g. ``PowerSGDState``); ``None`` gives it the gradient group.
        ddp_comm_wrapper: applied once as ``ddp_comm_wrapper(ddp_comm_hook)`` (e.g. ``fp16_compress_wrapper``).
        two_level: reduce each bucket inside the node, then across nodes between the ranks that hold the same
            shard, then inside the node again (:class:`~lightning_dp_strategies.reducers.two_level.TwoLevelReducer`):
            a node sends ``2(n-1)/n`` of the gradient over its link instead of almost twice that, and ``reducer``
            reduces the hop across nodes, so a compression wrapper compresses what crosses the slow link: for several
            processes a node over a slow link (see ``docs/network.md``). ``None`` (default) and ``False``: one flat
            ring; ``reducer="auto"`` measures both.
        model_averaging_period: post-local SGD, as Lightning's ``DDPStrategy`` runs it (there on CUDA only):
            with ``ddp_comm_state=PostLocalSGDState(...)`` and ``ddp_comm_hook=post_localSGD_hook``, the parameters
            are averaged every this many optimizer steps after the state's ``start_localSGD_iter`` (see
            :class:`~lightning_dp_strategies.LocalSGDStrategy` for local SGD with an outer optimizer).
        fault_tolerant: go on without a rank that dies, hangs or loses its link (gloo, CPU): the survivors notice
            within seconds, agree on who is left through the job's store, re-form their groups and redo the step,
            training the lost ranks' micro-batches too so the global batch stays the same; ``True`` or a
            :class:`~lightning_dp_strategies.core.fault_tolerance.FaultTolerance` with its timeouts and
            ``keep_global_batch``. Launch with ``torchrun`` (its agent's store outlives every worker). See
            ``docs/fault_tolerance.md`` for what is and is not survived.
        shard_optimizer_state: each rank keeps the optimizer state of, and steps, about 1/N of the parameters
            (ZeRO stage 1): the buckets are reduce-scattered, the optimizer steps this rank's chunk, and the updated
            parameters are all-gathered (the bytes of one all-reduce). Any element-wise optimizer (SGD, Adam,
            AdamW, ...); checkpoints hold the whole optimizer state, loadable by any strategy and at any world size.
            With the plain ring only (no other ``reducer``, hook, ``two_level=True`` or model averaging). See
            :mod:`lightning_dp_strategies.sharding`.
        **options: Lightning's and the package's shared keyword options (``nonfinite_grads``, ``timeout``,
            ``process_group_backend``, ``start_method``, ...): see
            :class:`~lightning_dp_strategies.strategies.options.StrategyOptions`.

    Examples:
        >>> import lightning as L
        >>> import lightning_dp_strategies  # registers "ring_allreduce"
        >>> trainer = L.Trainer(strategy="ring_allreduce", accelerator="cpu", devices=2)  # doctest: +SKIP
        >>> trainer = L.Trainer(strategy=RingAllReduceStrategy(bucket_cap_mb=10), devices=2)  # doctest: +SKIP
    """

    config: RingAllReduceConfig
    registered_name: ClassVar[str | None] = "ring_allreduce"
    registered_description: ClassVar[str] = "Bucketed ring all-reduce data parallelism"
    compared_as: ClassVar[str | None] = "ring_allreduce"

    def __init__(
        self,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float = 1.0,
        reducer: str | Reducer | None = None,
        broadcast_buffers: bool = True,
        log_comm_stats: bool = False,
        two_level: bool | None = None,
        shard_optimizer_state: bool = False,
        ddp_comm_state: object = None,
        ddp_comm_hook: CommHook | None = None,
        ddp_comm_wrapper: Callable[[CommHook], CommHook] | None = None,
        model_averaging_period: int | None = None,
        fault_tolerant: bool | FaultTolerance = False,
        **options: Unpack[StrategyOptions],
    ) -> None:
        config = RingAllReduceConfig(
            bucket_cap_mb, first_bucket_cap_mb, broadcast_buffers, log_comm_stats, two_level, shard_optimizer_state
        )
        hook = (ddp_comm_state, ddp_comm_hook, ddp_comm_wrapper, model_averaging_period)
        super().__init__(config, reducer, *hook, **options)
        check_two_level(self.config.two_level, self.reduction)
        check_sharding(self.config, self.reduction)
        tolerance = as_fault_tolerance(fault_tolerant)
        check_fault_tolerance(
            tolerance, shard_optimizer_state, two_level, reducer, ddp_comm_hook, model_averaging_period
        )
        self.survival = TrainerSurvival(self, Survivors(tolerance)) if tolerance is not None else None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``ring_allreduce`` (with its launcher variants), ``ring_allreduce_auto`` (the same strategy with
        ``reducer="auto"``) and ``ring_allreduce_sharded`` (``shard_optimizer_state=True``), so that
        ``Trainer(strategy=...)`` and the comparison can name them."""
        super().register_strategies(strategy_registry)
        if cls.registered_name is not None:
            description = f"{cls.registered_description}, the reduction picked for the link (reducer='auto')"
            register_name(strategy_registry, f"{cls.registered_name}_auto", cls, description, reducer="auto")
            description = f"{cls.registered_description}, each rank keeping a shard of the optimizer state (ZeRO-1)"
            name = f"{cls.registered_name}_sharded"
            register_name(strategy_registry, name, cls, description, shard_optimizer_state=True)
            description = f"{cls.registered_description}, going on without a lost rank (fault_tolerant=True)"
            name = f"{cls.registered_name}_fault_tolerant"
            register_name(strategy_registry, name, cls, description, fault_tolerant=True)

    # ------------------------------------------------------------------ setup
    @override
    def arrange_reducer(self, reducer: Reducer) -> Reducer:
        """``reducer`` as the hop across nodes of a two-level reduction where the layout calls for it (see
        ``two_level``); with ``shard_optimizer_state`` the reduce-scattering ring instead."""
        if self.config.shard_optimizer_state:
            return ScatterReducer()
        return layout_reducer(self.config.two_level, self.num_processes, self.reduction, reducer)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if self.config.shard_optimizer_state and trainer.state.fn == TrainerFn.FITTING:
            check_no_finetuning(trainer, "with shard_optimizer_state=True", SHARDED_FINETUNING)
            check_no_lottery_ticket(trainer, "with shard_optimizer_state=True", SHARDED_LOTTERY_TICKET)
            warn_gradient_hooks(trainer, SHARDED_GRADIENTS)
        super().setup(trainer)

    @override
    def _fingerprint_options(self) -> dict[str, Any]:
        return {**super()._fingerprint_options(), "nodes": self.num_nodes, "per_node": self.num_processes}

    # ------------------------------------------------------------------ one step
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.config.broadcast_buffers and self.survival is not None:
            self.survival.broadcast_buffers()
        elif self.config.broadcast_buffers and self.lightning_module is not None:
            broadcast_module_buffers(self.lightning_module)
        return super().training_step(*args, **kwargs)

    @override
    def _log_step(self) -> None:
        module = self.lightning_module
        if should_log(self, self.config.log_comm_stats) and module is not None and module.logger is not None:
            module.logger.log_metrics(self.step_stats.as_dict("comm/"), step=module.trainer.global_step)

    # ------------------------------------------------------------------ options (read-only; see `config`)
    bucket_cap_mb = ConfigOption[float]()
    first_bucket_cap_mb = ConfigOption[float]()
    broadcast_buffers = ConfigOption[bool]()
    log_comm_stats = ConfigOption[bool]()
    two_level = ConfigOption[bool | None]()
    shard_optimizer_state = ConfigOption[bool]()
