"""Local SGD and DiLoCo under Fabric: local optimizer steps, then the average parameter change, every H steps."""

from __future__ import annotations

from typing import Any, ClassVar

from lightning.fabric.strategies.registry import _StrategyRegistry
from torch import nn
from torch.optim import Optimizer
from typing_extensions import Unpack, override

from lightning_dp_strategies.core.engine import EngineView
from lightning_dp_strategies.core.local_sgd import STREAMING_DEFAULTS, local_config, local_options
from lightning_dp_strategies.core.options import ConfigOption
from lightning_dp_strategies.core.registry import register_with_launchers
from lightning_dp_strategies.fabric.options import FabricOptions
from lightning_dp_strategies.fabric.ring_allreduce import FabricRingAllReduceStrategy
from lightning_dp_strategies.local_sgd import (
    LocalSGD,
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
        sync_every: optimizer steps between synchronisations (H, >= 1), or ``"auto"`` (see the Trainer strategy).
        outer_optimizer: ``factory(params) -> Optimizer`` over the anchor parameters (``None``: plain averaging).
        warmup_steps: optimizer steps at the start that average their gradients every step.
        reducer: how the change is averaged: ``"ring"`` (default), ``"native"``, or e.g. ``bf16_compress("ring")``.
        average_buffers: average floating-point buffers (BatchNorm statistics) at each synchronisation.
        bucket_cap_mb: cap of the warm-up's gradient buckets in MiB.
        first_bucket_cap_mb: cap of the warm-up's first gradient bucket in MiB.
        shard_optimizer_state: refused (``True`` raises): between averages every rank steps its whole model, so
            it needs the whole optimizer state; see ``RingAllReduceStrategy(shard_optimizer_state=True)``.
        fragments: streaming DiLoCo: runs of parameters synchronised in staggered turns (1: all at once).
        delay: streaming DiLoCo: inner steps that run while a fragment's change travels (0: the loop waits).
        mixing: streaming DiLoCo: the weight of the rank's own values when a fragment's global values are merged in.
        outer_precision: how the change travels: ``"fp32"``, ``"bf16"``, ``"int8"`` or ``"int4"``.
        **options: the shared keyword options (``nonfinite_grads``, ``timeout``, ...): see
            :class:`~lightning_dp_strategies.fabric.options.FabricOptions`.

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
        **options: Unpack[FabricOptions],
    ) -> None:
        self.local_config = local_config(
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
        caps = (bucket_cap_mb, first_bucket_cap_mb)
        super().__init__(*caps, reducer=reducer, broadcast_buffers=False, two_level=False, **options)

    local_sgd = EngineView[LocalSGD | None]()  # the algorithm (``None`` before setup)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        super().register_strategies(strategy_registry)
        description = "Streaming DiLoCo: fragments synchronised in turns, 4-bit changes sent during the inner steps"
        register_with_launchers(
            strategy_registry, "streaming_diloco", cls, f"{description} (Fabric)", "Fabric", **STREAMING_DEFAULTS
        )

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
    def _with_own_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """The local SGD record (rank 0's file gets every rank's own state); called on every rank."""
        module = self._trained
        if self.local_sgd is not None and module is not None and any(v is module for v in state.values()):
            optimizers = [self.get_optimizer_state(v) for v in state.values() if isinstance(v, Optimizer)]
            record = local_checkpoint_record(self.local_sgd, module, optimizers)
            state = {**state, "local_sgd": record} if record is not None else state
        return state

    @override
    def _restore_own_state(self, remainder: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
        """This rank's own parameters, optimizer state and the local SGD record."""
        module = self._trained
        if self.local_sgd is None or module is None or not any(v is module for v in state.values()):
            return remainder
        record = remainder.pop("local_sgd", None)
        restore_local_record(self.local_sgd, module, record, self.global_rank)
        if record is not None:
            optimizers = [v for v in state.values() if isinstance(v, Optimizer)]
            for optimizer, saved in zip(optimizers, record["ranks"][self.global_rank]["optimizer"], strict=True):
                optimizer.load_state_dict(saved)
        return remainder

    # ------------------------------------------------------------------ options (read-only)
    sync_every = ConfigOption[int | str]("local_config")
    outer_optimizer = ConfigOption[OuterOptimizerFactory | None]("local_config")
    warmup_steps = ConfigOption[int]("local_config")
    average_buffers = ConfigOption[bool]("local_config")
    fragments = ConfigOption[int]("local_config")
    delay = ConfigOption[int]("local_config")
    mixing = ConfigOption[float]("local_config")
    outer_precision = ConfigOption[str]("local_config")
