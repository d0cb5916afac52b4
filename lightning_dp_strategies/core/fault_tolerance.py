"""Training that goes on when a rank is lost: the survivors' groups, the lost ranks' batches, one record a failure.

A strategy with ``fault_tolerant=True`` holds one :class:`Survivors` and calls it at fixed points::

    setup_distributed   start(rank, world_size, timeout)     the gradient group (short timeout), the control group
                                                              (Lightning's collectives), a heartbeat thread
    each gradient wait  interrupted()                        polled: gives up the wait once a peer is known lost
    a peer failure      recover(step, error)                 survivors agree (store), new groups, a Recovery record
    each backward       lost_batches(batch_idx)              the lost logical ranks' batches this rank trains too
                        grad_scale                           members / world size with the global batch kept
    teardown            close()                              heartbeat stopped, the metrics' groups put back

The global batch stays the uninterrupted run's: the data sampler's logical ranks outlive the processes
(:func:`~lightning_dp_strategies.core.membership.logical_shares`), a survivor accumulates the micro-batch of every
logical rank it holds, and the averaged gradient is scaled by ``members / world_size`` so it is the mean over the
original world's micro-batches.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import nn

from lightning_dp_strategies.core.elastic import running_attempt_store
from lightning_dp_strategies.core.fault_tolerance_options import (
    FaultTolerance,
    check_fault_tolerance,
    check_local_fault_tolerance,
)
from lightning_dp_strategies.core.lost_batches import LostBatches
from lightning_dp_strategies.core.membership import ExcludedError, Membership, MembershipConfig

__all__ = [
    "JOIN_ENV",
    "Admission",
    "FaultTolerance",
    "LostBatches",
    "Recovery",
    "Survivors",
    "check_fault_tolerance",
    "check_local_fault_tolerance",
    "join_running_job",
    "request_join",
    "wants_to_join",
]

_log = logging.getLogger("lightning_dp_strategies")

PREFIX = "lightning_dp_strategies/survivors"
"""Where the membership's keys live in the job's store."""


@dataclass(frozen=True)
class Recovery:
    """One failure the survivors went on from."""

    step: int
    """The optimizer step (``trainer.global_step``) that was redone."""
    lost: list[int]
    members: list[int]
    """The original global ranks that went on."""
    reason: str
    """What the failed collective said (first line)."""
    agreement_s: float
    formation_s: float
    behind: list[int] = field(default_factory=list)
    """Survivors whose step failed while the others' completed (in a later step, or in the synchronisation that
    ends it): they take the step's result from a survivor that completed it, or redo it (local SGD)."""
    behind_control: list[int] = field(default_factory=list)
    """Survivors of the furthest step one control collective (between steps) behind: they take its result."""
    missed: list[int] = field(default_factory=list)
    """Survivors one step behind that also lack the furthest ones' last control collective (it failed on them only,
    in their step): they take its result."""
    lagging: list[int] = field(default_factory=list)
    """In a synchronisation: the survivors without the average that the furthest ones have."""
    control: int = 0
    """The most control collectives a survivor of the furthest step had completed."""
    at: float = field(default_factory=time.time)
    """When the survivors' groups were ready (``time.time()``)."""


JOIN_ENV = "LDPS_JOIN"
"""Set to ``1`` in a process started to replace a lost rank of a running ``fault_tolerant`` job."""


RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"
"""Set by torchrun's agent in the workers it starts: above ``0`` in a worker it restarted (``--max-restarts``)."""


def wants_to_join() -> bool:
    """Whether this process was started as a replacement (``LDPS_JOIN=1``)."""
    return os.environ.get(JOIN_ENV) == "1"


def restarted_into_running_job(rank: int, world_size: int, options: FaultTolerance, timeout: timedelta) -> bool:
    """Whether this process is a worker that torchrun's agent restarted while the rest of its job trains on: some
    other rank's heartbeat moves in the running attempt's store within ``stale_s``. Such a worker joins as a
    replacement, as with ``LDPS_JOIN=1``. After a restart of the whole job no heartbeat moves (nor in a first
    attempt, which is never a restart), and it starts as usual.

    Examples:
        >>> restarted_into_running_job(0, 2, FaultTolerance(), timedelta(seconds=1))  # not restarted by torchrun
        False
    """
    if int(os.environ.get(RESTART_ENV) or 0) == 0:
        return False
    store = running_attempt_store("ft/", timeout)  # the attempt whose workers may still train
    if store is None:
        return False
    watcher, ranks = _outside_watcher(store, rank, world_size, options), list(range(world_size))
    if not watcher.beating(ranks):  # no other rank ever beat in that attempt
        return False
    time.sleep(options.stale_s)  # a rank whose counter did not move meanwhile is stale
    return bool(watcher.beating(ranks))


def _outside_watcher(store: dist.Store, rank: int, world_size: int, options: FaultTolerance) -> Membership:
    """A :class:`Membership` that watches the running job's heartbeats from outside it (a process about to join)."""
    config = MembershipConfig(prefix=PREFIX, heartbeat_s=options.heartbeat_s, stale_s=options.stale_s)
    return Membership(store, rank, world_size, config)


@dataclass(frozen=True)
class Admission:
    """What a replacement is told: the membership epoch it joins at, the leader and every rank joining with it."""

    epoch: int
    leader: int
    joining: list[int]


def request_join(store: dist.Store, rank: int, world_size: int, options: FaultTolerance) -> Admission | None:
    """Ask the running job to take this process in as ``rank``; its answer, which comes at the survivors' next epoch
    start (however long the epoch: it waits while the job trains on), or ``None`` once no other rank's heartbeat has
    moved for ``stale_s``: the job ended before it answered."""
    token = uuid.uuid4().hex
    store.set(f"{PREFIX}/join/{rank}", token)
    _log.warning("Rank %d asked the running job to take it in; it is admitted at the job's next epoch start.", rank)
    answer, watcher = f"{PREFIX}/admitted/{token}", _outside_watcher(store, rank, world_size, options)
    while not store.check([answer]):
        if not watcher.beating(list(range(world_size))):
            return None
        time.sleep(options.heartbeat_s)
    epoch, leader, joining = store.get(answer).decode().split(";")
    return Admission(int(epoch), int(leader), [int(r) for r in joining.split(",")])


def join_running_job(
    rank: int, world_size: int, options: FaultTolerance, timeout: timedelta
) -> tuple[dist.Store, Admission] | None:
    """A replacement's admission as ``rank`` into the running attempt of its job: that attempt's store and the answer;
    ``None`` in a worker torchrun restarted whose job ended before answering (the whole job restarts: it starts as
    usual).

    Raises:
        RuntimeError: outside torchrun's agent store, or with ``LDPS_JOIN=1`` when the job ended first.
    """
    store = running_attempt_store("ft/", timeout)
    if store is None:
        raise RuntimeError(
            f"{JOIN_ENV}=1: a replacement joins a fault-tolerant job through torchrun's agent store "
            "(TORCHELASTIC_USE_AGENT_STORE=True, MASTER_ADDR:MASTER_PORT): start it with the job's torchrun "
            "command on the replacement node, with that node's --node-rank."
        )
    admission = request_join(store, rank, world_size, options)
    if admission is None and wants_to_join():
        raise RuntimeError(
            f"{JOIN_ENV}=1: the job this replacement asked to join ended before admitting it (no rank's heartbeat "
            f"moved for stale_s={options.stale_s} s). Start the whole job again, without {JOIN_ENV}."
        )
    return None if admission is None else (store, admission)


class Survivors:
    """The live ranks of a fault-tolerant run, their groups, and what a survivor does for the lost ones.

    Examples:
        >>> survivors = Survivors(FaultTolerance())
        >>> survivors.started, survivors.grad_scale, survivors.lost_ranks()
        (False, 1.0, [])
    """

    def __init__(self, options: FaultTolerance) -> None:
        self.options = options
        self.membership: Membership | None = None
        self.group: dist.ProcessGroup | None = None
        """The gradient group: the members, collective timeout ``timeout_s``."""
        self.control_group: dist.ProcessGroup | None = None
        """The members again, with the strategy's long timeout: barriers, broadcasts, metric and log syncs."""
        self.recoveries: list[Recovery] = []
        self.batches: LostBatches | None = None
        self._metric_groups: dict[int, tuple[Any, object]] = {}  # id -> (metric, its own process_group)
        self._control_timeout = timedelta(minutes=30)

    @property
    def started(self) -> bool:
        return self.membership is not None

    @property
    def members(self) -> list[int]:
        return self.membership.state.members if self.membership is not None else []

    @property
    def leader(self) -> int:
        """The lowest live original rank: it writes checkpoints and answers for rank 0."""
        return self.membership.leader if self.membership is not None else 0

    @property
    def world_size(self) -> int:
        return self.membership.world_size if self.membership is not None else 1

    @property
    def grad_scale(self) -> float:
        """What the survivors' averaged gradient is multiplied by: ``members / world_size`` while the global batch is
        kept and ranks are missing (each survivor's gradient then sums several micro-batches), else 1."""
        if self.membership is None or not self.options.keep_global_batch:
            return 1.0
        return len(self.members) / self.world_size

    def start(self, store: dist.Store, rank: int, world_size: int, control_timeout: timedelta, epoch: int = 0) -> None:
        """Form the gradient and control groups over the whole world and start beating (every rank, at setup; a
        replacement at the ``epoch`` it was admitted at)."""
        config = MembershipConfig(
            prefix=PREFIX,
            heartbeat_s=self.options.heartbeat_s,
            stale_s=self.options.stale_s,
            poll_s=0.02,
            freeze_heap=self.options.freeze_heap,
        )
        self.membership = Membership(store, rank, world_size, config)
        self._control_timeout = control_timeout
        self.readmit(epoch)
        self.membership.start_heartbeat()

    def readmit(self, epoch: int) -> None:
        """The whole original world is back (replacements joined) from membership ``epoch`` on: new groups over it."""
        membership = self.membership
        assert membership is not None
        membership.rejoin(epoch)
        self.group = membership.form_group(membership.state.members, epoch, self.options.timeout_s)
        self._form_control_group()

    # ------------------------------------------------------------------ replacements
    def join_requests(self) -> dict[int, str]:
        """The lost ranks a replacement has asked to take over (rank -> its token), read from the store."""
        membership = self.membership
        assert membership is not None
        missing = [r for r in range(membership.world_size) if r not in membership.state.members]
        keys = {r: f"{PREFIX}/join/{r}" for r in missing}
        return {r: membership.store.get(k).decode() for r, k in keys.items() if membership.store.check([k])}

    def admit(self, requests: dict[int, str], epoch: int) -> None:
        """Tell the replacements they join at membership ``epoch`` (the leader, once the survivors agreed)."""
        membership = self.membership
        assert membership is not None
        answer = f"{epoch};{membership.leader};{','.join(map(str, sorted(requests)))}"
        for rank, token in requests.items():
            membership.store.delete_key(f"{PREFIX}/join/{rank}")
            membership.store.set(f"{PREFIX}/admitted/{token}", answer)

    def _form_control_group(self) -> None:
        """The control group over the current members; the watched metrics sync over it from now on."""
        group = dist.new_group(
            self.members, timeout=self._control_timeout, backend="gloo", use_local_synchronization=True
        )
        assert group is not None
        self.control_group = group
        for metric, _ in self._metric_groups.values():
            metric.process_group = group

    def interrupted(self) -> str | None:
        """Polled while waiting for the gradients: why the wait cannot complete (a peer known lost), or ``None``."""
        return self.membership.interrupted() if self.membership is not None else None

    def recover(
        self, step: int, error: BaseException, progress: int | None = None, control: int | None = None
    ) -> Recovery:
        """After a peer failure in optimizer step ``step``: agree on the survivors, form their groups, point the
        metrics at them. A collective can complete on some ranks and fail on others: the record names the survivors
        one step behind (``behind``), those of the furthest step with fewer ``control`` collectives completed
        (``behind_control``), and, in a synchronisation (``progress``: 1 without the average, 2 with it; 0 in the
        step), those without the average (``lagging``).

        Raises:
            ExcludedError: if the others went on without this rank (it should exit).
        """
        membership = self.membership
        assert membership is not None, "recover() before start()"
        since = membership.cut_off()
        if since is not None:
            raise ExcludedError(
                f"Rank {membership.rank} lost the job's store: its heartbeat has not reached it for {since:.1f} s "
                f"(this node's link is down, or the store's host is gone), so the other ranks go on without it. "
                "This process exits; the survivors finish the run."
            )
        before = list(membership.state.members)
        note = f"{step}/{progress or 0}/{control or 0}"
        self.group = membership.recover(self.options.timeout_s, agreement=self.options.timeout_s, note=note)
        notes = {rank: tuple(map(int, note.split("/"))) for rank, note in membership.notes().items()}
        at = {rank: (taken, made) for rank, (taken, made, _) in notes.items()}
        furthest = max(at.values())
        controls = {rank: done for rank, (taken, made, done) in notes.items() if (taken, made) == furthest}
        most = max(controls.values())
        behind = sorted(r for r, (taken, made) in at.items() if (taken, made) < furthest and made == 0)
        self._form_control_group()
        record = Recovery(
            step=furthest[0],
            lost=[r for r in before if r not in membership.state.members],
            members=list(membership.state.members),
            reason=str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__,
            agreement_s=membership.stats.agreements_s[-1],
            formation_s=membership.stats.formations_s[-1],
            behind=behind,
            behind_control=sorted(r for r, done in controls.items() if done < most),
            missed=[r for r in behind if notes[r][2] < most],
            lagging=sorted(r for r, (taken, made) in at.items() if (taken, made) < furthest and made > 0),
            control=most,
        )
        self.recoveries.append(record)
        if membership.rank == membership.leader:
            batch = "training the lost ranks' batches too" if self.options.keep_global_batch else "with a smaller batch"
            if record.lost:
                message = "Lost rank(s) %s at step %d (%s); ranks %s go on, %s."
                _log.warning(message, record.lost, step, record.reason, record.members, batch)
            else:
                message = "A collective failed at step %d (%s) with no rank lost; ranks %s try it again."
                _log.warning(message, step, record.reason, record.members)
        return record

    def lost_ranks(self) -> list[int]:
        """The lost logical ranks whose micro-batches this rank trains besides its own (keeping the global batch)."""
        if self.membership is None or not self.options.keep_global_batch:
            return []
        return [r for r in self.membership.shares() if r != self.membership.rank]

    def lost_batches(self, batch_idx: int) -> list[Any]:
        """Their batches ``batch_idx`` (those that exist)."""
        if self.batches is None:
            return []
        batches = (self.batches.batch(r, batch_idx) for r in self.lost_ranks())
        return [b for b in batches if b is not None]

    def use_loader(self, loader: object) -> None:
        """The train loader the lost ranks' batches are rebuilt from (checked now, so a bad one fails at start)."""
        if self.options.keep_global_batch:
            self.batches = LostBatches(loader)

    def watch_metrics(self, modules: Iterable[nn.Module], is_metric: Callable[[object], bool]) -> None:
        """Sync the torchmetrics metrics among ``modules`` over the control group from now on (their own
        ``process_group`` is put back by :meth:`close`)."""
        for module in modules:
            if is_metric(module) and id(module) not in self._metric_groups:
                self._metric_groups[id(module)] = (module, module.process_group)
                module.process_group = self.control_group  # type: ignore[assignment]

    def close(self) -> None:
        """Stop beating and give the metrics their own groups back."""
        if self.membership is not None:
            self.membership.stop_heartbeat()
        for metric, own in self._metric_groups.values():
            metric.process_group = own
        self._metric_groups = {}
