"""Fabric's DDP with its gradients averaged by this package's bucketed ring all-reduce, overlapped with backward.

The Fabric twin of :class:`~lightning_dp_strategies.RingAllReduceStrategy`: Fabric's ``DDPStrategy`` plus the same
:class:`~lightning_dp_strategies.core.engine.BucketedEngine` (gradient buckets, sharded optimizer state, the
non-finite check), called from Fabric's hooks::

    _setup_distributed ──▶ restart-safe default group ──▶ engine.make_groups(world, arrange_reducer(reducer))
    setup_module ──▶ ranks agree ──▶ rank 0's weights ──▶ engine.attach(module's parameters)
    setup_optimizer ──▶ engine.bind (sharded state)
    backward ──▶ engine.before_backward ─ backward ─ engine.after_backward
    optimizer_step ──▶ engine.guard ─ step ─ engine.after_step
    teardown ──▶ engine.close ──▶ Fabric's teardown ──▶ engine.destroy_groups
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, ClassVar

import torch
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.types import _PATH, Optimizable
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import Unpack, override

from lightning_dp_strategies.bucketing import CommStats, GradientBuckets
from lightning_dp_strategies.bucketing.sync import GradientSync
from lightning_dp_strategies.core.agreement import bucketed_options, check_ranks_agree, model_fingerprint
from lightning_dp_strategies.core.checkpoint_io import AtomicByDefault
from lightning_dp_strategies.core.distinct_batches import DistinctBatches
from lightning_dp_strategies.core.elastic import init_strategy_process_group
from lightning_dp_strategies.core.engine import BucketedEngine, EngineView
from lightning_dp_strategies.core.launch import check_launch
from lightning_dp_strategies.core.module_state import broadcast_module_buffers, require_storage, sync_module_states
from lightning_dp_strategies.core.nonfinite import NonfiniteGuard
from lightning_dp_strategies.core.options import (
    ConfigOption,
    ReductionOptions,
    RingAllReduceConfig,
    check_sharding,
    lightning_arguments,
)
from lightning_dp_strategies.core.registry import register_name, register_with_launchers
from lightning_dp_strategies.core.topology import check_own_reducer, check_two_level, layout_reducer, priced
from lightning_dp_strategies.fabric._checkpoints import load_sharded, save_sharded
from lightning_dp_strategies.fabric.options import FABRIC_PLUGINS, FabricOptions
from lightning_dp_strategies.plan import RING_ALLREDUCE, CostModel
from lightning_dp_strategies.reducers import CommHook, Reducer, ScatterReducer
from lightning_dp_strategies.sharding import OptimizerSharding

__all__ = ["FabricRingAllReduceStrategy"]


class FabricRingAllReduceStrategy(DDPStrategy):
    """One process per device under Lightning Fabric; gradients averaged by the bucketed ring all-reduce.

    The Fabric counterpart of :class:`~lightning_dp_strategies.RingAllReduceStrategy`, on the same machinery
    (:class:`~lightning_dp_strategies.bucketing.GradientBuckets`, the reducers, the rank-agreement check, the option
    checks). Fabric's launchers, cluster environments and process-group setup come from Fabric's ``DDPStrategy``; the
    module is not wrapped in torch DDP: ``fabric.setup`` broadcasts rank 0's parameters and buffers and attaches the
    buckets, ``fabric.backward(loss)`` arms them, runs backward and waits for the average, and
    ``fabric.no_backward_sync(model)`` accumulates locally without communicating. One module with trainable
    parameters per strategy (set up further modules only if they are frozen).

    Args:
        bucket_cap_mb: cap of each gradient bucket in MiB (default 25, as torch DDP).
        first_bucket_cap_mb: cap of the first bucket in MiB (default 1), so communication starts early in backward.
        reducer: how a bucket is averaged: ``"ring"`` (default), ``"native"``, ``"per_tensor"``, ``"auto"`` (the
            fastest reduction for the link, picked after a few timed steps:
            :class:`~lightning_dp_strategies.reducers.AutoReducer`), or any callable ``reducer(bucket) -> Future``;
            see :mod:`lightning_dp_strategies.reducers`.
        broadcast_buffers: broadcast module buffers (BatchNorm statistics) from rank 0 before every training forward
            call (train mode, gradients enabled, outside ``no_backward_sync``), as torch DDP does.
        ddp_comm_hook: a torch DDP communication hook ``hook(state, bucket) -> Future`` that averages each bucket
            instead of ``reducer``, on any device and backend (see :mod:`lightning_dp_strategies.comm_hooks`).
        ddp_comm_state: the hook's ``state``; ``None`` gives it the strategy's gradient group.
        ddp_comm_wrapper: applied once as ``ddp_comm_wrapper(ddp_comm_hook)`` (e.g. ``fp16_compress_wrapper``).
        two_level: ``True``: reduce inside each node, then across nodes, then inside the node again; ``None``
            (default) and ``False``: one flat ring (as :class:`~lightning_dp_strategies.RingAllReduceStrategy`).
        shard_optimizer_state: each rank keeps and steps the optimizer state of about 1/N of the parameters (ZeRO
            stage 1, as :class:`~lightning_dp_strategies.RingAllReduceStrategy`): set up the module before (or
            with) its optimizers; ``fabric.save`` writes the whole optimizer state, ``fabric.load`` takes this
            rank's part of it.
        **options: the shared keyword options (``nonfinite_grads``, ``timeout``, ...): see
            :class:`~lightning_dp_strategies.fabric.options.FabricOptions`.

    Examples:
        >>> import lightning as L
        >>> import lightning_dp_strategies  # registers "ring_allreduce" with Fabric too
        >>> fabric = L.Fabric(strategy="ring_allreduce", accelerator="cpu", devices=2)
        >>> type(fabric.strategy).__name__, fabric.strategy.bucket_cap_mb
        ('FabricRingAllReduceStrategy', 25.0)
        >>> fabric = L.Fabric(strategy=FabricRingAllReduceStrategy(reducer="native"), devices=2)  # doctest: +SKIP
    """

    config: RingAllReduceConfig
    registered_name: ClassVar[str] = "ring_allreduce"
    registered_description: ClassVar[str] = "Bucketed ring all-reduce data parallelism (Fabric)"
    cost_model: ClassVar[CostModel] = RING_ALLREDUCE
    """Its per-step communication formula (:mod:`lightning_dp_strategies.plan`), the Trainer strategy's."""
    registers_ring_variants: ClassVar[bool] = True
    """Whether :meth:`register_strategies` adds the ``_auto`` and ``_sharded`` names (a subclass that is not a ring
    of gradients, such as local SGD, sets ``False``)."""

    def __init__(
        self,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float = 1.0,
        reducer: str | Reducer | None = None,
        broadcast_buffers: bool = True,
        two_level: bool | None = None,
        shard_optimizer_state: bool = False,
        ddp_comm_state: object = None,
        ddp_comm_hook: CommHook | None = None,
        ddp_comm_wrapper: Callable[[CommHook], CommHook] | None = None,
        **options: Unpack[FabricOptions],
    ) -> None:
        fabric_options = lightning_arguments(
            type(self).__name__, options, FabricOptions, FABRIC_PLUGINS
        )  # validated before Fabric does anything
        self.reduction = ReductionOptions(reducer, ddp_comm_hook, ddp_comm_state, ddp_comm_wrapper)
        self.config = RingAllReduceConfig(
            bucket_cap_mb,
            first_bucket_cap_mb,
            broadcast_buffers,
            two_level=two_level,
            shard_optimizer_state=shard_optimizer_state,
        )
        check_two_level(self.config.two_level, self.reduction)
        self.cost_model = priced(type(self).cost_model, self.reduction, two_level)  # type: ignore[misc]  # its own
        check_sharding(self.config, self.reduction)
        check_own_reducer(type(self), FabricRingAllReduceStrategy, shard_optimizer_state)
        super().__init__(**fabric_options)
        # collaborators: runtime state (groups, reducer, buckets, no-sync flag, shards) and statistics
        self.engine = BucketedEngine(self.config, self.reduction, options.get("nonfinite_grads"))
        self._trained: nn.Module | None = None
        """The module set up with trainable parameters (the one the buckets average)."""
        self._buffer_hook: Any = None
        self._distinct_hook: Any = None  # warns when the ranks' first training forward gets the same inputs
        self._backward_sync_control = _BucketSyncControl(self)

    # ------------------------------------------------------------------ what a subclass says
    def configure_reducer(self) -> Reducer:
        """The reducer of the gradient buckets, called once at setup (default: the hook's when ``ddp_comm_hook`` was
        given, else the ``reducer=`` option's): override it to reduce another way. What it returns still goes
        through :meth:`arrange_reducer`; with ``shard_optimizer_state=True`` an override is refused at construction."""
        return self.reduction.make_reducer()

    def arrange_reducer(self, reducer: Reducer) -> Reducer:
        """``reducer`` as the hop across nodes of a two-level reduction where the layout calls for it (see
        ``two_level``); with ``shard_optimizer_state`` the reduce-scattering ring instead."""
        if self.config.shard_optimizer_state:
            return ScatterReducer()
        return layout_reducer(self.config.two_level, self.num_processes, self.reduction, reducer)

    # ------------------------------------------------------------------ the collaborators, as users read them
    grad_sync = EngineView[GradientSync]()
    sharding = EngineView[OptimizerSharding]()  # this rank's share of the optimizer state (sharded state)
    nonfinite = EngineView[NonfiniteGuard]()
    buckets = EngineView[GradientBuckets | None]()  # ``None`` before setup and after teardown
    step_stats = EngineView[CommStats]()  # communication of the last optimizer step
    comm_stats = EngineView[CommStats]()  # running totals on this rank since setup (kept after teardown)
    checkpoint_io = AtomicByDefault()
    """The ``checkpoint_io`` given, else an :class:`~lightning_dp_strategies.AtomicCheckpointIO`."""

    # ------------------------------------------------------------------ names and launch
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``ring_allreduce`` (with its launcher variants) and, for the ring and its subclasses that keep
        :attr:`registers_ring_variants`, ``ring_allreduce_auto`` (``reducer="auto"``) and ``ring_allreduce_sharded``
        (``shard_optimizer_state=True``)."""
        register_with_launchers(strategy_registry, cls.registered_name, cls, cls.registered_description, where="Fabric")
        if not cls.registers_ring_variants:
            return
        description = f"{cls.registered_description}, the reduction picked for the link (reducer='auto')"
        register_name(strategy_registry, f"{cls.registered_name}_auto", cls, description, "Fabric", reducer="auto")
        description = f"{cls.registered_description}, each rank keeping a shard of the optimizer state (ZeRO-1)"
        name = f"{cls.registered_name}_sharded"
        register_name(strategy_registry, name, cls, description, "Fabric", shard_optimizer_state=True)

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        check_launch(self, "Fabric")

    # ------------------------------------------------------------------ setup
    @override
    def _setup_distributed(self) -> None:
        self._set_world_ranks()
        init_strategy_process_group(self)
        super()._setup_distributed()
        reducer = self.arrange_reducer(self.configure_reducer())
        self.engine.make_groups([list(range(self.world_size))], self.global_rank, self._process_group_backend, reducer)

    @override
    def module_to_device(self, module: nn.Module) -> None:
        require_storage(module, type(self).__name__)  # a module built on the meta device cannot move
        super().module_to_device(module)

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:  # type: ignore[override]  # not wrapped
        """Check that the ranks agree, broadcast rank 0's parameters and buffers, and attach the gradient buckets.

        The module itself is returned (not wrapped), so ``fabric.save`` holds its plain ``state_dict``. It gets a
        forward pre-hook that, at its first training forward, warns on rank 0 when ranks got the same inputs (a loader
        every rank reads whole) and then removes itself; :meth:`teardown` removes it if no step ran.
        """
        require_storage(module, type(self).__name__)  # set up with `move_to_device=False`
        trainable = any(p.requires_grad for p in module.parameters())
        if trainable and self.engine.buckets is not None:
            raise ValueError(
                f"{type(self).__name__} averages the gradients of one module, and one with trainable parameters was "
                "set up already. Put the models in one `nn.Module` (e.g. `nn.ModuleDict`) and set that up once, or "
                "freeze the second one (`requires_grad_(False)`) before `fabric.setup`."
            )
        check_ranks_agree(model_fingerprint(module, self._fingerprint_options(module)))  # before the broadcast
        sync_module_states(module)
        if trainable:
            self.engine.attach(list(module.named_parameters()), self._timeout, module=module)
            self._trained = module
            if self.world_size > 1:
                self._distinct_hook = DistinctBatches("fabric").watch(module, self.root_device)
            if self.config.broadcast_buffers and any(True for _ in module.buffers()):
                self._buffer_hook = module.register_forward_pre_hook(self._broadcast_buffers)
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """With sharded state ``optimizer`` steps this rank's pieces of its parameters (set up the module first)."""
        optimizer = super().setup_optimizer(optimizer)
        if self.config.shard_optimizer_state and not self.engine.sharded:
            raise RuntimeError(
                "With shard_optimizer_state=True the optimizer is cut to the shards of the module's buckets: set "
                "up the module first (`fabric.setup(model, optimizer)` or `fabric.setup_module` before "
                "`fabric.setup_optimizers`)."
            )
        self.engine.bind(optimizer)
        return optimizer

    def _fingerprint_options(self, module: nn.Module) -> dict[str, Any]:
        """What every rank must agree on besides the model: the options, precision and bucket layout."""
        options = bucketed_options(self, self.reduction, self.config, module, self.precision)
        return {**options, "nodes": self.num_nodes, "per_node": self.num_processes}

    def _broadcast_buffers(self, module: nn.Module, args: Any) -> None:
        """Before a training forward (train mode, gradients on, not inside ``no_backward_sync``): rank 0's buffers."""
        if module.training and torch.is_grad_enabled() and not self.engine.grad_sync.blocked:
            broadcast_module_buffers(module)

    # ------------------------------------------------------------------ one step
    @override
    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """Arm the buckets (or count a skipped pass inside ``no_backward_sync``), run backward through the precision
        plugin, and wait until ``.grad`` holds the average over the ranks."""
        self.engine.before_backward()
        try:
            super().backward(tensor, module, *args, **kwargs)
        except BaseException:
            self.engine.abort()
            raise
        self.engine.after_backward(getattr(self.precision, "scaler", None))

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        """The non-finite check first (the gradients are reduced by now; a ``closure`` is wrapped instead), then the
        step and what follows it (sharded parameters gathered, statistics, local SGD's count)."""
        checked = self.engine.nonfinite.mode is not None and self._trained is not None
        if checked and isinstance(optimizer, Optimizer):
            named = self.engine.guarded_parameters(self._trained.named_parameters())  # type: ignore[union-attr]
            kwargs = self.engine.nonfinite.check_step(kwargs, optimizer, named, self.root_device)
        output = super().optimizer_step(optimizer, **kwargs)
        self.engine.after_step(optimizer)  # every step is counted, whatever optimizer Fabric steps
        return output

    @contextmanager
    def no_backward_sync(self) -> Generator[None, None, None]:
        """Backward passes inside accumulate gradients locally; the next synchronised one averages the sum.

        ``fabric.no_backward_sync(model)`` enters this.
        """
        with self.engine.grad_sync.no_sync():
            yield None

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """With sharded state: the 2-norm over every rank's pieces (each element lives on one rank)."""
        if not self.engine.sharded:
            return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)
        if float(norm_type) != 2.0:
            raise ValueError(
                f"With shard_optimizer_state=True, `fabric.clip_gradients` clips by the 2-norm over every rank; got "
                f"norm_type={norm_type}. Pass norm_type=2.0, or clip by value (`clip_val=...`)."
            )
        self.precision.unscale_gradients(optimizer)
        total = self.engine.clip_grad_norm(
            list(self.precision.main_params(optimizer)), float(max_norm), self.root_device
        )
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"The total norm of the gradients is {total.item()}, not finite.")
        return total

    # ------------------------------------------------------------------ checkpoints (sharded state)
    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """With sharded state: rank 0 writes the checkpoint while every rank sends its pieces of the optimizer state,
        one tensor at a time (the whole state, as one optimizer over the module saves it)."""
        state = self._with_own_state(state)
        if not self.engine.sharded:
            super().save_checkpoint(path, state, storage_options, filter)
            return
        save_sharded(self, self.engine, path, state, storage_options, filter)

    def _with_own_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """What ``fabric.save`` writes besides ``state`` (a subclass adds its own entries; default: nothing)."""
        return state

    def _restore_own_state(self, remainder: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
        """After ``fabric.load`` filled ``state``: take this strategy's own entries out of ``remainder`` (what the file
        holds beyond ``state``) and return the rest (default: all of it)."""
        return remainder

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        """With sharded state: the whole optimizer's ``state_dict`` on rank 0 (a collective, as ``fabric.save``)."""
        optimizer = getattr(optimizer, "optimizer", optimizer)
        if not self.engine.sharded:
            return super().get_optimizer_state(optimizer)
        return self.engine.optimizer_state(optimizer)

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: nn.Module | Optimizer | dict[str, nn.Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """With sharded state: each rank takes its pieces of the whole optimizer states in the file (saved by any
        strategy, at any world size)."""
        if not isinstance(state, dict):
            return super().load_checkpoint(path, state, strict, weights_only)
        if not self.engine.sharded:
            return self._restore_own_state(super().load_checkpoint(path, state, strict, weights_only), state)
        load = super().load_checkpoint
        remainder = load_sharded(self.engine, state, lambda proxy: load(path, proxy, strict, weights_only))
        return self._restore_own_state(remainder, state)

    # ------------------------------------------------------------------ teardown
    @override
    def teardown(self) -> None:
        """Close the buckets, the reducer and the gradient groups (Fabric itself never calls this; a script may)."""
        for hook in (self._buffer_hook, self._distinct_hook):
            if hook is not None:
                hook.remove()
        self._buffer_hook = self._distinct_hook = None
        self.engine.close()
        self._trained = None
        super().teardown()
        self.engine.destroy_groups()

    # ------------------------------------------------------------------ options (read-only; see `config`)
    bucket_cap_mb = ConfigOption[float]()
    first_bucket_cap_mb = ConfigOption[float]()
    broadcast_buffers = ConfigOption[bool]()
    two_level = ConfigOption[bool | None]()
    shard_optimizer_state = ConfigOption[bool]()
    reducer = ConfigOption[str | Reducer | None]("reduction")
    ddp_comm_hook = ConfigOption[CommHook | None]("reduction")
    ddp_comm_state = ConfigOption[object]("reduction")
    ddp_comm_wrapper = ConfigOption[Callable[[CommHook], CommHook] | None]("reduction")


class _BucketSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model, enabled)``: the strategy's no-sync block, or nothing when not enabled."""

    def __init__(self, strategy: FabricRingAllReduceStrategy) -> None:
        self._strategy = strategy

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return self._strategy.no_backward_sync() if enabled else nullcontext()
