"""A script that catches a failed fit and fits again trains on every rank.

The first fit raises on every rank; a rank started by Lightning's launcher catches it like rank 0 and goes on to
the second fit, which must find every rank there (a failed run's ranks are stopped when rank 0 exits, not when it
raises) and end where one device does (1e-6)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import run_script
from tests.reliability.retry_scenario import WORLD, reference


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["ring_allreduce", "hybrid_pipeline"])
def test_a_caught_failure_leaves_every_rank_for_the_next_fit(strategy: str, tmp_path: Path) -> None:
    output = run_script(["-m", "tests.reliability.retry_scenario", strategy, str(tmp_path)], timeout=240)
    assert output.count("first fit raised") == WORLD, output[-4000:]
    expected = reference()
    for rank in range(WORLD):
        assert f"rank {rank} fit again: 8 steps" in output, output[-4000:]
        state = torch.load(tmp_path / f"final-rank{rank}.pt")
        assert state, f"rank {rank} holds no parameters"
        for name, value in state.items():
            torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6, msg=f"rank {rank}: {name}")
