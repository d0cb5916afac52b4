"""The clock-table model of the pipeline schedules: one step simulated tick by tick, its bubble and activations held.

Each forward (``F``), input-gradient pass (``I``) or weight-gradient pass (``W``) of a micro-batch takes one tick, a
full backward (``B`` = ``I`` then ``W``) two. The model is the documentation and the test oracle: it gives the ideal
bubble and the activations each rank holds at most. Two stages, four micro-batches (``Fm``/``Bm``: forward/backward of
micro-batch m, ``..``: idle)::

    gpipe
    rank 0  F0 F1 F2 F3 .. .. .. B0 B0 B1 B1 B2 B2 B3 B3
    rank 1  .. F0 F1 F2 F3 B0 B0 B1 B1 B2 B2 B3 B3 .. ..
    1f1b
    rank 0  F0 F1 .. .. B0 B0 F2 B1 B1 F3 B2 B2 .. B3 B3
    rank 1  .. F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3 .. ..

Both idle ``(S-1)/(M+S-1)`` of the time (the *bubble*), but GPipe holds the activations of all ``M`` micro-batches
before its first backward while 1F1B holds at most ``S - s`` on stage ``s``.

The schedules with several chunks per rank (:mod:`~lightning_dp_strategies.pipeline.orders`) are placed in ticks the
same way, from the per-rank orders torch's schedule classes generate. The zero-bubble schedules split backward into
``I`` and ``W`` and fill the bubble with the ``W`` passes.
"""

from __future__ import annotations

from lightning_dp_strategies.pipeline.orders import default_virtual_stages, rank_order

__all__ = ["clock_table", "gpipe_bubble", "schedule_bubble", "table_bubble", "table_in_flight"]

_TICKS = {"F": 1, "B": 2, "I": 1, "W": 1}


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
