"""DataParallel-style training in one process: every forward call scattered, replicated, run in threads, gathered."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, Strategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from typing_extensions import override

from lightning_dp_strategies.core.agreement import require_materialized
from lightning_dp_strategies.core.checkpoint_io import AtomicByDefault
from lightning_dp_strategies.core.module_state import require_storage
from lightning_dp_strategies.core.nonfinite import NonfiniteGuard, check_nonfinite_mode
from lightning_dp_strategies.core.options import check_dim
from lightning_dp_strategies.core.registry import register_name
from lightning_dp_strategies.data_parallel import as_devices
from lightning_dp_strategies.data_parallel.forward import ParallelForward, ScatterGatherStats
from lightning_dp_strategies.data_parallel.replicas import check_replicable
from lightning_dp_strategies.pipeline.materialize import cpu_keeps_meta
from lightning_dp_strategies.plan import SCATTER_GATHER, CostModel
from lightning_dp_strategies.strategies._trainer import with_resumed_sampler_epoch

__all__ = ["ParallelForward", "ScatterGatherStats", "ScatterGatherStrategy"]


@dataclass
class _StepState:
    hook: str | None = None  # the step hook now running
    forward_calls: int = 0  # parallel forward calls inside it
    warned: set[str] = field(default_factory=set)  # hooks already warned about (never called forward)


class ScatterGatherStrategy(ParallelForward, ParallelStrategy):
    """One process, several devices: the ``torch.nn.DataParallel`` data flow, with Lightning around it.

    Each training/validation/test/predict step runs once on the root device (the first of ``parallel_devices``).
    Inside it, every call of the LightningModule's forward (``self(x)`` or ``self.forward(x)``) runs as
    :meth:`scatter` -> :meth:`replicate` -> :meth:`parallel_apply` -> :meth:`gather` (see :meth:`parallel_forward`),
    so the loss is computed on the gathered outputs of the whole batch and the gradients are the single-device
    gradients, also when the batch does not split evenly. The module is never wrapped: the optimizer holds the real
    parameters and checkpoints hold the plain ``state_dict``.

    With ``accelerator="cuda"`` there is one replica per GPU (``torch.nn.parallel`` primitives); with
    ``accelerator="cpu"``, ``devices=N`` gives N logical replicas on the CPU that share the parameters. The
    replicas' gradients are summed in replica order, so runs with the same seed are bitwise identical; logical CPU
    replicas that draw random numbers (dropout) draw them in a fixed order only with ``Trainer(deterministic=True)``,
    which runs them one after another.

    Args:
        accelerator: set by the Trainer.
        parallel_devices: the devices (set by the Trainer from ``devices``); the first is the root device.
        checkpoint_io: set by the Trainer.
        precision_plugin: set by the Trainer; autocast (``precision="bf16-mixed"``) applies inside every replica.
        dim: the batch dimension that inputs are split and outputs concatenated along.
        nonfinite_grads: check the gradients for NaN/Inf before each optimizer step: ``None`` (no check, the
            default), ``"skip"`` (skip the step, counted in ``nonfinite.skipped_steps``) or ``"raise"``
            (``FloatingPointError``).

    Examples:
        >>> import lightning as L
        >>> import lightning_dp_strategies  # registers "dp" and "scatter_gather"
        >>> trainer = L.Trainer(strategy="dp", accelerator="cpu", devices=3)  # doctest: +SKIP
        >>> trainer = L.Trainer(strategy=ScatterGatherStrategy(), accelerator="cuda", devices=[0, 1])  # doctest: +SKIP
    """

    cost_model: ClassVar[CostModel] = SCATTER_GATHER
    """Its per-step communication formula (:mod:`lightning_dp_strategies.plan`)."""
    registered_name: ClassVar[str | None] = "scatter_gather"
    """Registered with ``"dp"`` beside it, the name Lightning 1.x gave DataParallel."""
    registered_description: ClassVar[str] = "DataParallel-style scatter/replicate/parallel_apply/gather in one process"
    compared_as: ClassVar[str | None] = "dp"
    """The name the comparison runs it under when no strategies are named."""

    @classmethod
    def launched_processes(cls, devices: int) -> int:
        """Processes a run on ``devices`` devices starts: one (the replicas are threads)."""
        return 1

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: Sequence[torch.device | str | int] | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        dim: int = 0,
        nonfinite_grads: Literal["skip", "raise"] | None = None,
    ) -> None:
        check_dim(dim)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=None if parallel_devices is None else as_devices(parallel_devices),
            cluster_environment=None,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        # configuration
        self.dim = dim
        # runtime state
        self._step = _StepState()
        # statistics
        self.stats = ScatterGatherStats()
        self.nonfinite = NonfiniteGuard(check_nonfinite_mode(nonfinite_grads))

    checkpoint_io = AtomicByDefault()
    """The ``checkpoint_io`` given, else an :class:`~lightning_dp_strategies.AtomicCheckpointIO`."""

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """The loader as Lightning prepared it; the train sampler already set to the epoch that is resumed."""
        return with_resumed_sampler_epoch(self, super().process_dataloader(dataloader))

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Lightning's step, its closure checked by the non-finite guard (``nonfinite_grads``)."""
        module = self.lightning_module
        if module is not None and self.nonfinite.mode is not None:
            closure = self.nonfinite.wrap(closure, optimizer, module.named_parameters(), self.root_device)
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    # ------------------------------------------------------------------ devices and ranks: one process
    @property
    @override
    def parallel_devices(self) -> list[torch.device] | None:
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: Sequence[torch.device | str | int] | None) -> None:
        self._parallel_devices = None if devices is None else as_devices(devices)

    @property
    @override
    def root_device(self) -> torch.device:
        if not self.parallel_devices:
            raise RuntimeError(
                f"{type(self).__name__} has no devices yet: pass it to `Trainer(strategy=..., devices=...)`, or "
                "construct it with `parallel_devices=[...]`."
            )
        return self.parallel_devices[0]

    @override
    def replica_devices(self) -> list[torch.device]:
        return self.parallel_devices or [self.root_device]

    @property
    @override
    def global_rank(self) -> int:
        return 0

    @property
    @override
    def local_rank(self) -> int:
        return 0

    @property
    @override
    def node_rank(self) -> int:
        return 0

    @property
    @override
    def world_size(self) -> int:
        return 1

    @property
    def num_nodes(self) -> int:
        """Always 1: the replicas are threads of one process on one machine."""
        return 1

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        if num_nodes != 1:
            raise ValueError(
                f"{type(self).__name__} runs in one process on one machine, so `num_nodes={num_nodes}` cannot be "
                "honoured. Drop `num_nodes` (or pass num_nodes=1), or use strategy='ring_allreduce' to train across "
                "several machines."
            )

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": 1, "rank": 0}  # one process reads the whole batch; never a DistributedSampler

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        return tensor  # one process: the values already cover the whole batch

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        return tensor

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision

    @override
    def barrier(self, name: str | None = None) -> None:
        pass

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    # ------------------------------------------------------------------ setup
    @override
    def setup_environment(self) -> None:
        devices = self.parallel_devices or [self.root_device]
        if devices[0].type == "cuda":
            available = torch.cuda.device_count()
            unknown = [str(d) for d in devices if d.index is None or d.index >= available]
            if unknown:
                raise ValueError(
                    f"Unknown CUDA device(s) {unknown}: this machine has {available} GPU(s). Give explicit indices "
                    f"below {available}, e.g. `devices=[0, 1]`, or use accelerator='cpu' for logical CPU replicas."
                )
            if len(set(devices)) != len(devices):
                raise ValueError(
                    f"Each GPU can hold one replica, got {[str(d) for d in devices]}: list every CUDA device once."
                )
        super().setup_environment()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if self._layer_sync is not None:
            raise ValueError(
                f"`sync_batchnorm=True` is not supported by {type(self).__name__}: its replicas are threads of one "
                "process, with no process group to synchronise over. Drop `sync_batchnorm=True` (BatchNorm keeps the "
                "first replica's running statistics, as in torch.nn.DataParallel) or use strategy='ddp'."
            )
        module = self.lightning_module
        if (
            trainer.state.fn == TrainerFn.FITTING
            and module is not None
            and module.automatic_optimization
            and not any(p.requires_grad for p in module.parameters())
        ):
            raise ValueError(
                f"{type(module).__name__} has no parameter that requires grad, so {type(self).__name__} has nothing "
                "to train (the first backward would fail). Unfreeze at least one parameter before `trainer.fit`, or "
                "use `trainer.validate` / `trainer.predict` to run the frozen model."
            )
        if module is not None:  # before Lightning moves it to the device
            require_storage(module, type(self).__name__)
        if module is not None and len(self.replica_devices()) > 1:  # here, before the sanity check's first forward
            check_replicable(module)
            require_materialized(module, type(self).__name__)
        super().setup(trainer)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None, "self.model must be set before self.model.to()"
        self.model.to(self.root_device)

    @override
    def teardown(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()
        with cpu_keeps_meta(self.lightning_module):  # a module refused at setup for its meta tensors
            Strategy.teardown(self)

    # ------------------------------------------------------------------ steps
    @contextmanager
    def _redirect_forward(self, hook: str) -> Generator[None, None, None]:
        """While ``hook`` runs, calls of the LightningModule's forward go through :meth:`parallel_forward`."""
        module = self.lightning_module
        if module is None or self._step.hook is not None:  # no module yet, or already inside a step
            yield
            return
        own = module.__dict__.get("forward")  # an instance-level forward (rare) to restore afterwards

        def restore() -> None:
            if own is None:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = own

        def forward(*args: Any, **kwargs: Any) -> Any:
            self._step.forward_calls += 1
            restore()  # replicas must copy the real forward, and nested calls are plain
            try:
                return self.parallel_forward(module, *args, **kwargs)
            finally:
                module.__dict__["forward"] = forward

        self._step = _StepState(hook=hook, warned=self._step.warned)
        module.__dict__["forward"] = forward
        try:
            yield
        finally:
            restore()
            calls, self._step.hook = self._step.forward_calls, None
        if calls == 0 and hook not in self._step.warned:
            self._step.warned.add(hook)
            rank_zero_warn(
                f"`{type(module).__name__}.{hook}` never called the module's forward, so nothing ran in parallel on "
                f"the {len(self.parallel_devices or [])} devices of {type(self).__name__}: only calls of "
                f"`self(...)`/`self.forward(...)` inside the step are scattered. Move the model's computation into "
                f"`forward` and call `self(batch)` in `{hook}`, or train with strategy='auto'."
            )

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self._redirect_forward("training_step"):
            return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self._redirect_forward("validation_step"):
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self._redirect_forward("test_step"):
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._redirect_forward("predict_step"):
            return super().predict_step(*args, **kwargs)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if cls.registered_name is not None:
            for name in (cls.registered_name, "dp"):
                register_name(strategy_registry, name, cls, description=cls.registered_description)
