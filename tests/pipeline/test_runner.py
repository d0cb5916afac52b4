"""PipelineRunner on real processes: the transparency test (gradients equal to one backward on the whole model).

Every case runs inside one 2-process (or 4-process) gloo group, looping over schedules and micro-batch counts, so the
whole module costs two launches.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_dp_strategies.comm import clip_grad_norm_across
from lightning_dp_strategies.pipeline import (
    LOOPED,
    V_SHAPED,
    PipelineRunner,
    chunk_ranks,
    effective_schedule,
    rank_order,
    stage_order,
    stage_ranges,
)
from tests.helpers.distributed import run_distributed

# numerically sensitive: CI runs this file again under other CPU kernel paths and thread counts
pytestmark = pytest.mark.numerics


def make_body() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def reference_grads(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    body = make_body()
    F.cross_entropy(body(x), y).backward()
    return {n: p.grad.clone() for n, p in body.named_parameters() if p.grad is not None}


def reference_clipped_grads(x: torch.Tensor, y: torch.Tensor, max_norm: float) -> dict[str, torch.Tensor]:
    body = make_body()
    F.cross_entropy(body(x), y).backward()
    torch.nn.utils.clip_grad_norm_(body.parameters(), max_norm)
    return {n: p.grad.clone() for n, p in body.named_parameters() if p.grad is not None}


def _transparency(rank: int, world: int) -> None:
    balance = [2, 3] if world == 2 else [1, 1, 2, 1]
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
    expected = reference_grads(x, y)
    full = make_body()
    local = stage_ranges(balance)[rank]
    stage = nn.Sequential(*[full[i] for i in local])
    names = {f"{i}.{n}": p for i in local for n, p in full[i].named_parameters()}
    for schedule in ("gpipe", "1f1b"):
        for micro in (1, 2, 4, 3):  # 3 does not divide 8: the runner uses 2 equal micro-batches
            runner = PipelineRunner(stage, rank, world, None, torch.device("cpu"), schedule, micro)
            for p in stage.parameters():
                p.grad = None
            result = runner.train_step(x, y, F.cross_entropy)
            for name, p in names.items():
                assert p.grad is not None, name
                diff = (p.grad - expected[name]).abs().max().item()
                assert diff <= 1e-6, f"{schedule} M={micro} stage {rank} {name}: {diff}"
            assert result.stats.micro_batches == (2 if micro == 3 else micro)
            # the engine ran this stage's forwards and backwards in the order of the clock-table model (1F1B with
            # fewer micro-batches than stages runs as GPipe)
            ran = effective_schedule(schedule, world, result.stats.micro_batches)
            assert ran == ("gpipe" if schedule == "gpipe" or result.stats.micro_batches < world else "1f1b")
            assert runner.last_order == stage_order(ran, world, result.stats.micro_batches, rank)
            assert 0.0 <= result.stats.bubble <= 1.0 and result.stats.compute_seconds > 0
            if micro == 1:
                # clipping by the global norm over the stages equals clipping the whole model on one device
                clipped = reference_clipped_grads(x, y, 0.05)
                total = clip_grad_norm_across(stage.parameters(), 0.05, group=None)
                assert total.item() > 0.05, "the test must actually clip"
                for name, p in names.items():
                    assert (p.grad - clipped[name]).abs().max().item() <= 1e-6, f"clipped {name}"
            shared = runner.share_output(result.output)
            with torch.no_grad():
                reference_out = make_body()(x)
            assert torch.allclose(shared, reference_out, atol=1e-6), "every stage gets the last stage's output"
            if runner.is_last:
                assert result.loss is not None
                assert abs(result.loss.item() - F.cross_entropy(reference_out, y).item()) < 1e-6
            else:
                assert result.loss is None and result.output is None
            # a second step on a smaller batch (the last batch of an epoch) builds a new stage; then evaluation
            runner.train_step(x[:5], y[:5], F.cross_entropy)
            with torch.inference_mode():
                out = runner.share_output(runner.forward(x[:6]))
            assert torch.allclose(out, reference_out[:6], atol=1e-6)
    if world == 2:
        _virtual_stages(rank, world, x, y, expected)
    dist.barrier()


def _virtual_stages(rank: int, world: int, x: torch.Tensor, y: torch.Tensor, expected: dict[str, torch.Tensor]) -> None:
    """The schedules with two chunks per rank: the five blocks in four chunks, placed as each schedule places them."""
    ranges = stage_ranges([1, 1, 2, 1])
    for schedule in (*LOOPED, *V_SHAPED):
        full = make_body()
        chunks = [c for c, r in enumerate(chunk_ranks(schedule, world, 2)) if r == rank]
        modules = [nn.Sequential(*[full[i] for i in ranges[c]]) for c in chunks]
        names = {f"{i}.{n}": p for c in chunks for i in ranges[c] for n, p in full[i].named_parameters()}
        for micro in (4, 2, 1):
            runner = PipelineRunner(modules, rank, world, None, torch.device("cpu"), schedule, micro)
            full.zero_grad(set_to_none=True)
            result = runner.train_step(x, y, F.cross_entropy)
            for name, p in names.items():
                assert p.grad is not None, f"{schedule} {name}"
                diff = (p.grad - expected[name]).abs().max().item()
                assert diff <= 1e-6, f"{schedule} M={micro} rank {rank} {name}: {diff}"
            # the order torch ran is the one the clock-table model simulates
            assert runner.last_order == rank_order(schedule, world, micro, rank), schedule
            assert result.stats.p2p_bytes_sent > 0
            with torch.no_grad():
                reference_out = make_body()(x)
            assert torch.allclose(runner.share_output(result.output), reference_out, atol=1e-6), schedule
            with torch.inference_mode():
                out = runner.share_output(runner.forward(x[:6]))
            assert torch.allclose(out, reference_out[:6], atol=1e-6), f"{schedule}: evaluation"


@pytest.mark.timeout(180)
def test_gradients_equal_one_backward_on_the_whole_model_two_stages() -> None:
    run_distributed(_transparency, 2, timeout=150)


@pytest.mark.timeout(180)
def test_gradients_equal_one_backward_on_the_whole_model_four_stages() -> None:
    run_distributed(_transparency, 4, timeout=150)
