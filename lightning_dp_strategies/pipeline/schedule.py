"""The two schedules, "gpipe" and "1f1b": a pure clock-table model of each, and the glue to torch's engine.

The engine is ``torch.distributed.pipelining`` (:class:`ScheduleGPipe`, :class:`Schedule1F1B`); this module adds
the naming, a stage that measures its own compute time (for the bubble), and :func:`clock_table`, a tiny pure
model of both schedules under the textbook assumption that every forward and backward of a micro-batch takes one
tick. The model is the documentation and the test oracle: it gives the ideal bubble and the activations each stage
holds at most. Two stages, four micro-batches (``Fm``/``Bm``: forward/backward of micro-batch m, ``..``: idle)::

    gpipe                                     1f1b
    tick     0  1  2  3  4  5  6  7  8  9     tick     0  1  2  3  4  5  6  7  8  9
    stage 0 F0 F1 F2 F3 .. .. B0 B1 B2 B3     stage 0 F0 F1 .. B0 F2 B1 F3 B2 .. B3
    stage 1 .. F0 F1 F2 F3 B0 B1 B2 B3 ..     stage 1 .. F0 B0 F1 B1 F2 B2 F3 B3 ..

Both idle ``(S-1)/(M+S-1)`` of the time (2 of 10 ticks here: the *bubble*), but GPipe holds the activations of all
``M`` micro-batches before its first backward while 1F1B holds at most ``S - s`` on stage ``s`` (2 and 1 here).

``torch.distributed.pipelining``'s ``Schedule1F1B`` refuses fewer micro-batches than stages. With ``M < S`` 1F1B
saves nothing where memory peaks (stage 0 holds all ``M`` micro-batches under both), so :func:`make_schedule` then
builds ``ScheduleGPipe`` (:func:`effective_schedule`); the gradients are the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

__all__ = [
    "SCHEDULES",
    "TimedStage",
    "clock_table",
    "effective_schedule",
    "gpipe_bubble",
    "make_schedule",
    "stage_order",
    "table_bubble",
    "table_in_flight",
]

SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")


def effective_schedule(schedule: str, stages: int, micro_batches: int) -> str:
    """The schedule that runs: ``"1f1b"`` with fewer micro-batches than stages runs as ``"gpipe"``.

    Examples:
        >>> effective_schedule("1f1b", 2, 1), effective_schedule("1f1b", 2, 4)
        ('gpipe', '1f1b')
    """
    _check_name(schedule)
    return "gpipe" if schedule == "1f1b" and micro_batches < stages else schedule


def gpipe_bubble(stages: int, micro_batches: int) -> float:
    """The ideal bubble fraction ``(S - 1) / (M + S - 1)`` of a fill-drain pipeline.

    Examples:
        >>> gpipe_bubble(2, 4)
        0.2
    """
    return (stages - 1) / (micro_batches + stages - 1)


def stage_order(schedule: str, stages: int, micro_batches: int, stage: int) -> list[str]:
    """The order in which ``stage`` runs its forwards (``"F0"``...) and backwards (``"B0"``...) in one step.

    1F1B as in ``torch.distributed.pipelining``: ``S - s`` warm-up forwards, then one backward and one forward
    alternately, then the remaining backwards.

    Examples:
        >>> stage_order("1f1b", 2, 4, 0)
        ['F0', 'F1', 'B0', 'F2', 'B1', 'F3', 'B2', 'B3']
    """
    _check_name(schedule)
    forwards = [f"F{m}" for m in range(micro_batches)]
    backwards = [f"B{m}" for m in range(micro_batches)]
    if schedule == "gpipe":
        return forwards + backwards
    warmup = min(micro_batches, stages - stage)
    order = forwards[:warmup]
    f, b = warmup, 0
    while f < micro_batches:
        order += [backwards[b], forwards[f]]
        b, f = b + 1, f + 1
    return order + backwards[b:]


def clock_table(schedule: str, stages: int, micro_batches: int) -> list[list[str]]:
    """Simulate one step, one tick per forward or backward: ``table[stage][tick]`` is an action or ``""`` (idle).

    A forward waits for the same micro-batch's forward on the previous stage, a backward for its backward on the
    next stage (on the last stage: for its own forward); each stage runs its :func:`stage_order` one action a tick.

    Examples:
        >>> [" ".join(a or ".." for a in row) for row in clock_table("gpipe", 2, 2)]
        ['F0 F1 .. .. B0 B1', '.. F0 F1 B0 B1 ..']
    """
    orders = [stage_order(schedule, stages, micro_batches, s) for s in range(stages)]
    done: dict[tuple[int, str], int] = {}  # (stage, action) -> tick it finished
    position = [0] * stages
    table: list[list[str]] = [[] for _ in range(stages)]
    tick = 0
    while any(position[s] < len(orders[s]) for s in range(stages)):
        ran = []
        for s in range(stages):
            if position[s] == len(orders[s]):
                table[s].append("")
                continue
            action = orders[s][position[s]]
            kind, m = action[0], action[1:]
            if kind == "F":
                dep = (s - 1, action) if s > 0 else None
            else:
                dep = (s + 1, action) if s < stages - 1 else (s, f"F{m}")
            if dep is None or done.get(dep, tick) < tick:
                table[s].append(action)
                ran.append((s, action))
            else:
                table[s].append("")
        for s, action in ran:
            done[(s, action)] = tick
            position[s] += 1
        tick += 1
    return table


def table_bubble(table: list[list[str]]) -> float:
    """Idle ticks over all ticks of a :func:`clock_table`.

    Examples:
        >>> table_bubble(clock_table("1f1b", 2, 4))
        0.2
    """
    cells = [a for row in table for a in row]
    return sum(1 for a in cells if not a) / len(cells)


def table_in_flight(table: list[list[str]]) -> list[int]:
    """Per stage, the most micro-batches whose activations are held at once (forward done, backward not yet).

    Examples:
        >>> table_in_flight(clock_table("gpipe", 2, 8)), table_in_flight(clock_table("1f1b", 2, 8))
        ([8, 8], [2, 1])
    """
    peaks = []
    for row in table:
        held = peak = 0
        for action in row:
            held += 1 if action.startswith("F") else -1 if action.startswith("B") else 0
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def _check_name(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"Unknown pipeline `schedule` {schedule!r}: use one of {list(SCHEDULES)}.")


class TimedStage(PipelineStage):
    """A :class:`~torch.distributed.pipelining.PipelineStage` that adds up the seconds it spends computing.

    Everything else a step takes (waiting for a neighbour's activations or gradients, sending) is idle time, so
    ``1 - compute_seconds / step_seconds`` is this rank's measured bubble. On CUDA each chunk is synchronised before
    the clock is read, which costs a little overlap.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.compute_seconds = 0.0
        self.actions: list[str] = []
        """The forwards (``"F0"``...) and backwards (``"B0"``...) this stage ran, in order."""

    def _sync(self) -> None:
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        self.actions.append(f"F{args[0] if args else kwargs['fwd_chunk_id']}")
        self._sync()
        start = time.perf_counter()
        try:
            return super().forward_one_chunk(*args, **kwargs)
        finally:
            self._sync()
            self.compute_seconds += time.perf_counter() - start

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> None:
        if self.has_backward:
            self.actions.append(f"B{args[0] if args else kwargs['bwd_chunk_id']}")
        self._sync()
        start = time.perf_counter()
        try:
            super().backward_one_chunk(*args, **kwargs)
        finally:
            self._sync()
            self.compute_seconds += time.perf_counter() - start


def make_schedule(
    schedule: str,
    stage: PipelineStage,
    micro_batches: int,
    loss_fn: Callable[[Any, Tensor], Tensor] | None,
) -> PipelineScheduleSingle:
    """The torch schedule for ``schedule``; ``loss_fn=None`` builds a forward-only one (evaluation).

    Gradients are not rescaled by the schedule (``scale_grads=False``): ``loss_fn`` carries the ``1 / M`` weight.

    Examples:
        >>> # on each rank of the stage's process group, with a torch PipelineStage for this rank's blocks
        >>> schedule = make_schedule("1f1b", stage, micro_batches=4, loss_fn=loss_fn)  # doctest: +SKIP
        >>> schedule.step(x, target=y)  # doctest: +SKIP
    """
    if effective_schedule(schedule, stage.num_stages, micro_batches) == "1f1b" and loss_fn is not None:
        return Schedule1F1B(stage, micro_batches, loss_fn=loss_fn, scale_grads=False)
    return ScheduleGPipe(stage, micro_batches, loss_fn=loss_fn, scale_grads=False)
