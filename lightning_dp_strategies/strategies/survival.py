"""The Trainer side of ``fault_tolerant``: a Lightning strategy's hooks over :class:`~lightning_dp_strategies.core.
fault_tolerance.Survivors`.

A bucketed strategy with ``fault_tolerant`` holds one :class:`TrainerSurvival` and hands it these hooks::

    setup_distributed   start()                 survivors' groups; the gradient sync averages over theirs
    setup               check(trainer)          refusals (manual optimization, accumulation)
    on_train_start      on_train_start(trainer) the train loader (lost ranks' batches), the metrics' group, and
                                                Lightning's per-batch SIGTERM broadcast over the survivors
    optimizer_step      step(run)               a peer failure: agree, regroup, redo the step
    backward            backward(run, loss)     the lost ranks' micro-batches too, one reduction
    post_backward       scale_gradients()       members / world size (global batch kept)
    barrier, broadcast, reduce, all_gather, reduce_boolean_decision, is_global_zero: over the survivors, leader first
    teardown            teardown()              heartbeat stopped, metrics' groups and Lightning's loop put back

Edits of objects the strategy does not own, each put back at teardown: the torchmetrics metrics of the module get
the survivors' control group as ``process_group``; the fit loop's ``_broadcast_sigterm_tensor`` (Lightning broadcasts
a SIGTERM flag from rank 0 over the whole world before every batch, which a lost rank blocks until the world's
timeout) is replaced by the same broadcast over the survivors from the leader.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, Protocol

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor

from lightning_dp_strategies.core.engine import BucketedEngine
from lightning_dp_strategies.core.fault_tolerance import Recovery, Survivors
from lightning_dp_strategies.core.membership import is_peer_failure
from lightning_dp_strategies.core.module_state import broadcast_module_buffers
from lightning_dp_strategies.reducers import Reducer

__all__ = ["TrainerSurvival", "check_survivable"]


def _is_metric(module: object) -> bool:
    from torchmetrics import Metric

    return isinstance(module, Metric)


def check_survivable(trainer: pl.Trainer) -> None:
    """A clear error, at setup, where ``fault_tolerant`` cannot redo a step over the survivors."""
    module = trainer.lightning_module
    if module is not None and not module.automatic_optimization:
        raise ValueError(
            "`fault_tolerant=True` redoes a failed step through Lightning's closure, which manual optimization does "
            "not use: set `self.automatic_optimization = True`, or pass `fault_tolerant=False`."
        )
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(
            "`fault_tolerant=True` cannot redo a step whose earlier micro-batches were accumulated before the "
            f"failure (accumulate_grad_batches={trainer.accumulate_grad_batches}): raise the batch size instead, or "
            "pass `fault_tolerant=False`."
        )


def _broadcast_sigterm(trainer: pl.Trainer, survivors: Survivors) -> None:
    """Lightning's per-batch SIGTERM broadcast, over the survivors' gradient group from the leader. A failure here
    is left to the step's gradient reduction to notice, as Lightning's own leaves it."""
    flag = torch.tensor([1 if getattr(trainer, "received_sigterm", False) else 0])
    try:
        dist.broadcast(flag, src=survivors.leader, group=survivors.group)
    except Exception:
        flag = torch.tensor([0])
    if flag.item() == 1:
        with contextlib.suppress(Exception):
            dist.barrier(group=survivors.control_group)
        raise SIGTERMException()


class SurvivingStrategy(Protocol):
    """What :class:`TrainerSurvival` uses of its strategy (a :class:`~lightning_dp_strategies.strategies.bucketed.
    BucketedDataParallel`)."""

    engine: BucketedEngine
    _timeout: timedelta | None

    @property
    def global_rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def root_device(self) -> torch.device: ...
    @property
    def lightning_module(self) -> pl.LightningModule | None: ...
    @property
    def precision_plugin(self) -> Any: ...
    def _get_process_group_backend(self) -> str: ...
    def configure_reducer(self) -> Reducer: ...
    def arrange_reducer(self, reducer: Reducer) -> Reducer: ...
    def _build_buckets(self) -> None: ...
    def batch_to_device(self, batch: Any) -> Any: ...
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any: ...


class TrainerSurvival:
    """What a Trainer strategy does with ``fault_tolerant`` (see the module docstring)."""

    def __init__(self, strategy: SurvivingStrategy, survivors: Survivors) -> None:
        self.strategy = strategy
        self.survivors = survivors
        self._loop: Any = None  # the fit loop whose SIGTERM broadcast is replaced

    # ------------------------------------------------------------------ setup
    def start(self) -> None:
        """Form the survivors' groups (gloo only) and have the gradient sync average over theirs."""
        strategy = self.strategy
        backend = strategy._get_process_group_backend()
        if backend != "gloo":
            raise ValueError(
                f"`fault_tolerant=True` runs on gloo only (CPU training), got process_group_backend={backend!r}: "
                "NCCL cannot re-form its communicators in place. Pass `fault_tolerant=False` on GPUs."
            )
        # the default group's store: torchrun's agent store (under this attempt's prefix), or the one rank 0 hosts
        store = dist.distributed_c10d._get_default_store()
        assert strategy._timeout is not None
        self.survivors.start(store, strategy.global_rank, strategy.world_size, strategy._timeout)
        assert self.survivors.group is not None
        reducer = strategy.arrange_reducer(strategy.configure_reducer())
        strategy.engine.grad_sync.use_group(self.survivors.group, reducer)
        strategy.engine.grad_sync.interrupt = self.survivors.interrupted

    def on_train_start(self, trainer: pl.Trainer) -> None:
        """The train loader checked (the lost ranks' batches come from it), the metrics and the SIGTERM broadcast
        moved to the survivors' groups."""
        module = trainer.lightning_module
        assert module is not None
        self.survivors.use_loader(trainer.train_dataloader)
        self.survivors.watch_metrics(module.modules(), _is_metric)
        self._loop = trainer.fit_loop.epoch_loop
        self._loop._broadcast_sigterm_tensor = functools.partial(_broadcast_sigterm, trainer, self.survivors)

    # ------------------------------------------------------------------ one step
    def step(self, run: Callable[[], Any]) -> Any:
        """``run()`` (Lightning's optimizer step), redone over the survivors after each peer failure in it (the
        closure zeroes the gradients and recomputes them)."""
        for _ in range(self.strategy.world_size):
            try:
                return run()
            except Exception as error:
                if not is_peer_failure(error):
                    raise
                self.recover(error)
        return run()

    def recover(self, error: BaseException) -> Recovery:
        """Agree on the survivors; average over their new group from now on (buckets built anew)."""
        strategy, survivors = self.strategy, self.survivors
        assert strategy.lightning_module is not None
        record = survivors.recover(strategy.lightning_module.trainer.global_step, error)
        assert survivors.group is not None
        strategy.engine.grad_sync.regroup(survivors.group, strategy.arrange_reducer(strategy.configure_reducer()))
        strategy._build_buckets()
        return record

    def backward(self, run: Callable[[Tensor], Tensor], closure_loss: Tensor) -> Tensor:
        """``run(loss)`` (Lightning's backward) for this rank's loss, then for each lost rank's micro-batch this rank
        holds, accumulated locally until the last one, whose backward reduces them all."""
        lost = self._lost_batches()
        if not lost:
            return run(closure_loss)
        with self.strategy.engine.grad_sync.no_sync():
            output = run(closure_loss)
            for batch in lost[:-1]:
                run(self._lost_loss(batch))
        run(self._lost_loss(lost[-1]))
        return output

    def _lost_batches(self) -> list[Any]:
        module = self.strategy.lightning_module
        if module is None or not self.survivors.lost_ranks():
            return []
        batch_idx = module.trainer.fit_loop.epoch_loop.batch_idx
        return [self.strategy.batch_to_device(batch) for batch in self.survivors.lost_batches(batch_idx)]

    def _lost_loss(self, batch: Any) -> Tensor:
        """The training loss of a lost rank's micro-batch, computed here."""
        module = self.strategy.lightning_module
        assert module is not None
        with self.strategy.precision_plugin.train_step_context():
            output = module.training_step(batch, module.trainer.fit_loop.epoch_loop.batch_idx)
        loss = output.get("loss") if isinstance(output, Mapping) else output
        if not isinstance(loss, Tensor):
            raise RuntimeError(
                "`fault_tolerant` trains a lost rank's batch with `training_step`, which returned no loss for it "
                f"({type(output).__name__}); return the loss (or a dict with 'loss') for every batch."
            )
        return loss

    def scale_gradients(self) -> None:
        """After a reduction: the average over the survivors times ``members / world_size`` (global batch kept)."""
        scale, module = self.survivors.grad_scale, self.strategy.lightning_module
        if scale != 1.0 and module is not None:
            for param in module.parameters():
                if param.grad is not None:
                    param.grad.mul_(scale)

    # ------------------------------------------------------------------ Lightning's collectives
    def is_leader(self) -> bool:
        return self.strategy.global_rank == self.survivors.leader

    def barrier(self) -> None:
        dist.barrier(group=self.survivors.control_group)

    def broadcast(self, obj: Any, src: int) -> Any:
        """Lightning's broadcast over the survivors; rank 0's part is the leader's."""
        box = [obj]
        dist.broadcast_object_list(box, self.survivors.leader if src == 0 else src, group=self.survivors.control_group)
        return box[0]

    def reduce_boolean_decision(self, decision: bool, all: bool) -> bool:
        total = self.strategy.reduce(torch.tensor(int(decision), device=self.strategy.root_device), reduce_op="sum")
        return bool(total == len(self.survivors.members)) if all else bool(total)

    def broadcast_buffers(self) -> None:
        module = self.strategy.lightning_module
        if module is not None:
            broadcast_module_buffers(module, self.survivors.control_group, self.survivors.leader)

    # ------------------------------------------------------------------ teardown
    def teardown(self) -> None:
        self.survivors.close()
        loop, self._loop = self._loop, None
        if loop is not None:
            del loop._broadcast_sigterm_tensor  # Lightning's own method again
