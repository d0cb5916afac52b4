"""The attempt handshake: every rank agrees on one fresh prefix whatever keys a dead attempt left in the store."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_dp_strategies.core import elastic
from lightning_dp_strategies.core.elastic import PREFIX, agree_on_attempt, shares_agent_store


def agree(store: dist.Store, ranks: list[int], world_size: int, timeout: float = 10.0) -> dict[int, object]:
    """Run the handshake of ``ranks`` (of ``world_size``) in threads; each rank's nonce, or the exception it raised."""
    results: dict[int, object] = {}

    def run(rank: int) -> None:
        try:
            results[rank] = agree_on_attempt(store, rank, world_size, timedelta(seconds=timeout))
        except Exception as error:  # the test looks at it
            results[rank] = error

    threads = [threading.Thread(target=run, args=(rank,)) for rank in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 10)
    return results


def test_ranks_agree_on_a_fresh_nonce_despite_a_dead_attempts_keys() -> None:
    store = dist.HashStore()
    first = agree(store, [0, 1, 2], 3)
    assert len(set(first.values())) == 1 and all(isinstance(n, str) for n in first.values())
    store.set(f"{PREFIX}/hello/2", "token-of-a-dead-worker")  # as a worker killed before its ack leaves it
    second = agree(store, [0, 1, 2], 3)
    assert len(set(second.values())) == 1
    assert set(second.values()) != set(first.values())


def test_a_single_rank_needs_no_peer() -> None:
    assert isinstance(agree_on_attempt(dist.HashStore(), 0, 1, timedelta(seconds=1)), str)


def test_a_missing_rank_fails_the_leader_within_the_timeout_naming_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(elastic, "POLL_S", 0.01)
    results = agree(dist.HashStore(), [0, 1], 3, timeout=0.5)
    assert isinstance(results[0], TimeoutError)
    assert "Only 1 of the 2 other ranks" in str(results[0]) and "`timeout`" in str(results[0])


def test_only_torchrun_workers_with_the_agent_store_take_part(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert not shares_agent_store()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert shares_agent_store()
