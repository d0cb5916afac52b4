"""The inner optimizer states fault-tolerant local SGD hands over, sent while the next period trains.

At every synchronisation, once every member has the average, each rank sends the inner states of the logical ranks
it trains (its own and its replicas') to the members that keep them (:func:`~lightning_dp_strategies.core.handover.
handover_plan`). The bytes travel on the group's threads while the next period's inner steps run; the next
synchronisation waits for them before it averages, and once it commits (every member got that far) they are the
states a lost rank is rebuilt from. Until then the states handed over before stay, with the periods trained since
(each one's anchor, buffers and inner steps)::

    sync n       commit: the states sent at sync n-1 become `handed`; send the states of sync n (in flight)
    period n+1   a rank lost: if every survivor received the states of sync n, its taker replays period n+1 from
                 them; if one did not, it replays periods n and n+1 from the states of sync n-1

:meth:`HandOvers.settle` makes every survivor choose the same: the newest states all of them hold, counted in
synchronisations since the last hand-over that waited (:attr:`HandOvers.point`). At a fresh start every rank's inner
state is the optimizer's initial one, alike on every rank (the same optimizer over the same parameters), so each
keeper takes copies of its own and nothing is sent (:meth:`HandOvers.start_alike`); at the start of a resumed run,
after an admission and after a recovery in a synchronisation the states are handed over before training goes on.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dp_strategies.core.fault_tolerance import Survivors
from lightning_dp_strategies.core.handover import Plan, handover_plan, takeover_plan
from lightning_dp_strategies.local_sgd.replicas import InnerStates, Pending, Replicas, exchange, start_exchange
from lightning_dp_strategies.strategies.control import all_reduce

__all__ = ["HandOvers", "Period", "Step"]


@dataclass(frozen=True)
class Step:
    """One inner step as a replay repeats it: the micro-batch's position (sampler epoch, ``batch_idx``) and every
    parameter group's settings but its parameters (the learning rate a scheduler set for that step, ...)."""

    epoch: int
    batch_idx: int
    settings: list[dict[str, Any]]


@dataclass
class Period:
    """The inner steps between two synchronisations, and the parameters (the anchor) and buffers they started from."""

    anchor: list[Tensor]
    buffers: list[Tensor]
    steps: list[Step] = field(default_factory=list)


class HandOvers:
    """The inner states handed to this rank, the hand-over in flight, and the periods a replay from them trains (see
    the module docstring). ``replicas`` are this rank's (their states are sent beside its own)."""

    def __init__(self, survivors: Survivors, replicas: Replicas, rank: int) -> None:
        self.survivors, self.replicas, self.rank = survivors, replicas, rank
        self.handed: InnerStates = {}
        """The states handed to this rank that every member received: what a lost rank is rebuilt from."""
        self.point = 0
        """Where :attr:`handed` was taken: synchronisations since the last :meth:`hand_over`."""
        self.periods: list[Period] = []
        """The periods completed since :attr:`handed`'s point: a replay trains them before the current."""
        self._flight: Pending | None = None
        self._flight_point = 0  # the point the states in flight were taken at: after the last of `periods`
        self._arrived: InnerStates | None = None

    def hand_over(self) -> None:
        """Hand the states over now and wait for them (collective over the survivors): they become :attr:`handed`,
        and the points count from here."""
        received = self._received(self._start().wait(self.survivors.interrupted))
        self.handed, self.point, self.periods, self._flight, self._arrived = received, 0, [], None, None

    def start_alike(self) -> None:
        """At a fresh start, where every rank's inner state is the optimizer's initial one and alike on every rank:
        the states this rank keeps become copies of its own, which is what :meth:`hand_over` would receive, without
        communicating (so no loss at the start can leave a state unkept)."""
        own = self.replicas.states(self.rank)[self.rank]
        kept = [r for targets in self._plan().values() for r in targets.get(self.rank, [])]
        self.handed = {r: copy.deepcopy(own) for r in kept}
        self.point, self.periods, self._flight, self._arrived = 0, [], None, None

    def finish(self) -> None:
        """Before a synchronisation averages: wait for the states in flight (polled)."""
        if self._flight is not None and self._arrived is None:
            self._arrived = self._received(self._flight.wait(self.survivors.interrupted))

    def commit(self, ended: Period | None) -> None:
        """Once every member has a synchronisation's average: the states that arrived become :attr:`handed`, and this
        synchronisation's start on their way. ``ended`` is the period this synchronisation ends, which a replay from
        :attr:`handed` trains until they have arrived everywhere (``None``: it is the last of :attr:`periods`
        already, and the states it ended on are sent again, as after a recovery that lost them in flight)."""
        if self._arrived is not None:
            self._promote(self._flight_point, self._arrived)
        self._flight, self._arrived = None, None
        if ended is not None:
            self.periods.append(ended)
        self._flight_point = self.point + len(self.periods)
        self._flight = self._start()  # a peer lost here: the recovery replays the periods from `handed`

    def settle(self) -> None:
        """In a recovery (collective over the survivors): every survivor takes the newest states all of them hold,
        as :attr:`handed` (those in flight where every survivor received them), and the periods since.

        A rank holds :attr:`handed` and the states that arrived; the survivors agree on the least of their newest
        points. An earlier recovery or synchronisation that completed on some survivors only leaves them at most one
        point apart, each still holding the point agreed on, so redoing a recovery cut short by another loss agrees
        on what it agreed before.

        Raises:
            RuntimeError: if this rank does not hold the agreed point (the survivors' records disagree).
        """
        survivors = self.survivors
        assert survivors.group is not None
        if self._flight is not None and self._arrived is None and self._flight.arrived():
            self._arrived = self._received(self._flight.wait())
        newest = self._flight_point if self._arrived is not None else self.point
        agreed = int(all_reduce(torch.tensor([newest]), dist.ReduceOp.MIN, survivors.group, survivors.interrupted))
        if agreed != self.point:
            if self._arrived is None or agreed != self._flight_point:
                raise RuntimeError(
                    f"The survivors agreed to rebuild lost ranks from the inner states of point {agreed}, which rank "
                    f"{self.rank} does not hold (it holds {sorted({self.point, newest})}): their hand-over records "
                    "disagree. Resume from the last checkpoint."
                )
            self._promote(agreed, self._arrived)
        self._flight, self._arrived = None, None

    def _promote(self, point: int, states: InnerStates) -> None:
        """``states``, taken at ``point``, become :attr:`handed`; the periods before it are dropped."""
        self.periods = self.periods[point - self.point :]
        self.handed, self.point = states, point

    def wait_quietly(self) -> None:
        """:meth:`finish`, a peer lost meanwhile left to the next recovery (before an admission, at the end)."""
        try:
            self.finish()
        except RuntimeError:  # the backend's error or PeerLostError: the states stay in flight for settle to see
            pass

    def _start(self) -> Pending:
        """Start sending every logical rank's inner state trained here to the members that keep it."""
        survivors, replicas = self.survivors, self.replicas
        assert survivors.group is not None
        plan = self._plan()
        states = replicas.states(self.rank)
        outgoing = {dst: {r: states[r] for r in held} for dst, held in plan.get(self.rank, {}).items()}
        sources = [src for src, targets in plan.items() if self.rank in targets]
        return start_exchange(outgoing, sources, survivors.group, survivors.interrupted)

    def _plan(self) -> Plan:
        """Who keeps whose inner states among the current members (:func:`handover_plan`)."""
        survivors = self.survivors
        return handover_plan(survivors.members, survivors.world_size, survivors.options.state_copies)

    @staticmethod
    def _received(parts: dict[int, Any]) -> InnerStates:
        return {r: state for part in parts.values() for r, state in part.items()}

    def take_over(self, needed: list[int]) -> tuple[InnerStates, dict[int, Any]]:
        """What this rank needs to train the ``needed`` logical ranks (those it now trains and did not before): the
        states of :attr:`handed` other survivors kept, and the replicas other survivors trained until now, which
        this rank's replicas of them replace (:func:`takeover_plan`; collective over the survivors: who trains, keeps
        and needs which, then the states and replicas). A replica this rank gives away is dropped once the exchange
        completed here; where another loss cut it short first, the redone recovery gives it again if its taker did
        not receive it; if its taker did, the two copies are equal (nothing trained in between) and the recovery
        drops this rank's, which its new share no longer holds.

        Raises:
            RuntimeError: on every survivor, where a logical rank needed was trained and kept by lost ranks only.
        """
        survivors, replicas, handed = self.survivors, self.replicas, self.handed
        assert survivors.group is not None
        others = [m for m in survivors.members if m != self.rank]
        mine = (sorted(handed), sorted(replicas.shadows), needed)
        told = {**exchange({m: mine for m in others}, others, survivors.group, survivors.interrupted), self.rank: mine}
        moves, sends, missing = takeover_plan(
            {m: t for m, (_, t, _) in told.items()},
            {m: k for m, (k, _, _) in told.items()},
            {m: n for m, (_, _, n) in told.items()},
        )
        if missing:
            copies = survivors.options.state_copies
            raise RuntimeError(
                f"Logical rank(s) {missing} cannot be rebuilt: the rank that trained it and the next {copies} "
                "member(s) in rank order, which kept its inner optimizer state, were all lost. Resume from the last "
                "checkpoint; to survive more ranks lost at once, pass "
                f"`fault_tolerant=FaultTolerance(state_copies={copies + 1})` (or `keep_global_batch=False`)."
            )
        outgoing: dict[int, dict[str, dict[int, Any]]] = {}
        for dst, logicals in sends.get(self.rank, {}).items():
            outgoing.setdefault(dst, {"kept": {}, "moved": {}})["kept"].update({r: handed[r] for r in logicals})
        for dst, logicals in moves.get(self.rank, {}).items():
            outgoing.setdefault(dst, {"kept": {}, "moved": {}})["moved"].update({r: replicas.give(r) for r in logicals})
        sources = sorted({src for plan in (moves, sends) for src, targets in plan.items() if self.rank in targets})
        received = exchange(outgoing, sources, survivors.group, survivors.interrupted)
        for logical in (r for targets in moves.get(self.rank, {}).values() for r in targets):
            del replicas.shadows[logical]  # sent: its new taker trains it from now on
        kept = {r: state for part in received.values() for r, state in part["kept"].items()}
        return kept, {r: replica for part in received.values() for r, replica in part["moved"].items()}
