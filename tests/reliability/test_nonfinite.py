"""``nonfinite_grads``: NaN/Inf gradients after reduction skip the step on every rank alike, or stop every rank.

The loss turns NaN on one rank only (the last pipeline stage for ``hybrid_pipeline``) at one step. With ``"skip"``
that step must leave parameters and momentum exactly as they were (bitwise), every rank must count one skipped step,
and training must go on to finite parameters that agree across data-parallel ranks. With ``"raise"`` the run must
end with ``FloatingPointError`` instead of NaN parameters, and within the time bound (no rank left waiting).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_dp_strategies.core.nonfinite import NonfiniteGuard, check_nonfinite_mode
from tests.helpers.distributed import run_distributed, run_ranks, run_script

# numerically sensitive: CI runs this file again under other CPU kernel paths and thread counts
pytestmark = pytest.mark.numerics


STRATEGIES = ["dp", "ring_allreduce", "hybrid_pipeline"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_skip_leaves_the_bad_step_out_on_every_rank(strategy: str, tmp_path: Path) -> None:
    ranks = 1 if strategy == "dp" else 2
    run_ranks("tests.reliability.nonfinite_scenario", [strategy, "skip", str(tmp_path)], ranks, timeout=240)
    results = [torch.load(tmp_path / f"result-rank{r}.pt", weights_only=False) for r in range(ranks)]
    for rank, result in enumerate(results):
        assert result["skipped_steps"] == 1, f"rank {rank} counted {result['skipped_steps']} skipped steps"
        for name, before in result["before"]["params"].items():
            assert torch.equal(result["after"]["params"][name], before), f"rank {rank}: {name} changed"
        for before, after in zip(result["before"]["momentum"], result["after"]["momentum"], strict=True):
            assert torch.equal(before, after), f"rank {rank}: the momentum moved on a skipped step"
        assert all(torch.isfinite(p).all() for p in result["final"].values()), f"rank {rank} ended with NaN"
        assert any(not torch.equal(result["final"][n], result["after"]["params"][n]) for n in result["final"]), (
            "training went on after the skipped step"
        )
    if strategy == "ring_allreduce":
        for name, value in results[0]["final"].items():
            assert torch.equal(value, results[1]["final"][name]), f"the ranks disagree on {name}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_raise_stops_every_rank_with_an_error_that_names_the_fix(strategy: str, tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="exit statuses") as failure:
        run_script(["-m", "tests.reliability.nonfinite_scenario", strategy, "raise", str(tmp_path)], timeout=240)
    assert "FloatingPointError" in str(failure.value) and "nonfinite_grads='skip'" in str(failure.value)
    assert "Trainer(gradient_clip_val=...)" in str(failure.value) and "fabric.clip_gradients" in str(failure.value)


def _check_same_decision(rank: int, world_size: int, mode: str) -> None:
    param = torch.nn.Parameter(torch.zeros(3))
    param.grad = torch.full((3,), float("inf")) if rank == 1 else torch.ones(3)
    optimizer = torch.optim.SGD([param], lr=1.0)
    guard = NonfiniteGuard(check_nonfinite_mode(mode))
    closure = guard.wrap(lambda: None, optimizer, [("w", param)], torch.device("cpu"))
    if mode == "raise":
        with pytest.raises(FloatingPointError, match="on this rank in \\['w'\\]" if rank == 1 else "on another rank"):
            closure()
    else:
        closure()
        assert param.grad is None and guard.skipped_steps == 1, "every rank skips, also those with finite gradients"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["skip", "raise"])
def test_the_decision_is_the_same_on_every_rank(mode: str) -> None:
    run_distributed(_check_same_decision, 3, mode)


def test_unknown_mode_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"use None .* 'skip' .* or 'raise'"):
        check_nonfinite_mode("ignore")
