"""``LocalSGDStrategy(fault_tolerant=True)``: a lost rank's replica is trained by a survivor, so the run ends on the
uninterrupted run's parameters.

Three gloo ranks launched as torchrun launches them (``fault_tolerant_scenarios``), SGD with momentum as the inner
optimizer (its state is what the survivors cannot average and must be handed over), ``sync_every=4`` over epochs of 5
steps with validation at each epoch's end (so periods end at a synchronisation and at validation). The specification
is the uninterrupted run's final parameters, to 1e-6 (a replica's sums run in another order: about 1e-7 apart).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_dp_strategies import LocalSGDStrategy
from lightning_dp_strategies.core.fault_tolerance import FaultTolerance
from lightning_dp_strategies.core.handover import handover_plan, takeover_plan
from lightning_dp_strategies.local_sgd.replicas import Replicas
from tests.strategies import fault_tolerant_scenarios as ft

TOLERANCE = 1e-6
SYNC_EVERY = 4


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> torch.Tensor:
    return ft.uninterrupted_params(ft.Run(sync_every=SYNC_EVERY), tmp_path_factory.mktemp("uninterrupted"))


@pytest.fixture(scope="module")
def uninterrupted_of_40(tmp_path_factory: pytest.TempPathFactory) -> torch.Tensor:
    """40 steps without a failure (the admission runs pace their steps so that a replacement's start-up spans a few
    epochs; a pace changes no parameter, so the reference runs unpaced)."""
    return ft.uninterrupted_params(ft.Run(steps=40, sync_every=SYNC_EVERY), tmp_path_factory.mktemp("forty"))


@pytest.fixture(scope="module")
def with_batch_norm(tmp_path_factory: pytest.TempPathFactory) -> torch.Tensor:
    run = ft.Run(sync_every=SYNC_EVERY, batch_norm=True)
    return ft.uninterrupted_params(run, tmp_path_factory.mktemp("batch-norm"))


@pytest.mark.timeout(240)
def test_survivors_of_a_rank_killed_mid_period_end_on_the_uninterrupted_parameters(
    uninterrupted: torch.Tensor, tmp_path: Path
) -> None:
    # killed at the start of step 7: the period that began at step 5 (after validation) is met at step 9's sync,
    # where rank 0 takes logical rank 1 over: its replica replays steps 5-8 from the momentum handed over at step 5
    outcomes, codes, _ = ft.launch(ft.Run(sync_every=SYNC_EVERY, victim=1, fail_at=7), tmp_path)
    assert codes == [0, -9, 0], outcomes
    for rank in (0, 2):
        result = ft.result(outcomes, rank)
        assert result["global_step"] == ft.Run().steps
        assert [lost for _, lost, _ in result["recoveries"]] == [[1]]
        assert (ft.final_params(outcomes, rank) - uninterrupted).abs().max().item() <= TOLERANCE
    # the leader wrote the checkpoints after the loss, and the last one holds the uninterrupted model
    best = ft.result(outcomes, 0)["best_params"]
    assert best is not None and ft.result(outcomes, 2)["best_params"] is None
    saved = torch.load(ft.result(outcomes, 0)["best"], weights_only=False)["local_sgd"]["ranks"]
    assert len(saved) == ft.WORLD and all(record is not None for record in saved)


@pytest.mark.timeout(240)
def test_a_rank_lost_as_training_step_syncs_its_logged_loss_is_survived(
    uninterrupted: torch.Tensor, tmp_path: Path
) -> None:
    # met in training_step's `sync_dist` reduction of an inner step, not at a synchronisation: the taker's replica
    # must start there (replaying steps 5-6) before the step is redone, and train step 7 with it
    outcomes, codes, _ = ft.launch(ft.Run(sync_every=SYNC_EVERY, victim=2, fail_at=7, in_step="sync_dist"), tmp_path)
    ft.assert_survived(outcomes, codes, 2, uninterrupted, TOLERANCE)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "where",
    [
        ("in_step", 5),
        ("in_step", SYNC_EVERY - 1),
        ("in_step", ft.STEPS_PER_EPOCH - 1),
        ("before_step", 5),
        ("before_step", ft.STEPS_PER_EPOCH * 2 - 1),
    ],
)
def test_a_rank_whose_reduction_completed_only_elsewhere_takes_their_result_and_catches_up(
    uninterrupted: torch.Tensor, tmp_path: Path, where: tuple[str, int]
) -> None:
    # rank 1's reduction completes on the others and then fails on it: training_step's `sync_dist` reduction
    # ("in_step"), or a callback's before the step ("before_step"). An inner step sends nothing, so they go on to
    # their next collective (the next inner step's reduction, the synchronisation that ends the period, the one
    # before validation) and fail there. Rank 1 takes their result, redoes its step with it (or trains the steps it
    # is behind) and meets them.
    run = ft.Run(sync_every=SYNC_EVERY, in_step="sync_dist" if where[0] == "in_step" else None)
    outcomes, codes, _ = ft.launch(dataclasses.replace(run, reduction_stumbles=(1, where)), tmp_path)
    assert codes == [0] * ft.WORLD, outcomes
    for rank in range(ft.WORLD):
        assert ft.result(outcomes, rank)["behind"] == [[1]]
        assert (ft.final_params(outcomes, rank) - uninterrupted).abs().max().item() <= TOLERANCE


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tensor_lr", [False, True])
def test_a_replay_steps_at_the_learning_rates_the_lost_rank_stepped_at(tensor_lr: bool, tmp_path: Path) -> None:
    # the learning rate decays at every step: the replica's replay of steps 5-6 (at recovery, step 9's sync) must
    # use the rates of steps 5 and 6, not the rate of the step where the replay runs; also where the rate is a
    # tensor, which the scheduler fills in place (a reference to it would read the current rate)
    run = ft.Run(sync_every=SYNC_EVERY, schedule=True, tensor_lr=tensor_lr)
    reference = ft.uninterrupted_params(run, tmp_path / "reference")
    outcomes, codes, _ = ft.launch(dataclasses.replace(run, victim=1, fail_at=7), tmp_path / "lost")
    ft.assert_survived(outcomes, codes, 1, reference, TOLERANCE)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("where", "periods"), [("bytes", 2), ("sizes", 1)])
def test_a_rank_lost_while_its_states_are_in_flight_is_rebuilt_from_the_states_before(
    where: str, periods: int, with_batch_norm: torch.Tensor, tmp_path: Path
) -> None:
    # rank 1 dies in the hand-over after the synchronisation at validation (step 5), which it committed. "bytes": its
    # states were never sent, so when the survivors meet the loss in validation, its taker starts from the states of
    # the synchronisation at step 4 and replays two periods (step 4's, then the empty one since step 5), in training
    # mode (the model has batch norm). "sizes": the survivors' hand-over itself fails, inside the synchronisation,
    # and the states that arrived from step 4 serve with one period replayed
    run = ft.Run(sync_every=SYNC_EVERY, batch_norm=True, dies_handing_over=(where, 1, 5))
    outcomes, codes, _ = ft.launch(run, tmp_path)
    ft.assert_survived(outcomes, codes, 1, with_batch_norm, TOLERANCE)
    assert [ft.result(outcomes, rank)["replayed"] for rank in (0, 2)] in ([[periods], []], [[], [periods]])


@pytest.mark.timeout(240)
def test_without_the_handed_over_state_the_run_departs(uninterrupted: torch.Tensor, tmp_path: Path) -> None:
    """The control: with a shrinking batch the lost rank's period is dropped, and the parameters end elsewhere."""
    ft.assert_departs(
        ft.Run(sync_every=SYNC_EVERY, victim=1, fail_at=7, keep_global_batch=False), tmp_path, uninterrupted
    )


@pytest.mark.timeout(240)
def test_a_rank_whose_average_failed_after_the_others_got_it_takes_theirs(
    uninterrupted: torch.Tensor, tmp_path: Path
) -> None:
    outcomes, codes, _ = ft.launch(ft.Run(sync_every=SYNC_EVERY, average_fails=(2, 1)), tmp_path)
    assert codes == [0] * ft.WORLD, outcomes
    for rank in range(ft.WORLD):
        result = ft.result(outcomes, rank)
        assert result["lagging"] == [[2]] and result["behind"] == [[]], result
        assert result["recoveries"][0][1:] == ([], [0, 1, 2])
        assert (ft.final_params(outcomes, rank) - uninterrupted).abs().max().item() <= TOLERANCE


@pytest.mark.timeout(240)
@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_lost_in_validation_is_replaced_by_its_replica(
    uninterrupted: torch.Tensor, tmp_path: Path, victim: int
) -> None:
    """Killed at its first validation batch of the second epoch (the ranks in sync after the synchronisation before
    validation): the survivors redo the collective they were in, the taker starts the lost rank's replica from the
    state handed over at that synchronisation, and the run ends on the uninterrupted run's parameters."""
    outcomes, codes, _ = ft.launch(
        ft.Run(sync_every=SYNC_EVERY, dies_between_steps=("validation", victim, 1)), tmp_path
    )
    survivors = ft.assert_survived(outcomes, codes, victim, uninterrupted, TOLERANCE)
    assert ft.result(outcomes, survivors[0])["best_params"] is not None


@pytest.mark.timeout(240)
@pytest.mark.parametrize("method", ["validate", "test"])
def test_a_rank_lost_in_trainer_validate_or_test_is_survived(method: str, tmp_path: Path) -> None:
    """``trainer.validate`` or ``trainer.test`` alone (no fit, the ranks in sync): rank 1 killed at its first batch;
    the survivors finish the loop over themselves and log the metric."""
    during = "validation" if method == "validate" else "test"
    run = ft.Run(sync_every=SYNC_EVERY, evaluate_only=method, dies_between_steps=(during, 1, 0))
    outcomes, codes, _ = ft.launch(run, tmp_path)
    assert codes == [0, -9, 0], outcomes
    for rank in (0, 2):
        result = ft.result(outcomes, rank)
        assert [(lost, members) for _, lost, members in result["recoveries"]] == [([1], [0, 2])]
        assert math.isfinite(result["val_mse" if method == "validate" else "test_mse"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("victim", [0, 1])
def test_a_rank_lost_while_a_checkpoint_is_saved_is_survived(
    uninterrupted: torch.Tensor, tmp_path: Path, victim: int
) -> None:
    """Killed while the second epoch's checkpoint is saved (rank 0: the writer, before it gathered every rank's
    state): the survivors redo the gather of every rank's own state to the leader of then, the lost rank's from the
    replica its taker now trains, and the run ends on the uninterrupted run's parameters; the leader's last
    checkpoint holds a record for every rank of the world."""
    outcomes, codes, _ = ft.launch(ft.Run(sync_every=SYNC_EVERY, dies_between_steps=("save", victim, 1)), tmp_path)
    survivors = ft.assert_survived(outcomes, codes, victim, uninterrupted, TOLERANCE)
    leader = ft.result(outcomes, survivors[0])
    saved = torch.load(leader["best"], weights_only=False)["local_sgd"]["ranks"]
    assert len(saved) == ft.WORLD and all(record is not None for record in saved)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_lost_while_a_mid_period_checkpoints_model_is_averaged_is_survived(
    uninterrupted: torch.Tensor, tmp_path: Path, victim: int
) -> None:
    """A checkpoint every 3 steps: those at steps 6 and 12 are taken mid-period, their model the ranks' average (a
    collective). Killed as step 6's is made: the survivors redo the average over themselves, the lost rank's part
    from the replica its taker now trains; the run ends on the uninterrupted run's parameters, and the checkpoints of
    steps 6 and 12 hold the models the uninterrupted run's hold."""
    reference, codes, _ = ft.launch(ft.Run(sync_every=SYNC_EVERY, checkpoint_every=3), tmp_path / "reference")
    assert codes == [0] * ft.WORLD, reference
    run = ft.Run(sync_every=SYNC_EVERY, checkpoint_every=3, dies_between_steps=("state", victim, 1))
    outcomes, codes, _ = ft.launch(run, tmp_path / "lost")
    ft.assert_survived(outcomes, codes, victim, uninterrupted, TOLERANCE)
    for step in (6, 12):
        ours = torch.load(tmp_path / "lost" / "steps" / f"step={step}.ckpt", weights_only=False)
        theirs = torch.load(tmp_path / "reference" / "steps" / f"step={step}.ckpt", weights_only=False)
        for key, value in theirs["state_dict"].items():
            assert (ours["state_dict"][key] - value).abs().max().item() <= TOLERANCE, (step, key)
        assert all(record is not None for record in ours["local_sgd"]["ranks"])


@pytest.mark.timeout(240)
def test_a_checkpoint_saved_over_the_survivors_resumes_as_the_uninterrupted_runs_does(tmp_path: Path) -> None:
    """The checkpoint rank 1 wrote after rank 0 was killed in its save (rank 0's record from its replica) resumes on
    three ranks to the parameters the uninterrupted run's own checkpoint resumes to."""
    ends = {}
    for name, during in (("lost", ("save", 0, 1)), ("reference", None)):
        short = ft.Run(steps=2 * ft.STEPS_PER_EPOCH, sync_every=SYNC_EVERY, dies_between_steps=during)
        outcomes, codes, _ = ft.launch(short, tmp_path / name)
        assert codes == ([-9, 0, 0] if during else [0] * ft.WORLD), outcomes
        best = ft.result(outcomes, 1 if during else 0)["best"]
        assert Path(best).name == f"epoch=1-step={2 * ft.STEPS_PER_EPOCH}.ckpt", best
        resumed, codes, _ = ft.launch(ft.Run(sync_every=SYNC_EVERY, resume_from=best), tmp_path / f"{name}-resumed")
        assert codes == [0] * ft.WORLD, resumed
        ends[name] = ft.final_params(resumed, 0)
    assert (ends["lost"] - ends["reference"]).abs().max().item() <= TOLERANCE


@pytest.mark.timeout(240)
def test_resuming_a_rank_the_checkpoint_holds_no_state_of_is_said(tmp_path: Path) -> None:
    """With ``keep_global_batch=False`` nobody trains a lost rank's replica, so the survivors' checkpoints hold no
    state of it; resumed on three ranks, that rank (and only it) warns that it starts from the averaged model and
    the writer's inner optimizer state."""
    short = ft.Run(
        steps=2 * ft.STEPS_PER_EPOCH,
        sync_every=SYNC_EVERY,
        victim=1,
        fail_at=7,
        keep_global_batch=False,
        checkpoint_every=3,
    )
    lost, codes, _ = ft.launch(short, tmp_path / "lost")
    assert codes == [0, -9, 0], lost
    after = str(tmp_path / "lost" / "steps" / "step=9.ckpt")  # the first checkpoint after the loss
    assert torch.load(after, weights_only=False)["local_sgd"]["ranks"][1] is None
    resumed, codes, _ = ft.launch(ft.Run(sync_every=SYNC_EVERY, resume_from=after), tmp_path / "resumed")
    assert codes == [0] * ft.WORLD, resumed
    said = [[w for w in ft.result(resumed, r)["warnings"] if "holds no state of rank" in w] for r in range(ft.WORLD)]
    assert [len(s) for s in said] == [0, 1, 0], said
    assert "holds no state of rank 1" in said[1][0]


@pytest.mark.timeout(240)
def test_a_checkpoint_whose_writer_was_lost_after_the_gather_is_written_by_the_new_leader(tmp_path: Path) -> None:
    """Rank 0 (the leader) is killed once it gathered every rank's state for the last checkpoint, before it wrote
    it: the survivors gather again to rank 1, the new leader, which writes it; the file holds the parameters the
    survivors ended on and a record for every rank of the world."""
    run = ft.Run(steps=2 * ft.STEPS_PER_EPOCH, sync_every=SYNC_EVERY, dies_between_steps=("gathered", 0, 1))
    outcomes, codes, _ = ft.launch(run, tmp_path)
    assert codes == [-9, 0, 0], outcomes
    leader = ft.result(outcomes, 1)
    assert [(lost, members) for _, lost, members in leader["recoveries"]] == [([0], [1, 2])]
    assert leader["best_params"] is not None and Path(leader["best"]).is_file()
    assert torch.equal(torch.tensor(leader["best_params"]), ft.final_params(outcomes, 1))
    saved = torch.load(leader["best"], weights_only=False)["local_sgd"]["ranks"]
    assert len(saved) == ft.WORLD and all(record is not None for record in saved)


def test_the_hand_over_goes_to_the_next_member_so_each_keeps_one_others_states() -> None:
    assert handover_plan([0, 1, 2], 3) == {0: {1: [0]}, 1: {2: [1]}, 2: {0: [2]}}
    assert handover_plan([0, 2], 3) == {0: {2: [0, 1]}, 2: {0: [2]}}  # 0 trains logical rank 1 too
    assert handover_plan([1], 3) == {}
    plan = handover_plan(range(8), 8)
    receivers = [dst for targets in plan.values() for dst in targets]
    assert sorted(receivers) == list(range(8))  # no member receives more than one member's states


def test_after_a_loss_replicas_move_whole_and_kept_states_go_to_the_takers() -> None:
    # 4 ranks, 1 and 3 lost in one period (the ring kept: 0 -> 1, 1 -> 2, 2 -> 3, 3 -> 0): the keepers send
    assert takeover_plan({}, {0: [3], 2: [1]}, {0: [1], 2: [3]}) == ({}, {2: {0: [1]}, 0: {2: [3]}}, [])
    # 1 and 2 lost: 2 kept 1's state; 3 kept 2's and takes 2 over itself
    assert takeover_plan({}, {0: [3], 3: [2]}, {0: [1], 3: [2]}) == ({}, {}, [1])
    # 2 lost first (0 took it over); later 1: logical rank 2 goes to 3, and 0's replica of it moves there whole
    assert takeover_plan({0: [2]}, {0: [3], 3: [1]}, {0: [1], 3: [2]}) == ({0: {3: [2]}}, {3: {0: [1]}}, [])


def test_a_handed_over_state_arrives_as_it_was_sent_whatever_its_tensors() -> None:
    from lightning_dp_strategies.local_sgd.replicas import _packed, _unpacked

    state = {
        0: {"step": torch.tensor(7.0), "exp_avg": torch.randn(3, 4), "flags": torch.tensor([True, False])},
        2: {"momentum_buffer": torch.randn(5, 2).t(), "half": torch.randn(3).to(torch.bfloat16), "n": 3},
        "others": ([1, 2], (torch.arange(4), "name"), torch.empty(0)),
    }
    got = _unpacked(torch.cat(_packed(state)))
    assert got.keys() == state.keys() and got[2]["n"] == 3 and got["others"][0] == [1, 2]
    assert isinstance(got["others"], tuple) and got["others"][1][1] == "name"
    pairs = [(got[0][k], state[0][k]) for k in state[0]]
    pairs += [(got[2][k], state[2][k]) for k in ("momentum_buffer", "half")]
    pairs += [(got["others"][1][0], state["others"][1][0]), (got["others"][2], state["others"][2])]
    for received, sent in pairs:
        assert received.dtype == sent.dtype and received.shape == sent.shape and torch.equal(received, sent)


def test_a_replica_swaps_its_parameters_gradients_and_optimizer_state_in_and_out() -> None:
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 3)).sum().backward()
    optimizer.step()
    own = [p.detach().clone() for p in model.parameters()]
    own_momentum = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    replicas = Replicas(list(model.parameters()), [], optimizer)
    replicas.adopt(2, {}, [torch.zeros(1, 3), torch.zeros(1)])
    with replicas.swapped(2):
        assert all(p.abs().sum() == 0 and p.grad is None for p in model.parameters())
        assert not optimizer.state  # the replica's state: none handed over
        model(torch.ones(2, 3)).sum().backward()
        optimizer.step()
        replica_momentum = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    assert all(torch.equal(p, o) for p, o in zip(model.parameters(), own, strict=True))
    assert all(
        torch.equal(optimizer.state[p]["momentum_buffer"], m)
        for p, m in zip(model.parameters(), own_momentum, strict=True)
    )
    assert replicas.states(0)[2][0]["momentum_buffer"].equal(replica_momentum[0])
    assert replicas.changes([torch.zeros(1, 3), torch.zeros(1)], [0])[0].ne(0).all()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"fragments": 2}, "fragments=2"),
        ({"sync_every": "auto", "fragments": 1}, "fixed `sync_every`"),
        ({"warmup_steps": 3}, "warmup_steps=3"),
        ({"outer_precision": "int4"}, "outer_precision='int4'"),
        ({"reducer": "per_tensor"}, "reducer='per_tensor'"),
    ],
)
def test_impossible_combinations_are_refused_at_construction(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        LocalSGDStrategy(fault_tolerant=FaultTolerance(), **options)  # type: ignore[arg-type]
    LocalSGDStrategy(**options)  # type: ignore[arg-type]  # accepted without fault_tolerant


def test_state_copies_without_a_hand_over_are_refused_at_construction() -> None:
    LocalSGDStrategy(fault_tolerant=FaultTolerance(state_copies=2))
    with pytest.raises(ValueError, match="has nothing to copy"):
        LocalSGDStrategy(fault_tolerant=FaultTolerance(state_copies=2, keep_global_batch=False))


@pytest.mark.timeout(300)
def test_a_replacement_takes_its_replicas_state_and_the_run_ends_on_the_uninterrupted_parameters(
    uninterrupted_of_40: torch.Tensor, tmp_path: Path
) -> None:
    run = ft.Run(steps=40, pace_s=0.15, sync_every=SYNC_EVERY, victim=1, fail_at=3, replace=True)
    outcomes, codes, _ = ft.launch(run, tmp_path / "joined")
    assert codes[: ft.WORLD] == [0, -9, 0] and codes[ft.WORLD :] == [0], outcomes
    assert ft.result(outcomes, 1)["admitted_at"] == 2  # membership epochs: 1 when rank 1 was lost, 2 at its return
    ((step, ranks),) = ft.result(outcomes, 0)["joins"]
    assert ranks == [1] and step % 5 == 0 and 5 <= step < 40  # at an epoch's start, in sync after validation
    for rank in range(ft.WORLD):
        assert (ft.final_params(outcomes, rank) - uninterrupted_of_40).abs().max().item() <= TOLERANCE
        assert ft.result(outcomes, rank)["global_step"] == 40


@pytest.mark.timeout(300)
def test_a_rank_lost_while_a_replacement_is_being_admitted_is_survived_and_the_admission_waits(
    uninterrupted_of_40: torch.Tensor, tmp_path: Path
) -> None:
    """Rank 1 killed at step 3 and its replacement started; rank 2 killed as the survivors make the admission's
    local SGD record (rank 0 waits in its gather). Rank 0 recovers, rebuilds logical rank 2 from the state it kept,
    leaves the admission for when every lost rank has a replacement, and ends alone on the uninterrupted run's
    parameters."""
    run = ft.Run(
        steps=40, pace_s=0.15, sync_every=SYNC_EVERY, victim=1, fail_at=3, replace=True, dies_admitting=("on_admit", 2)
    )
    outcomes, codes, _ = ft.launch(run, tmp_path / "lost", expected=1, linger=1.0)
    assert codes[: ft.WORLD] == [0, -9, -9], outcomes
    survivor = ft.result(outcomes, 0)
    assert [(lost, members) for _, lost, members in survivor["recoveries"]] == [([1], [0, 2]), ([2], [0])]
    assert survivor["joins"] == [] and survivor["global_step"] == 40
    assert (ft.final_params(outcomes, 0) - uninterrupted_of_40).abs().max().item() <= TOLERANCE


@pytest.fixture(scope="module")
def uninterrupted_of_four(tmp_path_factory: pytest.TempPathFactory) -> torch.Tensor:
    return ft.uninterrupted_params(ft.Run(sync_every=SYNC_EVERY, world=4), tmp_path_factory.mktemp("four"))


@pytest.mark.timeout(300)
def test_two_ranks_lost_in_one_period_are_rebuilt_from_the_states_the_others_kept(
    uninterrupted_of_four: torch.Tensor, tmp_path: Path
) -> None:
    """Four ranks, 1 and 3 killed at the start of step 7 and met at step 9's synchronisation: rank 2 kept rank 1's
    inner state and rank 0 rank 3's, but rank 0 takes logical rank 1 over and rank 2 logical rank 3. The keepers send
    the states to the takers, which replay steps 5-8, and the run ends on the uninterrupted run's parameters."""
    run = ft.Run(sync_every=SYNC_EVERY, world=4, victim=1, fail_at=7, also=(3, 7))
    outcomes, codes, _ = ft.launch(run, tmp_path)
    ft.assert_survived(outcomes, codes, [1, 3], uninterrupted_of_four, TOLERANCE, world=4)


@pytest.mark.timeout(300)
def test_a_replica_moves_whole_when_a_later_loss_gives_its_logical_rank_to_another_survivor(
    uninterrupted_of_four: torch.Tensor, tmp_path: Path
) -> None:
    """Four ranks: 2 killed in the first epoch (rank 0 takes logical rank 2 over), 1 in the second. The survivors 0
    and 3 then share the logical ranks as {0: [0, 1], 3: [2, 3]}: rank 0's replica of logical rank 2 moves to rank 3
    (trained by one rank only, not two) and the run ends on the uninterrupted run's parameters."""
    run = ft.Run(sync_every=SYNC_EVERY, world=4, victim=2, fail_at=3, also=(1, 8))
    outcomes, codes, _ = ft.launch(run, tmp_path)
    assert codes == [0, -9, -9, 0], outcomes
    for rank in (0, 3):
        result = ft.result(outcomes, rank)
        assert [(lost, members) for _, lost, members in result["recoveries"]] == [([2], [0, 1, 3]), ([1], [0, 3])]
        assert (ft.final_params(outcomes, rank) - uninterrupted_of_four).abs().max().item() <= TOLERANCE


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("first", "where"),
    [("mid_period", "settle"), ("mid_period", "take_over"), ("mid_period", "_start"), ("validation", "take_over")],
)
def test_a_rank_lost_while_the_survivors_recover_is_survived_too(
    first: str, where: str, uninterrupted_of_four: torch.Tensor, tmp_path: Path
) -> None:
    """Four ranks: rank 1 is killed (at the start of step 7, met at the next synchronisation; or in the second
    epoch's validation), then rank 3 as it starts rebuilding the lost rank in that recovery, or (``"_start"``) once
    the recovery ended the period, as it starts sending its states; the others lose it inside their recovery's
    collectives. The survivors 0 and 2 start the recovery again without rank 3, agree on the same handed-over states
    (and replay the ended period once), rebuild both lost ranks and end on the uninterrupted run's parameters."""
    loss: dict[str, Any] = {"victim": 1, "fail_at": 7} if first == "mid_period" else {}
    if first == "validation":
        loss["dies_between_steps"] = ("validation", 1, 1)
    run = ft.Run(sync_every=SYNC_EVERY, world=4, dies_recovering=(where, 3), **loss)
    outcomes, codes, _ = ft.launch(run, tmp_path)
    assert codes == [0, -9, 0, -9], outcomes
    for rank in (0, 2):
        result = ft.result(outcomes, rank)
        assert [(lost, members) for _, lost, members in result["recoveries"]] == [([1], [0, 2, 3]), ([3], [0, 2])]
        assert result["global_step"] == ft.Run().steps
        assert (ft.final_params(outcomes, rank) - uninterrupted_of_four).abs().max().item() <= TOLERANCE


@pytest.mark.timeout(300)
def test_a_replica_whose_move_a_loss_cut_short_stays_with_its_trainer(
    uninterrupted_of_four: torch.Tensor, tmp_path: Path
) -> None:
    """Four ranks, two copies of every inner state: rank 2 killed in the first epoch (rank 0 takes logical rank 2
    over), rank 1 in the second, so rank 0's replica of logical rank 2 moves to rank 3; rank 3 is killed as it starts
    the exchange that carries it. Rank 0, whose sending failed, still trains that replica, takes logical ranks 1 and 3
    over from the states it kept, and ends alone on the uninterrupted run's parameters."""
    run = ft.Run(
        sync_every=SYNC_EVERY,
        world=4,
        state_copies=2,
        victim=2,
        fail_at=3,
        also=(1, 8),
        dies_recovering=("exchange", 3, 4),
    )
    outcomes, codes, _ = ft.launch(run, tmp_path, expected=1)
    assert codes == [0, -9, -9, -9], outcomes
    result = ft.result(outcomes, 0)
    assert [(lost, members) for _, lost, members in result["recoveries"]] == [
        ([2], [0, 1, 3]),
        ([1], [0, 3]),
        ([3], [0]),
    ]
    assert result["global_step"] == ft.Run().steps
    assert (ft.final_params(outcomes, 0) - uninterrupted_of_four).abs().max().item() <= TOLERANCE


@pytest.mark.timeout(300)
def test_a_rank_lost_with_the_member_that_kept_its_state_stops_every_survivor_naming_it(tmp_path: Path) -> None:
    """Four ranks, 1 and 2 killed at the start of step 7: rank 2 kept rank 1's inner state, so logical rank 1
    cannot be rebuilt; both survivors stop with the error (neither waits for the other)."""
    run = ft.Run(sync_every=SYNC_EVERY, world=4, victim=1, fail_at=7, also=(2, 7))
    outcomes, codes, _ = ft.launch(run, tmp_path)
    assert codes == [0, -9, -9, 0], outcomes
    for rank in (0, 3):
        assert isinstance(outcomes[rank], RuntimeError), outcomes[rank]
        assert "Logical rank(s) [1] cannot be rebuilt" in str(outcomes[rank])
        assert "FaultTolerance(state_copies=2)" in str(outcomes[rank])


@pytest.mark.timeout(240)
def test_a_fresh_start_hands_nothing_over_and_a_rank_lost_in_the_first_period_is_survived(
    uninterrupted: torch.Tensor, tmp_path: Path
) -> None:
    """Three ranks from scratch: rank 1 would be killed if it entered a hand-over, and is killed at the start of
    step 2, in the first period. Every rank's inner state is the optimizer's initial one, so its keeper holds a copy
    of its own and nothing is sent at the start; the survivors rebuild rank 1 from it and end on the uninterrupted
    run's parameters."""
    run = ft.Run(sync_every=SYNC_EVERY, victim=1, fail_at=2, dies_recovering=("hand_over", 1))
    outcomes, codes, _ = ft.launch(run, tmp_path)
    ft.assert_survived(outcomes, codes, 1, uninterrupted, TOLERANCE)


@pytest.mark.timeout(240)
def test_a_rank_lost_in_a_resumed_runs_first_hand_over_stops_every_survivor_saying_so(tmp_path: Path) -> None:
    """Three ranks resumed from a checkpoint, rank 1 killed as it starts the hand-over of the resumed inner states:
    no survivor holds its state, so both survivors stop at once with an error that says where and what to do (not
    the backend's connection error alone)."""
    first, codes, _ = ft.launch(ft.Run(steps=ft.STEPS_PER_EPOCH, sync_every=SYNC_EVERY), tmp_path / "first")
    assert codes == [0] * ft.WORLD, first
    run = ft.Run(sync_every=SYNC_EVERY, resume_from=ft.result(first, 0)["best"], dies_recovering=("hand_over", 1))
    outcomes, codes, _ = ft.launch(run, tmp_path / "resumed", timeout=60)  # a survivor that waited reports nothing
    assert codes == [0, -9, 0], outcomes
    for rank in (0, 2):
        assert isinstance(outcomes.get(rank), RuntimeError), outcomes
        assert "could not hand the inner optimizer states over at the start of the resumed" in str(outcomes[rank])
        assert "Restart the job from the last checkpoint" in str(outcomes[rank])


@pytest.mark.timeout(300)
def test_with_two_copies_a_rank_lost_with_its_first_keeper_is_rebuilt_from_the_second(
    uninterrupted_of_four: torch.Tensor, tmp_path: Path
) -> None:
    """As above with ``state_copies=2``: rank 3 kept rank 1's state too, and sends it to rank 0, its taker."""
    run = ft.Run(sync_every=SYNC_EVERY, world=4, victim=1, fail_at=7, also=(2, 7), state_copies=2)
    outcomes, codes, _ = ft.launch(run, tmp_path)
    ft.assert_survived(outcomes, codes, [1, 2], uninterrupted_of_four, TOLERANCE, world=4)
