"""hybrid_pipeline's schedules with several chunks per rank (interleaved and zero-bubble): parity with one device.

Each schedule cuts the five blocks of ``PipeNet`` into four chunks, two per rank, and trains with gradient clipping
by norm and gradient accumulation, at 2 stages x 1 replica (4 micro-batches) and 2 stages x 2 replicas (2), one
launch each (``tests/strategies/pipeline_scenarios.py``). Tolerance: max absolute parameter difference <= 1e-5, as
for GPipe and 1F1B. A checkpoint saved after ``fit`` under ``"zbv"`` (whose rank 0 runs the first and the last
chunk) holds the whole model, trained to the same parity. ``trainer.validate`` after each fit runs the schedule's
forwards alone and gives every rank the trained single-device module's loss, within the same tolerance.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.strategies.pipeline_scenarios import SUITES, VAL_SAMPLES, make_data, reference, reference_state
from tests.strategies.test_hybrid_pipeline import TOLERANCE, assert_no_groups_left, check_suite, launch, load_ranks


def check_activation_bytes(out: Path, suite: str) -> None:
    """Every rank counted the activations and gradients it exchanged: a 16-wide fp32 row per sample and crossing.

    Of the three boundaries between the four chunks, all cross ranks when the chunks loop (0, 1, 0, 1); under "zbv"
    (0, 1, 1, 0) the middle one stays on rank 1. Each crossing sends each sample's activation one way and its gradient
    back, one send per rank."""
    for case in SUITES[suite]:
        crossings = 2 if case.schedule == "zbv" else 3
        expected = crossings * (case.samples // case.replicas) * 16 * 4 * case.epochs
        for rank, result in enumerate(load_ranks(out, case.name, case.world)):
            assert result["p2p_total"] == (expected, expected), (case.name, rank)
            assert result["p2p_step"][0] > 0, "step_stats counts the bytes of the latest optimizer step"


def check_saved(out: Path, suite: str) -> None:
    case = SUITES[suite][-1]
    assert case.schedule == "zbv"
    checkpoint = torch.load(out / "saved.ckpt", weights_only=False)
    expected = reference(case)
    state = checkpoint["state_dict"]
    assert set(state) == {f"{n}" for n in expected} | {k for k in state if not k.startswith("body.")}
    for name, value in expected.items():
        assert (state[name] - value).abs().max().item() <= TOLERANCE, name
    _, optimizer = reference_state(case)
    saved = checkpoint["optimizer_states"][0]["state"]
    reference_buffers = optimizer.state_dict()["state"]
    assert sorted(saved) == sorted(reference_buffers)
    for index, entry in reference_buffers.items():
        diff = (saved[index]["momentum_buffer"] - entry["momentum_buffer"]).abs().max().item()
        assert diff <= TOLERANCE, f"momentum of parameter {index}"


def check_validated(out: Path, suite: str) -> None:
    """``trainer.validate`` after each fit, forward-only through the schedule: every rank's ``val_loss`` (synced) is
    the trained single-device module's loss on the same samples."""
    x, y = make_data(VAL_SAMPLES, seed=7).tensors
    for case in SUITES[suite]:
        model, _ = reference_state(case)
        with torch.no_grad():
            expected = torch.nn.functional.cross_entropy(model.body(x), y).item()
        for rank in range(case.world):
            val_loss = torch.load(out / f"validate-{case.name}-rank{rank}.pt")
            assert abs(float(val_loss) - expected) <= TOLERANCE, (case.name, rank)


@pytest.mark.timeout(300)
def test_interleaved_and_zero_bubble_schedules_two_stages_one_replica(tmp_path: Path) -> None:
    out = launch("schedules2", tmp_path)
    check_suite(out, SUITES["schedules2"])
    check_activation_bytes(out, "schedules2")
    check_saved(out, "schedules2")
    check_validated(out, "schedules2")
    assert_no_groups_left(out, 2)


@pytest.mark.timeout(420)
def test_interleaved_and_zero_bubble_schedules_two_stages_two_replicas(tmp_path: Path) -> None:
    out = launch("schedules4", tmp_path, timeout=360)
    check_suite(out, SUITES["schedules4"])
    for case in SUITES["schedules4"]:  # each bucket launched inside the schedule, at its chunks' last backward (W)
        for result in load_ranks(out, case.name, case.world):
            assert result["buckets"] > 0
            assert result["overlapped"] == result["synced"] * result["buckets"], (case.name, result)
    check_activation_bytes(out, "schedules4")
    check_saved(out, "schedules4")
    check_validated(out, "schedules4")
    assert_no_groups_left(out, 4)
