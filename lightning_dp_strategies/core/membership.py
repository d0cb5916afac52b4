"""Who is still alive after a collective failed: the survivors' agreement, their new group, the lost rank's share.

A failure is detected by a collective that raises: on gloo (torch 2.13) a peer killed outright makes the ranks that
talk to it directly raise at once (``Connection closed by peer``), while the others, and every rank when a peer hangs
or its link is cut, raise after the process group's timeout (``Timed out waiting <timeout>ms for recv/send``). So
the group that training runs its collectives on is made with a short timeout (:meth:`Membership.form_group`), and
:func:`detect` tells a peer's failure from other errors. Then every survivor calls :meth:`Membership.recover` (or
:meth:`Membership.agree` and :meth:`Membership.form_group` itself)::

    rank r (any survivor)                               the job's store, under <prefix>/<epoch>/
    set alive/<r>                                       ─▶ alive/0, alive/2, ...
    poll until all current members are alive, or
    `timeout` has passed since r began waiting
    compare_set(decided, "", <the alive ranks seen>)    the first rank to get there writes it; the store keeps one
    read decided                                        ─▶ the same sorted list on every rank
    dist.new_group(decided, use_local_synchronization=True, timeout): only the survivors take part

With heartbeats (:meth:`Membership.start_heartbeat`: a thread adds one to ``heartbeat/<r>`` every ``heartbeat_s``),
a member that has not announced itself is also left out once its counter has not moved for ``stale_s``: a killed
process or a node whose link is cut stops beating, so the survivors decide within about ``stale_s`` instead of at the
agreement's timeout; a hung process whose threads still run keeps beating and is left out at the timeout. While it
beats, the objects alive when it started are frozen out of the garbage collector's reach (:mod:`.frozen_heap`): a full
collection holds the GIL, and over a large heap on a loaded host it would stop the beats for seconds. The same
counters let a survivor that is still waiting in a collective notice the failure (:meth:`Membership.interrupted`)
before its own collective times out.

The decision is the store's: ``compare_set`` is atomic, so every rank reads the list the first decider wrote. A rank
that is slow but alive and announces itself after that is not in it and gets :class:`ExcludedError` (it should
exit; a replacement joins later). A rank that announced itself and then dies is in the list: forming the group, or
the next collective on it, fails within ``timeout``, and the survivors agree again under the next epoch. ``timeout``
must therefore exceed the spread of the survivors' detection times (up to the group's collective timeout: a rank
that is not the dead one's neighbour only learns of it by timing out).

The store must outlive every worker (torchrun's agent store does; a store hosted by rank 0, as Lightning's own
launcher makes it, dies with rank 0), and must be this attempt's of the job (see :mod:`.elastic`): the keys of one
epoch are written once.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from lightning_dp_strategies.comm.failures import PeerFailure, PeerLostError, detect, is_peer_failure
from lightning_dp_strategies.core import frozen_heap

__all__ = [
    "ExcludedError",
    "Membership",
    "MembershipConfig",
    "MembershipState",
    "MembershipStats",
    "PeerFailure",
    "PeerLostError",
    "detect",
    "is_peer_failure",
    "logical_shares",
]


class ExcludedError(RuntimeError):
    """This rank answered the membership agreement too late: the survivors went on without it."""


def logical_shares(live: list[int], world_size: int) -> dict[int, list[int]]:
    """The original world's logical ranks (the data sampler's) spread over the live ranks.

    Each live rank keeps its own logical rank; each lost one goes to the live rank with the fewest shares so far (the
    lowest rank on a tie), so the shares differ by at most one. The global batch stays that of ``world_size`` ranks:
    a live rank trains one micro-batch per logical rank it holds and accumulates them.

    Examples:
        >>> logical_shares([0, 2], 3)
        {0: [0, 1], 2: [2]}
        >>> logical_shares([1, 2], 3)
        {1: [0, 1], 2: [2]}
        >>> logical_shares([0, 3], 4)
        {0: [0, 1], 3: [2, 3]}
        >>> logical_shares([0, 1, 2], 3)
        {0: [0], 1: [1], 2: [2]}

    Raises:
        ValueError: if ``live`` is empty, repeats a rank, or names one outside ``range(world_size)``.
    """
    if not live or len(set(live)) != len(live) or not all(0 <= r < world_size for r in live):
        raise ValueError(
            f"`live` must be distinct ranks of the original world 0..{world_size - 1}, at least one, got {live}."
        )
    shares = {rank: [rank] for rank in sorted(live)}
    for lost in (r for r in range(world_size) if r not in shares):
        taker = min(shares, key=lambda rank: (len(shares[rank]), rank))
        shares[taker].append(lost)
    return {rank: sorted(held) for rank, held in shares.items()}


@dataclass(frozen=True)
class MembershipConfig:
    """Where the agreement meets in the store, and how often it looks."""

    prefix: str = "lightning_dp_strategies/membership"
    poll_s: float = 0.02
    heartbeat_s: float = 0.5
    """How often :meth:`Membership.start_heartbeat`'s thread beats."""
    stale_s: float = 5.0
    """A member whose beats stopped this long is taken for gone (only members that have beaten at least once)."""
    freeze_heap: bool = True
    """Freeze the objects alive when beating starts out of the garbage collector's reach until it stops (see
    :mod:`.frozen_heap`), so that a full collection cannot stop the beats for longer than ``stale_s``."""


@dataclass
class MembershipState:
    """The current epoch, its members (original global ranks, sorted) and the group over them."""

    epoch: int
    members: list[int]
    group: dist.ProcessGroup | None = None


@dataclass
class MembershipStats:
    """How long each agreement and each group formation took, in seconds, in order."""

    agreements_s: list[float] = field(default_factory=list)
    formations_s: list[float] = field(default_factory=list)


class Membership:
    """The live ranks of a job that goes on after losing some, and the process group over them.

    Args:
        store: the job's store, outliving every worker and this attempt's own (see the module docstring).
        rank: this process's original global rank.
        world_size: the original world size.
        config: where the keys live and how often the store is polled.

    Examples:
        >>> membership = Membership(dist.HashStore(), 0, 1)
        >>> membership.agree(1, timedelta(seconds=1)), membership.leader
        ([0], 0)
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, config: MembershipConfig | None = None) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"`rank` must be in 0..{world_size - 1} (the original world), got {rank}.")
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.config = config or MembershipConfig()
        self.state = MembershipState(epoch=0, members=list(range(world_size)))
        self.stats = MembershipStats()
        self.heartbeat_error: BaseException | None = None
        """What stopped this rank's heartbeat thread (the store out of reach), if anything did."""
        self._beating = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._seen: dict[int, tuple[int, float]] = {}  # member -> (last counter read, when it last changed)
        self._last_beat = time.monotonic()  # when a beat last reached the store
        self._observed: tuple[int, str | None] = (0, None)  # (epoch, what the heartbeat thread saw then)
        self._holds_heap = False  # whether this rank's beating holds the heap frozen

    @property
    def leader(self) -> int:
        """The lowest live original rank: it logs, writes checkpoints and decides what rank 0 used to."""
        return self.state.members[0]

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The group over the current members, once :meth:`form_group` made it."""
        return self.state.group

    # ------------------------------------------------------------------ heartbeats
    def _heartbeat_key(self, rank: int) -> str:
        return f"{self.config.prefix}/heartbeat/{rank}"

    def start_heartbeat(self) -> None:
        """Beat in a daemon thread from now to :meth:`stop_heartbeat` (one beat at once, so peers see this rank)."""
        if self._heartbeat is not None:
            return
        if self.config.freeze_heap and not self._holds_heap:
            frozen_heap.freeze_heap()
            self._holds_heap = True
        self.store.add(self._heartbeat_key(self.rank), 1)
        self._last_beat = time.monotonic()
        self._beating.set()
        self._heartbeat = threading.Thread(target=self._beat, name="ldps-heartbeat", daemon=True)
        self._heartbeat.start()

    def _beat(self) -> None:
        """Beat, then look at the peers for :meth:`interrupted` (so that the training thread never waits on the
        store: where the link is cut, a store call blocks until the store's own timeout)."""
        key = self._heartbeat_key(self.rank)
        while True:
            time.sleep(self.config.heartbeat_s)
            if not self._beating.is_set():
                return
            try:
                self.store.add(key, 1)
                self._last_beat = time.monotonic()
                epoch = self.state.epoch
                self._observed = (epoch, self._observe())
            except Exception as error:  # the store is out of reach: the peers will take this rank for gone
                self.heartbeat_error = error

    def cut_off(self) -> float | None:
        """Seconds since this rank's last beat reached the store, where that is over ``stale_s`` (its link is down
        or the store's host gone: the others are taking it for gone); ``None`` otherwise or without heartbeats."""
        if self._heartbeat is None:
            return None
        since = time.monotonic() - self._last_beat
        return since if since > self.config.stale_s else None

    def rejoin(self, epoch: int) -> None:
        """The whole original world is a member again from membership ``epoch`` on (replacements joined). Every
        member is watched afresh, ``stale_s`` from now: a replacement's counter would otherwise be judged by the
        last beat of the process it replaces, and taken for gone before its own first beat."""
        self._seen.clear()
        self.state = MembershipState(epoch=epoch, members=list(range(self.world_size)))

    def stop_heartbeat(self) -> None:
        """Stop beating (peers take this rank for gone ``stale_s`` later) and give up the hold on the frozen heap."""
        self._beating.clear()
        self._heartbeat = None
        if self._holds_heap:
            self._holds_heap = False
            frozen_heap.thaw_heap()

    def stale(self, ranks: list[int]) -> list[int]:
        """Those of ``ranks`` whose heartbeat has not moved for ``stale_s`` as this rank watched it (a rank that
        never beat is never stale). Each call reads every counter once."""
        now, gone = time.monotonic(), []
        for rank in ranks:
            key = self._heartbeat_key(rank)
            if rank == self.rank or not self.store.check([key]):
                continue
            count = self.store.add(key, 0)
            last = self._seen.get(rank)
            if last is None or last[0] != count:
                self._seen[rank] = (count, now)
            elif now - last[1] >= self.config.stale_s:
                gone.append(rank)
        return gone

    def beating(self, ranks: list[int]) -> list[int]:
        """Those of ``ranks`` (this rank aside) that have beaten and are not :meth:`stale`."""
        gone = set(self.stale(ranks))
        keyed = [r for r in ranks if r != self.rank and self.store.check([self._heartbeat_key(r)])]
        return [r for r in keyed if r not in gone]

    def interrupted(self) -> str | None:
        """Why a collective in flight on the current group cannot complete, or ``None``: a survivor has begun the
        next agreement (it saw a peer fail), a member's heartbeat stopped, or this rank's own beats no longer reach
        the store. Polled while waiting; with heartbeats it reads what the heartbeat thread last saw (never the store).
        """
        if self._heartbeat is None:
            return self._observe()
        since = self.cut_off()
        if since is not None:
            return f"this rank's heartbeat has not reached the job's store for {since:.1f} s"
        epoch, reason = self._observed
        return reason if epoch == self.state.epoch else None

    def _observe(self) -> str | None:
        base = f"{self.config.prefix}/{self.state.epoch + 1}"
        started = [r for r in self.state.members if self.store.check([f"{base}/alive/{r}"])]
        if started:
            return f"rank {started[0]} began the membership agreement of epoch {self.state.epoch + 1}"
        gone = self.stale(self.state.members)
        if gone:
            return f"no heartbeat from rank(s) {gone} for {self.config.stale_s:g} s"
        return None

    def shares(self) -> list[int]:
        """The logical ranks this rank trains now (see :func:`logical_shares`)."""
        return logical_shares(self.state.members, self.world_size)[self.rank]

    def agree(self, epoch: int, timeout: timedelta | float, note: str = "1") -> list[int]:
        """The sorted live original ranks, the same on every survivor (a collective over the store).

        Every survivor of the current members calls it with the same ``epoch``, one past the current one. It waits
        until all current members announced themselves, or ``timeout`` (seconds or a ``timedelta``) since it began.
        ``note`` is announced with this rank (:meth:`notes` reads the survivors' afterwards: e.g. their steps).

        Raises:
            ValueError: if ``epoch`` is not one past the current epoch.
            ExcludedError: if this rank announced itself after the survivors had decided without it.
        """
        if epoch != self.state.epoch + 1:
            raise ValueError(
                f"`epoch` must be one past the current epoch {self.state.epoch}, got {epoch}: every survivor passes "
                "`membership.state.epoch + 1` (or calls `membership.recover(timeout)`)."
            )
        start = time.monotonic()
        base = f"{self.config.prefix}/{epoch}"
        self.store.set(f"{base}/alive/{self.rank}", note)
        decided = self._decide(base, _seconds(timeout))
        self.stats.agreements_s.append(time.monotonic() - start)
        if self.rank not in decided:
            raise ExcludedError(
                f"Rank {self.rank} answered the membership agreement of epoch {epoch} after the survivors {decided} "
                "had decided without it (it was hung, or detected the failure later than `timeout` allows). Exit "
                "this process; raise the agreement's `timeout` above the group's collective timeout if it was alive."
            )
        self.state = MembershipState(epoch=epoch, members=decided)
        return decided

    def _decide(self, base: str, timeout_s: float) -> list[int]:
        """Wait for the members' announcements under ``base``; the list the first decider wrote there."""
        deadline = time.monotonic() + timeout_s
        members = self.state.members
        decided_key = f"{base}/decided"
        while not self.store.check([decided_key]):
            alive = [r for r in members if self.store.check([f"{base}/alive/{r}"])]
            missing = [r for r in members if r not in alive]
            gone = set(self.stale(missing)) if missing else set()
            if len(alive) + len(gone) == len(members) or time.monotonic() >= deadline:
                written = self.store.compare_set(decided_key, "", ",".join(map(str, alive)))
                return [int(r) for r in written.decode().split(",")]
            time.sleep(self.config.poll_s)
        return [int(r) for r in self.store.get(decided_key).decode().split(",")]

    def notes(self) -> dict[int, str]:
        """What each current member announced with itself in the agreement of the current epoch."""
        base = f"{self.config.prefix}/{self.state.epoch}/alive"
        return {r: self.store.get(f"{base}/{r}").decode() for r in self.state.members}

    def form_group(self, live: list[int], epoch: int, timeout: timedelta | float) -> dist.ProcessGroup:
        """A gloo group over ``live`` only, made without the default (WORLD) group, with collective timeout ``timeout``.

        Every rank of ``live`` calls it; the group keeps the original global ranks (``dist.get_rank()`` and the
        ``group_dst``/``dst`` translations work as on any ``new_group``). ``timeout`` bounds the formation too, and
        is the failure detection's bound for every collective on the group. Epoch 0 is the group over the whole
        original world, made at setup.

        Raises:
            RuntimeError: if no default process group is initialised (``torch.distributed.new_group`` needs one).
            ValueError: if this rank is not in ``live`` or ``epoch`` is not the current one.
        """
        if not dist.is_initialized():
            raise RuntimeError(
                "Membership.form_group needs the default process group: call `torch.distributed.init_process_group` "
                "(its store must outlive every worker) before forming the survivors' group."
            )
        if self.rank not in live or epoch != self.state.epoch:
            raise ValueError(
                f"Rank {self.rank} at epoch {self.state.epoch} cannot form the group of {live} at epoch {epoch}: call "
                "it with the list `agree` returned and `membership.state.epoch`, on the ranks of that list only."
            )
        start = time.monotonic()
        group = dist.new_group(
            sorted(live), timeout=_timedelta(timeout), backend="gloo", use_local_synchronization=True
        )
        assert group is not None  # this rank is in `live`
        self.stats.formations_s.append(time.monotonic() - start)
        self.state = MembershipState(epoch=epoch, members=sorted(live), group=group)
        return group

    def recover(self, timeout: timedelta | float, agreement: float | None = None, note: str = "1") -> dist.ProcessGroup:
        """After a peer failure: agree on the survivors under the next epoch and form their group.

        ``timeout`` is the new group's collective timeout (the detection's bound, as the failed group's); the
        agreement waits twice as long, since one survivor may learn of the failure up to one timeout after another
        (unless ``agreement`` says otherwise: with heartbeats and :meth:`interrupted` polled, the survivors join
        within a poll of each other).
        """
        live = self.agree(self.state.epoch + 1, 2 * _seconds(timeout) if agreement is None else agreement, note)
        return self.form_group(live, self.state.epoch, timeout)


def _seconds(timeout: timedelta | float) -> float:
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


def _timedelta(timeout: timedelta | float) -> timedelta:
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
