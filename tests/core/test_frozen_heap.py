"""While a rank beats, the objects alive when it started are out of the garbage collector's reach (``gc.freeze``), so
that a full collection, which holds the GIL, cannot stop the beats for ``stale_s``; the heap is thawed when the last
heartbeat stops, and a heap the process froze itself is left as it was."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
from pytest_mock import MockerFixture

from lightning_dp_strategies.core import frozen_heap
from lightning_dp_strategies.core.fault_tolerance import FaultTolerance, Survivors
from lightning_dp_strategies.core.membership import Membership, MembershipConfig

BEATS = MembershipConfig(heartbeat_s=0.05, stale_s=0.3)


def collected(obj: object) -> bool:
    """Whether a collection would traverse ``obj`` (the permanent generation is not in ``gc.get_objects()``)."""
    return any(o is obj for o in gc.get_objects())


@pytest.fixture
def thawed() -> Iterator[None]:
    assert gc.get_freeze_count() <= frozen_heap._AT_IMPORT, "an earlier test left the heap frozen"
    yield
    gc.unfreeze()


def test_the_objects_alive_when_beating_starts_are_frozen_until_it_stops(thawed: None) -> None:
    before = [[]]  # a container: the collector tracks it
    membership = Membership(torch.distributed.HashStore(), 0, 1, BEATS)
    assert collected(before)
    membership.start_heartbeat()
    try:
        after = [[]]
        assert not collected(before)  # no full collection traverses it while the rank beats
        assert collected(after)  # what training makes is collected as before
    finally:
        membership.stop_heartbeat()
    assert gc.get_freeze_count() == 0
    assert collected(before)


def test_the_heap_thaws_when_the_last_heartbeat_of_the_process_stops(thawed: None) -> None:
    store = torch.distributed.HashStore()
    first, second = Membership(store, 0, 2, BEATS), Membership(store, 1, 2, BEATS)
    first.start_heartbeat()
    second.start_heartbeat()
    first.stop_heartbeat()
    first.stop_heartbeat()  # a second stop gives up no other holder's hold
    assert not collected(first)  # the second still beats
    second.stop_heartbeat()
    assert gc.get_freeze_count() == 0


def test_a_heap_the_process_froze_itself_stays_frozen_after_the_heartbeat(thawed: None) -> None:
    own = [[]]
    gc.freeze()
    membership = Membership(torch.distributed.HashStore(), 0, 1, BEATS)
    membership.start_heartbeat()
    membership.stop_heartbeat()
    assert not collected(own)  # not thawed: the process's own freeze is its owner's


def test_freeze_heap_false_leaves_the_collector_alone(thawed: None) -> None:
    config = MembershipConfig(heartbeat_s=0.05, stale_s=0.3, freeze_heap=False)
    membership = Membership(torch.distributed.HashStore(), 0, 1, config)
    membership.start_heartbeat()
    try:
        assert collected(membership)
    finally:
        membership.stop_heartbeat()


@pytest.mark.parametrize("freeze", [True, False])
def test_the_fault_tolerance_option_reaches_the_heartbeat(freeze: bool, mocker: MockerFixture) -> None:
    membership = mocker.patch("lightning_dp_strategies.core.fault_tolerance.Membership")
    mocker.patch.object(Survivors, "readmit")  # forms process groups: not needed to see the configuration
    Survivors(FaultTolerance(freeze_heap=freeze)).start(torch.distributed.HashStore(), 0, 1, timedelta(seconds=1))
    config = membership.call_args.args[3]
    assert config.freeze_heap is freeze
    membership.return_value.start_heartbeat.assert_called_once()


def test_freeze_heap_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="`freeze_heap` must be True or False"):
        FaultTolerance(freeze_heap="yes")  # type: ignore[arg-type]
