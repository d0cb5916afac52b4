"""The pipeline schedules: a pure clock-table model of each, and the glue to ``torch.distributed.pipelining``.

The engine is ``torch.distributed.pipelining``; this module adds the naming, the checks, a stage that measures its
own compute time and traffic (for the bubble and the statistics), and :func:`clock_table`, a tiny pure model of
every schedule: each forward (``F``), input-gradient pass (``I``) or weight-gradient pass (``W``) of a micro-batch
takes one tick, a full backward (``B`` = ``I`` then ``W``) two. The model is the documentation and the test oracle:
it gives the ideal bubble and the activations each rank holds at most. Two stages, four micro-batches (``Fm``/``Bm``:
forward/backward of micro-batch m, ``..``: idle)::

    gpipe
    rank 0  F0 F1 F2 F3 .. .. .. B0 B0 B1 B1 B2 B2 B3 B3
    rank 1  .. F0 F1 F2 F3 B0 B0 B1 B1 B2 B2 B3 B3 .. ..
    1f1b
    rank 0  F0 F1 .. .. B0 B0 F2 B1 B1 F3 B2 B2 .. B3 B3
    rank 1  .. F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3 .. ..

Both idle ``(S-1)/(M+S-1)`` of the time (the *bubble*), but GPipe holds the activations of all ``M`` micro-batches
before its first backward while 1F1B holds at most ``S - s`` on stage ``s``.

The other schedules give each rank ``V`` *virtual stages* (chunks of the body): ``"interleaved_1f1b"``,
``"looped_bfs"`` and ``"interleaved_zb"`` place chunk ``c`` on rank ``c % S`` (rank 0 runs chunks 0 and S, ...);
``"zbv"`` places two chunks per rank in a V (rank 0 runs the first and the last chunk). Their
actions name the chunk first, as torch does (``2F0``: chunk 2's forward of micro-batch 0); their per-rank orders are
the ones torch's schedule classes generate, and the clock table places them in ticks. The zero-bubble schedules split
backward into ``I`` and ``W`` and fill the bubble with the ``W`` passes.

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
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining.schedules import _PipelineSchedule

__all__ = [
    "LOOPED",
    "SCHEDULES",
    "SPLIT_BACKWARD",
    "V_SHAPED",
    "TimedStage",
    "check_schedule",
    "chunk_ranks",
    "clock_table",
    "default_virtual_stages",
    "effective_schedule",
    "gpipe_bubble",
    "make_schedule",
    "rank_order",
    "schedule_bubble",
    "schedule_micro_batches",
    "stage_order",
    "table_bubble",
    "table_in_flight",
]

LOOPED: tuple[str, ...] = ("interleaved_1f1b", "looped_bfs", "interleaved_zb")
"""Schedules with ``V >= 2`` chunks per rank, chunk ``c`` on rank ``c % S``."""
V_SHAPED: tuple[str, ...] = ("zbv",)
"""Schedules with exactly two chunks per rank, placed in a V: rank ``r`` runs chunks ``r`` and ``2S - 1 - r``."""
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", *LOOPED, *V_SHAPED)
SPLIT_BACKWARD: tuple[str, ...] = ("interleaved_zb", "zbv")
"""Schedules that split a backward into input- and weight-gradient passes."""

_TORCH_CLASSES: dict[str, Any] = {
    "interleaved_1f1b": torch_schedules.ScheduleInterleaved1F1B,
    "looped_bfs": torch_schedules.ScheduleLoopedBFS,
    "interleaved_zb": torch_schedules.ScheduleInterleavedZeroBubble,
    "zbv": torch_schedules.ScheduleZBVZeroBubble,
}
_TICKS = {"F": 1, "B": 2, "I": 1, "W": 1}


def default_virtual_stages(schedule: str) -> int:
    """Chunks per rank when ``virtual_stages`` is not given: 1 for GPipe and 1F1B, 2 for the others.

    Examples:
        >>> default_virtual_stages("1f1b"), default_virtual_stages("interleaved_1f1b")
        (1, 2)
    """
    _check_name(schedule)
    return 1 if schedule in ("gpipe", "1f1b") else 2


def check_schedule(schedule: str, stages: int, micro_batches: int, virtual_stages: int) -> None:
    """Raise, naming the schedules or values that work, unless ``schedule`` can run this configuration.

    Examples:
        >>> check_schedule("interleaved_1f1b", 2, 4, 2)
        >>> check_schedule("1f1b", 2, 4, 2)
        Traceback (most recent call last):
        ...
        ValueError: schedule='1f1b' runs one chunk per rank, but virtual_stages=2: use virtual_stages=1, or a \
schedule with several chunks per rank: ['interleaved_1f1b', 'looped_bfs', 'interleaved_zb', 'zbv'].
    """
    _check_name(schedule)
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise ValueError(f"`virtual_stages` must be an integer >= 1, got {virtual_stages!r}.")
    if schedule in ("gpipe", "1f1b") and virtual_stages != 1:
        raise ValueError(
            f"schedule={schedule!r} runs one chunk per rank, but virtual_stages={virtual_stages}: use "
            f"virtual_stages=1, or a schedule with several chunks per rank: {[*LOOPED, *V_SHAPED]}."
        )
    if schedule in LOOPED and virtual_stages < 2:
        raise ValueError(
            f"schedule={schedule!r} interleaves several chunks per rank, but virtual_stages={virtual_stages}: use "
            "virtual_stages >= 2, or schedule='1f1b' / 'gpipe' for one chunk per rank."
        )
    if schedule in V_SHAPED and virtual_stages != 2:
        raise ValueError(
            f"schedule={schedule!r} places exactly two chunks per rank (a V), but virtual_stages={virtual_stages}: "
            f"use virtual_stages=2, or one of {list(LOOPED)} for {virtual_stages} chunks per rank."
        )
    if not schedule_micro_batches(schedule, stages, micro_batches):
        works = [m for m in range(1, 4 * stages + 1) if schedule_micro_batches(schedule, stages, m)]
        raise ValueError(
            f"schedule={schedule!r} runs micro-batches in rounds of pipeline_stages={stages}, and "
            f"micro_batches={micro_batches} is not a whole number of rounds: use micro_batches in {works} (up to "
            f"{4 * stages}), or schedule='looped_bfs' / 'zbv', which take any count."
        )


def schedule_micro_batches(schedule: str, stages: int, micro_batches: int) -> bool:
    """Whether ``schedule`` runs ``micro_batches`` micro-batches on ``stages`` ranks (for a batch cut smaller).

    Examples:
        >>> [m for m in range(1, 9) if schedule_micro_batches("interleaved_1f1b", 2, m)]
        [1, 2, 3, 4, 6, 8]
    """
    if schedule in ("interleaved_1f1b", "interleaved_zb"):
        return micro_batches % max(1, micro_batches // stages) == 0
    return True


def chunk_ranks(schedule: str, stages: int, virtual_stages: int) -> list[int]:
    """The pipeline rank of each chunk of the body (``stages x virtual_stages`` chunks, in body order).

    Examples:
        >>> chunk_ranks("1f1b", 2, 1), chunk_ranks("interleaved_1f1b", 2, 2), chunk_ranks("zbv", 2, 2)
        ([0, 1], [0, 1, 0, 1], [0, 1, 1, 0])
    """
    count = stages * virtual_stages
    if schedule in V_SHAPED:
        return [c if c < stages else count - 1 - c for c in range(count)]
    return [c % stages for c in range(count)]


def effective_schedule(schedule: str, stages: int, micro_batches: int) -> str:
    """The schedule that runs: ``"1f1b"`` with fewer micro-batches than stages runs as ``"gpipe"``.

    Examples:
        >>> effective_schedule("1f1b", 2, 1), effective_schedule("1f1b", 2, 4)
        ('gpipe', '1f1b')
    """
    _check_name(schedule)
    return "gpipe" if schedule == "1f1b" and micro_batches < stages else schedule


def gpipe_bubble(stages: int, micro_batches: int) -> float:
    """The ideal bubble fraction ``(S - 1) / (M + S - 1)`` of a fill-drain pipeline (GPipe and 1F1B).

    Examples:
        >>> gpipe_bubble(2, 4)
        0.2
    """
    return (stages - 1) / (micro_batches + stages - 1)


def schedule_bubble(schedule: str, stages: int, micro_batches: int, virtual_stages: int | None = None) -> float:
    """The ideal bubble of ``schedule``: the idle fraction of its :func:`clock_table`.

    Examples:
        >>> schedule_bubble("1f1b", 2, 4), round(schedule_bubble("interleaved_1f1b", 2, 4), 3)
        (0.2, 0.111)
    """
    return table_bubble(clock_table(schedule, stages, micro_batches, virtual_stages))


def stage_order(schedule: str, stages: int, micro_batches: int, stage: int) -> list[str]:
    """The order in which ``stage`` runs its forwards (``"F0"``...) and backwards (``"B0"``...) in one step, for the
    one-chunk schedules.

    1F1B as in ``torch.distributed.pipelining``: ``S - s`` warm-up forwards, then one backward and one forward
    alternately, then the remaining backwards.

    Examples:
        >>> stage_order("1f1b", 2, 4, 0)
        ['F0', 'F1', 'B0', 'F2', 'B1', 'F3', 'B2', 'B3']
    """
    _check_name(schedule)
    if schedule not in ("gpipe", "1f1b"):
        raise ValueError(f"stage_order covers 'gpipe' and '1f1b'; use rank_order for {schedule!r}.")
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


def rank_order(
    schedule: str, stages: int, micro_batches: int, rank: int, virtual_stages: int | None = None
) -> list[str]:
    """The actions ``rank`` runs in one step, in order: :func:`stage_order` for the one-chunk schedules (``"F0"``),
    the order torch's schedule class generates for the others (``"2F0"``, ``"0I1"``, ``"3W1"``).

    Examples:
        >>> rank_order("looped_bfs", 2, 2, 0)
        ['0F0', '0F1', '2F0', '2F1', '2B1', '2B0', '0B1', '0B0']
    """
    virtual = default_virtual_stages(schedule) if virtual_stages is None else virtual_stages
    check_schedule(schedule, stages, micro_batches, virtual)
    if schedule in ("gpipe", "1f1b"):
        return stage_order(effective_schedule(schedule, stages, micro_batches), stages, micro_batches, rank)
    actions: list[str] = []
    for action in _torch_orders(schedule, stages, micro_batches, virtual)[rank]:
        if action is None:
            continue
        actions.append(str(action))
    return actions


def _torch_orders(schedule: str, stages: int, micro_batches: int, virtual: int) -> dict[int, list[Any]]:
    """Every rank's compute actions as torch's schedule class generates them (no process group needed)."""
    cls = _TORCH_CLASSES[schedule]
    plan = cls.__new__(cls)  # only the order generator runs: it reads these fields
    plan.pp_group_size, plan._n_microbatches, plan.n_local_stages = stages, micro_batches, virtual
    plan.number_of_rounds = max(1, micro_batches // stages)
    plan.microbatches_per_round = micro_batches // plan.number_of_rounds
    plan.num_stages = plan._num_stages = stages * virtual
    plan._stages, plan.rank = [None] * virtual, 0
    orders = {rank: plan._calculate_single_rank_operations(rank) for rank in range(stages)}
    if schedule == "interleaved_zb":
        plan.pipeline_order = orders
        orders = plan._add_bubbles_to_actions(stages * virtual)
    return orders


def _parse(action: str) -> tuple[int | None, str, int]:
    """``"F3"`` -> ``(None, "F", 3)``; ``"2I3"`` -> ``(2, "I", 3)``."""
    for position, char in enumerate(action):
        if char.isalpha():
            chunk = int(action[:position]) if position else None
            return chunk, char, int(action[position + 1 :])
    raise ValueError(action)  # pragma: no cover


def clock_table(schedule: str, stages: int, micro_batches: int, virtual_stages: int | None = None) -> list[list[str]]:
    """Simulate one step: ``table[rank][tick]`` is the action running then, or ``""`` (idle).

    A forward waits for the same micro-batch's forward on the previous chunk, an input-gradient pass (``I``, or a
    full backward ``B``) for the one on the next chunk (on the last chunk: for its own forward), a ``W`` for its
    ``I``; each rank runs its :func:`rank_order` in order, ``F``/``I``/``W`` one tick each and ``B`` two.

    Examples:
        >>> [" ".join(a or ".." for a in row) for row in clock_table("gpipe", 2, 2)]
        ['F0 F1 .. .. .. B0 B0 B1 B1', '.. F0 F1 B0 B0 B1 B1 .. ..']
    """
    virtual = default_virtual_stages(schedule) if virtual_stages is None else virtual_stages
    orders = [rank_order(schedule, stages, micro_batches, r, virtual) for r in range(stages)]
    chunks = stages * virtual
    finish: dict[tuple[int, str, int], int] = {}  # (chunk, kind, micro-batch) -> tick it finished
    position, busy = [0] * stages, [0] * stages
    table: list[list[str]] = [[] for _ in range(stages)]
    running = [""] * stages
    tick = 0
    while any(position[r] < len(orders[r]) or busy[r] > tick for r in range(stages)):
        for r in range(stages):
            if busy[r] > tick:
                table[r].append(running[r])
                continue
            if position[r] == len(orders[r]):
                table[r].append("")
                continue
            action = orders[r][position[r]]
            chunk, kind, m = _parse(action)
            c = r if chunk is None else chunk
            if kind == "F":
                deps = [(c - 1, "F", m)] if c > 0 else []
            elif kind == "W":
                deps = [(c, "I", m)]
            else:
                deps = [(c + 1, "I", m)] if c < chunks - 1 else [(c, "F", m)]
            if all(finish.get(dep, tick + 1) <= tick for dep in deps):
                finish[(c, kind, m)] = busy[r] = tick + _TICKS[kind]
                if kind == "B":
                    finish[(c, "I", m)] = busy[r]  # a full backward passes the input gradient on when it ends
                running[r] = action
                position[r] += 1
                table[r].append(action)
            else:
                table[r].append("")
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
    """Per rank, the most micro-batch chunks whose activations are held at once (forward done, the last backward
    pass, ``B`` or ``W``, not yet).

    Examples:
        >>> table_in_flight(clock_table("gpipe", 2, 8)), table_in_flight(clock_table("1f1b", 2, 8))
        ([8, 8], [2, 1])
    """
    peaks = []
    for row in table:
        held = peak = 0
        previous = ""
        for action in row:
            if action and action != previous:
                kind = _parse(action)[1]
                held += 1 if kind == "F" else -1 if kind in "BW" else 0
                peak = max(peak, held)
            previous = action
        peaks.append(peak)
    return peaks


def _check_name(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"Unknown pipeline `schedule` {schedule!r}: use one of {list(SCHEDULES)}.")


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
        """A timed backward pass; ``on_last_backward`` around it when it completes the step's gradients."""
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
        if not self.has_backward:
            super().backward_one_chunk(*args, **kwargs)
            return
        full = kwargs.get("full_backward", args[2] if len(args) > 2 else True)
        last = full and kwargs.get("last_backward", args[3] if len(args) > 3 else False)
        run = lambda: super(TimedStage, self).backward_one_chunk(*args, **kwargs)  # noqa: E731
        self._backward(f"{'B' if full else 'I'}{chunk}", last, run)

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> None:
        chunk = args[0] if args else kwargs["bwd_chunk_id"]
        if not self.has_backward:
            super().backward_weight_one_chunk(*args, **kwargs)
            return
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
            forward = (kinds.FORWARD, kinds.SEND_F, kinds.RECV_F)
            lowered = built.pipeline_order_with_comms
            for rank, actions in lowered.items():
                lowered[rank] = [a for a in actions if a.computation_type in forward]
        return built
    (stage,) = stages
    if effective_schedule(schedule, stage.num_stages, micro_batches) == "1f1b" and loss_fn is not None:
        return Schedule1F1B(stage, micro_batches, loss_fn=loss_fn, scale_grads=False)
    return ScheduleGPipe(stage, micro_batches, loss_fn=loss_fn, scale_grads=False)
