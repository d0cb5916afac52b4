"""The pipeline schedules' glue to ``torch.distributed.pipelining``: a stage that times itself, and the schedule.

The engine is ``torch.distributed.pipelining``; this module adds :class:`TimedStage` (a stage that measures its own
compute time and traffic, for the bubble and the statistics) and :func:`make_schedule`. The schedules by name
(checks, chunk placement, per-rank orders) live in :mod:`.orders`, the clock-table model with its diagrams in
:mod:`.clock`; every name is importable from here as well.

``Schedule1F1B`` refuses fewer micro-batches than stages. With ``M < S`` 1F1B saves nothing where memory peaks
(stage 0 holds all ``M`` micro-batches under both), so :func:`make_schedule` then builds ``ScheduleGPipe``
(:func:`effective_schedule`); the gradients are the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, schedules as torch_schedules
from torch.distributed.pipelining.schedules import _PipelineSchedule

from lightning_dp_strategies.pipeline import clock, orders
from lightning_dp_strategies.pipeline.clock import *  # noqa: F403  (the clock-table model's names, from here too)
from lightning_dp_strategies.pipeline.orders import *  # noqa: F403  (the schedules by name, from here too)
from lightning_dp_strategies.pipeline.orders import _TORCH_CLASSES, effective_schedule

__all__ = ["TimedStage", "make_schedule", *clock.__all__, *orders.__all__]


class TimedStage(PipelineStage):
    """A :class:`~torch.distributed.pipelining.PipelineStage` that adds up the seconds it spends computing and the
    bytes it sends to and receives from neighbouring stages.

    Everything else a step takes (waiting for a neighbour's activations or gradients, sending) is idle time, so
    ``1 - compute_seconds / step_seconds`` is this rank's measured bubble. On CUDA each chunk is synchronised before
    the clock is read, which costs a little overlap. The stages of one rank share ``actions`` (pass the same list),
    labelled as :func:`rank_order` labels them (``label_chunks``: with the chunk index first, as ``"2F0"``).
    ``on_last_backward(stage, done)`` runs right before (``done=False``) and after (``done=True``) the backward
    pass (``B``, or ``W`` when backward is split) that completes this stage's parameter gradients for the step.
    """

    def __init__(
        self,
        *args: Any,
        actions: list[str] | None = None,
        label_chunks: bool = False,
        on_last_backward: Callable[[TimedStage, bool], None] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.on_last_backward = on_last_backward
        self.compute_seconds = 0.0
        self.bytes_sent = 0
        """Bytes of activations (forward) and their gradients (backward) sent to neighbouring stages."""
        self.bytes_received = 0
        """Bytes of activations and gradients received from neighbouring stages."""
        self.actions: list[str] = [] if actions is None else actions
        """The forwards (``"F0"``...) and backwards (``"B0"``, or ``"I0"`` and ``"W0"``) this rank ran, in order."""
        self._prefix = str(self.stage_index) if label_chunks else ""

    def _sync(self) -> None:
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)

    def _timed(self, label: str, run: Callable[[], Any]) -> Any:
        self.actions.append(self._prefix + label)
        self._sync()
        start = time.perf_counter()
        try:
            return run()
        finally:
            self._sync()
            self.compute_seconds += time.perf_counter() - start

    def _count(self, ops: list[dist.P2POp], sent: bool) -> list[dist.P2POp]:
        size = sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
        if sent:
            self.bytes_sent += size
        else:
            self.bytes_received += size
        return ops

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._count(super().get_fwd_send_ops(fwd_chunk_id), sent=True)

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._count(super().get_bwd_send_ops(bwd_chunk_id), sent=True)

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._count(super().get_fwd_recv_ops(fwd_chunk_id), sent=False)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._count(super().get_bwd_recv_ops(bwd_chunk_id), sent=False)

    def _backward(self, label: str, last: bool, run: Callable[[], Any]) -> None:
        """A timed backward pass; ``on_last_backward`` around it when it completes the step's gradients. A stage
        with no backward (nothing trainable, no input gradient) runs it untimed."""
        if not self.has_backward:
            run()
            return
        callback = self.on_last_backward if last else None
        if callback is not None:
            callback(self, False)
        self._timed(label, run)
        if callback is not None:
            callback(self, True)

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        chunk = args[0] if args else kwargs["fwd_chunk_id"]
        return self._timed(f"F{chunk}", lambda: super(TimedStage, self).forward_one_chunk(*args, **kwargs))

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> None:
        chunk = args[0] if args else kwargs["bwd_chunk_id"]
        full = kwargs.get("full_backward", args[2] if len(args) > 2 else True)
        last = full and kwargs.get("last_backward", args[3] if len(args) > 3 else False)
        run = lambda: super(TimedStage, self).backward_one_chunk(*args, **kwargs)  # noqa: E731
        self._backward(f"{'B' if full else 'I'}{chunk}", last, run)

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> None:
        chunk = args[0] if args else kwargs["bwd_chunk_id"]
        last = kwargs.get("last_backward", args[1] if len(args) > 1 else False)
        self._backward(f"W{chunk}", last, lambda: super(TimedStage, self).backward_weight_one_chunk(*args, **kwargs))


def make_schedule(
    schedule: str,
    stages: Sequence[PipelineStage],
    micro_batches: int,
    loss_fn: Callable[[Any, Tensor], Tensor] | None,
) -> _PipelineSchedule:
    """The torch schedule for ``schedule`` over this rank's ``stages`` (one, or its chunks in body order);
    ``loss_fn=None`` builds a forward-only one (evaluation).

    Gradients are not rescaled by the schedule (``scale_grads=False``): ``loss_fn`` carries the ``1 / M`` weight.
    Evaluation runs every schedule's forwards as its training order does, without the backwards.

    Examples:
        >>> # on each rank of the stage's process group, with a torch PipelineStage for this rank's blocks
        >>> schedule = make_schedule("1f1b", [stage], micro_batches=4, loss_fn=loss_fn)  # doctest: +SKIP
        >>> schedule.step(x, target=y)  # doctest: +SKIP
    """
    if schedule in _TORCH_CLASSES:
        built = _TORCH_CLASSES[schedule](stages, micro_batches, loss_fn=loss_fn, scale_grads=False)
        if loss_fn is None:  # keep the forwards, in the training order, and their sends and receives only
            kinds = torch_schedules._ComputationType
            # torch >= 2.15 also lowers each send to a later WAIT_SEND_F, and refuses a send left unwaited
            forward = {kinds.FORWARD, kinds.SEND_F, kinds.RECV_F, getattr(kinds, "WAIT_SEND_F", kinds.FORWARD)}
            lowered = built.pipeline_order_with_comms
            for rank, actions in lowered.items():
                lowered[rank] = [a for a in actions if a.computation_type in forward]
        return built
    (stage,) = stages
    if effective_schedule(schedule, stage.num_stages, micro_batches) == "1f1b" and loss_fn is not None:
        return Schedule1F1B(stage, micro_batches, loss_fn=loss_fn, scale_grads=False)
    return ScheduleGPipe(stage, micro_batches, loss_fn=loss_fn, scale_grads=False)
