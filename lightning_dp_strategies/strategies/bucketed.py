"""The base of the multi-process strategies whose gradients are averaged by gradient buckets.

A strategy is Lightning's ``DDPStrategy`` plus the collaborators of a :class:`~lightning_dp_strategies.core.engine.
BucketedEngine` (gradient buckets, sharded optimizer state, the non-finite check, post-local SGD's averaging), which
the Fabric strategies hold too. Lightning's hooks are written once, here, as named calls over it::

    setup_distributed ──▶ restart-safe default group ──▶ engine.make_groups(grad_group_ranks(), reducer)
    configure_ddp ──▶ ranks agree ──▶ rank 0's weights ──▶ engine.attach(bucketed_parameters())
    pre_backward: engine.before_backward ─ backward ─ post_backward: engine.after_backward (.grad holds the average)
    optimizer_step ──▶ engine.guard(closure) ──▶ step ──▶ engine.after_step
    teardown ──▶ engine.close ──▶ Lightning's teardown ──▶ engine.destroy_groups

With ``fault_tolerant`` they hand over to its :class:`~lightning_dp_strategies.strategies.survival.TrainerSurvival`.

Contract for a subclass:

- ``grad_group_ranks()``: the world split into the lists of global ranks that average together (default: the
  whole world, one group). Called on every rank, it must give every rank the same lists.
- ``bucketed_parameters()``: the ``(name, parameter)`` pairs this rank averages (default: the whole module's).
- ``configure_reducer()``: how a bucket is reduced (default: the ``reducer=`` option or the communication hook);
  ``arrange_reducer(reducer)`` fits it to the layout (the ring: two levels across nodes, sharded state).
- the base's ``configure_ddp`` checks that the ranks agree, broadcasts rank 0's weights and attaches the buckets; a
  strategy that places its module otherwise overrides it and calls ``self._build_buckets()`` once the module is in
  place, and one that runs backward itself calls ``self.engine.before_backward()`` / ``after_backward`` there.
- its own options go in a frozen dataclass derived from :class:`BucketedConfig`, passed as ``config=``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.optimizer import _optimizer_to_device
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import Unpack, override

from lightning_dp_strategies.bucketing import CommStats, GradientBuckets
from lightning_dp_strategies.bucketing.sync import GradientSync
from lightning_dp_strategies.core.agreement import (
    bucketed_options,
    check_ranks_agree,
    model_fingerprint,
    require_trainable,
)
from lightning_dp_strategies.core.checkpoint_io import AtomicByDefault
from lightning_dp_strategies.core.distinct_batches import DistinctBatches
from lightning_dp_strategies.core.elastic import init_strategy_process_group
from lightning_dp_strategies.core.engine import BucketedEngine, EngineView
from lightning_dp_strategies.core.even_batches import EvenBatches
from lightning_dp_strategies.core.launch import check_launch
from lightning_dp_strategies.core.module_state import sync_module_states
from lightning_dp_strategies.core.nonfinite import NonfiniteGuard
from lightning_dp_strategies.core.options import BucketedConfig, ConfigOption, ReductionOptions, lightning_arguments
from lightning_dp_strategies.core.registry import register_with_launchers
from lightning_dp_strategies.core.topology import check_own_reducer, priced
from lightning_dp_strategies.plan import RING_ALLREDUCE, CostModel
from lightning_dp_strategies.reducers import CommHook, Reducer
from lightning_dp_strategies.sharding import OptimizerSharding
from lightning_dp_strategies.strategies._trainer import STARTED_RANKS, batch_position, with_resumed_sampler_epoch
from lightning_dp_strategies.strategies.options import TRAINER_PLUGINS, StrategyOptions
from lightning_dp_strategies.strategies.precision import (
    ClipByNorm,
    ClippingAcrossRanks,
    GlobalNormClipping,
    averaged_backward,
    readable_by_wrapper,
    stored_under_plugin_name,
)
from lightning_dp_strategies.strategies.survival import TrainerSurvival, check_survivable

__all__ = ["BucketedConfig", "BucketedDataParallel"]


class BucketedDataParallel(DDPStrategy):
    """Base of the strategies whose gradients ``GradientBuckets`` average over groups of ranks (see the module doc).

    Lightning's launchers, cluster environments and process-group setup come from
    :class:`~lightning.pytorch.strategies.DDPStrategy`; the module is never wrapped. Checkpoints are written
    atomically (:class:`~lightning_dp_strategies.AtomicCheckpointIO`) unless a ``checkpoint_io`` is given.

    ``config`` holds the strategy's options (a :class:`BucketedConfig` or a subclass of it); ``reducer`` and the
    ``ddp_comm_*`` / ``model_averaging_period`` options are :class:`~lightning_dp_strategies.RingAllReduceStrategy`'s,
    and the keyword ``options`` those of :class:`~lightning_dp_strategies.strategies.options.StrategyOptions`.

    Examples:
        >>> from lightning_dp_strategies.reducers import NativeReducer
        >>> class NativeDDP(BucketedDataParallel):  # a complete strategy: DDP on the package's buckets
        ...     def configure_reducer(self) -> Reducer:
        ...         return NativeReducer()
        >>> NativeDDP(config=BucketedConfig(bucket_cap_mb=5)).config.bucket_cap_mb
        5.0
    """

    config: BucketedConfig
    survival: TrainerSurvival | None = None
    """With ``fault_tolerant``: the hooks' survivor side (set by a subclass that offers the option)."""
    cost_model: ClassVar[CostModel] = RING_ALLREDUCE  # per-step formula (plan); a subclass may set its own
    registered_name: ClassVar[str | None] = None
    """The name given to Lightning, with ``{name}_spawn`` and ``{name}_notebook`` beside it (``None``: none)."""
    registered_description: ClassVar[str] = ""
    compared_as: ClassVar[str | None] = None
    """The name the comparison runs it under when no strategies are named (``None``: only when named)."""

    @classmethod
    def launched_processes(cls, devices: int) -> int:
        """Processes a run on ``devices`` devices starts: one per device."""
        return devices

    def __init__(
        self,
        config: BucketedConfig | None = None,
        reducer: str | Reducer | None = None,
        ddp_comm_state: object = None,
        ddp_comm_hook: CommHook | None = None,
        ddp_comm_wrapper: Callable[[CommHook], CommHook] | None = None,
        model_averaging_period: int | None = None,
        **options: Unpack[StrategyOptions],
    ) -> None:
        lightning_options = lightning_arguments(type(self).__name__, options, StrategyOptions, TRAINER_PLUGINS)
        reduction = ReductionOptions(reducer, ddp_comm_hook, ddp_comm_state, ddp_comm_wrapper, model_averaging_period)
        config = config if config is not None else BucketedConfig()
        check_own_reducer(type(self), BucketedDataParallel, bool(getattr(config, "shard_optimizer_state", False)))
        super().__init__(**lightning_options)
        self.config, self.reduction = config, reduction  # configuration
        self.cost_model = priced(type(self).cost_model, reduction, getattr(config, "two_level", None))  # type: ignore[misc]
        self.engine = BucketedEngine(config, reduction, options.get("nonfinite_grads"))
        self._clipping: GlobalNormClipping | None = None
        self.distinct_batches = DistinctBatches()  # warns when ranks of a group read the same first batch of a fit
        self.even_batches = EvenBatches()  # fails on every rank when the ranks' batches in an epoch differ

    # ------------------------------------------------------------------ what a subclass says
    def grad_group_ranks(self) -> list[list[int]]:
        """The world split into the global ranks that average gradients together (default: one group, the world)."""
        return [list(range(self.world_size))]

    def bucketed_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The ``(name, parameter)`` pairs this rank's buckets average (default: the whole module's)."""
        assert self.lightning_module is not None
        return list(self.lightning_module.named_parameters())

    def configure_reducer(self) -> Reducer:
        """The reducer of the gradient buckets, called once at setup (default: the hook's when ``ddp_comm_hook`` was
        given, else the ``reducer=`` option's): override it to reduce another way. What it returns still goes
        through :meth:`arrange_reducer`; with ``shard_optimizer_state=True`` an override is refused at construction."""
        return self.reduction.make_reducer()

    def arrange_reducer(self, reducer: Reducer) -> Reducer:
        """Fit ``configure_reducer()``'s reducer to the job's layout (default: as it is)."""
        return reducer

    # ------------------------------------------------------------------ the collaborators, as users read them
    grad_sync = EngineView[GradientSync]()
    sharding = EngineView[OptimizerSharding]()  # this rank's share of the optimizer state (sharded state)
    nonfinite = EngineView[NonfiniteGuard]()
    buckets = EngineView[GradientBuckets | None]()  # ``None`` before setup and after teardown
    step_stats = EngineView[CommStats]()  # gradient communication of the last optimizer step
    comm_stats = EngineView[CommStats]()  # running totals on this rank since setup (kept after teardown)

    # ------------------------------------------------------------------ names, launch, plugins
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if cls.registered_name is not None:
            register_with_launchers(strategy_registry, cls.registered_name, cls, cls.registered_description)

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        check_launch(self, "Trainer")

    checkpoint_io = AtomicByDefault()
    """The ``checkpoint_io`` given, else an :class:`~lightning_dp_strategies.AtomicCheckpointIO`."""

    precision_plugin = ClippingAcrossRanks()
    """Lightning's plugin; from setup to teardown where clipping by norm spans ranks, it wrapped."""

    def clip_by_norm_across(self, clip_grad_by_norm: ClipByNorm) -> None:
        """From now to teardown, clipping by norm (``gradient_clip_val``) calls ``clip_grad_by_norm``."""
        self._clipping = GlobalNormClipping(super().precision_plugin, clip_grad_by_norm)

    # ------------------------------------------------------------------ setup
    @override
    def setup_distributed(self) -> None:
        self.set_world_ranks()
        (self.survival.init_process_group if self.survival is not None else init_strategy_process_group)(self)
        STARTED_RANKS.gathered()
        super().setup_distributed()
        backend, rank = self._get_process_group_backend(), self.global_rank
        self.engine.start_model_averaging(self.world_size, rank, self.num_processes, backend)
        if self.survival is not None:
            self.survival.start()
            return
        self.engine.make_groups(self.grad_group_ranks(), rank, backend, self.arrange_reducer(self.configure_reducer()))

    @override
    def configure_ddp(self) -> None:
        """Check that the ranks agree, broadcast rank 0's state, then attach gradient buckets (no DDP wrapper)."""
        module = self.lightning_module
        assert module is not None
        self._require_trainable("train with `strategy='auto'`")
        self._check_ranks_agree()  # before the broadcast, which mismatched shapes would hang
        sync_module_states(module, self.survival.leader if self.survival is not None else 0)
        self._build_buckets()
        self._receive_state(module.trainer)

    def _receive_state(self, trainer: pl.Trainer) -> None:
        """With ``fault_tolerant``, in a replacement: the live ranks' training state (once the module is in place)."""
        if self.survival is not None:
            self.survival.receive_state(trainer)

    def _build_buckets(
        self, named_params: Sequence[tuple[str, nn.Parameter]] | None = None, allow_no_trainable: bool = False
    ) -> None:
        """Attach the gradient buckets to ``named_params`` (default: :meth:`bucketed_parameters`); with
        ``allow_no_trainable`` a rank may own no trainable parameter (every rank of its group alike)."""
        named = list(self.bucketed_parameters() if named_params is None else named_params)
        self.engine.attach(named, self._timeout, allow_no_trainable, self.lightning_module)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """Lightning's optimizers; with sharded state each then steps this rank's pieces of its parameters."""
        super().setup_optimizers(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            for optimizer in self.optimizers:
                self.engine.bind(optimizer)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if self.survival is not None and trainer.state.fn == TrainerFn.FITTING:
            check_survivable(trainer)
        super().setup(trainer)
        self.distinct_batches.pending = trainer.state.fn == TrainerFn.FITTING
        if self.engine.sharded:
            self.clip_by_norm_across(self._clip_pieces_by_norm)

    def _clip_pieces_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        """Lightning's clip-by-norm with the norm over every rank's pieces."""
        self.engine.clip_grad_norm(list(self.precision_plugin.main_params(optimizer)), clip_val, self.root_device)

    def _require_trainable(self, fix: str) -> None:
        """A clear error, on every rank, when the module has no parameter that requires grad."""
        require_trainable(self.lightning_module, type(self).__name__, fix)  # type: ignore[arg-type]

    def _fingerprint_options(self) -> dict[str, Any]:
        """What every rank must agree on besides the model; subclasses add their own options."""
        module = self.lightning_module
        assert module is not None
        return {
            **bucketed_options(self, self.reduction, self.config, module, self.precision_plugin),
            "accumulate_grad_batches": getattr(module.trainer, "accumulate_grad_batches", None),
            "gradient_clip_val": getattr(module.trainer, "gradient_clip_val", None),
        }

    def _check_ranks_agree(self) -> None:
        """Fail on every rank, before anything else is communicated, if the ranks' models or options differ."""
        check_ranks_agree(model_fingerprint(self.lightning_module, self._fingerprint_options()))  # type: ignore[arg-type]

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """The loader as Lightning prepared it; the train sampler already set to the epoch training starts in."""
        return with_resumed_sampler_epoch(self, super().process_dataloader(dataloader), self.even_batches.begin)

    # ------------------------------------------------------------------ one step
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self.distinct_batches.check(batch, self.grad_group_ranks(), self.root_device)
        self.even_batches.check(batch_position(self, batch_idx), self.root_device)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Lightning's; a ``dataloader_iter`` it is given may be checked at each ``next()`` (``even_batches``)."""
        return super().training_step(*self.even_batches.reading(args, self.root_device), **kwargs)

    @override
    def on_train_end(self) -> None:
        self.even_batches.end(self.lightning_module.current_epoch)  # type: ignore[union-attr]
        super().on_train_end()

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Backward passes inside accumulate gradients locally (Lightning enters it on accumulation steps; in manual
        optimization ``with self.trainer.strategy.no_backward_sync(): self.manual_backward(loss)``)."""
        with self.engine.grad_sync.no_sync():
            yield None

    no_backward_sync = block_backward_sync

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        self.engine.before_backward()

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's backward with the gradients averaged before ``on_after_backward`` (:func:`averaged_backward`);
        with ``fault_tolerant``, also the lost ranks' micro-batches this rank holds."""
        run = functools.partial(averaged_backward, self, optimizer=optimizer, args=args, kwargs=kwargs)
        return run(closure_loss) if self.survival is None else self.survival.backward(run, closure_loss)

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        synced = not self.engine.grad_sync.blocked
        self.engine.after_backward(getattr(self.precision_plugin, "scaler", None))
        if self.survival is not None and synced:
            self.survival.scale_gradients()

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | Any | None = None,
        **kwargs: Any,
    ) -> Any:
        module = self.lightning_module
        if module is not None:
            closure = self.engine.guard(closure, optimizer, module.named_parameters(), self.root_device)
        step = functools.partial(super().optimizer_step, optimizer, closure, model, **kwargs)
        output = step() if self.survival is None else self.survival.step(step, closure)
        self.engine.after_step(optimizer)
        self._log_step()
        return output

    def _log_step(self) -> None:
        """Called after every optimizer step; the default logs nothing."""

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's ``state_dict`` (every rank holds the whole model); begins a sharded checkpoint's save."""
        if self.engine.sharded:
            self.engine.sharding.begin_save()
        return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Sharded: the whole ``state_dict`` on rank 0 (tensors streamed in by :meth:`save_checkpoint`; collective)."""
        if self.engine.sharded:
            return self.engine.optimizer_state(getattr(optimizer, "_optimizer", optimizer))
        return super().optimizer_state(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Save as Lightning does (the precision plugin's state under its own class name); with sharded state rank 0
        writes while every rank sends its pieces of the optimizer state, one tensor at a time."""
        checkpoint = stored_under_plugin_name(checkpoint, self.precision_plugin)
        if not self.engine.sharded:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        device = self.root_device if self._process_group_backend == "nccl" else torch.device("cpu")
        writer, io = self.is_global_zero, self.checkpoint_io
        save_whole = functools.partial(io.save_checkpoint, path=filepath, storage_options=storage_options)
        self.engine.save_sharded(checkpoint, filepath, io, writer, device, save_whole, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's load; the precision plugin's state also under the wrapper's name, where it will look."""
        return readable_by_wrapper(super().load_checkpoint(checkpoint_path, weights_only), self.precision_plugin)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Sharded: each rank takes its pieces of the whole optimizer states (saved by any strategy, any world)."""
        if not self.engine.sharded:
            super().load_optimizer_state_dict(checkpoint)
            return
        for optimizer, whole in zip(self.optimizers, checkpoint["optimizer_states"], strict=False):
            self.engine.load_optimizer(optimizer, whole)
            _optimizer_to_device(optimizer, self.root_device)

    # ------------------------------------------------------------------ teardown
    @override
    def on_exception(self, exception: BaseException) -> None:
        self.engine.abort()
        super().on_exception(exception)
        if self.survival is None:  # with fault_tolerant, the other ranks go on without this one
            STARTED_RANKS.stop_at_exit(self.launcher)

    @override
    def teardown(self) -> None:
        self._clipping = None
        if self.survival is not None:
            self.survival.teardown()
        self.engine.close()
        super().teardown()
        self.engine.destroy_groups()

    # ------------------------------------------------------------------ options (read-only)
    reducer = ConfigOption[str | Reducer | None]("reduction")
    ddp_comm_hook = ConfigOption[CommHook | None]("reduction")
    ddp_comm_state = ConfigOption[object]("reduction")
    ddp_comm_wrapper = ConfigOption[Callable[[CommHook], CommHook] | None]("reduction")
