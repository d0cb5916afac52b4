"""Fabric's side of ``shard_optimizer_state=True``: the ring strategy's hooks around an
:class:`~lightning_dp_strategies.sharding.OptimizerSharding`.

``fabric.setup`` binds each optimizer to this rank's pieces, ``fabric.backward`` hands them their reduced gradients,
``optimizer.step()`` steps them and all-gathers the parameters, ``fabric.clip_gradients`` clips by the norm over every
rank, and ``fabric.save`` / ``fabric.load`` write and read the whole optimizer state (streamed to rank 0 on save).
A 16-mixed gradient scaler sums its Inf/NaN finding over the ranks (its class is swapped for a subclass until
teardown, then put back).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.utilities.types import _PATH
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dp_strategies.bucketing.sync import GradientSync
from lightning_dp_strategies.core.checkpoint_io import atomic_write, can_stream
from lightning_dp_strategies.core.options import RingAllReduceConfig
from lightning_dp_strategies.pipeline import clip_grad_norm_across
from lightning_dp_strategies.sharding import OptimizerSharding, agree_on_nonfinite, restore_scaler
from lightning_dp_strategies.sharding.checkpoint import finish_save

__all__ = ["ShardedFabricSteps"]


class _LoadsShards:
    """Stands in for a sharded optimizer in ``fabric.load``: loading gives it this rank's pieces of the whole state."""

    def __init__(self, sharding: OptimizerSharding, optimizer: Optimizer) -> None:
        self.sharding, self.optimizer = sharding, optimizer

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.sharding.load(self.optimizer, state_dict)


class ShardedFabricSteps(DDPStrategy):
    """Mixed in ahead of Fabric's ``DDPStrategy`` by :class:`FabricRingAllReduceStrategy`, which calls
    :meth:`_attach_sharding`, :meth:`_before_synced_backward`, :meth:`_after_synced_backward` and
    :meth:`_after_step` at the matching points."""

    config: RingAllReduceConfig
    grad_sync: GradientSync
    sharding: OptimizerSharding

    @property
    def _sharded(self) -> bool:
        return self.config.shard_optimizer_state and self.sharding.attached

    # ------------------------------------------------------------------ setup and teardown
    def _attach_sharding(self) -> None:
        """With ``shard_optimizer_state``: cut the buckets just attached into every rank's pieces."""
        if not self.config.shard_optimizer_state or self.grad_sync.buckets is None:
            return
        self.sharding.attach(self.grad_sync.buckets, self.grad_sync.group)
        scaler = getattr(self.precision, "scaler", None)
        if scaler is not None:
            agree_on_nonfinite(scaler)

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """With sharded state: ``optimizer`` now steps this rank's pieces of its parameters (set up the module
        first)."""
        optimizer = super().setup_optimizer(optimizer)
        if self.config.shard_optimizer_state:
            if not self.sharding.attached:
                raise RuntimeError(
                    "With shard_optimizer_state=True the optimizer is cut to the shards of the module's buckets: set "
                    "up the module first (`fabric.setup(model, optimizer)` or `fabric.setup_module` before "
                    "`fabric.setup_optimizers`)."
                )
            self.sharding.bind(optimizer)
        return optimizer

    def _close_sharding(self) -> None:
        scaler = getattr(self.precision, "scaler", None)
        if scaler is not None:
            restore_scaler(scaler)
        self.sharding.close()

    # ------------------------------------------------------------------ one step
    def _before_synced_backward(self) -> None:
        if self._sharded and not self.grad_sync.blocked:
            self.sharding.before_backward()

    def _after_synced_backward(self) -> None:
        if self._sharded:
            self.sharding.after_backward()

    def _after_step(self, optimizer: Any) -> None:
        if self._sharded and hasattr(optimizer, "param_groups"):
            self.sharding.after_step(getattr(optimizer, "optimizer", optimizer))

    def _guarded_parameters(self, module: nn.Module) -> Iterable[tuple[str, nn.Parameter]]:
        """The names a non-finite gradient is reported under: this rank's pieces, named after their parameters."""
        named = list(module.named_parameters())
        return self.sharding.named_pieces(named) if self._sharded else named

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
        if not self._sharded:
            return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)
        if float(norm_type) != 2.0:
            raise ValueError(
                f"With shard_optimizer_state=True, `fabric.clip_gradients` clips by the 2-norm over every rank; got "
                f"norm_type={norm_type}. Pass norm_type=2.0, or clip by value (`clip_val=...`)."
            )
        self.precision.unscale_gradients(optimizer)
        pieces = list(self.precision.main_params(optimizer))
        total = clip_grad_norm_across(pieces, float(max_norm), group=None, device=self.root_device)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"The total norm of the gradients is {total.item()}, not finite.")
        return total

    # ------------------------------------------------------------------ checkpoints
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
        if not self._sharded:
            super().save_checkpoint(path, state, storage_options, filter)
            return
        self.sharding.begin_save()
        converted = self._convert_stateful_objects_in_state(state, filter=(filter or {}))
        save, self.sharding.save = self.sharding.save, type(self.sharding.save)()
        device = self.root_device if dist.get_backend() == "nccl" else torch.device("cpu")
        stream = (
            functools.partial(atomic_write, path) if can_stream(self.checkpoint_io, path, storage_options) else None
        )

        def save_whole(whole: dict[str, Any]) -> None:
            self.checkpoint_io.save_checkpoint(checkpoint=whole, path=path, storage_options=storage_options)

        finish_save(save, converted, self.is_global_zero, device, stream, save_whole)

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        """With sharded state: the whole optimizer's ``state_dict`` on rank 0 (a collective, as ``fabric.save``)."""
        optimizer = getattr(optimizer, "optimizer", optimizer)
        if not self._sharded:
            return super().get_optimizer_state(optimizer)
        return self.sharding.optimizer_state(optimizer)

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
        if not self._sharded or not isinstance(state, dict):
            return super().load_checkpoint(path, state, strict, weights_only)
        proxy = {
            name: _LoadsShards(self.sharding, getattr(obj, "optimizer", obj)) if isinstance(obj, Optimizer) else obj
            for name, obj in state.items()
        }
        remaining = super().load_checkpoint(path, proxy, strict, weights_only)
        for name, value in proxy.items():
            if not isinstance(value, _LoadsShards):
                state[name] = value
        return remaining
