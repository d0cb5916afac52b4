"""Who keeps a fault-tolerant local SGD rank's inner optimizer state between synchronisations, and who sends what
to whom after a loss.

At every synchronisation each member hands the inner states of the logical ranks it trains to the next ``copies``
members in rank order (:func:`handover_plan`), which keep them until the next one. After a loss the survivors share
the logical ranks anew (:func:`~lightning_dp_strategies.core.membership.logical_shares`): a taker gets each logical
rank it did not train before as a replica another survivor trained until now, or as a state it or another survivor
kept (:func:`takeover_plan`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from lightning_dp_strategies.core.membership import logical_shares

__all__ = ["Plan", "handover_plan", "takeover_plan"]

Plan = dict[int, dict[int, list[int]]]
"""``plan[src][dst]``: the logical ranks whose inner states ``src`` sends ``dst``."""


def handover_plan(members: Sequence[int], world_size: int, copies: int = 1) -> Plan:
    """Who keeps whose inner states: the logical ranks each member trains (:func:`logical_shares`) go to the next
    ``copies`` members in rank order (after the last member, the first). Every member keeps ``copies`` other members'
    states, so each link carries the same share, and a lost rank's state survives as long as one of its keepers does.
    Empty with one member.

    Examples:
        >>> handover_plan([0, 1, 2], 3)
        {0: {1: [0]}, 1: {2: [1]}, 2: {0: [2]}}
        >>> handover_plan([0, 2], 3)
        {0: {2: [0, 1]}, 2: {0: [2]}}
        >>> handover_plan([0, 1, 2], 3, copies=2)
        {0: {1: [0], 2: [0]}, 1: {2: [1], 0: [1]}, 2: {0: [2], 1: [2]}}
        >>> handover_plan([1], 3)
        {}
    """
    members = sorted(members)
    held = logical_shares(members, world_size)
    n = len(members)
    keepers = range(1, min(copies, n - 1) + 1)
    return {src: {members[(i + k) % n]: held[src] for k in keepers} for i, src in enumerate(members) if keepers}


def takeover_plan(
    trained: Mapping[int, Collection[int]], kept: Mapping[int, Collection[int]], needs: Mapping[int, Collection[int]]
) -> tuple[Plan, Plan, list[int]]:
    """After a loss, how each survivor ``dst`` gets the logical ranks it now trains and did not before (``needs[dst]``):
    a replica another survivor trains (``trained[src]``) moves to it whole (``moves[src][dst]``); else the state it
    kept itself (``kept[dst]``) rebuilds it, or the lowest survivor that kept that state sends it (``sends[src][dst]``).
    Returns ``(moves, sends, missing)``, ``missing`` the logical ranks needed that no survivor trains or kept.

    Examples:
        >>> # 4 ranks, 1 and 3 lost: 2 kept 1's state and 0 kept 3's, but 0 takes 1 over and 2 takes 3
        >>> takeover_plan({}, {0: [3], 2: [1]}, {0: [1], 2: [3]})
        ({}, {2: {0: [1]}, 0: {2: [3]}}, [])
        >>> # 4 ranks, 2 and 3 lost: 0 takes 2 over, whose state 3 kept (lost), and 1 takes 3, whose state 0 kept
        >>> takeover_plan({}, {0: [3], 1: [0]}, {0: [2], 1: [3]})
        ({}, {0: {1: [3]}}, [2])
        >>> # 4 ranks, 2 lost (0 took it over), then 1: 0 takes 1 over, 3 takes 2, whose replica moves from 0
        >>> takeover_plan({0: [2]}, {0: [3], 3: [1]}, {0: [1], 3: [2]})
        ({0: {3: [2]}}, {3: {0: [1]}}, [])
    """
    moves: Plan = {}
    sends: Plan = {}
    missing: list[int] = []
    for dst in sorted(needs):
        for logical in sorted(needs[dst]):
            trainer = next((m for m in sorted(trained) if m != dst and logical in trained[m]), None)
            keeper = min((m for m, held in kept.items() if logical in held), default=None)
            if trainer is not None:
                moves.setdefault(trainer, {}).setdefault(dst, []).append(logical)
            elif keeper is None:
                missing.append(logical)
            elif logical not in kept.get(dst, ()):
                sends.setdefault(keeper, {}).setdefault(dst, []).append(logical)
    return moves, sends, sorted(missing)
