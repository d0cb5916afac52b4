"""ActivationMeter: bytes saved for backward, counted once per storage, parameters excluded, freed by backward."""

from __future__ import annotations

import torch
from torch import nn

from lightning_dp_strategies.pipeline import ActivationMeter


def test_counts_saved_activations_once_and_releases_them() -> None:
    lin = nn.Linear(100, 100)
    x = torch.randn(8, 100)
    with ActivationMeter(exclude=lin.parameters()) as meter:
        hidden = torch.tanh(lin(x))  # linear saves x; tanh saves its output
        loss = (hidden * hidden).sum()  # mul saves `hidden` twice: the same storage, counted once
    assert meter.peak_bytes == 2 * 8 * 100 * 4
    loss.backward()
    assert meter.live_bytes == 0


def test_peak_grows_with_micro_batches_held_at_once() -> None:
    lin = nn.Linear(64, 64)
    with ActivationMeter(exclude=lin.parameters()) as meter:
        losses = [torch.tanh(lin(torch.randn(4, 64))).sum() for _ in range(4)]  # GPipe-like: all forwards first
    held = meter.peak_bytes
    for loss in losses:
        loss.backward()
    with ActivationMeter(exclude=lin.parameters()) as meter:
        for _ in range(4):  # one at a time
            torch.tanh(lin(torch.randn(4, 64))).sum().backward()
    assert held == 4 * meter.peak_bytes
