"""Measure one rank's step without communication: a :class:`~lightning_dp_strategies.plan.Workload`'s
``compute_seconds``."""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["ComputeTimes", "measure_compute"]


@dataclass(frozen=True)
class ComputeTimes:
    """Median seconds of the parts of one step on one rank.

    Examples:
        >>> ComputeTimes(forward=0.25, backward=0.5, optimizer=0.125).total
        0.875
    """

    forward: float
    backward: float
    optimizer: float

    @property
    def total(self) -> float:
        """The whole step: ``Workload.compute_seconds``."""
        return self.forward + self.backward + self.optimizer


def _loss(module: Any, batch: Any, loss_fn: Callable[[Any, Any], Any] | None) -> Any:
    if loss_fn is not None:
        return loss_fn(module, batch)
    out = module.training_step(batch, 0) if hasattr(module, "training_step") else module(batch)
    return out["loss"] if isinstance(out, dict) else out


def measure_compute(
    module: Any,
    batch: Any,
    loss_fn: Callable[[Any, Any], Any] | None = None,
    optimizer: Callable[[Any], Any] | None = None,
    steps: int = 5,
    warmup: int = 2,
) -> ComputeTimes:
    """Time forward, backward and the optimizer step of a copy of ``module`` on ``batch`` (the module is untouched).

    Args:
        module: a ``torch.nn.Module`` (a LightningModule's ``training_step`` is used when it has one).
        batch: one rank's batch, as the training step takes it.
        loss_fn: ``loss_fn(module, batch) -> loss``; default: ``training_step(batch, 0)`` (its ``"loss"`` if it returns
            a dict), else ``module(batch)``.
        optimizer: a factory ``optimizer(parameters) -> Optimizer``; default: SGD with lr 0.01.
        steps: timed steps (the medians count).
        warmup: untimed steps first.

    Examples:
        >>> import torch
        >>> net = torch.nn.Linear(64, 1)
        >>> times = measure_compute(net, torch.randn(8, 64), loss_fn=lambda m, x: m(x).square().mean(), steps=2)
        >>> times.total > 0 and times.backward > 0
        True
    """
    import torch

    model = copy.deepcopy(module)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer(params) if optimizer is not None else torch.optim.SGD(params, lr=0.01)
    parts: list[tuple[float, float, float]] = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        loss = _loss(model, batch, loss_fn)
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=False)
        end = time.perf_counter()
        if step >= warmup:
            parts.append((forward - start, backward - forward, end - backward))
    return ComputeTimes(*(statistics.median(p[i] for p in parts) for i in range(3)))
