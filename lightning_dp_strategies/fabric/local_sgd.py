"""Local SGD and DiLoCo under Fabric: local optimizer steps, then the average parameter change, every H steps."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, ClassVar, Literal

from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.utilities.types import _PATH
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dp_strategies.core.engine import EngineView
from lightning_dp_strategies.core.local_sgd import check_not_sharded, local_options
from lightning_dp_strategies.core.options import ConfigOption
from lightning_dp_strategies.fabric.ring_allreduce import FabricRingAllReduceStrategy
from lightning_dp_strategies.local_sgd import (
    LocalSGD,
    LocalSGDConfig,
    OuterOptimizerFactory,
    local_checkpoint_record,
    restore_local_record,
)
from lightning_dp_strategies.reducers import Reducer

__all__ = ["FabricLocalSGDStrategy"]


class FabricLocalSGDStrategy(FabricRingAllReduceStrategy):
    """The Fabric counterpart of :class:`~lightning_dp_strategies.LocalSGDStrategy`, on the same
    :class:`~lightning_dp_strategies.core.local_sgd.LocalSGD`.

    ``fabric.backward(loss)`` keeps the gradient on the rank (the warm-up's steps average it), every
    ``optimizer.step()`` counts towards ``sync_every``, and the period's last step synchronises. Fabric has no
    validation loop: call ``fabric.strategy.synchronize()`` before evaluating, so every rank holds the averaged model.
    ``fabric.save`` writes the averaged model under the module's key and the local SGD record (anchor, outer
    optimizer, position, every rank's own parameters and optimizer state) under ``"local_sgd"``; ``fabric.load`` with
    the same keys resumes where the run stopped. The inner optimizer's state stays on each rank.

    Args:
        sync_every: optimizer steps between synchronisations (H, >= 1).
        outer_optimizer: ``factory(params) -> Optimizer`` over the anchor parameters (``None``: plain averaging).
        warmup_steps: optimizer steps at the start that average their gradients every step.
        reducer: how the change is averaged: ``"ring"`` (default), ``"native"``, or e.g. ``bf16_compress("ring")``.
        average_buffers: average floating-point buffers (BatchNorm statistics) at each synchronisation.
        bucket_cap_mb: cap of the warm-up's gradient buckets in MiB.
        first_bucket_cap_mb: cap of the warm-up's first gradient bucket in MiB.
        nonfinite_grads: ``None``, ``"skip"`` or ``"raise"`` on NaN/Inf in the gradients at each step.
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; ``None`` picks by device.
        timeout: collective timeout (``timedelta`` or seconds); ``None`` is 5 minutes on gloo, 30 on NCCL.
        start_method: ``"popen"`` (scripts, the default), ``"spawn"``, ``"fork"`` (notebooks) or ``"forkserver"``.
        shard_optimizer_state: refused (``True`` raises): between averages every rank steps its whole model, so
            it needs the whole optimizer state; see ``RingAllReduceStrategy(shard_optimizer_state=True)``.

    Examples:
        >>> import lightning as L
        >>> fabric = L.Fabric(strategy=FabricLocalSGDStrategy(sync_every=16), accelerator="cpu", devices=2)
        >>> type(fabric.strategy).__name__, fabric.strategy.sync_every
        ('FabricLocalSGDStrategy', 16)
    """

    registered_name: ClassVar[str] = "local_sgd"
    registered_description: ClassVar[str] = "Local SGD / DiLoCo: local steps, the parameter change averaged (Fabric)"

    def __init__(
        self,
        sync_every: int = 8,
        outer_optimizer: OuterOptimizerFactory | None = None,
        warmup_steps: int = 0,
        reducer: str | Reducer | None = None,
        average_buffers: bool = True,
        accelerator: Accelerator | None = None,
        parallel_devices: list[Any] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float = 1.0,
        nonfinite_grads: Literal["skip", "raise"] | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        shard_optimizer_state: bool = False,
    ) -> None:
        check_not_sharded(shard_optimizer_state)
        self.local_config = LocalSGDConfig(sync_every, outer_optimizer, warmup_steps, average_buffers)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            bucket_cap_mb=bucket_cap_mb,
            first_bucket_cap_mb=first_bucket_cap_mb,
            reducer=reducer,
            broadcast_buffers=False,
            nonfinite_grads=nonfinite_grads,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            two_level=False,
        )

    local_sgd = EngineView[LocalSGD | None]()  # the algorithm (``None`` before setup)

    # ------------------------------------------------------------------ setup
    @override
    def _setup_distributed(self) -> None:
        super()._setup_distributed()
        reducer = self.configure_reducer()
        self.engine.start_local_sgd(self.local_config, reducer, self.world_size, self._process_group_backend)

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:  # type: ignore[override]  # not wrapped
        """As :class:`FabricRingAllReduceStrategy` (ranks agree, rank 0's weights), then the anchor."""
        module = super().setup_module(module)
        if self.local_sgd is not None and any(p.requires_grad for p in module.parameters()):
            self.local_sgd.start(module)
        return module

    @override
    def _fingerprint_options(self, module: nn.Module) -> dict[str, Any]:
        return {**super()._fingerprint_options(module), **local_options(self.local_config)}

    def synchronize(self) -> None:
        """Average the ranks' parameter changes now and apply the outer step (on every rank; nothing when the ranks
        are in sync already): call it before evaluating."""
        self.engine.synchronize()

    # ------------------------------------------------------------------ checkpoints
    @override
    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The module averaged over the ranks (collective mid-period): what ``fabric.save`` writes."""
        state = super().get_module_state_dict(module)
        return state if self.local_sgd is None or module is not self._trained else self.local_sgd.averaged_state(state)

    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, nn.Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Add the local SGD record (rank 0's file gets every rank's own state); called on every rank."""
        module = self._trained
        if self.local_sgd is not None and module is not None and any(v is module for v in state.values()):
            optimizers = [self.get_optimizer_state(v) for v in state.values() if isinstance(v, Optimizer)]
            record = local_checkpoint_record(self.local_sgd, module, optimizers)
            state = {**state, "local_sgd": record} if record is not None else state
        super().save_checkpoint(path, state, storage_options, filter)

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: nn.Module | Optimizer | dict[str, nn.Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """As Fabric's, then this rank's own parameters, optimizer state and the local SGD record."""
        remainder = super().load_checkpoint(path, state, strict, weights_only)
        module = self._trained
        if self.local_sgd is None or module is None or not isinstance(state, dict):
            return remainder
        if not any(v is module for v in state.values()):
            return remainder
        record = remainder.pop("local_sgd", None)
        restore_local_record(self.local_sgd, module, record, self.global_rank)
        if record is not None:
            optimizers = [v for v in state.values() if isinstance(v, Optimizer)]
            for optimizer, saved in zip(optimizers, record["ranks"][self.global_rank]["optimizer"], strict=True):
                optimizer.load_state_dict(saved)
        return remainder

    # ------------------------------------------------------------------ options (read-only)
    sync_every = ConfigOption[int]("local_config")
    outer_optimizer = ConfigOption[OuterOptimizerFactory | None]("local_config")
    warmup_steps = ConfigOption[int]("local_config")
    average_buffers = ConfigOption[bool]("local_config")
