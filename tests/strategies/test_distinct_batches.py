"""Data-parallel ranks that read the same batches are warned about at the first batch of a fit: a loader every rank
reads whole trains on copies of one batch, which no error reveals (``core/distinct_batches.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lightning.fabric.utilities.warnings import PossibleUserWarning
from pytest_mock import MockerFixture

from lightning_dp_strategies.comm.failures import PEER_FAILURE_HINT
from lightning_dp_strategies.core.distinct_batches import DistinctBatches, batch_digest, repeated_ranks
from tests.helpers.distributed import run_ranks

SAME = ("ring_whole_loader", "streaming_unsplit_iterable", "sharded_whole_loader")


@pytest.mark.timeout(300)
def test_ranks_that_read_the_same_batches_are_warned_and_sharded_ranks_are_not(tmp_path: Path) -> None:
    run_ranks("tests.strategies.same_batch_scenarios", [str(tmp_path), ",".join((*SAME, "ring_lightning_sampler"))], 2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for name in SAME:
        assert ranks[0][name]["first"] == ranks[1][name]["first"], name  # the scenario is what it says
        (message,) = ranks[0][name]["warnings"]  # once a fit, on rank 0
        assert "(ranks 0, 1)" in message and "use_distributed_sampler=True" in message, message
        assert "An `IterableDataset`: split it by `trainer.global_rank`" in message
        assert "DistributedSampler(dataset, num_replicas=trainer.world_size, rank=trainer.global_rank)" in message
        assert ranks[1][name]["warnings"] == [], name
    sharded = ranks[0]["ring_lightning_sampler"], ranks[1]["ring_lightning_sampler"]
    assert sharded[0]["first"] != sharded[1]["first"]
    assert sharded[0]["warnings"] == sharded[1]["warnings"] == []


@pytest.mark.timeout(300)
def test_the_replicas_of_a_pipeline_stage_that_read_the_same_batches_are_warned(tmp_path: Path) -> None:
    run_ranks("tests.strategies.same_batch_scenarios", [str(tmp_path), "hybrid_whole_loader"], 4)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text())["hybrid_whole_loader"] for r in range(4)]
    # the stages of a replica read one batch (ranks 0 and 2 are replica 0), as they must; so do the replicas here
    assert len({json.dumps(rank["first"]) for rank in ranks}) == 1
    (message,) = ranks[0]["warnings"]
    assert "(ranks 0, 1; ranks 2, 3)" in message and "num_replicas=2" in message, message
    assert all(rank["warnings"] == [] for rank in ranks[1:])


def test_batch_digest_is_equal_for_equal_batches_and_tells_any_difference() -> None:
    x, y = torch.arange(12.0).reshape(3, 4), torch.tensor([0, 1, 2])
    batch = {"x": x, "y": y, "meta": ["a", "b", "c"]}
    assert batch_digest(batch) == batch_digest({"meta": ["z"], "y": y.clone(), "x": x.clone()})  # only tensors count
    assert batch_digest(batch) != batch_digest({"x": x, "y": y.flip(0)})
    assert batch_digest((x, y)) != batch_digest((y, x))
    assert batch_digest((x, y)) != batch_digest((x.to(torch.float64), y))
    assert batch_digest([x.to(torch.bfloat16)]) != batch_digest([x.to(torch.float16)])
    assert batch_digest("no tensor") == 0 and batch_digest([]) == 0


def test_repeats_are_found_within_each_group_only() -> None:
    # a pipeline of 2 stages over 2 replicas: stage s is ranks 2s, 2s + 1; the stages of a replica read one batch
    assert repeated_ranks([11, 12, 11, 12], [[0, 1], [2, 3]]) == []
    assert repeated_ranks([11, 11, 11, 11], [[0, 1], [2, 3]]) == [[0, 1], [2, 3]]
    assert repeated_ranks([5, 6, 5], [[0, 1, 2]]) == [[0, 2]]  # a sampler of 2 replicas over 3 ranks


def gathering(answers: list[int]) -> tuple[DistinctBatches, list[torch.Tensor]]:
    """A check armed for a fit whose gather (every rank's digest, stacked) returns ``answers``; and its calls."""
    calls: list[torch.Tensor] = []

    def gather(tensor: torch.Tensor) -> torch.Tensor:
        calls.append(tensor)
        return torch.tensor(answers, dtype=torch.int64).reshape(-1, 1)

    check = DistinctBatches()
    check.gather = gather
    return check, calls


def test_the_check_gathers_once_a_fit_and_warns_naming_the_ranks() -> None:
    batch = (torch.ones(2, 3), torch.zeros(2))
    check, calls = gathering([batch_digest(batch)] * 2)
    assert check.check(batch, [[0, 1]], torch.device("cpu")) == []  # not armed: no fit set up
    check.pending = True
    with pytest.warns(PossibleUserWarning, match=r"same first training batch \(ranks 0, 1\)"):
        assert check.check(batch, [[0, 1]], torch.device("cpu")) == [[0, 1]]
    assert check.check(batch, [[0, 1]], torch.device("cpu")) == [] and len(calls) == 1


def test_a_peer_failure_in_the_gather_says_what_it_most_likely_means(mocker: MockerFixture) -> None:
    timed_out = "[unbound_buffer.cc:81] Timed out waiting 3000ms for recv operation to complete"
    mocker.patch.object(dist, "get_world_size", return_value=2)
    mocker.patch.object(dist, "get_rank", return_value=1)
    mocker.patch.object(dist, "is_initialized", return_value=True)
    mocker.patch.object(dist, "all_gather", side_effect=RuntimeError(timed_out))
    check = DistinctBatches()
    check.pending = True
    with pytest.raises(RuntimeError) as raised:
        check.check(torch.ones(2), [[0, 1]], torch.device("cpu"))
    message = str(raised.value)
    assert message.startswith("Comparing the ranks' first training batches failed on rank 1: RuntimeError: [unbound")
    assert PEER_FAILURE_HINT in message and str(raised.value.__cause__) == timed_out


def test_groups_smaller_than_the_world_name_their_own_size() -> None:
    check, _ = gathering([7, 8, 7, 8])  # two stages of two replicas each, as under hybrid_pipeline
    check.pending = True
    assert check.check(torch.ones(2), [[0, 1], [2, 3]], torch.device("cpu")) == []
    check, _ = gathering([7, 7, 7, 7])
    check.pending = True
    with pytest.warns(PossibleUserWarning, match=r"ranks 0, 1; ranks 2, 3.*num_replicas=2"):
        assert check.check(torch.ones(2), [[0, 1], [2, 3]], torch.device("cpu")) == [[0, 1], [2, 3]]


def test_fewer_answers_than_ranks_are_not_compared() -> None:
    check, _ = gathering([7, 7])  # a fault-tolerant run's survivors, fewer than the groups name
    check.pending = True
    assert check.check(torch.ones(2), [[0, 1, 2]], torch.device("cpu")) == []


def test_no_rank_gathers_when_no_group_holds_two_ranks() -> None:
    check, calls = gathering([1])
    check.pending = True
    assert check.check(torch.ones(1), [[0], [1]], torch.device("cpu")) == [] and calls == []


def test_fabrics_check_runs_at_the_first_training_forward_only_and_then_removes_its_hook(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An evaluation forward, or one without gradients, may run on one rank alone: the gather waits for the first
    forward in train mode with gradients on, which every rank runs."""
    x = torch.ones(2, 3)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    check, calls = gathering([batch_digest(((x,), {}))] * 2)
    check.owner = "fabric"
    module = torch.nn.Linear(3, 1)
    check.watch(module, torch.device("cpu"))
    module.eval()
    module(x)
    module.train()
    with torch.no_grad():
        module(x)
    assert calls == [] and len(module._forward_pre_hooks) == 1
    with pytest.warns(PossibleUserWarning, match=r"same inputs at its first training forward \(ranks 0, 1\)"):
        module(x)
    module(x)
    assert len(calls) == 1 and len(module._forward_pre_hooks) == 0
