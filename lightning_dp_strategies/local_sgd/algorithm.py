"""The runtime of local SGD for one module: anchor, outer optimizer, position in the period, synchronisation; and
streaming DiLoCo's fragments in flight."""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_dp_strategies.bucketing.stats import CommStats
from lightning_dp_strategies.local_sgd.averaging import FlatAverager, averageable
from lightning_dp_strategies.local_sgd.config import LocalSGDConfig, make_outer_optimizer
from lightning_dp_strategies.local_sgd.streaming import (
    BYTES_PER_VALUE,
    InFlight,
    OuterChannel,
    choose_period,
    split_fragments,
    turns,
)
from lightning_dp_strategies.reducers.auto import visible

__all__ = ["LocalSGD", "SyncSurvivor"]

log = logging.getLogger("lightning_dp_strategies")


class SyncSurvivor(Protocol):
    """What averages a synchronisation's changes when ranks may be lost (fault-tolerant local SGD)."""

    def averaged_changes(self, indices: list[int]) -> list[Tensor]:
        """The changes of parameters ``indices`` (and the buffers with the last) averaged over the original world."""
        ...

    def after_outer_step(self, indices: list[int]) -> None:
        """The anchors of ``indices`` moved and the parameters took them: the replicas take them too."""
        ...

    def averaged_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """A module ``state_dict`` averaged over the original world's replicas (collective)."""
        ...


class LocalSGD:
    """The runtime of local SGD for one module: anchor, outer optimizer, position in the period.

    A strategy calls :meth:`start` once the module is in place (rank 0's weights on every rank), :meth:`after_step`
    after every optimizer step, and :meth:`synchronize` where every rank must hold the same parameters (before
    validation, at the end of training). Configuration is ``config``; runtime state is ``anchor``, ``outer``,
    ``steps``, ``phase``, ``since_sync`` and ``in_flight``; statistics are ``syncs``, ``exposed_seconds`` and the
    averager's ``counter``.

    With one fragment and no delay, each period ends in one synchronisation of the whole model (local SGD, DiLoCo).
    Streaming DiLoCo (``fragments``, ``delay``, ``mixing``) synchronises fragment ``p`` at its turn of every period (see
    :mod:`~lightning_dp_strategies.local_sgd.streaming`): its change ``anchor_p - params_p`` leaves then; ``delay``
    steps later the average is applied by the outer optimizer to ``anchor_p``, and the rank's own values become
    ``mixing * params_p + (1 - mixing) * anchor_p``.

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
        self.channel = OuterChannel() if config.delay > 0 else None
        """The thread the averager's reductions run on (with a delay); ``None``: the caller's thread."""
        # runtime state
        self.params: list[nn.Parameter] = []
        self.buffers: list[Tensor] = []
        self.anchor: list[Tensor] = []
        self.outer: Optimizer | None = None
        self.fragments: list[list[int]] = []
        self.turns: list[int] = []
        self.sync_every = config.sync_every if isinstance(config.sync_every, int) else 0
        """The period in use: ``config.sync_every``, or the one ``"auto"`` chose (0 until then)."""
        self.delay = config.delay
        """The delay in use: ``config.delay``, or the one ``"auto"`` chose."""
        self.timings: dict[str, list[float]] = {"step": [], "fragment": []}
        """``sync_every="auto"``: the inner steps' and the fragments' reductions' seconds, until it chooses."""
        self._step_end: float | None = None
        self.steps = 0
        """Optimizer steps taken since training began (the warm-up's included)."""
        self.phase = 0
        """Local steps since the warm-up or the last synchronisation of the whole model: the position in the period."""
        self.since_sync = 0
        """Local steps since every rank last held the same parameters."""
        self.in_flight: list[InFlight] = []
        self.hold_sends = False
        """Keep a fragment's reduction until :meth:`release` (else it starts when the fragment leaves). The Trainer
        strategy releases at the next batch's start, after Lightning's per-batch broadcast from rank 0, so that the
        fragment's bytes do not queue on the link ahead of that broadcast."""
        self.survivor: SyncSurvivor | None = None
        """With ``fault_tolerant``: what averages the changes over the survivors (the lost ranks' replicas too)."""
        # statistics
        self.syncs = 0
        """Outer steps applied: one a period (a fragment's turn with streaming), one a synchronisation of all."""
        self.exposed_seconds = 0.0
        """Time the training loop waited for the averaging (a delay hides the rest)."""

    # ------------------------------------------------------------------ setup
    def start(self, module: nn.Module) -> None:
        """Take the module's trainable parameters and averaged buffers, copy the anchor, make the outer optimizer."""
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.buffers = [b for b in module.buffers() if averageable(b)] if self.config.average_buffers else []
        self.anchor = [p.detach().to(torch.float32, copy=True).requires_grad_(True) for p in self.params]
        self.outer = make_outer_optimizer(self.config.outer_optimizer, self.anchor)
        self.fragments = split_fragments(self.params, self.config.fragments)
        self._set_turns()

    @property
    def choosing(self) -> bool:
        """Whether ``sync_every="auto"`` is still timing its first period."""
        return self.sync_every == 0

    @property
    def _trial_period(self) -> int:
        """The first period of ``sync_every="auto"``: every fragment leaves once, one a step."""
        return max(self.config.fragments, self.delay + 1)

    @property
    def _period(self) -> int:
        """The period the turns follow now: the chosen one, or the trial period while choosing."""
        return self.sync_every or self._trial_period

    def _set_turns(self) -> None:
        self.turns = [turn % self._period for turn in turns(self.config.fragments, self._period)]

    @property
    def stats(self) -> CommStats:
        """What the synchronisations sent so far, as gradient statistics count it; exposed: what the loop waited."""
        stats = CommStats.from_counter(self.averager.counter)
        return dataclasses.replace(stats, exposed_seconds=self.exposed_seconds)

    @property
    def averages_gradients(self) -> bool:
        """Whether the next optimizer step is a warm-up step, whose gradients are averaged over the ranks."""
        return self.steps < self.config.warmup_steps

    @property
    def in_sync(self) -> bool:
        """Whether every rank holds the same parameters now (in the warm-up, or right after a synchronisation)."""
        return self.since_sync == 0 and not self.in_flight

    # ------------------------------------------------------------------ each step
    def after_step(self) -> bool:
        """Count an optimizer step; apply the averages due and send the fragments whose turn it is. Returns whether
        an outer step was applied."""
        self.steps += 1
        if self.steps <= self.config.warmup_steps:
            if self.steps == self.config.warmup_steps:
                self._reset_anchor()
            return False
        if self.choosing and self._step_end is not None:  # the inner step since the last call, nothing of ours
            self.timings["step"].append(time.perf_counter() - self._step_end)
        self.phase += 1
        self.since_sync += 1
        applied = False
        while self.in_flight and self.in_flight[0].apply_at <= self.phase:
            self._apply(self.in_flight.pop(0))
            applied = True
        if self.choosing and self.phase > self._period:  # the trial period's fragments in flight: none leaves
            if self.phase == self._period + self.delay:
                self._choose_period()
        else:
            for fragment, turn in enumerate(self.turns):
                if self.phase % self._period == turn:
                    applied |= self._send(fragment)
        self._step_end = time.perf_counter()
        return applied

    # ------------------------------------------------------------------ sync_every="auto"
    def _choose_period(self) -> None:
        """Agree on the slowest rank's median step and fragment reduction, choose the period and the delay
        (:func:`~lightning_dp_strategies.plan.streaming.choose_period`), log them, and start the period."""
        measured = torch.tensor([statistics.median(v) if v else 0.0 for v in self.timings.values()])
        if self.averager.world_size > 1:
            self._collective(lambda: self.averager.maximum(measured))
        step, fragment = measured.tolist()
        self.sync_every, self.delay = choose_period(self.config.fragments, self.config.delay, step, fragment)
        self._set_turns()
        self.phase = 0
        values = max(sum(self.params[i].numel() for i in run) for run in self.fragments)
        megabytes = values * BYTES_PER_VALUE[self.config.outer_precision] / 1e6
        if not dist.is_initialized() or dist.get_rank() == 0:
            visible(log).info(
                f"Local SGD (sync_every='auto'): sync_every={self.sync_every}, delay={self.delay}. A fragment's change "
                f"({megabytes:.3g} MB as {self.config.outer_precision}) took {fragment * 1e3:.0f} ms to average; an "
                f"inner step {step * 1e3:.0f} ms. The choice follows these timings, so another launch may choose "
                f"otherwise: for a run that repeats in every launch, pass sync_every={self.sync_every}, "
                f"delay={self.delay}."
            )

    def synchronize(self) -> None:
        """Apply the averages in flight, then average the whole model's change (and buffers) in one reduction and
        apply the outer step, so every rank holds the same parameters; the period starts again (collective)."""
        while self.in_flight:
            self._apply(self.in_flight.pop(0))
        if self.in_sync:
            self.phase = 0
            return
        everything = list(range(len(self.params)))
        count = len(everything)
        averaged = self._collective(lambda: self._averaged_now(everything, lambda c: self.averager.average(c, count)))
        self._outer_step(everything, averaged, exact=True)
        self.phase = 0

    def restart(self) -> None:
        """Make the current parameters the anchor, at the start of a period (a model loaded from elsewhere)."""
        self._reset_anchor()
        self.phase = self.since_sync = 0
        self.in_flight = []

    def close(self) -> None:
        """Wait for the reductions started and stop the channel's thread. Held ones are dropped, unstarted: nothing
        applies them after this, and after an exception before their release the other ranks may never join them."""
        for pending in self.in_flight:
            if pending.work is None:
                pending.result()
        if self.channel is not None:
            self.channel.close()

    def _reset_anchor(self) -> None:
        with torch.no_grad():
            for anchor, param in zip(self.anchor, self.params, strict=True):
                anchor.copy_(param)

    # ------------------------------------------------------------------ one fragment's turn
    def _changes(self, indices: list[int]) -> list[Tensor]:
        """The changes ``anchor - params`` of ``indices`` in fp32, then copies of the buffers (with the last
        fragment, or the whole model)."""
        changes = [self.anchor[i] - self.params[i].detach().to(torch.float32) for i in indices]
        if indices and indices[-1] == len(self.params) - 1:
            changes += [b.detach().clone() for b in self.buffers]
        return changes

    def _send(self, fragment: int) -> bool:
        """Send ``fragment``'s change: applied now without a delay (returns True), else in flight."""
        indices = self.fragments[fragment]
        if self.channel is None:  # the loop waits for the average: counted as exposed
            changes = self._collective(lambda: self._averaged_now(indices, lambda c: self._averaged(c, len(indices))))
            self._outer_step(indices, changes, exact=self.config.turns_equalize)
            return True
        with torch.no_grad():
            changes = self._changes(indices)
        pending = InFlight(fragment, self.phase + self.delay, work=lambda: self._averaged(changes, len(indices)))
        self.in_flight.append(pending)
        if not self.hold_sends:
            pending.start(self.channel)
        return False

    def release(self) -> None:
        """Start the held reductions, in the order the fragments left."""
        if self.channel is not None:
            for pending in self.in_flight:
                pending.start(self.channel)

    def _averaged_now(self, indices: list[int], average: Callable[[list[Tensor]], object]) -> list[Tensor]:
        """The changes of ``indices`` (and the buffers with the last) averaged by ``average``, or by the survivor."""
        if self.survivor is not None:
            return self.survivor.averaged_changes(indices)
        with torch.no_grad():
            changes = self._changes(indices)
            average(changes)
        return changes

    def _averaged(self, changes: list[Tensor], lossy: int) -> list[Tensor]:
        """``changes`` averaged in place, the buffers after the first ``lossy`` exactly (on the channel's thread with
        a delay); timed while choosing a period."""
        start = time.perf_counter()
        self.averager.average(changes, lossy)
        if self.choosing:
            self.timings["fragment"].append(time.perf_counter() - start)
        return changes

    def _collective(self, work: Callable[[], Any]) -> Any:
        """Run ``work`` (a collective over the averager's group) after what is in flight, counting the wait."""
        start = time.perf_counter()
        self.release()  # after the fragments in flight, on every rank alike
        result = work() if self.channel is None else self.channel.run(work)
        self.exposed_seconds += time.perf_counter() - start
        return result

    def _average(self, tensors: list[Tensor], lossy: int) -> None:
        """Average ``tensors`` over the ranks (through the channel when there is one), counting the wait; those after
        the first ``lossy`` (buffers, values) exactly, whatever the outer precision."""
        self._collective(lambda: self.averager.average(tensors, lossy))

    def _apply(self, pending: InFlight) -> None:
        if self.channel is not None:  # the first in flight: started before any other held
            pending.start(self.channel)
        start = time.perf_counter()
        averaged = pending.result()
        self.exposed_seconds += time.perf_counter() - start
        self._outer_step(self.fragments[pending.fragment], averaged, exact=self.config.turns_equalize)

    def _outer_step(self, indices: list[int], averaged: list[Tensor], exact: bool) -> None:
        """The outer optimizer's step on the anchors of ``indices`` with their averaged change, the new values merged
        into the parameters (replacing them where ``mixing`` is 0 or ``exact``), the averaged buffers copied."""
        changes, buffers = averaged[: len(indices)], averaged[len(indices) :]
        anchors = [self.anchor[i] for i in indices]
        with torch.no_grad():
            if self.outer is None:
                for anchor, change in zip(anchors, changes, strict=True):
                    anchor.sub_(change)
            else:
                for anchor, change in zip(anchors, changes, strict=True):
                    anchor.grad = change
                self.outer.step()
                self.outer.zero_grad(set_to_none=True)
            for i, anchor in zip(indices, anchors, strict=True):
                param = self.params[i]
                if exact or self.config.mixing == 0:
                    param.copy_(anchor)
                else:
                    param.copy_(torch.lerp(anchor, param.detach().to(torch.float32), self.config.mixing))
            for buffer, value in zip(self.buffers, buffers, strict=False):
                buffer.copy_(value)
        if self.survivor is not None:
            self.survivor.after_outer_step(indices)
        self.syncs += 1
        if exact:
            self.since_sync = 0

    # ------------------------------------------------------------------ checkpoints
    def averaged_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (a module's ``state_dict``, this rank's) with its parameters and floating-point buffers averaged
        over the ranks: the model a checkpoint holds. Collective unless the ranks are in sync; the module is left as
        it is."""
        if self.in_sync:
            return state
        if self.survivor is not None:
            return self.survivor.averaged_state(state)
        averaged = {k: v.detach().clone() if isinstance(v, Tensor) and averageable(v) else v for k, v in state.items()}
        self._average([v for v in averaged.values() if isinstance(v, Tensor) and averageable(v)], 0)
        return averaged

    def state_dict(self) -> dict[str, Any]:
        """What resumes the run besides the module and the inner optimizer: anchor, outer state, position, and the
        averages in flight (received first)."""
        self.release()
        return {
            "sync_every": self.sync_every,
            "delay": self.delay,
            "timings": {k: list(v) for k, v in self.timings.items()},
            "warmup_steps": self.config.warmup_steps,
            "fragments": self.config.fragments,
            "steps": self.steps,
            "phase": self.phase,
            "since_sync": self.since_sync,
            "syncs": self.syncs,
            "anchor": [a.detach().clone() for a in self.anchor],
            "outer": self.outer.state_dict() if self.outer is not None else None,
            "in_flight": [
                {"fragment": p.fragment, "apply_at": p.apply_at, "averaged": [t.clone() for t in p.result()]}
                for p in self.in_flight
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s record (after :meth:`start`)."""
        if len(state["anchor"]) != len(self.anchor):
            raise ValueError(
                f"The checkpoint's local SGD anchor has {len(state['anchor'])} tensors, this model trains "
                f"{len(self.anchor)} parameters. Resume with the model the checkpoint was saved from."
            )
        saved_fragments = int(state.get("fragments", 1))
        in_flight = state.get("in_flight", [])
        if in_flight and (saved_fragments != self.config.fragments or self.channel is None):
            raise ValueError(
                f"This checkpoint was saved by streaming DiLoCo with fragments={saved_fragments} and averages in "
                f"flight; resume it with the same `fragments` and a `delay` (this run: fragments="
                f"{self.config.fragments}, delay={self.config.delay})."
            )
        with torch.no_grad():
            for mine, saved in zip(self.anchor, state["anchor"], strict=True):
                mine.copy_(saved)
        if self.outer is not None and state["outer"] is not None:
            self.outer.load_state_dict(state["outer"])
        self.steps, self.since_sync, self.syncs = int(state["steps"]), int(state["since_sync"]), int(state["syncs"])
        self.phase = int(state.get("phase", self.since_sync))
        if self.config.sync_every == "auto":  # the period chosen before (0: still choosing) and its timings
            self.sync_every, self.delay = int(state["sync_every"]), int(state.get("delay", self.config.delay))
            self.timings = {k: list(v) for k, v in state.get("timings", self.timings).items()}
            self._set_turns()
        self.in_flight = [InFlight(int(p["fragment"]), int(p["apply_at"]), averaged=p["averaged"]) for p in in_flight]
