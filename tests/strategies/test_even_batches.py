"""Ranks given different numbers of training batches in an epoch fail together, at once, with the reason, instead of
waiting in a collective until the timeout (``core/even_batches.py``); equal counts, limits and ``max_steps`` that
stop the ranks together do not fail. Under ``fault_tolerant``, which is not checked, the error it gives up with names
the cause."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from pytest_mock import MockerFixture

from lightning_dp_strategies.core.even_batches import UNKNOWN, BatchPosition, EvenBatches, UnevenBatchesError
from lightning_dp_strategies.strategies.control import GAVE_UP_HINT
from tests.helpers.distributed import run_ranks
from tests.strategies.uneven_batches_scenarios import CASES

CPU = torch.device("cpu")
UNEVEN_STREAMS = ("uneven_stream_ring", "uneven_stream_streaming", "uneven_stream_accumulating", "uneven_stream_hybrid")


@pytest.mark.timeout(300)
def test_uneven_ranks_fail_together_before_the_batch_they_part_at_and_even_ones_train(tmp_path: Path) -> None:
    # The scenarios' collectives time out after 60 s: without the check the uneven cases would fail only then, with
    # gloo's message, and a run of them all would pass the deadline below.
    run_ranks("tests.strategies.uneven_batches_scenarios", [str(tmp_path), ",".join(CASES)], 2, timeout=150)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for name, steps in (("even_stream", 8), ("uneven_stream_limited", 6), ("uneven_stream_max_steps", 3)):
        assert [rank[name]["error"] for rank in ranks] == [None, None], name
        assert [rank[name]["steps"] for rank in ranks] == [steps, steps], name
    for name in UNEVEN_STREAMS:  # rank 0 has 5 batches, rank 1 has 4: both fail at the start of the 4th
        for rank in ranks:
            kind, message = rank[name]["error"]
            assert kind == "UnevenBatchesError", (name, message)
            assert "rank 1 ends epoch 0 after 4 batches while rank 0 has more" in message, message
            assert "An `IterableDataset` split by rank must yield the same number of batches" in message
            assert rank[name]["trained"] == 3 or name == "uneven_stream_hybrid", (name, rank[name])
    for rank in ranks:  # a sampler of one's own with 5 batches on rank 0 and 4 on rank 1: fails before the first
        kind, message = rank["uneven_sampler"]["error"]
        assert kind == "UnevenBatchesError", message
        assert "training batches in epoch 0 (rank 0: 5, rank 1: 4)" in message
        assert "leave `use_distributed_sampler=True`" in message
        assert rank["uneven_sampler"]["trained"] == 0
    for rank in ranks:  # not checked under fault_tolerant: its tries fail with every rank alive, and it gives up
        kind, message = rank["uneven_stream_fault_tolerant"]["error"]
        assert kind == "PeerLostError" and message.endswith(GAVE_UP_HINT), message


class TwoRanks:
    """The other rank's answers to :class:`EvenBatches`'s gathers and sums, in order, and how many there were."""

    def __init__(self, mocker: MockerFixture, other: list[int]) -> None:
        mocker.patch.object(dist, "is_initialized", return_value=True)
        mocker.patch.object(dist, "get_world_size", return_value=2)
        self.other, self.calls = list(other), 0

    def gather(self, mine: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.stack([mine, torch.tensor([self.other.pop(0)])])

    def total(self, mine: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return mine + self.other.pop(0)

    def answer(self, check: EvenBatches) -> EvenBatches:
        check.gather, check.total = self.gather, self.total
        return check


def position(epoch: int, batch_idx: int, count: int, ends: bool = False) -> BatchPosition:
    return BatchPosition(epoch=epoch, batch_idx=batch_idx, count=count, ends=ends)


def test_equal_known_counts_are_compared_once_an_epoch_and_never_at_a_batch(mocker: MockerFixture) -> None:
    other = TwoRanks(mocker, [5, 5])
    check = other.answer(EvenBatches())
    for epoch in (0, 1):
        for batch_idx in range(5):
            check.check(position(epoch, batch_idx, 5, ends=batch_idx == 4), CPU)
    assert other.calls == 2


def test_known_counts_that_differ_fail_at_the_epochs_first_batch(mocker: MockerFixture) -> None:
    check = TwoRanks(mocker, [4]).answer(EvenBatches())
    with pytest.raises(UnevenBatchesError, match=r"in epoch 2 \(rank 0: 5, rank 1: 4\)"):
        check.check(position(2, 0, 5), CPU)


def test_an_unknown_count_is_followed_batch_by_batch_until_one_rank_ends_alone(mocker: MockerFixture) -> None:
    check = TwoRanks(mocker, [UNKNOWN, 0, 0, 1, 1]).answer(EvenBatches())
    check.check(position(0, 0, UNKNOWN), CPU)  # counts, then the batch
    check.check(position(0, 1, UNKNOWN), CPU)
    with pytest.raises(UnevenBatchesError, match="rank 1 ends epoch 0 after 3 batches while rank 0 has more"):
        check.check(position(0, 2, UNKNOWN), CPU)


def test_ranks_that_end_their_epoch_together_pass_and_a_new_fit_compares_counts_again(mocker: MockerFixture) -> None:
    other = TwoRanks(mocker, [UNKNOWN, 0, 1, 3])
    check = other.answer(EvenBatches())
    check.check(position(0, 0, UNKNOWN), CPU)
    check.check(position(0, 1, UNKNOWN, ends=True), CPU)
    check.reset()
    with pytest.raises(UnevenBatchesError, match=r"rank 0: 4, rank 1: 3"):
        check.check(position(0, 0, 4), CPU)  # epoch 0 again, in a new fit
    assert other.calls == 4


def test_a_disabled_check_and_a_world_of_one_gather_nothing(mocker: MockerFixture) -> None:
    other = TwoRanks(mocker, [])
    check = other.answer(EvenBatches())
    check.enabled = False
    check.check(position(0, 0, UNKNOWN), CPU)
    check.enabled = True
    mocker.patch.object(dist, "get_world_size", return_value=1)
    check.check(position(0, 0, UNKNOWN), CPU)
    assert other.calls == 0
