"""Gradient synchronisation as an object a strategy holds: groups, reducer, buckets, the no-sync flag, statistics.

A strategy (Trainer or Fabric) makes one :class:`GradientSync` and calls it at fixed points::

    setup        make_groups(partition, rank, backend, reducer)  ──▶  attach(named_parameters, caps)
    each pass    arm_or_skip()  ─ backward ─  finish()      (inside ``no_sync()``: accumulate locally)
    each step    record_step()                               (``step_stats``: that step's communication; a reducer
                                                              with ``observe_step`` is told the step's timing)
    teardown     close()  ──▶  destroy_groups()
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Generator, Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch import nn

from lightning_dp_strategies.bucketing.buckets import GradientBuckets
from lightning_dp_strategies.bucketing.stats import CommStats
from lightning_dp_strategies.comm.groups import new_group
from lightning_dp_strategies.reducers import Reducer, StepTiming, as_reducer, close_reducer, setup_reducer
from lightning_dp_strategies.reducers.thread import close_in_background

__all__ = ["GradientSync", "destroy_groups"]


def destroy_groups(groups: Iterable[object]) -> None:
    """Destroy the process groups a strategy made at setup, once each; ``None``, the placeholder a rank outside a
    group holds, and the default group (Lightning's) are skipped."""
    if not dist.is_initialized():
        return
    destroyed: set[int] = set()
    for group in groups:
        if isinstance(group, dist.ProcessGroup) and group is not dist.group.WORLD and id(group) not in destroyed:
            destroyed.add(id(group))
            dist.destroy_process_group(group)


@dataclass
class _Clock:
    """When this step's communicating backward began, and what its backward and waiting took so far (seconds)."""

    armed_at: float | None = None
    backward: float = 0.0
    exposed: float = 0.0
    last_step: float | None = None


class GradientSync:
    """The gradient averaging of one strategy: one process group per averaging group, the reducer, the buckets.

    Configuration is given to the methods that use it; the object holds runtime state (``groups``, ``group``,
    ``reducer``, ``buckets``, ``blocked``) and statistics (``step_stats``, ``totals``).

    Examples:
        >>> sync = GradientSync()
        >>> sync.arm_or_skip(); sync.finish()  # before setup: nothing to do
        >>> with sync.no_sync():
        ...     sync.blocked
        True
        >>> sync.blocked, sync.totals.synced_backwards
        (False, 0)
    """

    def __init__(self) -> None:
        # runtime state
        self.groups: list[dist.ProcessGroup] = []
        self.group: dist.ProcessGroup | None = None
        """This rank's averaging group (``None`` before setup, or when this rank averages with no one)."""
        self.reducer: Reducer | None = None
        self.buckets: GradientBuckets | None = None
        self.blocked = False
        """Inside :meth:`no_sync`: backward passes accumulate locally."""
        self.interrupt: Callable[[], str | None] | None = None
        """Polled while waiting for the buckets: a reason to give up the wait (a peer known lost), or ``None``."""
        # statistics
        self.step_stats = CommStats()
        """Communication of the last optimizer step (all backward passes since the previous step)."""
        self._step_start = CommStats()
        self._closed_totals = CommStats()
        self._earlier: CommStats | None = None  # the totals of the buckets dropped by :meth:`regroup`
        self._clock = _Clock()

    # ------------------------------------------------------------------ setup
    def make_groups(self, partition: Sequence[Sequence[int]], rank: int, backend: str | None, reducer: Reducer) -> None:
        """One dedicated group per list of ``partition`` (the global ranks that average together), then the
        reducer's own groups, on every rank in the same order; this rank's group kept.

        A dedicated group keeps the communication thread from interleaving with collectives the main thread issues
        on the default group (metric syncs, SyncBatchNorm, barriers).
        """
        self.groups = [new_group(ranks, backend) for ranks in partition]
        self.reducer = reducer
        for group, ranks in zip(self.groups, partition, strict=True):
            setup_reducer(reducer, group, list(ranks), backend)
        mine = [group for group, ranks in zip(self.groups, partition, strict=True) if rank in ranks]
        self.group = mine[0] if mine else None

    def use_group(self, group: dist.ProcessGroup, reducer: Reducer) -> None:
        """Average over ``group``, made and owned by the caller (not destroyed here), with ``reducer`` as it is: its
        ``setup`` is not run, so it makes no groups of its own (the fault-tolerant strategies' survivors' groups)."""
        self.groups, self.group, self.reducer = [], group, reducer

    def regroup(self, group: dist.ProcessGroup, reducer: Reducer) -> None:
        """After a peer failure: drop the buckets and the reducer without waiting for them, and average over
        ``group`` with ``reducer`` from now on; :meth:`attach` again before the next backward.

        The old reducer is closed in a background thread: a reduction it still runs on the failed group ends with
        that group's timeout. The running totals carry over."""
        old_buckets, old_reducer = self.buckets, self.reducer
        self._earlier = self.totals
        if old_buckets is not None:
            old_buckets.abort()
        self.buckets = None
        self._step_start = CommStats()
        close = old_buckets.close if old_buckets is not None else None
        if close is None and old_reducer is not None:
            close = functools.partial(close_reducer, old_reducer)
        if close is not None:
            close_in_background(close)
        self.use_group(group, reducer)

    def attach(
        self,
        named_params: Sequence[tuple[str, nn.Parameter]],
        bucket_cap_mb: float,
        first_bucket_cap_mb: float,
        allow_no_trainable: bool = False,
        timeout: timedelta | None = None,
    ) -> GradientBuckets:
        """Attach the gradient buckets to ``named_params``, averaging over this rank's group with the reducer."""
        self.buckets = GradientBuckets(
            named_params,
            group=self.group,
            reducer=self.reducer,
            bucket_cap_mb=bucket_cap_mb,
            first_bucket_cap_mb=first_bucket_cap_mb,
            allow_no_trainable=allow_no_trainable,
            timeout=timeout.total_seconds() if timeout is not None else None,
        )
        self.buckets.sync_blocked = self.blocked
        self.buckets.interrupt = self.interrupt
        return self.buckets

    # ------------------------------------------------------------------ each backward pass
    @contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """Backward passes inside accumulate gradients locally; the previous state comes back on exit (nesting)."""
        previous = self.blocked
        self.set_blocked(True)
        try:
            yield None
        finally:
            self.set_blocked(previous)

    def set_blocked(self, blocked: bool) -> None:
        self.blocked = blocked
        if self.buckets is not None:
            self.buckets.sync_blocked = blocked

    def arm_or_skip(self) -> None:
        """Before a backward pass: arm the buckets, or count a skipped one inside a no-sync block."""
        if self.buckets is None:
            return
        if self.blocked:
            self.buckets.skip()
        else:
            self.buckets.arm()
            self._clock.armed_at = time.perf_counter()

    def finish(self) -> None:
        """After a backward pass: wait until every ``.grad`` holds the average (nothing to do when skipped)."""
        if self.buckets is not None:
            clock, start = self._clock, time.perf_counter()
            self.buckets.finish()
            if clock.armed_at is not None:
                clock.backward += start - clock.armed_at
                clock.exposed += time.perf_counter() - start
                clock.armed_at = None

    def abort(self) -> None:
        """On an exception: drop the buckets' pending work so that nothing waits for it."""
        if self.buckets is not None:
            self.buckets.abort()

    # ------------------------------------------------------------------ statistics
    def record_step(self) -> None:
        """After an optimizer step: the communication since the previous one becomes :attr:`step_stats`."""
        if self.buckets is not None:
            self.step_stats = self.buckets.totals - self._step_start
            self._step_start = self.buckets.totals.copy()
        self._observe_step()

    def _observe_step(self) -> None:
        """Tell a reducer that watches the steps (``observe_step``, e.g. ``reducer="auto"``) how this one went."""
        clock, now = self._clock, time.perf_counter()
        if self.reducer is not None and clock.last_step is not None:
            as_reducer(self.reducer).observe_step(StepTiming(now - clock.last_step, clock.backward, clock.exposed))
        self._clock = _Clock(last_step=now)

    @property
    def totals(self) -> CommStats:
        """Running totals of gradient communication on this rank since setup (kept after :meth:`close`)."""
        if self.buckets is None:
            return self._closed_totals
        return self.buckets.totals + self._earlier if self._earlier is not None else self.buckets.totals

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Close the buckets (which close their reducer), or the reducer alone when no buckets were built."""
        if self.buckets is None and self.reducer is not None:
            close_reducer(self.reducer)
        self.reducer = None
        if self.buckets is not None:
            self._closed_totals = self.totals
            self.buckets.close()
            self.buckets = None

    def destroy_groups(self) -> None:
        destroy_groups(self.groups)
        self.groups, self.group = [], None
