"""Determinism: runs with the same seed end with bitwise-identical parameters, for each strategy, on CPU.

Each strategy is launched twice (:mod:`tests.reliability.scenarios`, ``seeded`` mode; two processes apart, with
different hash seeds and launch paths: the first's ranks forked from the test's fork server as ``torchrun`` would start
them, the second through Lightning's own launcher in new interpreters with another ``PYTHONHASHSEED``), and each
launch trains twice in the same process, the second run after the first
(another autograd and allocator history), every run after ``seed_everything``, with dropout. The four results must be
equal with ``torch.equal`` (tolerance: none) on every rank.

``dp`` needs ``Trainer(deterministic=True)`` for dropout (its CPU replicas share one random generator and otherwise
draw in thread order); it is also run without dropout and without that flag, first in the process, where the sum of
the replicas' gradients used to depend on what the process had run before.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import run_ranks, run_script
from tests.reliability.scenarios import SETUPS

# numerically sensitive: CI runs this file again under other CPU kernel paths and thread counts
pytestmark = pytest.mark.numerics


STRATEGIES = ["dp", "ring_allreduce", "hybrid_pipeline"]


def launch(strategy: str, out: Path, tag: str, hash_seed: str | None) -> None:
    """One launch: with ``hash_seed``, through Lightning's launcher in new interpreters started with that
    ``PYTHONHASHSEED``; without, forked from the fork server (its hash seed)."""
    argv = ["seeded", strategy, str(out), tag]
    if hash_seed is None:
        run_ranks("tests.reliability.scenarios", argv, 1 if strategy == "dp" else SETUPS[strategy].devices, 200)
    else:
        run_script(["-m", "tests.reliability.scenarios", *argv], timeout=200, env={"PYTHONHASHSEED": hash_seed})


def assert_bitwise_equal(out: Path, runs: list[str], world: int) -> None:
    for rank in range(world):
        results = {run: torch.load(out / f"{run}-rank{rank}.pt")["params"] for run in runs}
        first = results[runs[0]]
        for run in runs[1:]:
            assert first.keys() == results[run].keys()
            for name, value in first.items():
                diff = (value - results[run][name]).abs().max().item()
                assert torch.equal(value, results[run][name]), f"rank {rank}: {name} of {run} != {runs[0]} by {diff}"


@pytest.mark.timeout(480)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_same_seed_gives_bitwise_identical_parameters(strategy: str, tmp_path: Path) -> None:
    launch(strategy, tmp_path, "first", hash_seed=None)  # the fork server's: random unless the session sets one
    launch(strategy, tmp_path, "second", hash_seed="1" if os.environ.get("PYTHONHASHSEED") != "1" else "2")
    world = 1 if strategy == "dp" else SETUPS[strategy].devices
    assert_bitwise_equal(tmp_path, ["first-a", "first-b", "second-a", "second-b"], world)
    if strategy == "dp":
        assert_bitwise_equal(tmp_path, ["first-plain-a", "first-plain-b", "second-plain-a", "second-plain-b"], world)
    # dropout was active: the runs with it trained other parameters than the runs without (dp has both)
    if strategy == "dp":
        with_dropout = torch.load(tmp_path / "first-a-rank0.pt")["params"]
        without = torch.load(tmp_path / "first-plain-a-rank0.pt")["params"]
        assert any(not torch.equal(with_dropout[n], without[n]) for n in with_dropout)
