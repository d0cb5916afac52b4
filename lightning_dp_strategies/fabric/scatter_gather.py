"""Fabric's DataParallel with this package's scatter/gather: one process, every forward call split across devices."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, ClassVar, Literal

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import DataParallelStrategy
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.types import Optimizable
from torch import nn
from torch.optim import Optimizer
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
from lightning_dp_strategies.plan import SCATTER_GATHER, CostModel

__all__ = ["FabricScatterGatherStrategy"]


class FabricScatterGatherStrategy(ParallelForward, DataParallelStrategy):
    """One process, several devices under Lightning Fabric: every ``model(x)`` is scattered, replicated, run in
    parallel and gathered (:class:`~lightning_dp_strategies.strategies.scatter_gather.ParallelForward`, the steps
    the Trainer's :class:`~lightning_dp_strategies.ScatterGatherStrategy` runs).

    ``fabric.setup(model)`` returns the model in a thin wrapper whose forward is :meth:`parallel_forward`; the loss
    computed on the gathered outputs is the loss of the whole batch, so ``fabric.backward(loss)`` gives the
    single-device gradients (autograd sums the replicas'), also when the batch does not split evenly. Nothing is
    communicated between processes, so ``fabric.no_backward_sync`` has nothing to skip (a no-op, without Fabric's
    warning). With ``accelerator="cpu"``, ``devices=N`` gives N logical replicas on the CPU.

    What a model must look like: its ``forward`` takes the batch as tensors (any nesting of tuples, lists, dicts,
    dataclasses) that share the batch dimension ``dim``, and returns tensors in such containers (concatenated along
    ``dim``). Only calls of the set-up model itself are parallel: calling another method through Fabric's forward
    redirection (``model.training_step(...)`` of a LightningModule, or a method marked with
    ``mark_forward_method``) raises, because it would run unsplit.

    Args:
        dim: the batch dimension that inputs are split and outputs concatenated along.
        nonfinite_grads: check the gradients for NaN/Inf at every ``optimizer.step()``: ``None`` (no check, the
            default), ``"skip"`` (skip the step, counted in ``nonfinite.skipped_steps``) or ``"raise"``.

    Examples:
        >>> import lightning as L
        >>> import lightning_dp_strategies  # registers "scatter_gather" with Fabric too
        >>> fabric = L.Fabric(strategy="scatter_gather", accelerator="cpu", devices=2)
        >>> model = fabric.setup(torch.nn.Linear(3, 1))
        >>> model(torch.ones(5, 3)).shape, fabric.strategy.stats.last_num_replicas
        (torch.Size([5, 1]), 2)
    """

    cost_model: ClassVar[CostModel] = SCATTER_GATHER
    """Its per-step communication formula (:mod:`lightning_dp_strategies.plan`), the Trainer strategy's."""
    registered_name: ClassVar[str] = "scatter_gather"
    registered_description: ClassVar[str] = (
        "DataParallel-style scatter/replicate/parallel_apply/gather in one process (Fabric)"
    )

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: Sequence[torch.device | str | int] | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        dim: int = 0,
        nonfinite_grads: Literal["skip", "raise"] | None = None,
    ) -> None:
        check_dim(dim)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=None if parallel_devices is None else as_devices(parallel_devices),
            checkpoint_io=checkpoint_io,
            precision=precision,
        )
        # configuration
        self.dim = dim
        # statistics
        self.stats = ScatterGatherStats()
        self.nonfinite = NonfiniteGuard(check_nonfinite_mode(nonfinite_grads))
        self._trained: nn.Module | None = None  # the module set up with trainable parameters
        self._backward_sync_control = _NothingToSkip()

    checkpoint_io = AtomicByDefault()
    """The ``checkpoint_io`` given, else an :class:`~lightning_dp_strategies.AtomicCheckpointIO`."""

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        # "dp" stays Fabric's own DataParallelStrategy (torch.nn.DataParallel), which Fabric registers itself
        register_name(strategy_registry, cls.registered_name, cls, cls.registered_description, where="Fabric")

    @override
    def replica_devices(self) -> list[torch.device]:
        return as_devices(self.parallel_devices or [self.root_device])

    @override
    def module_to_device(self, module: nn.Module) -> None:
        require_storage(module, type(self).__name__)  # a module built on the meta device cannot move
        super().module_to_device(module)

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:  # type: ignore[override]  # not wrapped
        """``module`` in a wrapper whose forward runs :meth:`parallel_forward`; checkpoints hold the module's own
        ``state_dict`` (see :meth:`get_module_state_dict`)."""
        require_storage(module, type(self).__name__)  # set up with `move_to_device=False`
        if len(self.replica_devices()) > 1:
            check_replicable(module)
            require_materialized(module, type(self).__name__)
        if any(p.requires_grad for p in module.parameters()):
            self._trained = module
        return _ParallelModule(module, self)

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        """The non-finite check (``nonfinite_grads``) on the gradients, then the step."""
        if self._trained is not None and isinstance(optimizer, Optimizer):
            named = self._trained.named_parameters()
            kwargs = self.nonfinite.check_step(kwargs, optimizer, named, self.root_device)
        return super().optimizer_step(optimizer, **kwargs)

    @override
    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The wrapped module's own ``state_dict`` (``fabric.save`` hands the strategy the wrapper)."""
        return super().get_module_state_dict(module.module if isinstance(module, _ParallelModule) else module)

    @override
    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        inner = module.module if isinstance(module, _ParallelModule) else module
        super().load_module_state_dict(inner, state_dict, strict=strict)


class _ParallelModule(nn.Module):
    """What Fabric calls for ``model(x)``: the wrapped module's forward, split across the strategy's devices."""

    def __init__(self, module: nn.Module, strategy: FabricScatterGatherStrategy) -> None:
        super().__init__()
        self.module = module
        self._strategy = strategy

    @override
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if "forward" in self.module.__dict__:  # Fabric redirects another method through forward
            raise TypeError(
                f"{type(self._strategy).__name__} splits calls of the model itself (`model(x)`), but Fabric routed "
                f"another method of {type(self.module).__name__} through forward (a LightningModule's "
                "`model.training_step(...)` or a method marked with `mark_forward_method`), which would run on the "
                "whole batch on one device. Call `model(x)` and compute the loss outside, or use strategy='dp' "
                "(torch.nn.DataParallel, which runs the whole method in every replica on CUDA)."
            )
        return self._strategy.parallel_forward(self.module, *args, **kwargs)


class _NothingToSkip(_BackwardSyncControl):
    """One process: gradients are summed by autograd, there is no communication for ``no_backward_sync`` to skip."""

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return nullcontext()
