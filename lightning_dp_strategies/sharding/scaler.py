"""A gradient scaler (16-mixed) that agrees with the other ranks on whether a step found Inf or NaN.

``GradScaler.unscale_`` checks the gradients of the optimizer's parameters, which under sharded optimizer state are
this rank's pieces only: one rank could skip a step that another takes. :func:`agree_on_nonfinite` makes the
scaler's class a subclass whose ``unscale_`` sums the finding over the ranks afterwards (as torch's
``ShardedGradScaler`` does), so every rank skips alike; :func:`restore_scaler` puts the class back.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["agree_on_nonfinite", "restore_scaler"]

_ORIGINAL = "_ldps_original_class"


def _unscale_agreed(self: Any, optimizer: torch.optim.Optimizer) -> None:
    base: Any = type(self).__mro__[1]  # the scaler's own class
    base.unscale_(self, optimizer)
    state = self._per_optimizer_states[id(optimizer)]
    found = list(state["found_inf_per_device"].values())
    device = found[0].device if found else self._scale.device
    total = torch.zeros(1, dtype=torch.float32, device=device)
    for flag in found:
        total += flag.to(device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    state["found_inf_per_device"] = {device: total}


def agree_on_nonfinite(scaler: torch.amp.GradScaler) -> None:
    """Make ``scaler`` sum its Inf/NaN finding over every rank in ``unscale_`` (its class becomes a subclass of its
    own class; :func:`restore_scaler` undoes it). Calling it twice does nothing more.

    Examples:
        >>> scaler = torch.amp.GradScaler("cpu")
        >>> agree_on_nonfinite(scaler); type(scaler).__name__, isinstance(scaler, torch.amp.GradScaler)
        ('AgreedGradScaler', True)
        >>> restore_scaler(scaler); type(scaler).__name__
        'GradScaler'
    """
    if _ORIGINAL in vars(scaler):
        return
    base = type(scaler)
    agreed = type(f"Agreed{base.__name__}", (base,), {"unscale_": _unscale_agreed, "__module__": __name__})
    scaler.__dict__[_ORIGINAL] = base
    scaler.__class__ = agreed


def restore_scaler(scaler: torch.amp.GradScaler) -> None:
    """Give ``scaler`` back the class it had before :func:`agree_on_nonfinite`."""
    original = vars(scaler).pop(_ORIGINAL, None)
    if original is not None:
        scaler.__class__ = original
