"""The ``nonfinite_grads`` option: after reduction, skip the optimizer step on every rank, or raise, on NaN/Inf."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

__all__ = ["NONFINITE_MODES", "NonfiniteGuard", "NonfiniteMode", "check_nonfinite_mode"]

NonfiniteMode = Literal["skip", "raise"] | None
NONFINITE_MODES = (None, "skip", "raise")


def check_nonfinite_mode(mode: object) -> NonfiniteMode:
    """``mode`` itself, or a clear error listing the choices."""
    if mode not in NONFINITE_MODES:
        raise ValueError(
            f"Unknown `nonfinite_grads` {mode!r}: use None (no check, the default), 'skip' (skip the optimizer step "
            "on every rank when a reduced gradient holds NaN or Inf) or 'raise' (stop training with an error)."
        )
    return mode  # type: ignore[return-value]


def _nonfinite_names(optimizer: Optimizer, names: dict[int, str]) -> list[str]:
    grads = [(p, p.grad) for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return []
    finite = torch.stack([torch.isfinite(g).all() for _, g in grads]).tolist()  # one device sync
    return [names.get(id(p), "<unnamed>") for (p, _), ok in zip(grads, finite, strict=True) if not ok]


def _any_rank(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` is set on any rank of the world (every stage and replica): the same answer everywhere."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    tensor = torch.tensor([int(flag)], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item())


class NonfiniteGuard:
    """Wraps the optimizer closure: once it has run (gradients reduced), check them and decide on every rank alike.

    ``skip`` drops the gradients (``.grad = None``), so the optimizer leaves parameters and state untouched, clipping
    sees nothing, and ``skipped_steps`` counts it; learning-rate schedulers still step, as with AMP's skipped steps.
    ``raise`` raises ``FloatingPointError`` on every rank naming the parameters.
    """

    def __init__(self, mode: NonfiniteMode) -> None:
        self.mode = mode
        self.skipped_steps = 0
        """Optimizer steps skipped because a reduced gradient was not finite."""

    def wrap(
        self,
        closure: Callable[[], Any],
        optimizer: Optimizer,
        named_parameters: Iterable[tuple[str, nn.Parameter]],
        device: torch.device,
    ) -> Callable[[], Any]:
        """``closure`` itself when the check is off, else a closure that runs it and then checks."""
        if self.mode is None:
            return closure
        names = {id(p): n for n, p in named_parameters}

        def guarded() -> Any:
            result = closure()
            bad = _nonfinite_names(optimizer, names)
            if not _any_rank(bool(bad), device):
                return result
            if self.mode == "raise":
                where = f"on this rank in {bad[:5]}" if bad else "on another rank"
                raise FloatingPointError(
                    f"A gradient holds NaN or Inf after reduction ({where}), so the optimizer step would corrupt the "
                    "parameters; every rank stopped here. Lower the learning rate, clip gradients "
                    "(`Trainer(gradient_clip_val=...)`, or `fabric.clip_gradients(...)` before `optimizer.step()`), "
                    "check the data and loss, or pass `nonfinite_grads='skip'` to skip such steps."
                )
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None
            self.skipped_steps += 1
            return result

        return guarded

    def check_step(
        self,
        kwargs: dict[str, Any],
        optimizer: Optimizer,
        named_parameters: Iterable[tuple[str, nn.Parameter]],
        device: torch.device,
    ) -> dict[str, Any]:
        """Fabric's ``optimizer.step(**kwargs)``, whose gradients are reduced by now: a ``closure`` among ``kwargs``
        is wrapped; without one the check runs at once. The ``kwargs`` to step with are returned."""
        if self.mode is None:
            return kwargs
        closure = kwargs.pop("closure", None)
        if closure is not None:
            return {**kwargs, "closure": self.wrap(closure, optimizer, named_parameters, device)}
        self.wrap(lambda: None, optimizer, named_parameters, device)()
        return kwargs
