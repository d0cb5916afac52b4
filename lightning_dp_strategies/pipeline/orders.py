"""The pipeline schedules by name: the checks, which rank runs which chunk, and each rank's order of actions.

``"gpipe"`` and ``"1f1b"`` run one chunk of the body per rank. The other schedules give each rank ``V`` *virtual
stages* (chunks of the body): ``"interleaved_1f1b"``, ``"looped_bfs"`` and ``"interleaved_zb"`` place chunk ``c`` on
rank ``c % S`` (rank 0 runs chunks 0 and S, ...); ``"zbv"`` places two chunks per rank in a V (rank 0 runs the first
and the last chunk). Their actions name the chunk first, as torch does (``2F0``: chunk 2's forward of micro-batch 0);
their per-rank orders are the ones torch's schedule classes generate (:func:`rank_order`).
"""

from __future__ import annotations

from typing import Any

from torch.distributed.pipelining import schedules as torch_schedules

__all__ = [
    "LOOPED",
    "SCHEDULES",
    "SPLIT_BACKWARD",
    "V_SHAPED",
    "check_schedule",
    "chunk_ranks",
    "default_virtual_stages",
    "effective_schedule",
    "rank_order",
    "schedule_micro_batches",
    "stage_order",
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


def _check_name(schedule: str) -> None:
    """Raise, naming the schedules there are, unless ``schedule`` is one of them."""
    if schedule not in SCHEDULES:
        raise ValueError(f"Unknown pipeline `schedule` {schedule!r}: use one of {list(SCHEDULES)}.")
