"""The options of ``fault_tolerant=...`` and the checks, at construction, of what they cannot be combined with."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["FaultTolerance", "check_fault_tolerance", "check_local_fault_tolerance"]


@dataclass(frozen=True)
class FaultTolerance:
    """The options of ``fault_tolerant=True`` (pass an instance to change them).

    Args:
        timeout_s: the gradient group's collective timeout: the bound on noticing a rank that hangs (a killed rank
            or a cut link is noticed sooner, by a failed connection or a stopped heartbeat).
        keep_global_batch: the survivors also train the lost ranks' micro-batches, so every step averages the
            uninterrupted run's global batch (``False``: the batch shrinks with the world, as torchft does).
        heartbeat_s: how often each rank's heartbeat thread beats in the job's store.
        stale_s: a rank whose heartbeat stopped this long is taken for gone.
        state_copies: local SGD with ``keep_global_batch``: how many other ranks keep each rank's inner optimizer
            state between synchronisations (the next members in rank order). The ranks lost in one period are
            survived where one of each lost rank's keepers survives, so any ``state_copies`` ranks at once; each copy
            costs every rank one more send and one more kept state a synchronisation.
        freeze_heap: while the heartbeat runs, keep the objects alive at setup out of the garbage collector's reach
            (``gc.freeze``, undone at teardown), so that a full collection, which holds the GIL, cannot stop a live
            rank's beats for ``stale_s`` (see :mod:`lightning_dp_strategies.core.frozen_heap`). A heap the process
            froze itself is left alone. ``False``: the collector is untouched, and ``stale_s`` must cover its pauses.

    Examples:
        >>> FaultTolerance().timeout_s
        10.0
        >>> FaultTolerance(stale_s=0.5)
        Traceback (most recent call last):
        ...
        ValueError: `stale_s` must exceed twice `heartbeat_s` (0.5 s), got stale_s=0.5: ...
    """

    timeout_s: float = 10.0
    keep_global_batch: bool = True
    heartbeat_s: float = 0.5
    stale_s: float = 5.0
    state_copies: int = 1
    freeze_heap: bool = True

    def __post_init__(self) -> None:
        for name in ("timeout_s", "heartbeat_s", "stale_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"`{name}` must be a positive number of seconds, got {value!r}.")
        for flag in ("keep_global_batch", "freeze_heap"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"`{flag}` must be True or False, got {getattr(self, flag)!r}.")
        if isinstance(self.state_copies, bool) or not isinstance(self.state_copies, int) or self.state_copies < 1:
            raise ValueError(f"`state_copies` must be a whole number of at least 1, got {self.state_copies!r}.")
        if self.stale_s <= 2 * self.heartbeat_s:
            raise ValueError(
                f"`stale_s` must exceed twice `heartbeat_s` ({self.heartbeat_s:g} s), got stale_s={self.stale_s:g}: a "
                "rank that beats on time would be taken for gone. Raise `stale_s` or lower `heartbeat_s`."
            )


def check_fault_tolerance(
    options: FaultTolerance | None,
    shard_optimizer_state: bool,
    two_level: bool | None,
    reducer: object,
    comm_hook: object,
    model_averaging_period: int | None,
    keeps_states: bool = False,
) -> None:
    """A clear error, at construction, when ``fault_tolerant`` meets an option it cannot honour (``keeps_states``:
    the strategy keeps inner optimizer states, as local SGD does).

    Examples:
        >>> check_fault_tolerance(FaultTolerance(), False, None, "ring", None, None)
        >>> check_fault_tolerance(FaultTolerance(), True, None, None, None, None)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: `fault_tolerant=True` cannot be combined with `shard_optimizer_state=True`: ...
    """
    if options is None:
        return
    fix = "Leave that option out, or pass `fault_tolerant=False`."
    if options.state_copies != 1 and not (keeps_states and options.keep_global_batch):
        raise ValueError(
            f"`FaultTolerance(state_copies={options.state_copies})` has nothing to copy: only local SGD with "
            "`keep_global_batch=True` hands inner optimizer states over. Leave `state_copies` at 1."
        )
    if shard_optimizer_state:
        raise ValueError(
            "`fault_tolerant=True` cannot be combined with `shard_optimizer_state=True`: a lost rank takes its shard "
            f"of the optimizer state with it, so the survivors could not step its parameters. {fix}"
        )
    if two_level:
        raise ValueError(
            "`fault_tolerant=True` cannot be combined with `two_level=True`: the survivors average over one flat "
            f"group, rebuilt after each failure, and a lost rank breaks the node layout the two levels follow. {fix}"
        )
    if reducer not in (None, "ring", "native") or comm_hook is not None or model_averaging_period is not None:
        chosen = f"reducer={reducer!r}" if comm_hook is None and model_averaging_period is None else "a comm hook"
        raise ValueError(
            f"`fault_tolerant=True` cannot be combined with `{chosen}`: the survivors rebuild the reducer over their "
            "new group, which only the built-in lossless reducers (`reducer='ring'`, the default, or 'native') can "
            f"do; a reducer's or hook's state would describe the failed group. {fix}"
        )


def check_local_fault_tolerance(options: FaultTolerance | None, local: Mapping[str, Any], reducer: object) -> None:
    """A clear error, at construction, when ``fault_tolerant`` meets a local SGD option it cannot honour (``local``:
    the local SGD options by name).

    Examples:
        >>> check_local_fault_tolerance(FaultTolerance(), {"fragments": 4, "delay": 1}, None)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: `fault_tolerant=True` runs local SGD and DiLoCo, one synchronisation of the whole model at a time...
    """
    if options is None:
        return
    check_fault_tolerance(options, False, None, reducer, None, None, keeps_states=True)
    fix = "Leave that option at its default, or pass `fault_tolerant=False`."
    if local.get("fragments", 1) != 1 or local.get("delay", 0) != 0:
        raise ValueError(
            "`fault_tolerant=True` runs local SGD and DiLoCo, one synchronisation of the whole model at a time "
            f"(`fragments=1, delay=0`), got fragments={local.get('fragments')}, delay={local.get('delay')}: streaming "
            f"DiLoCo's fragments in flight are not redone after a failure. {fix}"
        )
    if (
        local.get("sync_every") == "auto"
        or local.get("warmup_steps", 0)
        or local.get("outer_precision")
        in (
            "int8",
            "int4",
        )
    ):
        raise ValueError(
            "`fault_tolerant=True` with local SGD needs a fixed `sync_every`, no `warmup_steps` and `outer_precision` "
            f"'fp32' or 'bf16', got sync_every={local.get('sync_every')!r}, warmup_steps={local.get('warmup_steps')}, "
            f"outer_precision={local.get('outer_precision')!r}: a failure is redone only at a synchronisation of "
            f"the whole model through the lossless ring. {fix}"
        )
