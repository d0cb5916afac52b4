"""The survivors' agreement over a store (ranks as threads), the logical ranks' spread, and failure detection."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from lightning_dp_strategies.core.membership import (
    ExcludedError,
    Membership,
    MembershipConfig,
    detect,
    is_peer_failure,
    logical_shares,
)

CONFIG = MembershipConfig(poll_s=0.005)


def agree_in_threads(
    store: dist.Store, ranks: dict[int, float], world_size: int, timeout: float, epoch: int = 1
) -> dict[int, object]:
    """Each rank of ``ranks`` (rank -> delay before it joins) agrees in a thread; its list or the error it raised."""
    results: dict[int, object] = {}

    def run(rank: int, delay: float) -> None:
        time.sleep(delay)
        membership = Membership(store, rank, world_size, CONFIG)
        membership.state.epoch = epoch - 1
        try:
            results[rank] = membership.agree(epoch, timeout)
        except ExcludedError as error:  # the test looks at it
            results[rank] = error

    threads = [threading.Thread(target=run, args=item) for item in ranks.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 10)
    return results


def test_when_every_member_answers_they_decide_at_once_on_all_of_them() -> None:
    start = time.monotonic()
    results = agree_in_threads(dist.HashStore(), {0: 0.0, 1: 0.0, 2: 0.0}, 3, timeout=30.0)
    assert results == {0: [0, 1, 2], 1: [0, 1, 2], 2: [0, 1, 2]}
    assert time.monotonic() - start < 10  # well before the timeout: nobody waited for it


def test_a_rank_that_never_answers_is_left_out_by_every_survivor() -> None:
    results = agree_in_threads(dist.HashStore(), {0: 0.0, 2: 0.1}, 3, timeout=0.5)
    assert results == {0: [0, 2], 2: [0, 2]}


def test_a_survivor_that_detects_later_within_the_timeout_is_in() -> None:
    results = agree_in_threads(dist.HashStore(), {0: 0.3, 2: 0.0}, 3, timeout=1.5)
    assert results == {0: [0, 2], 2: [0, 2]}


def test_a_rank_answering_after_the_decision_is_excluded_and_told_to_exit() -> None:
    results = agree_in_threads(dist.HashStore(), {0: 0.0, 1: 1.0, 2: 0.0}, 3, timeout=0.3)
    assert results[0] == results[2] == [0, 2]
    assert isinstance(results[1], ExcludedError)
    assert "Exit this process" in str(results[1]) and "[0, 2]" in str(results[1])


def test_a_second_failure_waits_only_for_the_members_of_the_previous_epoch() -> None:
    store = dist.HashStore()
    members = {r: Membership(store, r, 4, CONFIG) for r in range(4)}
    for membership in members.values():
        membership.state.epoch, membership.state.members = 1, [0, 2, 3]  # rank 1 was lost at epoch 1

    results: dict[int, list[int]] = {}
    threads = [
        threading.Thread(target=lambda r=r: results.__setitem__(r, members[r].agree(2, 30.0))) for r in (0, 2, 3)
    ]
    start = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(40)
    assert results == {0: [0, 2, 3], 2: [0, 2, 3], 3: [0, 2, 3]}
    assert time.monotonic() - start < 10  # all members answered: rank 1 was not waited for
    assert members[2].leader == 0 and members[2].state.epoch == 2 and members[3].shares() == [3]


def test_the_epoch_must_follow_the_current_one() -> None:
    membership = Membership(dist.HashStore(), 0, 2)
    with pytest.raises(ValueError, match=r"one past the current epoch 0, got 2.*recover"):
        membership.agree(2, 1.0)


def test_a_rank_outside_the_world_is_refused() -> None:
    with pytest.raises(ValueError, match=r"0\.\.2"):
        Membership(dist.HashStore(), 3, 3)


def test_forming_a_group_without_a_default_group_names_the_fix() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        Membership(dist.HashStore(), 0, 1).form_group([0], 0, 1.0)


def test_the_lost_shares_are_spread_evenly_and_every_logical_rank_is_held_once() -> None:
    for world in range(1, 7):
        for lost in range(world):
            live = [r for r in range(world) if r not in range(lost, world, 3)] or [0]
            shares = logical_shares(live, world)
            held = sorted(r for ranks in shares.values() for r in ranks)
            assert held == list(range(world))
            assert all(rank in shares[rank] for rank in live)
            sizes = [len(ranks) for ranks in shares.values()]
            assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("live", [[], [0, 0], [3]])
def test_logical_shares_refuse_a_wrong_live_list(live: list[int]) -> None:
    with pytest.raises(ValueError, match=r"distinct ranks of the original world 0\.\.2"):
        logical_shares(live, 3)


def test_detect_reports_gloos_failures_and_lets_other_errors_through() -> None:
    def closed() -> None:
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:7052")

    def wrong() -> None:
        raise RuntimeError("Tensors must be contiguous")

    failure = detect(closed)
    assert failure is not None and not failure.timed_out and "closed by peer" in str(failure.error)
    assert is_peer_failure(dist.DistStoreError("wait timeout after 5000ms, keys: a"))
    with pytest.raises(RuntimeError, match="contiguous"):
        detect(wrong)
