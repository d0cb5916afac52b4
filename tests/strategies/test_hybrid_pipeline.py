"""HybridPipelineStrategy: parity with single-device training is the specification.

Two launches carry the parity matrix: 2 stages x 1 replica and 2 stages x 2 replicas, each with both schedules at 1
and 4 micro-batches, plus clipping, gradient accumulation, the "native" reducer, checkpoints, validate and predict (see
``tests/strategies/pipeline_scenarios.py``). Tolerance: max absolute parameter difference <= 1e-5 (observed ~1e-7).
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.distributed import run_ranks, run_script
from tests.strategies.pipeline_scenarios import (
    BAD,
    CKPT,
    SUITES,
    VAL_SAMPLES,
    Case,
    PipeNet,
    make_data,
    make_optimizer,
    reference,
    reference_state,
    replica_shards,
)

# numerically sensitive: CI runs the parity tests again under other CPU kernel paths and thread counts (the bad-input
# tests check errors, which no kernel path changes)
NUMERICS = pytest.mark.numerics


TOLERANCE = 1e-5


def launch(suite: str, tmp_path: Path, timeout: float = 240) -> Path:
    """Run ``suite``'s cases in one launch: ``world2`` through Lightning's own launcher, the others as ``torchrun``
    starts ranks (:func:`run_ranks`, which skips the per-rank imports)."""
    out = tmp_path / suite
    out.mkdir()
    if suite == "world2":
        run_script(["-m", "tests.strategies.pipeline_scenarios", suite, str(out)], timeout=timeout)
    else:
        (world,) = {case.world for case in SUITES[suite]}
        run_ranks("tests.strategies.pipeline_scenarios", [suite, str(out)], world, timeout=timeout)
    return out


def assert_no_groups_left(out: Path, world: int) -> None:
    """The process groups each rank belongs to, counted after each call in one process: none piled up."""
    for rank in range(world):
        counts = torch.load(out / f"groups-rank{rank}.pt")
        assert len(counts) > 2 and len(set(counts)) == 1, f"rank {rank}: groups alive after each call {counts}"
        # the strategy swaps in its own stage body and precision-plugin view during fit; the user's objects come back
        untouched = torch.load(out / f"untouched-rank{rank}.pt")
        assert untouched and all(untouched), f"rank {rank}: the module's body or the precision plugin was changed"


def load_ranks(out: Path, name: str, world: int) -> list[dict[str, Any]]:
    return [torch.load(out / f"{name}-rank{r}.pt") for r in range(world)]


def assert_parity(ranks: list[dict[str, Any]], case: Case, epochs: int | None = None) -> None:
    expected = reference(case, epochs)
    covered: set[str] = set()
    for rank, result in enumerate(ranks):
        stage = rank // case.replicas
        params = result["params"]
        assert params, f"rank {rank} holds no parameter"
        # each rank trains exactly its stage's blocks (the module stays whole; the other stages' copies sit idle)
        assert all(n.startswith("body.") for n in params)
        for name, value in params.items():
            diff = (value - expected[name]).abs().max().item()
            assert diff <= TOLERANCE, f"{case.name}: rank {rank} (stage {stage}) {name} drifted by {diff}"
        covered |= set(params)
    assert covered == set(expected), f"{case.name}: stages together hold {sorted(covered)}"
    initial = dict(PipeNet().named_parameters())
    assert max((initial[n] - expected[n]).abs().max().item() for n in expected) > 1e-2, "training did not move"


def logged_losses(out: Path, case: Case) -> list[float]:
    rows = list(csv.DictReader(open(out / case.name / "version_0" / "metrics.csv")))
    return [float(r["train_loss"]) for r in rows if r.get("train_loss")]


def check_suite(out: Path, cases: list[Case]) -> None:
    for case in cases:
        ranks = load_ranks(out, case.name, case.world)
        assert_parity(ranks, case)
        for result in ranks:
            # a torchmetrics SumMetric of batch sizes, synced over the data-parallel group only: every sample of
            # the last epoch once (38), not once per stage (76)
            assert result["seen"] == case.samples
            assert 0.0 <= result["bubble"] <= 1.0 and result["steps"] > 0
        # the loss logged in training_step reached rank 0's logger and progress bar, step by step equal to the
        # single-device loss of replica 0's batch
        model, _ = reference_state(case)
        expected = model.losses  # type: ignore[attr-defined]
        if case.accumulate > 1:  # Lightning logs on the batches that end an accumulation window
            steps = len(replica_shards(case, 0))
            closing = [k for k in range(steps) if (k + 1) % case.accumulate == 0 or k == steps - 1]
            expected = [loss for i, loss in enumerate(expected) if i % steps in closing]
        logged = logged_losses(out, case)
        assert len(logged) == len(expected)
        assert max(abs(a - b) for a, b in zip(logged, expected, strict=True)) <= 1e-5
        assert abs(ranks[0]["progress_bar"]["train_loss"] - expected[-1]) <= 1e-5


@NUMERICS
@pytest.mark.timeout(300)
def test_parity_two_stages_one_replica_both_schedules_1_and_4_micro_batches_clipping_predict(tmp_path: Path) -> None:
    out = launch("world2", tmp_path)
    check_suite(out, SUITES["world2"])
    m4 = load_ranks(out, "s2d1-1f1b-m4", 2)
    # 38 samples in batches of 4: the last batch of 2 ran as 2 equal micro-batches (4 do not divide it)
    assert all(r["micro_batches"] == 2 for r in m4)
    # the activations (stage 0 -> 1) and their gradients (1 -> 0) were counted: a 16-wide fp32 row per sample
    assert [r["p2p_total"] for r in m4] == [(2 * 38 * 64, 2 * 38 * 64)] * 2
    assert [r["p2p_step"] for r in m4] == [(2 * 64, 2 * 64)] * 2  # the last step: a batch of 2
    # predict ran forward-only through the pipeline; afterwards every rank holds the whole module again
    x, _ = make_data(VAL_SAMPLES, seed=7).tensors
    with torch.no_grad():
        expected = PipeNet().body(x)
    for rank in range(2):
        result = torch.load(out / f"predict-rank{rank}.pt")
        assert (result["predictions"] - expected).abs().max().item() <= 1e-6
        assert set(result["params"]) == {n for n, _ in PipeNet().named_parameters()}
    assert_no_groups_left(out, 2)  # five fits and a predict in one process


@NUMERICS
@pytest.mark.timeout(420)
def test_parity_two_stages_two_replicas_accumulation_checkpoints_validate(tmp_path: Path) -> None:
    out = launch("world4", tmp_path, timeout=360)
    check_suite(out, SUITES["world4"])
    # gradient accumulation (2): per epoch of 5 batches, batches 0 and 2 accumulate locally, 1, 3 and 4 average
    for result in load_ranks(out, "s2d2-accumulate", 4):
        assert (result["ring_operations"], result["skipped"]) == (6, 4)
    # every bucket of every synchronised step was launched inside the schedule, as its chunk's last backward filled
    # it, with the gradients accumulated on the steps before added in (the parity above)
    for case in ("s2d2-accumulate", "s2d2-gpipe-m4", "s2d2-hook"):
        for result in load_ranks(out, case, 4):
            assert result["buckets"] > 0
            assert result["overlapped"] == result["synced"] * result["buckets"], (case, result)
    # the replicas of each stage averaged through the reducer asked for (gloo's own all-reduce), to parity above
    assert {r["reducer"] for r in load_ranks(out, "s2d2-native", 4)} == {"NativeReducer"}
    assert all(r["ring_operations"] > 0 for r in load_ranks(out, "s2d2-native", 4))
    # ... and through torch's DDP allreduce_hook, given each stage's replica group (not the world) as its state
    hooked = load_ranks(out, "s2d2-hook", 4)
    assert {r["reducer"] for r in hooked} == {"CommHookReducer"}
    assert [(r["ring_operations"], r["skipped"]) for r in hooked] == [(6, 4)] * 4
    # two replicas per stage on gloo: each stage's buckets carry a second group over that stage's two ranks
    assert [r["duplex_ranks"] for r in load_ranks(out, "s2d2-gpipe-m4", 4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    # 10 fits and a validate in one process: each made its mesh, gradient and duplex groups and destroyed them again
    assert_no_groups_left(out, 4)

    # the checkpoint saved under hybrid_pipeline after epoch 1 holds the whole model, in the single-device format
    checkpoint = torch.load(out / "hybrid.ckpt", weights_only=False)
    model, optimizer = reference_state(CKPT, epochs=1)
    single = PipeNet()
    single.load_state_dict(checkpoint["state_dict"])  # strict: exactly the keys of the plain module
    for name, param in single.named_parameters():
        assert (param - dict(model.named_parameters())[name]).abs().max().item() <= TOLERANCE
    # ... and the optimizer state loads into a single-device optimizer over the whole module
    restored = make_optimizer(single.parameters())
    restored.load_state_dict(checkpoint["optimizer_states"][0])
    for mine, theirs in zip(single.parameters(), model.parameters(), strict=True):
        diff = restored.state[mine]["momentum_buffer"] - optimizer.state[theirs]["momentum_buffer"]
        assert diff.abs().max().item() <= TOLERANCE
    # resuming under hybrid_pipeline from it, or from a single-device checkpoint, ends where uninterrupted training
    # ends (optimizer state included: the momentum would otherwise restart from zero)
    assert_parity(load_ranks(out, "resumed", 4), CKPT, epochs=2)
    assert_parity(load_ranks(out, "from-single", 4), CKPT, epochs=2)

    # validate after fit: forward-only through the pipeline; val_loss (sync_dist) is the mean over all samples
    x, y = make_data(VAL_SAMPLES, seed=7).tensors
    expected_val = torch.nn.functional.cross_entropy(model.body(x), y).item()
    for rank in range(4):
        result = torch.load(out / f"validate-rank{rank}.pt")
        assert abs(result["val_loss"] - expected_val) <= 1e-5
        assert len(result["params"]) == 6, "after validate the module is whole again on every rank"


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("case", "messages"),
    [
        ("no-opt-in", ["NoOptIn cannot run under HybridPipelineStrategy", "pipeline_body = ", "pipeline_loss(self"]),
        ("more-stages-than-blocks", ["Cannot split 1 blocks into 2 pipeline stages", "pipeline_stages=1"]),
        ("batch-smaller-than-micro-batches", ["batch size 4", "smaller than micro_batches=8"]),
        ("batch-not-divisible", ["cannot be cut into micro_batches=3 equal", "multiple of 3"]),
    ],
)
@pytest.mark.timeout(120)
def test_bad_input_fails_at_setup_on_every_rank_naming_the_fix(tmp_path: Path, case: str, messages: list[str]) -> None:
    with pytest.raises(AssertionError) as failure:
        run_ranks("tests.strategies.pipeline_scenarios", [case, str(tmp_path)], BAD[case][1].world, timeout=100)
    output = str(failure.value)
    for message in messages:
        assert message in output, output[-3000:]
    assert "training started" not in output


@pytest.mark.parametrize(
    ("case", "where"),
    [
        ("stages-train-on-different-batches", "the first training batch of epoch 0"),
        ("stages-validate-on-different-batches", "the first validation batch"),
    ],
)
@pytest.mark.timeout(120)
def test_stages_reading_different_batches_are_refused_on_every_rank(tmp_path: Path, case: str, where: str) -> None:
    # with Lightning's sampler off, a loader split over both processes gives stage 0 the inputs of one half of the
    # data and stage 1 the targets of the other: refused at the first batch, before the schedule runs, on both ranks
    with pytest.raises(AssertionError) as failure:
        run_ranks("tests.strategies.pipeline_scenarios", [case, str(tmp_path)], BAD[case][1].world, timeout=100)
    output = str(failure.value)
    assert output.count(f"The stages of one pipeline read different batches: at {where}") == 2, output[-3000:]
    assert "drop the sampler that splits it over the 2 processes" in output
    assert "training started" not in output


def test_world_size_not_divisible_by_stages_fails_when_the_trainer_is_built() -> None:
    import lightning as L

    from lightning_dp_strategies import HybridPipelineStrategy

    with pytest.raises(ValueError, match=r"world size 3 .* not divisible by pipeline_stages=2.*devices=2 or 4"):
        L.Trainer(strategy=HybridPipelineStrategy(pipeline_stages=2), accelerator="cpu", devices=3)


@pytest.mark.parametrize(
    ("options", "fix"),
    [
        ({"pipeline_stages": 0}, "`pipeline_stages` must be an integer >= 1"),
        ({"micro_batches": 2.0}, "`micro_batches` must be an integer >= 1"),
        ({"schedule": "interleaved"}, r"use one of \['gpipe', '1f1b', 'interleaved_1f1b', 'looped_bfs'"),
        ({"balance": "memory"}, "Unknown `balance` 'memory'"),
        ({"balance": [2, 0]}, "each >= 1"),
        ({"balance": [1, 1, 1]}, "number of blocks of each of the 2 stages"),
        ({"bucket_cap_mb": 0}, "`bucket_cap_mb` must be a positive number of MiB"),
        ({"start_method": "thread"}, "Unknown `start_method`"),
    ],
)
def test_bad_options_fail_at_construction(options: dict[str, Any], fix: str) -> None:
    from lightning_dp_strategies import HybridPipelineStrategy

    with pytest.raises((ValueError, TypeError), match=fix):
        HybridPipelineStrategy(**options)


def test_opt_in_error_names_exactly_what_is_missing() -> None:
    import lightning as L
    from torch import nn

    from lightning_dp_strategies.strategies.hybrid_pipeline.opt_in import check_opt_in as _check_opt_in

    class OnlyBody(L.LightningModule):
        pipeline_body = "body"

        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(2, 2))

    class BodyNotSequential(OnlyBody):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(2, 2)  # type: ignore[assignment]

        def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return output.sum()

    with pytest.raises(TypeError) as only_body:
        _check_opt_in(OnlyBody())
    assert "pipeline_loss(self, output, target)" in str(only_body.value)
    assert "a class attribute `pipeline_body" not in str(only_body.value)
    with pytest.raises(TypeError, match=r"self.body is a Linear\); wrap the blocks in nn.Sequential"):
        _check_opt_in(BodyNotSequential())
    compiled = PipeNet()
    compiled.body = torch.compile(compiled.body)  # type: ignore[assignment]
    with pytest.raises(TypeError, match=r"torch\.compile'd module\); compile each block instead"):
        _check_opt_in(compiled)
    assert _check_opt_in(PipeNet()) == "body"


def test_registered_name() -> None:
    import lightning as L
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_dp_strategies

    lightning_dp_strategies.register_all()
    assert StrategyRegistry["hybrid_pipeline"]["strategy"] is lightning_dp_strategies.HybridPipelineStrategy
    trainer = L.Trainer(strategy="hybrid_pipeline", accelerator="cpu", devices=4, logger=False)
    strategy = trainer.strategy
    assert isinstance(strategy, lightning_dp_strategies.HybridPipelineStrategy)
    assert strategy.config.pipeline_stages == 2 and strategy.config.schedule == "1f1b"
