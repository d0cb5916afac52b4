"""clip_grad_norm_across on one process equals torch's clip_grad_norm_; the pipeline and sharding names are it."""

from __future__ import annotations

import torch
from torch import nn

from lightning_dp_strategies import pipeline, sharding
from lightning_dp_strategies.comm import clip_grad_norm_across
from lightning_dp_strategies.pipeline import clipping as pipeline_clipping


def _grads(max_norm: float, ours: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model(torch.randn(5, 4)).square().sum().backward()
    clip = clip_grad_norm_across if ours else torch.nn.utils.clip_grad_norm_
    total = clip(model.parameters(), max_norm)
    return total, [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_one_process_clips_as_torch_does() -> None:
    for max_norm in (0.01, 1e6):  # clips, and leaves alone
        (total, ours), (expected_total, theirs) = _grads(max_norm, True), _grads(max_norm, False)
        assert torch.allclose(total, expected_total)
        assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(ours, theirs, strict=True))


def test_no_gradient_gives_a_zero_norm_on_the_given_device() -> None:
    total = clip_grad_norm_across([nn.Parameter(torch.ones(3))], 1.0, device=torch.device("cpu"))
    assert total.item() == 0.0 and total.device == torch.device("cpu")


def test_the_pipeline_and_sharding_packages_export_the_same_function() -> None:
    assert pipeline.clip_grad_norm_across is clip_grad_norm_across
    assert pipeline_clipping.clip_grad_norm_across is clip_grad_norm_across
    assert sharding.clip_grad_norm_across is clip_grad_norm_across
