"""The base of the bucketed strategies that offer ``fault_tolerant``: Lightning's collectives over the survivors.

:class:`SurvivingDataParallel` is :class:`~lightning_dp_strategies.strategies.bucketed.BucketedDataParallel` whose
``survival`` (a :class:`~lightning_dp_strategies.strategies.survival.TrainerSurvival`, set by the subclass when
``fault_tolerant`` is on) also answers Lightning's own collectives: ``is_global_zero`` is the lowest live rank, and
``barrier``, ``broadcast``, ``reduce``, ``all_gather`` and ``reduce_boolean_decision`` run over the survivors'
control group, the leader answering for rank 0, and are redone over the survivors after a peer failure between
optimizer steps; a checkpoint whose writer was lost is written by the new leader. Without ``fault_tolerant`` every
one of them is Lightning's. ``sync_batchnorm=True`` is refused at setup where torch's ``SyncBatchNorm`` cannot run:
across CPU processes, and with ``fault_tolerant`` (it reduces over every process the job started).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from typing_extensions import override

from lightning_dp_strategies.core.fault_tolerance import FaultTolerance, Survivors
from lightning_dp_strategies.core.module_state import require_storage
from lightning_dp_strategies.pipeline.materialize import cpu_keeps_meta
from lightning_dp_strategies.strategies.bucketed import BucketedDataParallel

__all__ = ["SurvivingDataParallel", "as_fault_tolerance", "check_layer_sync"]


def as_fault_tolerance(fault_tolerant: bool | FaultTolerance) -> FaultTolerance | None:
    """The options ``fault_tolerant=`` stands for (``None``: off).

    Examples:
        >>> as_fault_tolerance(True).keep_global_batch, as_fault_tolerance(False)
        (True, None)
    """
    if isinstance(fault_tolerant, FaultTolerance):
        return fault_tolerant
    if not isinstance(fault_tolerant, bool):
        raise TypeError(f"`fault_tolerant` must be True, False or a FaultTolerance, got {fault_tolerant!r}.")
    return FaultTolerance() if fault_tolerant else None


def check_layer_sync(layer_sync: object, device: torch.device, world_size: int, fault_tolerant: bool) -> None:
    """Refuse ``sync_batchnorm=True`` (``layer_sync`` set) where torch's ``SyncBatchNorm`` cannot run: across
    processes on CPUs (it synchronises accelerator tensors only), and with ``fault_tolerant`` (it reduces over every
    process the job started, so a lost rank would stop every forward pass).

    Examples:
        >>> check_layer_sync(None, torch.device("cpu"), 2, fault_tolerant=True)
        >>> check_layer_sync(object(), torch.device("cpu"), 1, fault_tolerant=False)  # one process: plain BatchNorm
        >>> check_layer_sync(object(), torch.device("cpu"), 2, fault_tolerant=False)
        Traceback (most recent call last):
        ...
        ValueError: `sync_batchnorm=True` needs GPUs: ...
        >>> check_layer_sync(object(), torch.device("cuda", 0), 2, fault_tolerant=False)
        >>> check_layer_sync(object(), torch.device("cuda", 0), 2, fault_tolerant=True)
        Traceback (most recent call last):
        ...
        ValueError: `fault_tolerant=True` cannot go on with `sync_batchnorm=True`: ...
    """
    if layer_sync is None:
        return
    if device.type == "cpu" and world_size > 1:
        raise ValueError(
            "`sync_batchnorm=True` needs GPUs: torch's SyncBatchNorm synchronises accelerator tensors only, and these "
            f"{world_size} processes train on CPUs. Drop `sync_batchnorm=True` (each rank's BatchNorm then "
            "normalises over its own micro-batch)."
        )
    if fault_tolerant:
        raise ValueError(
            "`fault_tolerant=True` cannot go on with `sync_batchnorm=True`: SyncBatchNorm reduces its statistics over "
            "every process the job started, so a lost rank would stop every forward pass. Drop "
            "`sync_batchnorm=True`, or pass `fault_tolerant=False`."
        )


class SurvivingDataParallel(BucketedDataParallel):
    """A bucketed strategy whose Lightning collectives go over the survivors when ``survival`` is set (see the module
    docstring)."""

    @property
    def survivors(self) -> Survivors | None:
        """With ``fault_tolerant``: the live ranks, their groups and the failures survived (``recoveries``)."""
        return self.survival.survivors if self.survival is not None else None

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if self.lightning_module is not None:  # before Lightning moves it to the device
            require_storage(self.lightning_module, type(self).__name__)
        if trainer.state.fn == TrainerFn.FITTING:  # Lightning converts BatchNorm for fit only
            check_layer_sync(self._layer_sync, self.root_device, self.world_size, self.survival is not None)
        super().setup(trainer)

    @override
    def teardown(self) -> None:
        with cpu_keeps_meta(self.lightning_module):  # a module refused at setup for its meta tensors
            super().teardown()

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self.survival is not None and self.lightning_module is not None:
            if self.survival.joining:  # a replacement: the live ranks are mid-fit, none compares batches with it
                self.distinct_batches.pending = False
            self.distinct_batches.gather = self.survival.control.all_gather
            self.even_batches.enabled = False  # it gathers over a fixed world; the live ranks change mid-fit
            self.survival.on_train_start(self.lightning_module.trainer)

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        if self.survival is not None and self.lightning_module is not None:
            self.survival.watch_metrics(self.lightning_module)

    @override
    def on_test_start(self) -> None:
        super().on_test_start()
        if self.survival is not None and self.lightning_module is not None:
            self.survival.watch_metrics(self.lightning_module)

    @property
    @override
    def is_global_zero(self) -> bool:
        """Global rank 0; with ``fault_tolerant``, the lowest live rank (it writes the checkpoints)."""
        return self.survival.is_leader() if self.survival is not None else super().is_global_zero

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        return self.survival.barrier() if self.survival is not None else super().barrier(*args, **kwargs)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self.survival.broadcast(obj, src) if self.survival is not None else super().broadcast(obj, src)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """Lightning's reduce; with ``fault_tolerant`` over the survivors (a replacement's setup: its own value)."""
        if self.survival is not None and self.survival.joining:
            return tensor
        if self.survival is not None and _whole_job(group) and isinstance(tensor, Tensor):
            return self.survival.control.reduce(tensor, reduce_op)
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Lightning's all-gather; with ``fault_tolerant`` over the survivors (a replacement's setup: its own value,
        with the leading dimension of one rank)."""
        if self.survival is not None and self.survival.joining:
            return tensor.unsqueeze(0)
        if self.survival is not None and _whole_job(group) and not sync_grads:
            return self.survival.control.all_gather(tensor)
        if self.survival is not None and _whole_job(group):
            self.survival.control.check()
            group = self.survival.survivors.control_group
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Lightning's save (the leader writes) of :meth:`checkpoint_to_write`; with ``fault_tolerant``, followed by a
        barrier over the survivors. If the leader was lost before every rank passed it, the new leader writes the
        checkpoint again."""
        survival, survivors = self.survival, self.survivors
        if survival is None or survivors is None or survival.joining:
            super().save_checkpoint(self.checkpoint_to_write(checkpoint), filepath, storage_options)
            return
        for _ in range(survivors.world_size):
            writer = survivors.leader
            super().save_checkpoint(self.checkpoint_to_write(checkpoint), filepath, storage_options)
            survival.barrier()
            if survivors.leader == writer:
                return
        raise RuntimeError(
            f"The checkpoint {str(filepath)!r} lost its writer in each try of its save, so the run stops here. Resume "
            "from the last complete checkpoint with `trainer.fit(..., ckpt_path='last')`."
        )

    def checkpoint_to_write(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """What the leader writes for Lightning's ``checkpoint`` (called on every rank before each write, so it may
        be collective): ``checkpoint`` itself, which every rank holds whole."""
        return checkpoint

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if self.survival is None:
            return super().reduce_boolean_decision(decision, all)
        return self.survival.reduce_boolean_decision(decision, all)


def _whole_job(group: Any | None) -> bool:
    """Whether a collective over ``group`` means every rank of the job (``LightningModule.all_gather`` passes
    ``WORLD`` where the user passed none): under ``fault_tolerant`` it runs over the survivors."""
    return group is None or group is dist.group.WORLD
