"""One rank's side of a pipeline step: micro-batch, run the schedule, measure the bubble, share the last output.

Every rank of a pipeline replica calls the same methods with the same batch (the stages of one replica see the
same data); the runner feeds the inputs to the first stage only and the target to the last stage only. The
``torch.distributed.pipelining`` stage sizes its receive buffers from the first micro-batch it sees, so the runner
keeps one stage and schedule per batch shape (usually two or three: full batches, the last batch of an epoch,
evaluation batches).

A training step runs forward *and* backward of every micro-batch (the schedule interleaves them), leaving this
stage's parameter gradients accumulated in ``.grad`` exactly as one ``loss.backward()`` on the whole batch would:
micro-batch losses are weighted ``scale / M``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining.schedules import _PipelineSchedule

from lightning_dp_strategies.pipeline.activations import (
    Activation,
    as_args,
    batch_size,
    detach,
    from_args,
    is_activation,
    signature,
)
from lightning_dp_strategies.pipeline.memory import ActivationMeter
from lightning_dp_strategies.pipeline.microbatch import effective_micro_batches
from lightning_dp_strategies.pipeline.orders import chunk_ranks, default_virtual_stages, schedule_micro_batches
from lightning_dp_strategies.pipeline.schedule import TimedStage, make_schedule

__all__ = ["LossFn", "PipelineRunner", "PipelineStats", "StepResult", "StepStats"]

LossFn = Callable[[Any, Tensor], Tensor]
"""The loss of one micro-batch on the last stage's output (a tensor or a tuple of tensors): ``loss_fn(output,
target)``, a mean over the micro-batch."""


@dataclass
class StepStats:
    """What one pipeline step on this rank took.

    Examples:
        >>> stats = StepStats(micro_batches=4, step_seconds=2.0, compute_seconds=1.5)
        >>> stats.bubble  # idle over total on this rank
        0.25
    """

    micro_batches: int = 0
    """Micro-batches the step ran (less than configured for a batch they do not divide)."""
    step_seconds: float = 0.0
    """Wall time of the whole schedule on this rank."""
    compute_seconds: float = 0.0
    """Time this rank spent in forward and backward of its stage; the rest is waiting for neighbours."""
    warmup: bool = False
    """The step built a new stage for a new batch shape (its time includes torch's shape inference)."""
    peak_activation_bytes: int = 0
    """Peak bytes saved for backward during the step, the parameters and the batch itself excluded (0 unless
    ``measure_activations``)."""
    p2p_bytes_sent: int = 0
    """Bytes this rank sent to neighbouring stages: activations forward and their gradients backward."""
    p2p_bytes_received: int = 0
    """Bytes this rank received from neighbouring stages."""

    @property
    def bubble(self) -> float:
        """Idle time over total time of the step on this rank."""
        if self.step_seconds <= 0:
            return 0.0
        return max(0.0, 1.0 - self.compute_seconds / self.step_seconds)


@dataclass
class StepResult:
    """A training step's outcome on this rank.

    Examples:
        >>> result = StepResult(output=None, loss=torch.tensor(0.5))  # what the last stage of a step returns
        >>> float(result.loss), result.stats.micro_batches
        (0.5, 0)
    """

    output: Activation | None
    """The last stage's output for the whole batch (a tensor or a tuple), detached (``None`` on other stages)."""
    loss: Tensor | None
    """The batch-mean loss, detached (``None`` but on the last stage)."""
    stats: StepStats = field(default_factory=StepStats)


@dataclass
class _Entry:
    stages: list[TimedStage]
    schedule: _PipelineSchedule
    micro_batches: int


class PipelineRunner:
    """Runs this rank's stage of a pipeline of ``num_stages`` ranks.

    Args:
        module: this stage's blocks (a :class:`~lightning_dp_strategies.pipeline.layout.StageBody`): called with
            the tensors the previous stage sent, it returns one tensor or a tuple of them. Under a schedule with
            several chunks per rank, a list of them: this rank's chunks in body order.
        stage_index: this rank's stage.
        num_stages: stages in the pipeline (ranks of the pipeline group).
        group: the pipeline group, its ranks ordered by stage (group rank ``s`` runs stage ``s``).
        device: where this stage runs.
        schedule: one of :data:`~lightning_dp_strategies.pipeline.schedule.SCHEDULES`.
        micro_batches: micro-batches per step.
        measure_activations: record the peak bytes saved for backward in each step's statistics.
        virtual_stages: chunks per rank (the schedule's default when ``None``).

    Example (on every rank of a 2-stage pipeline, under ``torch.distributed``)::

        runner = PipelineRunner(blocks[rank], rank, 2, group=None, device=torch.device("cpu"),
                                schedule="1f1b", micro_batches=4)
        result = runner.train_step(x, y, F.cross_entropy)   # .grad of this stage's parameters is now set
        out = runner.forward(x)                              # the last stage's output, on the last stage
    """

    def __init__(
        self,
        module: nn.Module | Sequence[nn.Module],
        stage_index: int,
        num_stages: int,
        group: dist.ProcessGroup | None,
        device: torch.device,
        schedule: str = "1f1b",
        micro_batches: int = 1,
        measure_activations: bool = False,
        virtual_stages: int | None = None,
    ) -> None:
        # configuration
        self.modules: list[nn.Module] = [module] if isinstance(module, nn.Module) else list(module)
        self.virtual_stages = default_virtual_stages(schedule) if virtual_stages is None else virtual_stages
        ranks = chunk_ranks(schedule, num_stages, self.virtual_stages)
        self.chunks = [c for c, rank in enumerate(ranks) if rank == stage_index]
        self.last_rank = ranks[-1]
        if len(self.modules) != len(self.chunks):
            raise ValueError(
                f"stage {stage_index} runs chunks {self.chunks} under {schedule!r}: pass that many modules"
            )
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group = group
        self.device = device
        self.schedule = schedule
        self.micro_batches = micro_batches
        self.measure_activations = measure_activations
        # runtime state
        self._entries: dict[Hashable, _Entry] = {}
        self._output_meta: dict[Hashable, Any] = {}
        self._last_key: Hashable = None
        self._loss_fn: LossFn | None = None
        self._weight = 1.0
        self.before_last_backward: Callable[[list[nn.Parameter]], None] | None = None
        """Called with a chunk's parameters right before the backward pass that completes their gradients for the
        step (their data-parallel reduction can start during it)."""
        self.after_last_backward: Callable[[list[nn.Parameter]], None] | None = None
        """Called with a chunk's parameters right after that pass: their gradients are final."""
        # statistics
        self.last_stats = StepStats()
        self.last_order: list[str] = []
        """The order this stage ran its forwards and backwards in the latest step (``["F0", "F1", "B0", ...]``)."""

    @property
    def is_first(self) -> bool:
        """Whether this rank runs the first chunk (it consumes the inputs)."""
        return 0 in self.chunks

    @property
    def is_last(self) -> bool:
        """Whether this rank runs the last chunk (it produces the output and the loss)."""
        return self.stage_index == self.last_rank

    # ------------------------------------------------------------------ stages per batch shape
    def reset(self) -> None:
        """Forget the built stages: the next step rebuilds them (on every stage of the pipeline alike).

        A stage learns at its first step which activations need a gradient; after parameters were frozen or
        unfrozen that may have changed."""
        self._entries.clear()
        self._output_meta.clear()

    def _entry(self, key: Hashable, micro_batches: int, training: bool) -> tuple[_Entry, bool]:
        self._last_key = key
        entry = self._entries.get(key)
        if entry is not None:
            return entry, False
        actions: list[str] = []
        total = self.num_stages * self.virtual_stages
        stages = [
            TimedStage(
                module,
                chunk,
                total,
                self.device,
                group=self.group,
                actions=actions,
                label_chunks=total > self.num_stages,
                on_last_backward=self._on_last_backward,
            )
            for module, chunk in zip(self.modules, self.chunks, strict=True)
        ]
        loss = self._weighted_loss if training else None
        entry = _Entry(stages, make_schedule(self.schedule, stages, micro_batches, loss), micro_batches)
        self._entries[key] = entry
        return entry, True

    def _on_last_backward(self, stage: TimedStage, done: bool) -> None:
        callback = self.after_last_backward if done else self.before_last_backward
        if callback is not None:
            callback(list(stage.submod.parameters()))

    def _micro_batches(self, batch: int) -> int:
        """The most equal micro-batches, at most the configured count, that cut ``batch`` and the schedule runs."""
        micro = effective_micro_batches(batch, self.micro_batches)
        while not schedule_micro_batches(self.schedule, self.num_stages, micro):
            micro = effective_micro_batches(batch, micro - 1)
        return micro

    def _weighted_loss(self, output: Any, target: Tensor) -> Tensor:
        assert self._loss_fn is not None
        return self._loss_fn(output, target) * self._weight

    @staticmethod
    def _shape_key(inputs: Activation, target: Tensor | None) -> tuple[object, ...]:
        target_key = None if target is None else signature(target)
        return (signature(inputs), target_key, torch.is_inference_mode_enabled())

    # ------------------------------------------------------------------ steps
    def train_step(self, inputs: Activation, target: Tensor, loss_fn: LossFn, scale: float = 1.0) -> StepResult:
        """Forward and backward of one batch through the pipeline; gradients accumulate into ``.grad``.

        Every stage passes the same ``inputs`` (a tensor or a tuple of tensors) and ``target`` (the whole batch); only
        their shapes matter off the first and last stage. ``scale`` multiplies the gradient
        (``1 / accumulate_grad_batches``).
        """
        batch = batch_size(inputs)
        micro = self._micro_batches(batch)
        entry, new = self._entry(("train", micro, *self._shape_key(inputs, target)), micro, training=True)
        self._loss_fn, self._weight = loss_fn, scale / micro
        losses: list[Tensor] = []
        kwargs: dict[str, Any] = {}
        if self.is_last:
            kwargs.update(target=target, losses=losses)
        args = as_args(inputs) if self.is_first else ()
        output, stats = self._timed(entry, new, args, kwargs)
        self._loss_fn = None
        loss = None
        if self.is_last:
            loss = (torch.stack([x.detach().float() for x in losses]).sum() / scale).to(losses[0].dtype)
        return StepResult(output, loss, stats)

    def forward(self, inputs: Activation) -> Activation | None:
        """Forward only (evaluation): the whole batch's output on the last stage, ``None`` elsewhere."""
        micro = self._micro_batches(batch_size(inputs))
        entry, new = self._entry(("eval", micro, *self._shape_key(inputs, None)), micro, training=False)
        args = as_args(inputs) if self.is_first else ()
        output, _ = self._timed(entry, new, args, {})
        return output

    def _timed(
        self, entry: _Entry, new: bool, args: tuple[Tensor, ...], kwargs: dict[str, Any]
    ) -> tuple[Activation | None, StepStats]:
        for stage in entry.stages:
            stage.compute_seconds = 0.0
            stage.bytes_sent = stage.bytes_received = 0
        entry.stages[0].actions.clear()  # shared by the stages of this rank
        # the batch is data, not activations: its storage (shared by the micro-batch views) is not counted
        excluded = [*(p for module in self.modules for p in module.parameters()), *args]
        meter = ActivationMeter(exclude=excluded) if self.measure_activations else None
        start = time.perf_counter()
        if meter is not None:
            with meter:
                output = entry.schedule.step(*args, **kwargs)
        else:
            output = entry.schedule.step(*args, **kwargs)
        stats = StepStats(
            micro_batches=entry.micro_batches,
            step_seconds=time.perf_counter() - start,
            compute_seconds=sum(stage.compute_seconds for stage in entry.stages),
            p2p_bytes_sent=sum(stage.bytes_sent for stage in entry.stages),
            p2p_bytes_received=sum(stage.bytes_received for stage in entry.stages),
            warmup=new,
            peak_activation_bytes=meter.peak_bytes if meter is not None else 0,
        )
        self.last_stats = stats
        self.last_order = list(entry.stages[0].actions)
        return detach(output), stats

    # ------------------------------------------------------------------ the output, on every stage
    def share_output(self, output: Activation | None) -> Activation:
        """Broadcast the last stage's ``output`` of the latest step to every stage of this pipeline.

        Collective over the pipeline group: every stage calls it right after the same :meth:`train_step` or
        :meth:`forward`. The output's shapes and dtypes are exchanged once per batch shape.
        """
        meta: Any = self._output_meta.get(self._last_key)
        if meta is None:
            if self.is_last:
                meta = _output_meta(output)
            if self.num_stages > 1:
                box = [meta]
                dist.broadcast_object_list(box, group=self.group, group_src=self.last_rank)
                meta = box[0]
            self._output_meta[self._last_key] = meta
        if isinstance(meta, str):
            raise TypeError(meta)
        if self.num_stages == 1:
            assert output is not None
            return output
        if self.is_last:
            assert output is not None
            buffers = [t.contiguous() for t in as_args(output)]
        else:
            buffers = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in meta]
        for buffer in buffers:
            dist.broadcast(buffer, group=self.group, group_src=self.last_rank)
        return from_args(buffers)


def _output_meta(output: object) -> Any:
    """The signature of the last stage's output, or the error every stage raises when it is not an activation."""
    if is_activation(output):
        return signature(output)
    return (
        f"The last pipeline stage returned {type(output).__name__}, but the pipeline passes one tensor or a tuple "
        "of tensors to the loss: make the last block of the body return one of those."
    )


@dataclass
class PipelineStats:
    """Statistics of this rank's pipeline steps."""

    last: StepStats = field(default_factory=StepStats)
    """The latest training step: ``last.bubble`` is its idle time over its total time on this rank."""
    steps: int = 0
    """Training steps run."""
    bubble_sum: float = 0.0
    """The bubbles of the steps that reused a built stage, summed (see :attr:`mean_bubble`)."""
    measured_steps: int = 0
    """Steps counted in ``bubble_sum`` (the first step of each batch shape builds its stage and is left out)."""
    p2p_bytes_sent: int = 0
    """Bytes this rank sent to neighbouring stages over all training steps (activations and their gradients)."""
    p2p_bytes_received: int = 0
    """Bytes this rank received from neighbouring stages over all training steps."""
    peak_activation_bytes: int = 0
    """The largest ``peak_activation_bytes`` of any training step (0 unless activations are measured)."""

    @property
    def mean_bubble(self) -> float:
        """Mean bubble over steps that reused a built stage (the first step of each batch shape is left out)."""
        return self.bubble_sum / self.measured_steps if self.measured_steps else 0.0

    def record(self, stats: StepStats) -> None:
        self.last = stats
        self.steps += 1
        self.p2p_bytes_sent += stats.p2p_bytes_sent
        self.p2p_bytes_received += stats.p2p_bytes_received
        self.peak_activation_bytes = max(self.peak_activation_bytes, stats.peak_activation_bytes)
        if not stats.warmup:
            self.bubble_sum += stats.bubble
            self.measured_steps += 1
