"""Local SGD and DiLoCo under the Trainer: local optimizer steps, then the average parameter change, every H steps."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import lightning.pytorch as pl
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import Unpack, override

from lightning_dp_strategies.core.engine import EngineView
from lightning_dp_strategies.core.local_sgd import (
    STREAMING_DEFAULTS,
    check_single_optimizer,
    local_config,
    local_options,
)
from lightning_dp_strategies.core.options import BucketedConfig, ConfigOption
from lightning_dp_strategies.core.registry import register_with_launchers
from lightning_dp_strategies.local_sgd import (
    LocalSGD,
    OuterOptimizerFactory,
    local_checkpoint_record,
    restore_local_record,
)
from lightning_dp_strategies.plan import CostModel
from lightning_dp_strategies.plan.formulas import LOCAL_SGD, local_sgd_cost_model
from lightning_dp_strategies.reducers import Reducer
from lightning_dp_strategies.strategies.bucketed import BucketedDataParallel
from lightning_dp_strategies.strategies.options import StrategyOptions

__all__ = ["LocalSGDStrategy"]


class LocalSGDStrategy(BucketedDataParallel):
    """Each rank takes ``sync_every`` optimizer steps on its own; then the ranks average the parameter change since
    the last synchronisation in one all-reduce, and an outer optimizer applies it (see
    :mod:`lightning_dp_strategies.core.local_sgd`).

    With the default plain averaging every rank ends a period with the mean of the ranks' parameters; with
    ``outer_optimizer=diloco_outer_optimizer()`` (SGD, lr 0.7, Nesterov momentum 0.9) it is DiLoCo. The inner
    optimizer (the one ``configure_optimizers`` returns) keeps its state on each rank: it is never averaged.
    Floating-point buffers (BatchNorm statistics) are averaged with the change at each synchronisation.

    The ranks synchronise before every validation run and at the end of ``fit``, so validation, ``ModelCheckpoint``
    and the code after ``fit`` see one model on every rank. ``sync_every`` counts optimizer steps (with
    ``accumulate_grad_batches`` a step is several batches; in manual optimization, every ``optimizer.step()``);
    gradient clipping clips each rank's local gradient. A checkpoint holds the averaged model as its ``state_dict``
    (so any strategy loads it), the anchor, the outer optimizer's state and the position in the period, and each
    rank's own parameters and inner optimizer state, so resuming continues exactly where the run stopped.

    Args:
        sync_every: optimizer steps between synchronisations (H, >= 1). With 1, plain averaging and SGD it trains as
            ``ring_allreduce`` does. ``"auto"``: a trial period sends every fragment once, one a step, and times
            the inner steps and the fragments' reductions; then the ranks take the smallest period (a multiple of
            ``fragments``) in which a fragment's reduction ends before the next one leaves, raise ``delay`` to
            cover it, and log the choice once.
        outer_optimizer: ``factory(params) -> Optimizer`` over the anchor parameters it is given, called once at
            setup (``None``: plain averaging).
        warmup_steps: optimizer steps at the start whose gradients are averaged every step, as ``ring_allreduce``
            does (post-local SGD); local steps begin after them.
        reducer: how the change is averaged (and the warm-up's gradients): ``"ring"`` (default), ``"native"``, or
            a reducer such as ``bf16_compress("ring")``, which halves the bytes sent.
        average_buffers: average floating-point buffers at each synchronisation.
        bucket_cap_mb: cap of the warm-up's gradient buckets in MiB.
        first_bucket_cap_mb: cap of the warm-up's first gradient bucket in MiB.
        shard_optimizer_state: refused (``True`` raises): between averages every rank steps its whole model, so
            it needs the whole optimizer state; see ``RingAllReduceStrategy(shard_optimizer_state=True)``.
        fragments: streaming DiLoCo: runs of consecutive parameters (about equal in size) synchronised in staggered
            turns, each every ``sync_every`` steps, so a turn sends ``1/fragments`` of the model (1: all at once).
        delay: streaming DiLoCo: inner steps that run while a fragment's change is averaged on a background thread;
            the average is applied after them (``0``: at once, the loop waits). Less than ``sync_every``.
        mixing: streaming DiLoCo: the weight of the rank's own values when a fragment's new global values are merged
            in (``0``: replaced; ``0.5`` suits a delay).
        outer_precision: how the change travels: ``"fp32"`` (through ``reducer``), ``"bf16"`` (``reducer`` on a
            bf16 copy), ``"int8"`` or ``"int4"`` (8 or 4 bits with a scale a block of 128 values, summed in fp32, on
            any backend, gloo included).
        **options: the shared keyword options (``nonfinite_grads``, ``timeout``, ...): see
            :class:`~lightning_dp_strategies.strategies.options.StrategyOptions`.

    ``fragments=1, delay=0, mixing=0, outer_precision="fp32"`` (the defaults) is local SGD or DiLoCo as above. The
    name ``"streaming_diloco"`` stands for :data:`~lightning_dp_strategies.core.local_sgd.STREAMING_DEFAULTS`:
    DiLoCo's outer optimizer, ``sync_every="auto", fragments=4, delay=1, mixing=0.5, outer_precision="int4"``.

    Examples:
        >>> import lightning as L
        >>> from lightning_dp_strategies import diloco_outer_optimizer
        >>> strategy = LocalSGDStrategy(sync_every=16, outer_optimizer=diloco_outer_optimizer())
        >>> strategy.sync_every, strategy.cost_model.name
        (16, 'local_sgd')
        >>> trainer = L.Trainer(strategy="local_sgd", accelerator="cpu", devices=2)  # doctest: +SKIP
    """

    registered_name: ClassVar[str | None] = "local_sgd"
    registered_description: ClassVar[str] = "Local SGD / DiLoCo: local steps, the parameter change averaged every H"
    compared_as: ClassVar[str | None] = None
    cost_model: ClassVar[CostModel] = LOCAL_SGD

    def __init__(
        self,
        sync_every: int | str = 8,
        outer_optimizer: OuterOptimizerFactory | None = None,
        warmup_steps: int = 0,
        reducer: str | Reducer | None = None,
        average_buffers: bool = True,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float = 1.0,
        shard_optimizer_state: bool = False,
        fragments: int = 1,
        delay: int = 0,
        mixing: float = 0.0,
        outer_precision: str = "fp32",
        **options: Unpack[StrategyOptions],
    ) -> None:
        config = local_config(
            shard_optimizer_state,
            reducer,
            outer_precision,
            sync_every=sync_every,
            outer_optimizer=outer_optimizer,
            warmup_steps=warmup_steps,
            average_buffers=average_buffers,
            fragments=fragments,
            delay=delay,
            mixing=mixing,
        )
        super().__init__(BucketedConfig(bucket_cap_mb, first_bucket_cap_mb), reducer, **options)
        self.local_config = config  # configuration; the algorithm is the engine's, made at setup
        period = sync_every if isinstance(sync_every, int) else 16  # "auto": priced at the registered default's
        self.cost_model = local_sgd_cost_model(period)  # type: ignore[misc]  # this instance's period

    local_sgd = EngineView[LocalSGD | None]()  # the algorithm (``None`` before setup)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        super().register_strategies(strategy_registry)
        description = "Streaming DiLoCo: fragments synchronised in turns, 4-bit changes sent during the inner steps"
        register_with_launchers(strategy_registry, "streaming_diloco", cls, description, **STREAMING_DEFAULTS)

    # ------------------------------------------------------------------ setup
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Restore after setup: each rank's own parameters must not be overwritten by rank 0's broadcast."""
        return True

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        reducer = self.configure_reducer()
        self.engine.start_local_sgd(self.local_config, reducer, self.world_size, self._process_group_backend)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            check_single_optimizer(self.optimizers, type(self).__name__)

    @override
    def configure_ddp(self) -> None:
        """As the base (ranks agree, rank 0's weights, gradient buckets for the warm-up), then the anchor."""
        super().configure_ddp()
        assert self.local_sgd is not None and self.lightning_module is not None
        self.local_sgd.start(self.lightning_module)

    @override
    def _fingerprint_options(self) -> dict[str, Any]:
        return {**super()._fingerprint_options(), **local_options(self.local_config)}

    # ------------------------------------------------------------------ synchronisation (the engine's)
    def synchronize(self) -> None:
        """Average the ranks' parameter changes now and apply the outer step (on every rank; nothing when the ranks
        are in sync already). Called before validation and at the end of training."""
        self.engine.synchronize()

    @override
    def on_validation_start(self) -> None:
        module = self.lightning_module
        if module is not None and module.trainer.state.fn == TrainerFn.FITTING:
            self.synchronize()
        super().on_validation_start()

    @override
    def on_train_end(self) -> None:
        self.synchronize()
        super().on_train_end()

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model averaged over the ranks (collective mid-period): what another strategy loads."""
        state = super().lightning_module_state_dict()
        return state if self.local_sgd is None else self.local_sgd.averaged_state(state)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Add the local SGD record (anchor, outer state, position, every rank's own state) to a resumable checkpoint;
        rank 0 writes it. Called on every rank."""
        module = self.lightning_module
        if self.local_sgd is not None and module is not None and "optimizer_states" in checkpoint:
            record = local_checkpoint_record(self.local_sgd, module, checkpoint["optimizer_states"])
            checkpoint = {**checkpoint, "local_sgd": record} if record is not None else checkpoint
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """The averaged model, then this rank's own parameters and the local SGD record, when the checkpoint has one;
        from another strategy's checkpoint, the anchor is the loaded model."""
        super().load_model_state_dict(checkpoint, strict)
        module = self.lightning_module
        if self.local_sgd is not None and module is not None:
            restore_local_record(self.local_sgd, module, checkpoint.get("local_sgd"), self.global_rank)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """This rank's own inner optimizer state where the checkpoint holds one per rank."""
        record = checkpoint.get("local_sgd")
        if record is not None:
            checkpoint = {**checkpoint, "optimizer_states": record["ranks"][self.global_rank]["optimizer"]}
        super().load_optimizer_state_dict(checkpoint)

    # ------------------------------------------------------------------ options (read-only)
    sync_every = ConfigOption[int | str]("local_config")
    outer_optimizer = ConfigOption[OuterOptimizerFactory | None]("local_config")
    warmup_steps = ConfigOption[int]("local_config")
    average_buffers = ConfigOption[bool]("local_config")
    fragments = ConfigOption[int]("local_config")
    delay = ConfigOption[int]("local_config")
    mixing = ConfigOption[float]("local_config")
    outer_precision = ConfigOption[str]("local_config")
    bucket_cap_mb = ConfigOption[float]()
    first_bucket_cap_mb = ConfigOption[float]()
