"""Partition a sequence of blocks into contiguous pipeline stages: by explicit balance, parameter count or time.

A *balance* is the number of blocks per stage, e.g. ``[3, 2]`` puts blocks 0-2 on stage 0 and blocks 3-4 on stage 1.
Automatic balances minimise the cost of the most expensive stage (the pipeline runs at the pace of its slowest
stage); the cost of a block is its parameter count (:func:`balance_by_parameters`) or its measured forward + backward
time (:func:`balance_by_time`). Both reduce to :func:`balance_costs`, the classic linear-partition problem.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_dp_strategies.pipeline.activations import Activation, as_args, detach, from_args

__all__ = [
    "balance_by_parameters",
    "balance_by_time",
    "balance_costs",
    "check_balance",
    "stage_ranges",
]


def _check_enough_blocks(num_blocks: int, stages: int) -> None:
    if stages < 1:
        raise ValueError(f"`pipeline_stages` must be >= 1, got {stages}.")
    if num_blocks == 0:
        raise ValueError(
            f"The pipeline body has no blocks, so there is nothing to split into {stages} pipeline stage(s). Put the "
            f"model's layers into its nn.Sequential, at least {stages} of them (one or more per stage)."
        )
    if num_blocks < stages:
        raise ValueError(
            f"Cannot split {num_blocks} blocks into {stages} pipeline stages: every stage needs at least one block. "
            f"Use at most pipeline_stages={num_blocks}, or split the body into more blocks (more entries in its "
            "nn.Sequential)."
        )


def check_balance(balance: Sequence[int], num_blocks: int, stages: int) -> list[int]:
    """Validate an explicit balance (blocks per stage) and return it as a list.

    Examples:
        >>> check_balance([3, 2], num_blocks=5, stages=2)
        [3, 2]
    """
    _check_enough_blocks(num_blocks, stages)
    values = list(balance)
    if len(values) != stages or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in values):
        raise ValueError(
            f"`balance` must list the number of blocks of each of the {stages} stages, each >= 1, got {values!r}."
        )
    if sum(values) != num_blocks:
        raise ValueError(
            f"`balance` {values} covers {sum(values)} blocks but the body has {num_blocks}; make the entries sum to "
            f"{num_blocks}, or pass balance='parameters' to split automatically."
        )
    return values


def balance_costs(costs: Sequence[float], stages: int) -> list[int]:
    """Split ``costs`` into ``stages`` contiguous non-empty groups minimising the largest group sum.

    Ties are broken towards the earliest cut that achieves the optimum, so the result is deterministic (every rank
    computes the same balance from the same costs).

    Examples:
        >>> balance_costs([1, 1, 1, 1], 2)
        [2, 2]
        >>> balance_costs([4, 1, 1, 1, 1], 2)
        [1, 4]
    """
    n = len(costs)
    _check_enough_blocks(n, stages)
    if any(c < 0 for c in costs):
        raise ValueError(f"Block costs must be >= 0, got {list(costs)}.")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: minimal max-stage cost of the first i blocks in k stages; cut[k][i]: where the last stage starts
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i] - 1e-12:
                    best[k][i] = value
                    cut[k][i] = j
    sizes = []
    i = n
    for k in range(stages, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def balance_by_parameters(blocks: Sequence[nn.Module], stages: int, trainable_weight: float = 4.0) -> list[int]:
    """Balance by what each block's parameters cost in memory; blocks without parameters cost nothing.

    A frozen element counts 1 (the parameter); a trainable one ``trainable_weight`` (default 4: the parameter, its
    gradient and two optimizer-state slots, as Adam keeps). Without frozen parameters this is an even split of the
    parameter counts.

    Examples:
        >>> blocks = [nn.Linear(10, 10), nn.Tanh(), nn.Linear(10, 10), nn.Linear(10, 30)]
        >>> balance_by_parameters(blocks, 2)
        [3, 1]
        >>> blocks[3].requires_grad_(False) and balance_by_parameters(blocks, 2)  # costs 440, 0, 440, 330
        [1, 3]
    """
    _check_enough_blocks(len(blocks), stages)
    costs = [sum(p.numel() * (trainable_weight if p.requires_grad else 1.0) for p in b.parameters()) for b in blocks]
    return balance_costs(costs, stages)


def balance_by_time(blocks: Sequence[nn.Module], sample: Activation, stages: int, repeats: int = 3) -> list[int]:
    """Balance by the measured forward + backward time of each block on ``sample`` (the body's input).

    Each block runs ``repeats`` times on the output of the previous one (the minimum time is kept, which is robust
    to noise); parameters' ``.grad`` are left untouched. ``sample`` and the activations may be tuples of tensors.
    Measure on one rank and broadcast the result: timings differ between processes, and every rank must use the
    same balance.

    Examples:
        >>> torch.manual_seed(0) and None
        >>> blocks = [nn.Linear(8, 8), nn.Linear(8, 8)]
        >>> balance_by_time(blocks, torch.randn(4, 8), 2)
        [1, 1]
    """
    _check_enough_blocks(len(blocks), stages)
    costs: list[float] = []
    x: Any = detach(sample)
    for block in blocks:
        params = [p for p in block.parameters() if p.requires_grad]
        best = float("inf")
        out = x
        for _ in range(max(1, repeats)):
            inputs = [t.detach().requires_grad_(t.is_floating_point()) for t in as_args(x)]
            start = time.perf_counter()
            out = block(from_args(inputs))
            targets = [t for t in (*inputs, *params) if t.requires_grad]
            outputs = [t for t in as_args(out) if t.requires_grad]
            if outputs and targets:
                ones = [torch.ones_like(t) for t in outputs]
                torch.autograd.grad(outputs, targets, grad_outputs=ones, allow_unused=True)
            if outputs and outputs[0].device.type == "cuda":
                torch.cuda.synchronize(outputs[0].device)
            best = min(best, time.perf_counter() - start)
        costs.append(best)
        x = detach(out)
    return balance_costs(costs, stages)


def stage_ranges(balance: Sequence[int]) -> list[range]:
    """The block indices of each stage.

    Examples:
        >>> stage_ranges([3, 2])
        [range(0, 3), range(3, 5)]
    """
    ranges = []
    start = 0
    for size in balance:
        ranges.append(range(start, start + size))
        start += size
    return ranges
