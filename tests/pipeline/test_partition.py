"""Partition and balance: contiguous, non-empty stages minimising the most expensive one."""

from __future__ import annotations

import itertools
import time

import pytest
import torch
from torch import nn

from lightning_dp_strategies.pipeline import (
    balance_by_parameters,
    balance_by_time,
    balance_costs,
    check_balance,
    stage_ranges,
)


def brute_force(costs: list[float], stages: int) -> float:
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(costs)), stages - 1):
        bounds = [0, *cuts, len(costs)]
        best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


@pytest.mark.parametrize(
    ("costs", "stages", "expected"),
    [
        ([1, 1, 1, 1], 2, [2, 2]),
        ([4, 1, 1, 1, 1], 2, [1, 4]),
        ([1, 2, 3, 4, 5, 6], 3, [3, 2, 1]),
        ([5, 5], 2, [1, 1]),
        ([0, 0, 0], 3, [1, 1, 1]),
    ],
)
def test_balance_costs_literal_cases(costs: list[float], stages: int, expected: list[int]) -> None:
    assert balance_costs(costs, stages) == expected


def test_balance_costs_is_optimal_against_brute_force() -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(1, 9, (1,), generator=gen))
        stages = int(torch.randint(1, n + 1, (1,), generator=gen))
        costs = torch.randint(0, 20, (n,), generator=gen).tolist()
        balance = balance_costs(costs, stages)
        assert len(balance) == stages and all(b >= 1 for b in balance) and sum(balance) == n
        achieved = max(sum(costs[r.start : r.stop]) for r in stage_ranges(balance))
        assert achieved == brute_force(costs, stages), (costs, stages, balance)


def test_balance_by_parameters_puts_the_big_block_alone() -> None:
    blocks = [nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 10), nn.Linear(10, 200)]
    assert balance_by_parameters(blocks, 2) == [3, 1]
    assert balance_by_parameters(blocks, 4) == [1, 1, 1, 1]


class Sleepy(nn.Linear):
    """A block whose forward takes at least ``seconds``: a cost no CPU load can make smaller."""

    def __init__(self, seconds: float) -> None:
        super().__init__(8, 8)
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return super().forward(x)


def test_balance_by_time_puts_the_slow_block_alone() -> None:
    # the slow block sleeps 0.2 s, the others compute an 8x8 layer: only a measurement that tells them apart gives
    # [3, 1] (a 60-layer block timed against single layers gave [2, 2] on a loaded machine: timing noise, not cost)
    torch.manual_seed(0)
    blocks = [Sleepy(0.0), Sleepy(0.0), Sleepy(0.0), Sleepy(0.2)]
    balance = balance_by_time(blocks, torch.randn(4, 8), 2)
    assert balance == [3, 1]
    assert all(p.grad is None for p in nn.ModuleList(blocks).parameters()), "timing must not leave gradients"


def test_stage_ranges() -> None:
    assert stage_ranges([2, 1, 3]) == [range(0, 2), range(2, 3), range(3, 6)]


@pytest.mark.parametrize(
    ("balance", "blocks", "stages", "message"),
    [
        ([1, 1], 1, 2, "Cannot split 1 blocks into 2 pipeline stages"),
        ([3, 1], 5, 2, r"covers 4 blocks but the body has 5"),
        ([4], 4, 2, "number of blocks of each of the 2 stages"),
        ([4, 0], 4, 2, "each >= 1"),
        ([1], 1, 0, "`pipeline_stages` must be >= 1"),
    ],
)
def test_check_balance_errors_name_the_fix(balance: list[int], blocks: int, stages: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_balance(balance, blocks, stages)


def test_more_stages_than_blocks_is_refused_by_the_automatic_balances() -> None:
    with pytest.raises(ValueError, match="Use at most pipeline_stages=2"):
        balance_by_parameters([nn.Linear(2, 2), nn.Linear(2, 2)], 3)
    with pytest.raises(ValueError, match="Cannot split 1 blocks"):
        balance_by_time([nn.Linear(2, 2)], torch.randn(1, 2), 2)
