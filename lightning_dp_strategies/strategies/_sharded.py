"""The Trainer's side of ``shard_optimizer_state=True``: the strategy's hooks around an
:class:`~lightning_dp_strategies.sharding.OptimizerSharding`.

What it changes while a fit runs, and puts back at teardown where it is not the run's own:

- the optimizers from ``configure_optimizers`` step this rank's pieces (their parameter groups are re-pointed; after
  ``fit`` they stay so, and a new fit builds new ones);
- clipping by norm (``gradient_clip_val``) takes the norm over every rank's pieces, through a view of Lightning's
  precision plugin (the plugin itself is not changed);
- a 16-mixed gradient scaler sums its Inf/NaN finding over the ranks (its class is swapped for a subclass until
  teardown).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizer_to_device
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dp_strategies.core.checkpoint_io import atomic_write, can_stream
from lightning_dp_strategies.core.options import RingAllReduceConfig
from lightning_dp_strategies.pipeline import clip_grad_norm_across
from lightning_dp_strategies.sharding import OptimizerSharding, agree_on_nonfinite, restore_scaler
from lightning_dp_strategies.sharding.checkpoint import finish_save
from lightning_dp_strategies.strategies._precision import PrecisionView, global_norm_view

__all__ = ["ShardedOptimizerSteps"]


class ShardedOptimizerSteps(PrecisionView):
    """Mixed in ahead of :class:`~lightning_dp_strategies.strategies.bucketed.BucketedDataParallel`: with
    ``config.shard_optimizer_state`` the optimizers step this rank's shard, and checkpoints hold the whole state."""

    config: RingAllReduceConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sharding = OptimizerSharding()
        """This rank's share of the optimizer state (attached at setup when ``shard_optimizer_state=True``)."""

    @property
    def _sharded(self) -> bool:
        return bool(getattr(self.config, "shard_optimizer_state", False))

    # ------------------------------------------------------------------ setup and teardown
    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        if not self._sharded or trainer.state.fn != TrainerFn.FITTING or self.buckets is None:
            return
        self.sharding = OptimizerSharding()
        self.sharding.attach(self.buckets, self.grad_sync.group)
        for optimizer in self.optimizers:
            self.sharding.bind(optimizer)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if self._sharded and self.sharding.attached:
            plugin = super().precision_plugin
            scaler = getattr(plugin, "scaler", None)
            if scaler is not None:
                agree_on_nonfinite(scaler)
            self._precision_view = global_norm_view(plugin, self._clip_grad_by_norm_sharded)

    def _clip_grad_by_norm_sharded(self, optimizer: Optimizer, clip_val: float) -> None:
        """Lightning's clip-by-norm with the norm over every rank's pieces (each element lives on one rank)."""
        pieces = list(self.precision_plugin.main_params(optimizer))
        clip_grad_norm_across(pieces, clip_val, group=None, device=self.root_device)

    @override
    def teardown(self) -> None:
        self._precision_view = None
        scaler = getattr(super().precision_plugin, "scaler", None)
        if scaler is not None:
            restore_scaler(scaler)
        if self._sharded:
            self.sharding.close()
        super().teardown()

    # ------------------------------------------------------------------ one step
    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        if self._sharded and not self.grad_sync.blocked:
            self.sharding.before_backward()
        super().pre_backward(closure_loss)

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        super().post_backward(closure_loss)
        if self._sharded:
            self.sharding.after_backward()

    @override
    def _after_step(self, optimizer: Optimizer) -> None:
        super()._after_step(optimizer)
        if self._sharded:
            self.sharding.after_step(optimizer)

    @override
    def _guarded_parameters(self) -> Iterable[tuple[str, nn.Parameter]]:
        if not self._sharded or not self.sharding.attached:
            return super()._guarded_parameters()
        return self.sharding.named_pieces(super()._guarded_parameters())

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's ``state_dict`` (every rank holds the whole model); begins a checkpoint's save."""
        if self._sharded and self.sharding.attached:
            self.sharding.begin_save()
        return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """With sharded state: the whole optimizer's ``state_dict`` on rank 0, as one optimizer over the module would
        save it (its tensors streamed in by :meth:`save_checkpoint`); a collective, like Lightning's save."""
        if not (self._sharded and self.sharding.attached):
            return super().optimizer_state(optimizer)
        return self.sharding.optimizer_state(getattr(optimizer, "_optimizer", optimizer))

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Rank 0 writes the checkpoint while every rank sends its pieces of the optimizer state, one tensor at a
        time (the default ``AtomicCheckpointIO`` and a local path; another ``checkpoint_io`` receives the whole
        state on rank 0 first)."""
        if not (self._sharded and self.sharding.attached):
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        device = self.root_device if dist.get_backend() == "nccl" else torch.device("cpu")
        streams = can_stream(self.checkpoint_io, filepath, storage_options)
        stream = functools.partial(atomic_write, filepath) if streams else None
        save, self.sharding.save = self.sharding.save, type(self.sharding.save)()

        def save_whole(whole: dict[str, Any]) -> None:
            self.checkpoint_io.save_checkpoint(whole, filepath, storage_options=storage_options)

        finish_save(save, checkpoint, self.is_global_zero, device, stream, save_whole)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Each rank takes its pieces of the whole optimizer states (saved by any strategy, at any world size)."""
        if not (self._sharded and self.sharding.attached):
            super().load_optimizer_state_dict(checkpoint)
            return
        for optimizer, whole in zip(self.optimizers, checkpoint["optimizer_states"], strict=False):
            self.sharding.load(optimizer, whole)
            _optimizer_to_device(optimizer, self.root_device)
