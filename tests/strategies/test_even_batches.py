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

from lightning_dp_strategies.comm.failures import PEER_FAILURE_HINT
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
    evens = {
        "even_stream": 8,
        "even_stream_dataloader_iter": 8,
        "uneven_stream_limited": 6,
        "uneven_stream_max_steps": 3,
        "resumed_after_last_batch": 8,
    }
    for name, steps in evens.items():
        assert [rank[name]["error"] for rank in ranks] == [None, None], name
        assert [rank[name]["steps"] for rank in ranks] == [steps, steps], name
        assert [rank[name]["empty_epochs_warned"] for rank in ranks] == [[], []], name
    for r, rank in enumerate(ranks):  # no batch on any rank in some epochs: each rank warns of them, and trains
        for name, empty, steps in (
            ("exhausted_stream", "epochs 1, 2", 3),
            ("exhausted_reloaded", "epochs 1, 2", 3),
            ("late_stream", "epoch 0", 3),
            ("late_after_epoch_end", "epoch 1", 6),
        ):
            case = rank[name]
            assert case["error"] is None and case["steps"] == steps, case
            [warned] = case["empty_epochs_warned"]
            assert warned.startswith(f"Rank {r} had no training batch in {empty} of this fit"), warned
    for name in UNEVEN_STREAMS:  # rank 0 has 5 batches, rank 1 has 4: both fail at the start of the 4th
        for rank in ranks:
            kind, message = rank[name]["error"]
            assert kind == "UnevenBatchesError", (name, message)
            assert "rank 1 ends epoch 0 after 4 batches while rank 0 has more" in message, message
            assert "An `IterableDataset` split by rank must yield the same number of batches" in message
            assert rank[name]["trained"] == 3 or name == "uneven_stream_hybrid", (name, rank[name])
    for rank in ranks:  # a training_step(dataloader_iter): both fail at the 5th next(), where rank 1 runs out
        kind, message = rank["uneven_stream_dataloader_iter"]["error"]
        assert kind == "UnevenBatchesError", message
        assert "rank 1 ends epoch 0 after 4 batches while rank 0 has more" in message, message
        assert rank["uneven_stream_dataloader_iter"]["trained"] == 4
    for rank in ranks:  # a sampler of one's own with 5 batches on rank 0 and 4 on rank 1: fails before the first
        for name in ("uneven_sampler", "uneven_sampler_dataloader_iter"):  # also where the step reads the iterator
            kind, message = rank[name]["error"]
            assert kind == "UnevenBatchesError", message
            assert "training batches in epoch 0 (rank 0: 5, rank 1: 4)" in message
            assert "leave `use_distributed_sampler=True`" in message
            assert rank[name]["trained"] == 0
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


def position(epoch: int, batch_idx: int, count: int, ends: bool | None = False) -> BatchPosition:
    return BatchPosition(epoch=epoch, batch_idx=batch_idx, count=count, ends=ends)


@pytest.mark.filterwarnings("error")  # any other warning fails
def test_a_rank_warns_of_epochs_it_had_no_batch_in_at_its_next_batch_and_at_the_end(mocker: MockerFixture) -> None:
    # Such a rank never reaches the comparison; it can only tell on its own, once it runs again.
    other = TwoRanks(mocker, [UNKNOWN, 0, 0, 0, 0, UNKNOWN, 0])
    mocker.patch.object(dist, "get_rank", return_value=1)
    check = other.answer(EvenBatches())
    check.begin(0, at_start=True)
    with pytest.warns(UserWarning, match=r"^Rank 1 had no training batch in epoch 0 of this fit, while 2 ranks"):
        check.check(position(1, 0, UNKNOWN), CPU)
    check.check(position(1, 1, UNKNOWN), CPU)
    check.check(position(2, 0, UNKNOWN), CPU)
    with pytest.warns(UserWarning, match=r"^Rank 1 had no training batch in epochs 3, 4 of this fit"):
        check.end(5)
    check.begin(0, at_start=True)
    check.check(position(0, 0, UNKNOWN), CPU)
    check.begin(1, at_start=True, reloaded=True)  # reload_dataloaders_every_n_epochs: epoch 0 had the last batch
    check.begin(2, at_start=True, reloaded=True)
    with pytest.warns(UserWarning, match=r"^Rank 1 had no training batch in epochs 1, 2 of this fit"):
        check.end(3)


@pytest.mark.filterwarnings("error")
def test_epochs_with_batches_and_a_resumed_epoch_left_without_any_are_not_warned_of(mocker: MockerFixture) -> None:
    other = TwoRanks(mocker, [4, 4, 4, 4])
    check = other.answer(EvenBatches())
    check.begin(0, at_start=True)
    check.check(position(0, 0, 4), CPU)
    check.check(position(1, 0, 4), CPU)
    check.end(2)
    check.begin(6, at_start=False)  # resumed after the last batch of epoch 6: nothing left to run in it
    check.end(7)
    check.end(9)  # no training started: nothing to warn of
    check.begin(3, at_start=True)
    check.check(position(3, 0, 4), CPU)
    check.begin(4, at_start=True, reloaded=True)  # the loader reloaded in the fit: epoch 4 has batches
    check.check(position(4, 0, 4), CPU)
    check.end(5)
    check.begin(0, at_start=True)
    check.enabled = False  # as under fault_tolerant
    check.end(3)
    assert other.calls == 4


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
    check.begin(0, at_start=True)
    with pytest.raises(UnevenBatchesError, match=r"rank 0: 4, rank 1: 3"):
        check.check(position(0, 0, 4), CPU)  # epoch 0 again, in a new fit
    assert other.calls == 4


def test_a_step_that_reads_its_iterator_is_compared_at_each_next_and_fails_where_one_rank_ran_out(
    mocker: MockerFixture,
) -> None:
    # training_step(dataloader_iter): the end shows only at the step's own next(), so the flags are summed there.
    other = TwoRanks(mocker, [UNKNOWN, 0, 0, 1, UNKNOWN, 0, 0, 0])  # the other rank: 2 batches, then 2 or more
    check = other.answer(EvenBatches())
    check.check(position(0, 0, UNKNOWN, ends=None), CPU)  # the epoch's counts; no flag before the step's next()
    assert other.calls == 1
    fake = iter([("a", 0, 0), ("b", 1, 0)])
    [reads] = check.reading((fake,), CPU)
    assert next(reads) == ("a", 0, 0) and other.calls == 2
    assert [batch for batch, _, _ in reads] == ["b"] and other.calls == 4  # a for loop ends where every rank ends
    check.check(position(1, 0, UNKNOWN, ends=None), CPU)
    [reads] = check.reading((iter([("c", 0, 0)]),), CPU)
    next(reads)
    with pytest.raises(UnevenBatchesError, match="rank 0 ends epoch 1 after 1 batches while rank 1 has more"):
        next(reads)
    assert check.reading((fake, 0), CPU)[0] is fake  # (batch, batch_idx): nothing to wrap


def test_a_step_that_reads_its_iterator_over_known_counts_is_not_compared_per_batch(mocker: MockerFixture) -> None:
    other = TwoRanks(mocker, [5])
    check = other.answer(EvenBatches())
    check.check(position(0, 0, 5, ends=None), CPU)
    fake = iter([1])
    assert check.reading((fake,), CPU)[0] is fake and other.calls == 1


def test_a_disabled_check_and_a_world_of_one_gather_nothing(mocker: MockerFixture) -> None:
    other = TwoRanks(mocker, [])
    check = other.answer(EvenBatches())
    check.enabled = False
    check.check(position(0, 0, UNKNOWN), CPU)
    check.enabled = True
    mocker.patch.object(dist, "get_world_size", return_value=1)
    check.check(position(0, 0, UNKNOWN), CPU)
    assert other.calls == 0


TIMED_OUT = "[unbound_buffer.cc:81] Timed out waiting 3000ms for recv operation to complete"
PAIR_CLOSED = "Application timeout caused pair closure"  # gloo, where a timeout on the peer's side closed the pair


@pytest.mark.parametrize(
    ("failing", "error"), [("all_gather", TIMED_OUT), ("all_reduce", TIMED_OUT), ("all_gather", PAIR_CLOSED)]
)
def test_a_peer_failure_in_the_checks_collectives_says_what_it_most_likely_means(
    failing: str, error: str, mocker: MockerFixture
) -> None:
    # A rank that had no batch at all in an epoch never reaches the check, so the others' comparison times out.
    mocker.patch.object(dist, "is_initialized", return_value=True)
    mocker.patch.object(dist, "get_world_size", return_value=2)
    mocker.patch.object(dist, "get_rank", return_value=0)

    def all_gather(out: list[torch.Tensor], mine: torch.Tensor) -> None:
        if failing == "all_gather":
            raise RuntimeError(error)
        for tensor in out:
            tensor.fill_(UNKNOWN)  # counts unknown: every batch then sums the flags

    mocker.patch.object(dist, "all_gather", side_effect=all_gather)
    mocker.patch.object(dist, "all_reduce", side_effect=RuntimeError(error))
    with pytest.raises(RuntimeError) as raised:
        EvenBatches().check(position(0, 0, UNKNOWN), CPU)
    message = str(raised.value)
    prefix = f"Comparing the ranks' numbers of training batches failed on rank 0: RuntimeError: {error}\n"
    assert message.startswith(prefix) and PEER_FAILURE_HINT in message, message
    assert str(raised.value.__cause__) == error
    mocker.patch.object(dist, "all_gather", side_effect=RuntimeError("Tensors must have the same shape"))
    with pytest.raises(RuntimeError, match=r"^Tensors must have the same shape$"):  # not a peer's failure: as it is
        EvenBatches().check(position(0, 0, UNKNOWN), CPU)
