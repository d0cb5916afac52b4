"""Local SGD and DiLoCo under the Trainer: local optimizer steps, then the average parameter change, every H steps."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dp_strategies.core.fault_tolerance import FaultTolerance, Survivors, check_local_fault_tolerance
from lightning_dp_strategies.core.local_sgd import LocalSGDInterface, check_single_optimizer, local_options
from lightning_dp_strategies.core.options import BucketedConfig, ConfigOption
from lightning_dp_strategies.core.registry import register_name
from lightning_dp_strategies.local_sgd import local_checkpoint_record, restore_local_record
from lightning_dp_strategies.strategies._trainer import check_no_finetuning
from lightning_dp_strategies.strategies.bucketed import BucketedDataParallel
from lightning_dp_strategies.strategies.local_survival import LocalSurvival, check_local_survivable
from lightning_dp_strategies.strategies.survival import TrainerSurvival
from lightning_dp_strategies.strategies.surviving import SurvivingDataParallel, as_fault_tolerance

__all__ = ["LocalSGDStrategy"]


LOCAL_FINETUNING = (
    "it unfreezes parameters while training, and local SGD averages the parameters that required grad when training "
    "began: the others would train apart on each rank, never averaged. Make every parameter the run will train "
    "trainable before `fit`, or train with strategy='ring_allreduce', which picks up a parameter unfrozen later."
)


class LocalSGDStrategy(LocalSGDInterface, SurvivingDataParallel):
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

    The options (``sync_every``, ``outer_optimizer``, streaming DiLoCo's ``fragments``, ``delay``, ``mixing`` and
    ``outer_precision``, ...) are :class:`~lightning_dp_strategies.core.local_sgd.LocalSGDInterface`'s, shared with
    :class:`~lightning_dp_strategies.FabricLocalSGDStrategy`; the shared keyword options are
    :class:`~lightning_dp_strategies.strategies.options.StrategyOptions`.

    ``fault_tolerant=True`` (or a :class:`~lightning_dp_strategies.FaultTolerance`) goes on without a rank that dies,
    hangs or loses its link, as :class:`~lightning_dp_strategies.RingAllReduceStrategy` does: the survivor that takes
    a lost rank over trains a replica of it (its inner optimizer state is handed over at every synchronisation), so
    the run ends on the uninterrupted run's parameters (see
    :mod:`~lightning_dp_strategies.strategies.local_survival` and ``docs/fault_tolerance.md``). Local SGD and DiLoCo
    only: one fragment, no delay, no warm-up, a fixed ``sync_every``, ``outer_precision`` fp32 or bf16.

    Examples:
        >>> import lightning as L
        >>> from lightning_dp_strategies import diloco_outer_optimizer
        >>> strategy = LocalSGDStrategy(sync_every=16, outer_optimizer=diloco_outer_optimizer())
        >>> strategy.sync_every, strategy.cost_model.name
        (16, 'local_sgd(sync_every=16)')
        >>> trainer = L.Trainer(strategy="local_sgd", accelerator="cpu", devices=2)  # doctest: +SKIP
    """

    registered_name: ClassVar[str | None] = "local_sgd"
    registered_description: ClassVar[str] = "Local SGD / DiLoCo: local steps, the parameter change averaged every H"
    compared_as: ClassVar[str | None] = None

    def __init__(self, *args: Any, fault_tolerant: bool | FaultTolerance = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        tolerance = as_fault_tolerance(fault_tolerant)
        check_local_fault_tolerance(tolerance, local_options(self.local_config), self.reduction.reducer)
        self.survival = TrainerSurvival(self, Survivors(tolerance)) if tolerance is not None else None
        self.local_survival = LocalSurvival(self, self.survival) if self.survival is not None else None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """The base's names and ``local_sgd_fault_tolerant`` (``fault_tolerant=True``)."""
        super().register_strategies(strategy_registry)
        description = f"{cls.registered_description}, going on without a lost rank (fault_tolerant=True)"
        register_name(strategy_registry, f"{cls.registered_name}_fault_tolerant", cls, description, fault_tolerant=True)

    @override
    def _init_data_parallel(self, caps: tuple[float, float], reducer: Any, options: Mapping[str, Any]) -> None:
        BucketedDataParallel.__init__(self, BucketedConfig(*caps), reducer, **options)

    # ------------------------------------------------------------------ setup
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Restore after setup: each rank's own parameters must not be overwritten by rank 0's broadcast."""
        return True

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        self._start_local_sgd()
        assert self.local_sgd is not None
        self.local_sgd.hold_sends = True  # released by on_train_batch_start

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Start the reductions of the fragments that left at the last step. Lightning broadcasts a flag from rank 0
        at the top of every batch; started here, after it, a fragment's bytes do not queue on the link ahead of it."""
        super().on_train_batch_start(batch, batch_idx)
        if self.local_sgd is not None:
            self.local_sgd.release()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            check_no_finetuning(trainer, "under local SGD", LOCAL_FINETUNING)
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            check_single_optimizer(self.optimizers, type(self).__name__)
            if self.local_survival is not None:
                check_local_survivable(trainer)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self.local_survival is not None:
            self.local_survival.start()

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        self._check_averaged(optimizer, self.lightning_module)
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    @override
    def _receive_state(self, trainer: pl.Trainer) -> None:
        """After the base's ``configure_ddp`` (ranks agree, rank 0's weights, gradient buckets for the warm-up): the
        anchor, then (a replacement) the live ranks' training state, local SGD's record included."""
        assert self.local_sgd is not None and self.lightning_module is not None
        self.local_sgd.start(self.lightning_module)
        super()._receive_state(trainer)

    @override
    def _fingerprint_options(self) -> dict[str, Any]:
        return {**super()._fingerprint_options(), **local_options(self.local_config)}

    # ------------------------------------------------------------------ synchronisation (the engine's)
    @override
    def on_validation_start(self) -> None:
        module = self.lightning_module
        if module is not None and module.trainer.state.fn == TrainerFn.FITTING:
            self.synchronize()
        super().on_validation_start()

    @override
    def on_train_end(self) -> None:
        self.synchronize()
        if self.local_survival is not None:
            self.local_survival.close()
        super().on_train_end()

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model averaged over the ranks (collective mid-period): what another strategy loads."""
        state = super().lightning_module_state_dict()
        return state if self.local_sgd is None else self.local_sgd.averaged_state(state)

    @override
    def checkpoint_to_write(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """A resumable checkpoint with the local SGD record (anchor, outer state, position, every rank's own state)
        gathered to the leader, which writes it (collective)."""
        module = self.lightning_module
        if self.local_sgd is None or module is None or "optimizer_states" not in checkpoint:
            return checkpoint
        states = checkpoint["optimizer_states"]
        if self.local_survival is not None:
            record = self.local_survival.checkpoint_record(states)
        else:
            record = local_checkpoint_record(self.local_sgd, module, states)
        return {**checkpoint, "local_sgd": record} if record is not None else checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """The averaged model, then (resuming ``fit``) this rank's own parameters and the local SGD record, when the
        checkpoint has one; from another strategy's checkpoint, the anchor is the loaded model. ``validate``, ``test``
        and ``predict`` evaluate the averaged model on every rank."""
        super().load_model_state_dict(checkpoint, strict)
        module = self.lightning_module
        if self.local_sgd is not None and module is not None and module.trainer.state.fn == TrainerFn.FITTING:
            restore_local_record(self.local_sgd, module, checkpoint.get("local_sgd"), self.global_rank)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """This rank's own inner optimizer state where the checkpoint holds one per rank; where it holds none for this
        rank (lost while the run went on with ``keep_global_batch=False``), the leader's, with a warning."""
        record = checkpoint.get("local_sgd")
        if record is not None and record["ranks"][self.global_rank] is not None:
            checkpoint = {**checkpoint, "optimizer_states": record["ranks"][self.global_rank]["optimizer"]}
        elif record is not None:
            warnings.warn(
                f"This local SGD checkpoint holds no state of rank {self.global_rank}: that rank was lost while the "
                "run went on without its share of the batch (`fault_tolerant` with `keep_global_batch=False`). It "
                "resumes from the averaged model with the writer's inner optimizer state.",
                stacklevel=2,
            )
        super().load_optimizer_state_dict(checkpoint)

    # ------------------------------------------------------------------ options (read-only; the rest shared)
    bucket_cap_mb = ConfigOption[float]()
    first_bucket_cap_mb = ConfigOption[float]()
