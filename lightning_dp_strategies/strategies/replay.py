"""A lost rank's micro-batch as a survivor trains it: the module's logging silenced and collectives refused; under local
SGD, its replica's inner step with the optimizer at the settings of the step repeated, autograd on and the module in
training mode. Each context puts back what it changed."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch

if TYPE_CHECKING:
    from lightning_dp_strategies.strategies.control import ControlCollectives

__all__ = ["LOST_BATCH_COLLECTIVE", "as_lost_rank", "settings", "silenced", "snapshot", "trainable"]


LOST_BATCH_COLLECTIVE = (
    "training_step ran a collective (`all_gather`, a `reduce`, a metric synced on the step, a barrier) while this "
    "rank trained a lost rank's micro-batch. Under `fault_tolerant` the survivors train different numbers of the "
    "lost ranks' micro-batches, so such a collective meets no partner on the other ranks; `self.log` is skipped there "
    "(with its `sync_dist`). Compute values across ranks in `on_train_batch_end` or the epoch hooks, or pass "
    "`FaultTolerance(keep_global_batch=False)` (the lost micro-batches are then not trained)."
)
"""The error of a collective in ``training_step`` on a lost rank's micro-batch (see :func:`as_lost_rank`)."""


@contextmanager
def silenced(module: pl.LightningModule) -> Generator[None, None, None]:
    """The module's ``log`` and ``log_dict`` do nothing inside (instance attributes over the methods, removed after;
    inside another ``silenced`` of the same module, nothing changes)."""

    def ignore(*args: Any, **kwargs: Any) -> None:
        return None

    if "log" in vars(module):
        yield
        return
    module.log = ignore  # type: ignore[method-assign]
    module.log_dict = ignore  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.log, module.log_dict


@contextmanager
def as_lost_rank(module: pl.LightningModule, control: ControlCollectives) -> Generator[None, None, None]:
    """Inside: the module's logging :func:`silenced`, and every collective of ``control`` (the strategy's
    Lightning collectives) refused with :data:`LOST_BATCH_COLLECTIVE`."""
    before, control.refusing = control.refusing, LOST_BATCH_COLLECTIVE
    try:
        with silenced(module):
            yield
    finally:
        control.refusing = before


def snapshot(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Every parameter group's settings but its parameters, as they are now, for :func:`settings` to restore: a
    tensor setting (a learning rate a scheduler fills in place, ``betas`` as tensors) is copied, the rest is shared.

    Examples:
        >>> optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=torch.tensor(0.1))
        >>> then = snapshot(optimizer)
        >>> _ = optimizer.param_groups[0]["lr"].fill_(0.2)
        >>> round(then[0]["lr"].item(), 6), round(optimizer.param_groups[0]["lr"].item(), 6)
        (0.1, 0.2)
    """
    return [{k: _copied(v) for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def _copied(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple):
        return tuple(_copied(v) for v in value)
    return value


@contextmanager
def settings(optimizer: torch.optim.Optimizer, recorded: list[dict[str, Any]]) -> Generator[None, None, None]:
    """The optimizer's parameter groups take the ``recorded`` settings (:func:`snapshot`) inside (what they held is
    put back after)."""
    held = [{k: group[k] for k in setting} for group, setting in zip(optimizer.param_groups, recorded, strict=True)]
    for group, setting in zip(optimizer.param_groups, recorded, strict=True):
        group.update(setting)
    try:
        yield
    finally:
        for group, setting in zip(optimizer.param_groups, held, strict=True):
            group.update(setting)


@contextmanager
def trainable(module: pl.LightningModule) -> Generator[None, None, None]:
    """Inside: autograd on and ``module`` in training mode, as at a training step, also where a replay runs in
    validation (under ``torch.inference_mode``, the module in eval mode); each submodule's mode is put back after."""
    modes = [(m, m.training) for m in module.modules()]
    module.train()
    try:
        with torch.inference_mode(False), torch.enable_grad():
            yield
    finally:
        for submodule, training in modes:
            submodule.training = training
