"""Three ranks on gloo lose one (killed, or hung) before an all-reduce; the survivors agree and go on in a new group.

The job's store is hosted by the test process, as torchrun's agent hosts it, so that killing rank 0 leaves it alive.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_dp_strategies.core.failures import FailureInjector, FailureKind
from lightning_dp_strategies.core.membership import ExcludedError, Membership, MembershipConfig, detect
from tests.helpers.distributed import _PRELOAD

TIMEOUT = 2.0
"""The survivors' groups' collective timeout: the bound on detecting a hung peer."""
WORLD = 3


def _rank(rank: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...], results: Any) -> None:
    try:
        store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False, timeout=timedelta(seconds=30))
        dist.init_process_group(
            "gloo", store=dist.PrefixStore("world/", store), rank=rank, world_size=WORLD, timeout=timedelta(seconds=30)
        )
        results.put((rank, fn(rank, dist.PrefixStore("membership/", store), *args)))
    except BaseException:
        results.put((rank, RuntimeError(traceback.format_exc())))
    os._exit(0)  # no teardown of groups whose peers are gone


def launch(fn: Callable[..., Any], *args: Any, timeout: float = 40.0) -> tuple[dict[int, Any], list[int | None]]:
    """Run ``fn(rank, store, *args)`` on ``WORLD`` ranks forked from the test suite's fork server, the store hosted
    here; each rank's return value (or the error it raised) and the exit codes. Ranks alive after ``timeout`` seconds
    are killed (exit code -9), so no test hangs."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    server = dist.TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False)
    results = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank, args=(r, server.port, fn, args, results), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    outcomes = {}
    while not results.empty():
        rank, value = results.get()
        outcomes[rank] = value
    return outcomes, [p.exitcode for p in procs]


def lose_one(rank: int, store: dist.Store, victim: int, kind: FailureKind, hang_s: float) -> dict[str, Any]:
    """One healthy all-reduce, ``victim`` fails, the survivors detect it, agree, form their group and use it."""
    membership = Membership(store, rank, WORLD, MembershipConfig(poll_s=0.01))
    group = membership.form_group(list(range(WORLD)), 0, TIMEOUT)
    injector = FailureInjector().fail(victim, step=1, kind=kind, hang_s=hang_s)
    healthy = torch.tensor([rank + 1.0])
    dist.all_reduce(healthy, group=group)
    injector.step(rank, 1)
    failure = detect(lambda: dist.all_reduce(torch.tensor([rank + 1.0]), group=group))
    assert failure is not None, "the all-reduce over a lost rank completed"
    try:
        group = membership.recover(TIMEOUT)
    except ExcludedError as error:
        return {"healthy": healthy.item(), "excluded": str(error)}
    total, token, message = torch.tensor([rank + 1.0]), torch.tensor([float(rank)]), torch.tensor([-1.0])
    dist.all_reduce(total, group=group)
    dist.broadcast(token, src=membership.leader, group=group)
    peer = next(r for r in membership.state.members if r != membership.leader)
    if rank == membership.leader:
        dist.send(torch.tensor([10.0 * rank]), dst=peer, group=group)
    elif rank == peer:
        dist.recv(message, src=membership.leader, group=group)
    return {
        "healthy": healthy.item(),
        "detected_s": failure.seconds,
        "timed_out": failure.timed_out,
        "live": membership.state.members,
        "leader": membership.leader,
        "epoch": membership.state.epoch,
        "group_rank": dist.get_rank(group),
        "sum": total.item(),
        "broadcast": token.item(),
        "received": message.item(),
        "shares": membership.shares(),
    }


def check(outcomes: dict[int, Any], live: list[int]) -> None:
    errors = {r: v for r, v in outcomes.items() if isinstance(v, BaseException)}
    assert not errors, "\n".join(f"rank {r}: {e}" for r, e in errors.items())
    leader = live[0]
    for index, rank in enumerate(live):
        got = outcomes[rank]
        assert got["healthy"] == 6.0  # 1 + 2 + 3 before the failure
        assert got["detected_s"] < 30  # a no-hang bound, not a timing
        assert (got["live"], got["leader"], got["epoch"], got["group_rank"]) == (live, leader, 1, index)
        assert got["sum"] == sum(r + 1.0 for r in live)
        assert got["broadcast"] == float(leader)
        assert got["received"] == (-1.0 if rank == leader else 10.0 * leader)


@pytest.mark.timeout(60)
def test_a_killed_rank_is_detected_and_the_survivors_go_on_without_it() -> None:
    outcomes, exits = launch(lose_one, 1, "kill", 0.0)
    check(outcomes, [0, 2])
    assert exits == [0, -9, 0] and 1 not in outcomes
    assert outcomes[0]["shares"] == [0, 1] and outcomes[2]["shares"] == [2]
    # both are rank 1's neighbours in gloo's ring: the kernel's reset reaches them at once, no timeout
    assert not outcomes[0]["timed_out"] and not outcomes[2]["timed_out"]


@pytest.mark.timeout(60)
def test_the_leader_killed_leaves_the_store_here_and_the_lowest_survivor_leads() -> None:
    outcomes, exits = launch(lose_one, 0, "kill", 0.0)
    check(outcomes, [1, 2])
    assert exits == [-9, 0, 0]
    assert outcomes[1]["shares"] == [0, 1] and outcomes[2]["shares"] == [2]


@pytest.mark.timeout(60)
def test_a_hung_rank_is_excluded_after_the_timeout_and_told_so_when_it_wakes() -> None:
    outcomes, exits = launch(lose_one, 1, "hang", 4 * TIMEOUT)
    check(outcomes, [0, 2])
    assert exits == [0, 0, 0]
    assert outcomes[0]["timed_out"] and outcomes[2]["timed_out"]  # a hung peer: only the timeout tells
    assert outcomes[1]["healthy"] == 6.0 and "after the survivors [0, 2] had decided" in outcomes[1]["excluded"]
