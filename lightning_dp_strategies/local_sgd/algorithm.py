"""The runtime of local SGD for one module: anchor, outer optimizer, position in the period, synchronisation."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_dp_strategies.bucketing.stats import CommStats
from lightning_dp_strategies.local_sgd.averaging import FlatAverager, averageable
from lightning_dp_strategies.local_sgd.config import LocalSGDConfig, make_outer_optimizer

__all__ = ["LocalSGD"]


class LocalSGD:
    """The runtime of local SGD for one module: anchor, outer optimizer, position in the period.

    A strategy calls :meth:`start` once the module is in place (rank 0's weights on every rank), :meth:`after_step`
    after every optimizer step, and :meth:`synchronize` where every rank must hold the same parameters (before
    validation, at the end of training). Configuration is ``config``; runtime state is ``anchor``, ``outer``, ``steps``
    and ``since_sync``; statistics are ``syncs`` and the averager's ``counter``.

    Examples:
        >>> from lightning_dp_strategies.reducers import NativeReducer
        >>> model = nn.Linear(2, 1)
        >>> local = LocalSGD(LocalSGDConfig(sync_every=2), FlatAverager(NativeReducer()))
        >>> local.start(model)
        >>> [local.after_step() for _ in range(4)], local.syncs
        ([False, True, False, True], 2)
    """

    def __init__(self, config: LocalSGDConfig, averager: FlatAverager) -> None:
        self.config = config
        self.averager = averager
        # runtime state
        self.params: list[nn.Parameter] = []
        self.buffers: list[Tensor] = []
        self.anchor: list[Tensor] = []
        self.outer: Optimizer | None = None
        self.steps = 0
        """Optimizer steps taken since training began (the warm-up's included)."""
        self.since_sync = 0
        """Local steps since the last synchronisation (the position in the period)."""
        # statistics
        self.syncs = 0

    # ------------------------------------------------------------------ setup
    def start(self, module: nn.Module) -> None:
        """Take the module's trainable parameters and averaged buffers, copy the anchor, make the outer optimizer."""
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.buffers = [b for b in module.buffers() if averageable(b)] if self.config.average_buffers else []
        self.anchor = [p.detach().to(torch.float32, copy=True).requires_grad_(True) for p in self.params]
        self.outer = make_outer_optimizer(self.config.outer_optimizer, self.anchor)

    @property
    def stats(self) -> CommStats:
        """What the synchronisations sent so far, as gradient statistics count it (all of it exposed)."""
        return CommStats.from_counter(self.averager.counter, exposed=True)

    @property
    def averages_gradients(self) -> bool:
        """Whether the next optimizer step is a warm-up step, whose gradients are averaged over the ranks."""
        return self.steps < self.config.warmup_steps

    @property
    def in_sync(self) -> bool:
        """Whether every rank holds the same parameters now (in the warm-up, or right after a synchronisation)."""
        return self.since_sync == 0

    # ------------------------------------------------------------------ each step
    def after_step(self) -> bool:
        """Count an optimizer step; synchronise when the period is complete. Returns whether it synchronised."""
        self.steps += 1
        if self.steps <= self.config.warmup_steps:
            if self.steps == self.config.warmup_steps:
                self._reset_anchor()
            return False
        self.since_sync += 1
        if self.since_sync >= self.config.sync_every:
            self.synchronize()
            return True
        return False

    def synchronize(self) -> None:
        """Average the pseudo-gradients (and buffers) in one all-reduce and apply the outer step (collective)."""
        if self.in_sync:
            return
        with torch.no_grad():
            deltas = [a - p.detach().to(torch.float32) for a, p in zip(self.anchor, self.params, strict=True)]
            self.averager.average([*deltas, *self.buffers])
            if self.outer is None:
                for anchor, delta in zip(self.anchor, deltas, strict=True):
                    anchor.sub_(delta)
            else:
                for anchor, delta in zip(self.anchor, deltas, strict=True):
                    anchor.grad = delta
                self.outer.step()
                self.outer.zero_grad(set_to_none=True)
            for param, anchor in zip(self.params, self.anchor, strict=True):
                param.copy_(anchor)
        self.since_sync = 0
        self.syncs += 1

    def restart(self) -> None:
        """Make the current parameters the anchor, at the start of a period (a model loaded from elsewhere)."""
        self._reset_anchor()
        self.since_sync = 0

    def _reset_anchor(self) -> None:
        with torch.no_grad():
            for anchor, param in zip(self.anchor, self.params, strict=True):
                anchor.copy_(param)

    # ------------------------------------------------------------------ checkpoints
    def averaged_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (a module's ``state_dict``, this rank's) with its parameters and floating-point buffers averaged
        over the ranks: the model a checkpoint holds. Collective unless the ranks are in sync; the module is left as
        it is."""
        if self.in_sync:
            return state
        averaged = {k: v.detach().clone() if isinstance(v, Tensor) and averageable(v) else v for k, v in state.items()}
        self.averager.average([v for v in averaged.values() if isinstance(v, Tensor) and averageable(v)])
        return averaged

    def state_dict(self) -> dict[str, Any]:
        """What resumes the run besides the module and the inner optimizer: anchor, outer state, position."""
        return {
            "sync_every": self.config.sync_every,
            "warmup_steps": self.config.warmup_steps,
            "steps": self.steps,
            "since_sync": self.since_sync,
            "syncs": self.syncs,
            "anchor": [a.detach().clone() for a in self.anchor],
            "outer": self.outer.state_dict() if self.outer is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s record (after :meth:`start`)."""
        if len(state["anchor"]) != len(self.anchor):
            raise ValueError(
                f"The checkpoint's local SGD anchor has {len(state['anchor'])} tensors, this model trains "
                f"{len(self.anchor)} parameters. Resume with the model the checkpoint was saved from."
            )
        with torch.no_grad():
            for mine, saved in zip(self.anchor, state["anchor"], strict=True):
                mine.copy_(saved)
        if self.outer is not None and state["outer"] is not None:
            self.outer.load_state_dict(state["outer"])
        self.steps, self.since_sync, self.syncs = int(state["steps"]), int(state["since_sync"]), int(state["syncs"])
