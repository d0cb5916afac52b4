"""Ranks that disagree about the model or the options are caught at setup, on every rank, before any step.

Without the check a wider layer on one rank makes the broadcast of rank 0's weights fail on some ranks only (or
hang), and a different bucket cap pairs up all-reduces of different buckets: silent corruption.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

from lightning_dp_strategies.core.agreement import RankMismatchError, check_ranks_agree, model_fingerprint
from tests.helpers.distributed import run_distributed, run_script


def test_the_fingerprint_sees_names_shapes_dtypes_trainability_buffers_and_options() -> None:
    base = model_fingerprint(nn.BatchNorm1d(4), {"bucket_cap_mb": 25.0})
    assert base == model_fingerprint(nn.BatchNorm1d(4), {"bucket_cap_mb": 25.0})
    frozen = nn.BatchNorm1d(4)
    frozen.bias.requires_grad_(False)
    variants = [
        model_fingerprint(nn.BatchNorm1d(5), {"bucket_cap_mb": 25.0}),
        model_fingerprint(nn.BatchNorm1d(4).double(), {"bucket_cap_mb": 25.0}),
        model_fingerprint(frozen, {"bucket_cap_mb": 25.0}),
        model_fingerprint(nn.BatchNorm1d(4, track_running_stats=False), {"bucket_cap_mb": 25.0}),
        model_fingerprint(nn.BatchNorm1d(4), {"bucket_cap_mb": 10.0}),
    ]
    assert all(v != base for v in variants)


def _check_mismatch(rank: int, world_size: int, what: str) -> None:
    odd = rank == world_size - 1
    model = nn.Sequential(
        nn.Linear(3, 5 if odd and what == "shape" else 4), nn.Linear(5 if odd and what == "shape" else 4, 1)
    )
    if odd and what == "dtype":
        model = model.double()
    options = {"bucket_cap_mb": 1.0 if odd and what == "option" else 25.0}
    with pytest.raises(RankMismatchError) as failure:
        check_ranks_agree(model_fingerprint(model, options))
    message = str(failure.value)
    assert f"rank {world_size - 1}:" in message and "rank 1:" not in message, "only the odd rank is listed"
    expected = {
        "shape": "parameter '0.weight' is [[4, 3]",
        "dtype": "torch.float64",
        "option": "option 'bucket_cap_mb'",
    }
    assert expected[what] in message, message
    assert "Every rank must run the same code with the same configuration" in message


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", ["shape", "dtype", "option"])
def test_every_rank_raises_and_names_the_difference(what: str) -> None:
    run_distributed(_check_mismatch, 3, what)


def _check_agreement(rank: int, world_size: int) -> None:
    check_ranks_agree(model_fingerprint(nn.Linear(3, 4), {"bucket_cap_mb": 25.0}))


@pytest.mark.timeout(120)
def test_agreeing_ranks_pass() -> None:
    run_distributed(_check_agreement, 2)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("strategy", "what"),
    [("ring_allreduce", "model"), ("ring_allreduce", "option"), ("hybrid_pipeline", "model")],
)
def test_the_strategies_check_at_setup_before_any_step(strategy: str, what: str, tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="exit statuses") as failure:
        run_script(["-m", "tests.reliability.mismatch_scenario", strategy, what, str(tmp_path)], 240)
    assert "RankMismatchError" in str(failure.value), str(failure.value)[-3000:]
    assert not list(tmp_path.glob("stepped-rank*")), "a training step ran although the ranks disagree"
