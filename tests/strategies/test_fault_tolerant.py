"""``RingAllReduceStrategy(fault_tolerant=True)``: the survivors of a lost rank end on the uninterrupted parameters.

Three gloo ranks launched as torchrun launches them (``fault_tolerant_scenarios``); the specification is the
uninterrupted run's final parameters, to 1e-6 (the survivors' sums run in another order: about 1e-7 apart).
"""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_dp_strategies import RingAllReduceStrategy
from lightning_dp_strategies.core.fault_tolerance import FaultTolerance, LostBatches, Survivors
from lightning_dp_strategies.core.membership import ExcludedError, Membership, MembershipConfig
from tests.helpers.distributed import run_script
from tests.strategies.fault_tolerant_scenarios import (
    STEPS_PER_EPOCH,
    WORLD,
    Run,
    assert_departs,
    assert_survived,
    final_params as _params,
    launch,
    result as _result,
    uninterrupted_params,
)

TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> torch.Tensor:
    return uninterrupted_params(Run(), tmp_path_factory.mktemp("uninterrupted"))


@pytest.fixture(scope="module")
def uninterrupted_of_40(tmp_path_factory: pytest.TempPathFactory) -> torch.Tensor:
    """40 steps without a failure (the admission runs pace their steps so that a replacement's start-up spans a few
    epochs; a pace changes no parameter, so the reference runs unpaced)."""
    return uninterrupted_params(Run(steps=40), tmp_path_factory.mktemp("forty"))


@pytest.mark.timeout(240)
def test_survivors_of_a_killed_rank_end_on_the_uninterrupted_parameters(
    uninterrupted: torch.Tensor, tmp_path: Path
) -> None:
    outcomes, codes, _ = launch(Run(victim=1, fail_at=3), tmp_path)
    assert codes == [0, -9, 0], outcomes
    for rank in (0, 2):
        result = outcomes[rank]
        assert isinstance(result, dict), result
        assert result["global_step"] == Run().steps
        assert result["recoveries"] == [(3, [1], [0, 2])]
        assert (_params(outcomes, rank) - uninterrupted).abs().max().item() <= TOLERANCE
    # rank 0 still leads: it wrote the best checkpoint, and it loads
    assert outcomes[0]["is_global_zero"] and not outcomes[2]["is_global_zero"]  # type: ignore[index]
    best = outcomes[0]["best"]  # type: ignore[index]
    assert Path(best).is_file()
    state = torch.load(best, weights_only=False)["state_dict"]
    assert set(state) >= {"net.0.weight", "net.2.bias"}


@pytest.mark.timeout(240)
def test_two_ranks_killed_in_one_step_leave_one_survivor_on_the_uninterrupted_parameters(
    uninterrupted: torch.Tensor, tmp_path: Path
) -> None:
    """Ranks 1 and 2 killed at the start of step 3: rank 0 alone trains all three micro-batches of every step."""
    outcomes, codes, _ = launch(Run(victim=1, fail_at=3, also=(2, 3)), tmp_path)
    assert_survived(outcomes, codes, [1, 2], uninterrupted, TOLERANCE)
    assert _result(outcomes, 0)["global_step"] == Run().steps


@pytest.mark.timeout(240)
def test_when_rank_zero_is_lost_the_lowest_survivor_leads(uninterrupted: torch.Tensor, tmp_path: Path) -> None:
    outcomes, codes, _ = launch(Run(victim=0, fail_at=2), tmp_path)
    assert codes == [-9, 0, 0], outcomes
    assert outcomes[1]["recoveries"] == [(2, [0], [1, 2])]  # type: ignore[index]
    assert outcomes[1]["is_global_zero"] and not outcomes[2]["is_global_zero"]  # type: ignore[index]
    assert Path(outcomes[1]["best"]).is_file()  # type: ignore[index]  # written by the new leader
    for rank in (1, 2):
        assert (_params(outcomes, rank) - uninterrupted).abs().max().item() <= TOLERANCE


@pytest.mark.timeout(240)
@pytest.mark.parametrize("in_step", [None, "sync_dist"])
def test_a_hung_rank_is_left_behind_after_the_timeout(
    uninterrupted: torch.Tensor, tmp_path: Path, in_step: str | None
) -> None:
    # met in the step's gradient reduction, or first in training_step's `sync_dist` reduction, whose group has the
    # strategy's timeout (here 600 s, past the launch's 120 s): in the step the others give up after `timeout_s` (5 s)
    # either way. The hung rank never ends: the others exit at once after reporting, so a short linger will do
    run = Run(victim=2, fail_at=4, kind="hang", in_step=in_step, strategy_timeout_s=600.0)
    outcomes, codes, _ = launch(run, tmp_path, expected=2, linger=3.0)
    assert codes[:2] == [0, 0] and codes[2] == -9, outcomes  # the hung rank is killed by the launcher at the end
    assert _result(outcomes, 0)["recoveries"] == [(4, [2], [0, 1])]
    for rank in (0, 1):
        assert (_params(outcomes, rank) - uninterrupted).abs().max().item() <= TOLERANCE


@pytest.mark.timeout(240)
def test_a_rank_lost_as_training_step_syncs_its_logged_loss_is_survived(
    uninterrupted: torch.Tensor, tmp_path: Path
) -> None:
    # the survivors first meet the loss in training_step's `sync_dist` reduction (inside the optimizer step); each
    # must notice it within `stale_s` (a wait that polls the heartbeats), else the one whose gloo reduction waits on
    # the other survivor comes to the agreement after it has decided, and is excluded. After the recovery the survivor
    # that trains the lost rank's micro-batch runs training_step once more, whose logging must not reduce: the other
    # survivor runs no such reduction
    outcomes, codes, _ = launch(Run(victim=2, fail_at=3, in_step="sync_dist"), tmp_path)
    assert_survived(outcomes, codes, 2, uninterrupted, TOLERANCE)


@pytest.mark.timeout(240)
def test_a_collective_of_training_step_on_a_lost_ranks_batch_is_refused_naming_the_fix(tmp_path: Path) -> None:
    # the survivors train different numbers of lost micro-batches, so an all_gather there would meet no partner
    outcomes, codes, _ = launch(Run(victim=2, fail_at=3, in_step="all_gather"), tmp_path)
    assert codes[2] == -9, outcomes
    errors = [str(outcomes.get(rank)) for rank in (0, 1)]
    assert any("while this rank trained a lost rank's micro-batch" in error for error in errors), errors
    assert all("keep_global_batch=False" in error for error in errors), errors


@pytest.mark.timeout(240)
def test_the_modules_all_gather_runs_over_the_survivors(tmp_path: Path) -> None:
    # LightningModule.all_gather passes the WORLD group where the user passes none: after a loss it must still mean
    # the survivors (each trains its own micro-batch only here, so every survivor runs it)
    outcomes, codes, _ = launch(Run(victim=2, fail_at=3, in_step="all_gather", keep_global_batch=False), tmp_path)
    assert codes == [0, 0, -9], outcomes
    for rank in (0, 1):
        assert _result(outcomes, rank)["global_step"] == Run().steps


@pytest.mark.timeout(240)
def test_a_shrinking_batch_departs_from_the_uninterrupted_run(uninterrupted: torch.Tensor, tmp_path: Path) -> None:
    """The control of the first test: without the lost rank's batches the parameters differ far beyond 1e-6."""
    assert_departs(Run(victim=1, fail_at=3, keep_global_batch=False), tmp_path, uninterrupted)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("in_step", [None, "sync_dist"])
def test_a_rank_whose_step_failed_while_the_others_completed_takes_their_result(
    uninterrupted: torch.Tensor, tmp_path: Path, in_step: str | None
) -> None:
    """Rank 2's step 2 fails after the reduction completed everywhere; ranks 0 and 1 took step 2 and fail in step
    3. All three are alive: rank 2 is one step behind and receives rank 0's state instead of redoing step 2. With
    ``training_step`` reducing its logged loss, rank 2's closure, run once more, takes the reduction's result from
    its failed attempt (the others are not in a reduction)."""
    outcomes, codes, _ = launch(Run(stumble=(2, 2), in_step=in_step), tmp_path)
    assert codes == [0] * WORLD, outcomes
    for rank in range(WORLD):
        assert _result(outcomes, rank)["recoveries"] == [(3, [], [0, 1, 2])]
        assert _result(outcomes, rank)["behind"] == [[2]]
        assert (_params(outcomes, rank) - uninterrupted).abs().max().item() <= TOLERANCE


@pytest.mark.timeout(240)
def test_a_rank_lost_while_a_step_behind_catches_up_is_survived(tmp_path: Path) -> None:
    """Four ranks: rank 2's step 2 fails after the reduction completed everywhere, so it is one step behind; rank 3
    is killed as the survivors start handing it the step's state. Ranks 0, 1 and 2 recover again without rank 3
    (rank 2 still behind, or caught up where the state reached it before the loss cut the broadcast short) and end
    on the uninterrupted run's parameters."""
    reference = uninterrupted_params(Run(world=4), tmp_path / "reference")
    outcomes, codes, _ = launch(Run(world=4, stumble=(2, 2), dies_recovering=("catch_up", 3)), tmp_path / "lost")
    assert codes == [0, 0, 0, -9], outcomes
    for rank in range(3):
        result = _result(outcomes, rank)
        assert [lost for _, lost, _ in result["recoveries"]] == [[], [3]]
        assert result["behind"][0] == [2] and result["global_step"] == Run().steps
        assert (_params(outcomes, rank) - reference).abs().max().item() <= TOLERANCE


@pytest.mark.timeout(240)
def test_a_rank_whose_last_step_before_validation_failed_catches_up_with_the_others_in_validation(
    uninterrupted: torch.Tensor, tmp_path: Path
) -> None:
    """Rank 2's last step of the first epoch fails after the reduction completed everywhere; ranks 0 and 1 took it
    and wait in validation's first collective. They take part in handing rank 2 the step's state, then all three
    meet in the collective again."""
    outcomes, codes, _ = launch(Run(stumble=(2, 4)), tmp_path)
    assert codes == [0] * WORLD, outcomes
    for rank in range(WORLD):
        assert _result(outcomes, rank)["behind"] == [[2]]
        assert (_params(outcomes, rank) - uninterrupted).abs().max().item() <= TOLERANCE


@pytest.mark.timeout(240)
@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_lost_in_validation_is_survived(uninterrupted: torch.Tensor, tmp_path: Path, victim: int) -> None:
    """A rank killed at its first validation batch of the second epoch: the survivors redo the collective they were
    in over themselves, and training ends on the uninterrupted run's parameters (the lowest survivor leading)."""
    outcomes, codes, _ = launch(Run(dies_between_steps=("validation", victim, 1)), tmp_path)
    survivors = assert_survived(outcomes, codes, victim, uninterrupted, TOLERANCE)
    for rank in survivors:
        result = _result(outcomes, rank)
        assert result["global_step"] == Run().steps
        assert math.isfinite(result["val_mse"])
        assert result["is_global_zero"] == (rank == survivors[0])
    assert Path(_result(outcomes, survivors[0])["best"]).is_file()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("method", ["validate", "test"])
def test_a_rank_lost_in_trainer_validate_or_test_is_survived(method: str, tmp_path: Path) -> None:
    """``trainer.validate`` or ``trainer.test`` alone (no fit): rank 1 killed at its first batch; the survivors
    finish the loop over themselves and log the metric. No warning about the metric's own sync arguments: it has
    none (the strategy's edits of the metric are not mistaken for the user's)."""
    during = "validation" if method == "validate" else "test"
    outcomes, codes, _ = launch(Run(evaluate_only=method, dies_between_steps=(during, 1, 0)), tmp_path)
    assert codes == [0, -9, 0], outcomes
    for rank in (0, 2):
        result = _result(outcomes, rank)
        assert [(lost, members) for _, lost, members in result["recoveries"]] == [([1], [0, 2])]
        assert math.isfinite(result["val_mse" if method == "validate" else "test_mse"])
        assert not [w for w in result["warnings"] if "is not used under `fault_tolerant=True`" in w]


@pytest.mark.timeout(240)
def test_a_rank_whose_reduction_failed_while_the_others_completed_takes_their_result(
    uninterrupted: torch.Tensor, tmp_path: Path
) -> None:
    """In the second validation rank 2's first reduction completes everywhere, then fails on rank 2; ranks 0 and 1
    fail in the next collective. All three are alive: rank 2 is one collective behind and takes rank 0's result."""
    outcomes, codes, _ = launch(Run(reduction_stumbles=(2, ("validation", 1))), tmp_path)
    assert codes == [0] * WORLD, outcomes
    for rank in range(WORLD):
        assert _result(outcomes, rank)["behind_control"] == [[2]]
        assert _result(outcomes, rank)["behind"] == [[]]
        assert (_params(outcomes, rank) - uninterrupted).abs().max().item() <= TOLERANCE


@pytest.mark.timeout(240)
def test_a_rank_one_collective_behind_gets_its_result_from_ranks_already_in_the_next_step(
    uninterrupted: torch.Tensor, tmp_path: Path
) -> None:
    """Before step 7 every rank reduces a value (a callback's collective); rank 2's reduction completes everywhere,
    then fails on rank 2, while ranks 0 and 1 go on into step 7's gradient reduction. Those two take part in handing
    rank 2 the result from their step's recovery, and every rank redoes step 7."""
    outcomes, codes, _ = launch(Run(reduction_stumbles=(2, ("before_step", 7))), tmp_path)
    assert codes == [0] * WORLD, outcomes
    for rank in range(WORLD):
        assert _result(outcomes, rank)["behind_control"] == [[2]]
        assert (_params(outcomes, rank) - uninterrupted).abs().max().item() <= TOLERANCE


@pytest.mark.timeout(240)
def test_a_checkpoint_whose_writer_was_lost_is_written_by_the_new_leader(tmp_path: Path) -> None:
    """Rank 0 (the leader) is killed while the last checkpoint is saved, before it wrote the file: rank 1 leads and
    writes it, and it holds the parameters the survivors ended on."""
    run = Run(steps=2 * STEPS_PER_EPOCH, dies_between_steps=("save", 0, 1))
    outcomes, codes, _ = launch(run, tmp_path)
    assert codes == [-9, 0, 0], outcomes
    assert _result(outcomes, 1)["recoveries"][0][1:] == ([0], [1, 2])
    saved = _result(outcomes, 1)["best_params"]
    assert saved is not None and Path(_result(outcomes, 1)["best"]).is_file()
    assert torch.equal(torch.tensor(saved), _params(outcomes, 1))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_lost_in_a_checkpoint_saved_within_the_epoch_is_survived(
    uninterrupted: torch.Tensor, tmp_path: Path, victim: int
) -> None:
    """A checkpoint every 3 steps, saved from the training loop (``on_train_batch_end``) rather than after
    validation: killed in step 6's save, before it was written, the survivors go on to the uninterrupted run's
    parameters, and the step-6 file is written (by rank 1 when rank 0 was lost)."""
    run = Run(checkpoint_every=3, dies_between_steps=("save", victim, 1))
    outcomes, codes, _ = launch(run, tmp_path)
    assert_survived(outcomes, codes, victim, uninterrupted, TOLERANCE)
    assert (tmp_path / "steps" / "step=6.ckpt").is_file()


# ---------------------------------------------------------------------------------------------- one process


def test_lost_batches_are_the_ones_the_lost_ranks_sampler_gives() -> None:
    data = torch.arange(50.0)
    sampler = DistributedSampler(data, num_replicas=3, rank=0, shuffle=True, seed=7)
    sampler.set_epoch(2)
    lost = LostBatches(DataLoader(data, batch_size=4, sampler=sampler))
    for rank in (1, 2):
        theirs = DistributedSampler(data, num_replicas=3, rank=rank, shuffle=True, seed=7)
        theirs.set_epoch(2)
        expected = list(DataLoader(data, batch_size=4, sampler=theirs))
        got = [lost.batch(rank, i) for i in range(len(expected))]
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
        assert lost.batch(rank, len(expected)) is None


def test_a_loader_whose_batches_cannot_be_rebuilt_is_refused_naming_the_fix() -> None:
    with pytest.raises(ValueError, match="keep_global_batch=False"):
        LostBatches(DataLoader(torch.arange(8.0), batch_size=2))  # no DistributedSampler
    assert Survivors(FaultTolerance(keep_global_batch=False)).use_loader([1, 2]) is None  # not needed: not checked


@pytest.mark.timeout(60)
def test_a_restarted_worker_joins_only_while_another_rank_beats(monkeypatch: pytest.MonkeyPatch) -> None:
    # a worker restarted by its torchrun agent: a replacement while the others train on (their heartbeats move);
    # after a restart of the whole job (every heartbeat stopped) or in a first attempt it starts as usual
    from datetime import timedelta

    from lightning_dp_strategies.core import elastic
    from lightning_dp_strategies.core.fault_tolerance import (
        JOIN_ENV,
        PREFIX,
        RESTART_ENV,
        join_running_job,
        restarted_into_running_job,
    )

    agent = torch.distributed.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    agent.set(f"{elastic.PREFIX}/current", "attempt-a")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(agent.port))
    options, timeout = FaultTolerance(heartbeat_s=0.05, stale_s=0.5), timedelta(seconds=10)
    store = elastic.running_attempt_store("ft/", timeout)
    assert store is not None
    store.add(f"{PREFIX}/heartbeat/1", 3)  # rank 1 beat, then stopped
    monkeypatch.setenv(RESTART_ENV, "0")
    assert not restarted_into_running_job(0, 2, options, timeout)  # a first attempt
    monkeypatch.setenv(RESTART_ENV, "1")
    assert not restarted_into_running_job(0, 2, options, timeout)  # nobody beats: the whole job restarted
    beating = threading.Event()

    def beat() -> None:
        while not beating.wait(0.05):
            store.add(f"{PREFIX}/heartbeat/1", 1)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        assert restarted_into_running_job(0, 2, options, timeout)
    finally:
        beating.set()
        thread.join()
    # the job ended while it waited for an answer: a restarted worker starts as usual, a replacement says why
    assert join_running_job(0, 2, options, timeout) is None
    monkeypatch.setenv(JOIN_ENV, "1")
    with pytest.raises(RuntimeError, match=r"ended before admitting it .*Start the whole job again, without LDPS_JOIN"):
        join_running_job(0, 2, options, timeout)


@pytest.mark.timeout(60)
def test_a_join_request_is_answered_however_late_or_given_up_once_the_job_stops_beating() -> None:
    from lightning_dp_strategies.core.fault_tolerance import PREFIX, Admission, request_join

    store, options = torch.distributed.HashStore(), FaultTolerance(heartbeat_s=0.05, stale_s=0.5)
    store.add(f"{PREFIX}/heartbeat/0", 7)  # rank 0 beat, then stopped: the job ended
    assert request_join(store, 1, 2, options) is None
    asked_before = store.get(f"{PREFIX}/join/1")
    stop = threading.Event()

    def leader() -> None:  # rank 0 beats, and answers the new request at an epoch start 2 s later (4 x stale_s)
        answer_at = time.monotonic() + 2.0
        while not stop.wait(0.05):
            store.add(f"{PREFIX}/heartbeat/0", 1)
            token = store.get(f"{PREFIX}/join/1")
            if token != asked_before and time.monotonic() > answer_at:
                store.set(f"{PREFIX}/admitted/{token.decode()}", "2;0;1")

    thread = threading.Thread(target=leader, daemon=True)
    thread.start()
    try:
        assert request_join(store, 1, 2, options) == Admission(2, 0, [1])
    finally:
        stop.set()
        thread.join()


@pytest.mark.timeout(240)
def test_a_whole_job_restart_starts_afresh_though_a_failing_worker_still_beat(
    uninterrupted: torch.Tensor, tmp_path: Path
) -> None:
    # every worker restarted by its torchrun agent (the whole job failed) while rank 1's worker of the attempt before
    # still beat: ranks 0 and 2 take that attempt for a running job and ask to join it; once its heartbeats stop they
    # start afresh with rank 1, instead of waiting for an answer for the strategy's timeout (600 s, past the launch's)
    outcomes, codes, _ = launch(Run(restart_while_beating=1, strategy_timeout_s=600.0), tmp_path)
    assert codes == [0] * WORLD, outcomes
    for rank in range(WORLD):
        assert _result(outcomes, rank)["admitted_at"] is None
        assert (_params(outcomes, rank) - uninterrupted).abs().max().item() <= TOLERANCE


def test_a_stopped_heartbeat_is_stale_after_stale_s() -> None:
    store = torch.distributed.HashStore()
    config = MembershipConfig(heartbeat_s=0.05, stale_s=0.3)
    watcher, beating = Membership(store, 0, 2, config), Membership(store, 1, 2, config)
    beating.start_heartbeat()
    time.sleep(0.2)
    assert watcher.stale([1]) == []
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        assert watcher.stale([1]) == []  # beating: never stale
        time.sleep(0.05)
    beating.stop_heartbeat()
    time.sleep(0.1)  # a beat under way when it stopped lands
    watcher.stale([1])
    time.sleep(0.35)
    assert watcher.stale([1]) == [1]


def test_a_readmitted_rank_is_watched_afresh_not_by_the_beats_of_the_process_it_replaces() -> None:
    store = torch.distributed.HashStore()
    config = MembershipConfig(heartbeat_s=0.05, stale_s=0.3)
    watcher, lost = Membership(store, 0, 2, config), Membership(store, 1, 2, config)
    lost.start_heartbeat()
    time.sleep(0.15)
    watcher.stale([1])
    lost.stop_heartbeat()
    time.sleep(0.1)  # a beat under way when it stopped lands
    watcher.stale([1])
    time.sleep(0.35)
    assert watcher.stale([1]) == [1]  # the lost process
    watcher.rejoin(1)  # its replacement is admitted and has not beaten yet
    assert watcher.state.epoch == 1 and watcher.state.members == [0, 1]
    assert watcher.stale([1]) == []  # watched from now, not from the lost process's last beat
    time.sleep(0.35)
    assert watcher.stale([1]) == [1]  # a replacement that never beats is still found out, stale_s later


class BlockingStore(torch.distributed.Store):
    """A store whose calls block (as over a cut link) once ``blocked`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.blocked = torch.distributed.HashStore(), False

    def _wait(self) -> None:
        while self.blocked:
            time.sleep(0.01)

    def add(self, key: str, value: int) -> int:
        self._wait()
        return self.inner.add(key, value)

    def check(self, keys: list[str]) -> bool:
        self._wait()
        return self.inner.check(keys)


def test_a_rank_cut_from_the_store_knows_without_waiting_on_it_and_leaves() -> None:
    store = BlockingStore()
    survivors = Survivors(FaultTolerance(heartbeat_s=0.05, stale_s=0.3))
    membership = survivors.membership = Membership(store, 0, 2, MembershipConfig(heartbeat_s=0.05, stale_s=0.3))
    membership.start_heartbeat()
    time.sleep(0.2)
    assert membership.interrupted() is None and membership.cut_off() is None
    store.blocked = True  # the link goes down: every store call hangs
    time.sleep(0.5)
    start = time.monotonic()
    reason = membership.interrupted()
    assert time.monotonic() - start < 0.05  # answered without touching the store
    assert reason is not None and "has not reached the job's store" in reason
    with pytest.raises(ExcludedError, match="lost the job's store"):
        survivors.recover(step=7, error=RuntimeError("Timed out waiting 5000ms for recv"))
    store.blocked = False
    membership.stop_heartbeat()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"shard_optimizer_state": True}, "shard_optimizer_state=True"),
        ({"two_level": True}, "two_level=True"),
        ({"reducer": "auto"}, "reducer='auto'"),
        ({"fault_tolerant": "yes"}, "True, False or a FaultTolerance"),
        ({"fault_tolerant": FaultTolerance(state_copies=2)}, "has nothing to copy: only local SGD"),
    ],
)
def test_impossible_combinations_are_refused_at_construction(options: dict[str, object], message: str) -> None:
    options = {"fault_tolerant": True, **options}
    with pytest.raises((ValueError, TypeError), match=message.replace("(", r"\(")):
        RingAllReduceStrategy(**options)  # type: ignore[arg-type]


def test_fault_tolerance_options_are_checked() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        FaultTolerance(timeout_s=0)
    with pytest.raises(ValueError, match="stale_s"):
        FaultTolerance(heartbeat_s=1.0, stale_s=1.5)
    for copies in (0, 1.5, True):
        with pytest.raises(ValueError, match="state_copies"):
            FaultTolerance(state_copies=copies)  # type: ignore[arg-type]
    assert math.isclose(Survivors(FaultTolerance()).grad_scale, 1.0)


@pytest.mark.timeout(300)
def test_a_rank_lost_while_a_replacement_is_being_admitted_is_survived_and_the_admission_waits(
    uninterrupted_of_40: torch.Tensor, tmp_path: Path
) -> None:
    """Rank 1 killed at step 3 and its replacement started; at the next epoch start rank 2 waits for the join
    request, then is killed, while rank 0 waits in the collective that shares the requests. Rank 0 notices the loss
    there, recovers, leaves the admission for when every lost rank has a replacement, and ends alone on the
    uninterrupted run's parameters."""
    run = Run(steps=40, pace_s=0.15, victim=1, fail_at=3, replace=True, dies_admitting=("request", 2))
    outcomes, codes, _ = launch(run, tmp_path / "lost", expected=1, linger=1.0)
    assert codes[:WORLD] == [0, -9, -9], outcomes
    survivor = _result(outcomes, 0)
    assert [(lost, members) for _, lost, members in survivor["recoveries"]] == [([1], [0, 2]), ([2], [0])]
    assert survivor["joins"] == [] and survivor["global_step"] == 40
    assert (_params(outcomes, 0) - uninterrupted_of_40).abs().max().item() <= TOLERANCE


ACCUMULATING = """
import lightning as L
from torch.utils.data import DataLoader
from lightning_dp_strategies import RingAllReduceStrategy
from tests.strategies.fault_tolerant_scenarios import Regression, data

trainer = L.Trainer(strategy=RingAllReduceStrategy(fault_tolerant=True), accelerator="cpu", devices=1, max_steps=1,
                    accumulate_grad_batches=2, logger=False, enable_progress_bar=False, default_root_dir={root!r})
trainer.fit(Regression(), DataLoader(data(8, 0), batch_size=2))
"""


def test_accumulation_is_refused_at_setup(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match=r"accumulate_grad_batches=2\): raise the batch size"):
        run_script(["-c", ACCUMULATING.format(root=str(tmp_path))], timeout=120)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("victim", "restarted"), [(1, False), (0, True)])
def test_a_replacement_joins_at_an_epoch_start_and_the_run_ends_on_the_uninterrupted_parameters(
    uninterrupted_of_40: torch.Tensor, tmp_path: Path, victim: int, restarted: bool
) -> None:
    # restarted: the victim's worker started again by its torchrun agent (`--max-restarts`), which is how node 0's
    # worker comes back (node 0's agent hosts the store, and without a restart it would end the job); it finds the
    # others beating and joins as a replacement started with LDPS_JOIN=1 does
    run = Run(steps=40, pace_s=0.15, victim=victim, fail_at=3, replace=True, restarted=restarted)
    outcomes, codes, _ = launch(run, tmp_path / "joined")
    assert codes[:WORLD] == [-9 if r == victim else 0 for r in range(WORLD)] and codes[WORLD:] == [0], outcomes
    joined = outcomes[victim]
    assert isinstance(joined, dict), joined
    assert joined["admitted_at"] == 2  # membership epochs: 1 when the victim was lost, 2 when its replacement came
    ((step, ranks),) = outcomes[2]["joins"]  # type: ignore[index]
    assert ranks == [victim] and step % 5 == 0 and 5 <= step < 40  # at an epoch's start
    for rank in range(WORLD):
        assert (_params(outcomes, rank) - uninterrupted_of_40).abs().max().item() <= TOLERANCE
        assert outcomes[rank]["global_step"] == 40  # type: ignore[index]
