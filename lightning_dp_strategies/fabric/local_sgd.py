"""Local SGD and DiLoCo under Fabric: local optimizer steps, then the average parameter change, every H steps."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from lightning.fabric.utilities.types import Optimizable
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dp_strategies.core.local_sgd import LocalSGDInterface, local_options
from lightning_dp_strategies.fabric.ring_allreduce import FabricRingAllReduceStrategy
from lightning_dp_strategies.local_sgd import local_checkpoint_record, restore_local_record

__all__ = ["FabricLocalSGDStrategy"]


class FabricLocalSGDStrategy(LocalSGDInterface, FabricRingAllReduceStrategy):
    """The Fabric counterpart of :class:`~lightning_dp_strategies.LocalSGDStrategy`, on the same
    :class:`~lightning_dp_strategies.core.local_sgd.LocalSGD`.

    ``fabric.backward(loss)`` keeps the gradient on the rank (the warm-up's steps average it), every
    ``optimizer.step()`` counts towards ``sync_every``, and the period's last step synchronises. Fabric has no
    validation loop: call ``fabric.strategy.synchronize()`` before evaluating, so every rank holds the averaged model.
    ``fabric.save`` writes the averaged model under the module's key and the local SGD record (anchor, outer
    optimizer, position, every rank's own parameters and optimizer state) under ``"local_sgd"``; ``fabric.load`` with
    the same keys resumes where the run stopped. The inner optimizer's state stays on each rank.

    The options are :class:`~lightning_dp_strategies.core.local_sgd.LocalSGDInterface`'s, the Trainer strategy's;
    the shared keyword options are :class:`~lightning_dp_strategies.fabric.options.FabricOptions`.

    Examples:
        >>> import lightning as L
        >>> fabric = L.Fabric(strategy=FabricLocalSGDStrategy(sync_every=16), accelerator="cpu", devices=2)
        >>> type(fabric.strategy).__name__, fabric.strategy.sync_every
        ('FabricLocalSGDStrategy', 16)
    """

    registered_name: ClassVar[str] = "local_sgd"
    registered_description: ClassVar[str] = "Local SGD / DiLoCo: local steps, the parameter change averaged (Fabric)"

    registered_where: ClassVar[str] = "Fabric"
    registers_ring_variants: ClassVar[bool] = False  # no "local_sgd_auto" or "local_sgd_sharded", as the Trainer

    @override
    def _init_data_parallel(self, caps: tuple[float, float], reducer: Any, options: Mapping[str, Any]) -> None:
        FabricRingAllReduceStrategy.__init__(
            self, *caps, reducer=reducer, broadcast_buffers=False, two_level=False, **options
        )

    # ------------------------------------------------------------------ setup
    @override
    def _setup_distributed(self) -> None:
        super()._setup_distributed()
        self._start_local_sgd()

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:  # type: ignore[override]  # not wrapped
        """As :class:`FabricRingAllReduceStrategy` (ranks agree, rank 0's weights), then the anchor."""
        module = super().setup_module(module)
        if self.local_sgd is not None and any(p.requires_grad for p in module.parameters()):
            self.local_sgd.start(module)
        return module

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        self._check_averaged(optimizer, self._trained)
        return super().optimizer_step(optimizer, **kwargs)

    @override
    def _fingerprint_options(self, module: nn.Module) -> dict[str, Any]:
        return {**super()._fingerprint_options(module), **local_options(self.local_config)}

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
