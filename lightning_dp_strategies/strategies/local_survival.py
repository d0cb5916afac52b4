"""The Trainer side of fault-tolerant local SGD: a lost rank's share of every period is trained by a survivor.

:class:`LocalSurvival` is what a :class:`~lightning_dp_strategies.LocalSGDStrategy` with ``fault_tolerant`` holds
beside its :class:`~lightning_dp_strategies.strategies.survival.TrainerSurvival` (which forms the survivors' groups,
moves Lightning's collectives onto them and notices a lost rank). Inner steps send nothing, so a lost rank is met at
the next synchronisation, which runs as one transaction::

    wait          for the inner optimizer states handed over at the last synchronisation (they travel meanwhile)
    average       the changes (this rank's, plus its replicas'), times members / world size
    commit        every member says in the store that it has the average; only then the outer step, and each rank
                  starts sending its inner states to the next member in rank order, which keeps them

(:class:`~lightning_dp_strategies.strategies.local_handover.HandOvers`). A peer failure before the commit: the survivors
agree, re-form their groups and compare whether any of them got the average. If one did, it was complete (every rank had
sent its change): it goes to the others. If none did, the synchronisation is redone. Either way the lost ranks' takers
first rebuild their replicas: each from the last inner state every survivor received, which the member that kept it
sends, and the anchor of then, replaying the lost rank's micro-batches since (rebuilt from their samplers) at the
optimizer settings (learning rate, ...) each step had; where that member was lost too, the run stops with an error
naming it. The survivors then hand their states over before training goes on. A loss during all this starts the recovery
again over the survivors left: the choice of handed-over states is the newest every survivor holds
(:meth:`~lightning_dp_strategies.strategies.local_handover.HandOvers.settle`), so a recovery cut short and redone
rebuilds from the same ones. The run goes on on the uninterrupted run's parameters (``keep_global_batch``); without it
nothing is handed over and the survivors average alone. A rank whose inner step failed in a collective of
``training_step`` that the others completed redoes its step with their result and meets them at the synchronisation.

A replica's step swaps its parameters, gradients, buffers and optimizer state into the module and the optimizer
(:class:`~lightning_dp_strategies.local_sgd.replicas.Replicas`) and runs ``training_step`` on the lost rank's
micro-batch with the module's ``log`` and ``log_dict`` silenced (put back after it): the lost rank's logged values
are not this rank's.

A replacement (``LDPS_JOIN=1``) is admitted at an epoch's start where the ranks are in sync (after validation): it
receives the leader's training state with the local SGD record, in which its own logical rank's inner optimizer state
is the one its replica's taker held, and the taker drops the replica.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dp_strategies.comm.failures import PeerLostError
from lightning_dp_strategies.core.fault_tolerance import PREFIX, Recovery
from lightning_dp_strategies.core.membership import is_peer_failure, logical_shares
from lightning_dp_strategies.local_sgd import LocalSGD
from lightning_dp_strategies.local_sgd.averaging import averageable, outer_reducer
from lightning_dp_strategies.local_sgd.checkpoint import merged_record, rank_record
from lightning_dp_strategies.local_sgd.replicas import Replicas
from lightning_dp_strategies.strategies import replay
from lightning_dp_strategies.strategies.control import (
    Interrupt,
    all_reduce,
    barrier,
    broadcast_object,
    copied,
    gather_object,
    redone,
)
from lightning_dp_strategies.strategies.local_handover import HandOvers, Period, Step
from lightning_dp_strategies.strategies.survival import SurvivingStrategy, TrainerSurvival
from lightning_dp_strategies.strategies.survival_hooks import SurvivalHooks

__all__ = ["LocalSurvival", "check_local_survivable"]


def check_local_survivable(trainer: pl.Trainer) -> None:
    """A clear error, at setup, where fault-tolerant local SGD could not step a lost rank's replica as that rank."""
    if getattr(trainer.strategy.precision_plugin, "scaler", None) is not None:
        raise ValueError(
            "Fault-tolerant local SGD steps a lost rank's replica without a gradient scaler, so `precision='16-mixed'` "
            "would train it otherwise than the lost rank did: use `precision='bf16-mixed'` or '32-true', or pass "
            "`fault_tolerant=False`."
        )


class LocalSurvivingStrategy(SurvivingStrategy, Protocol):
    """What :class:`LocalSurvival` uses of its strategy besides what the survival uses."""

    @property
    def local_sgd(self) -> LocalSGD | None: ...


class LocalSurvival(SurvivalHooks):
    """Fault-tolerant local SGD under the Trainer (see the module docstring)."""

    def __init__(self, strategy: LocalSurvivingStrategy, survival: TrainerSurvival) -> None:
        self.strategy = strategy
        self.trains_lost_batches = self.alike = False  # lost batches go to replicas; each rank its own state
        self.survival = survival
        self.replicas: Replicas | None = None
        """The lost ranks' replicas this rank trains (``keep_global_batch``)."""
        self.handovers: HandOvers | None = None
        """The inner states handed to this rank and what a replay from them trains (``keep_global_batch``)."""
        self.positions: list[Step] = []
        """Each inner step since the last synchronisation: what a replay trains."""
        self.replayed: list[int] = []
        """How many periods each replica started in a recovery replayed (the current one included)."""
        survival.hooks = self

    @property
    def local(self) -> LocalSGD:
        local = self.strategy.local_sgd
        assert local is not None, "fault-tolerant local SGD before setup"
        return local

    @property
    def rank(self) -> int:
        return self.strategy.global_rank

    # ------------------------------------------------------------------ setup
    def start(self) -> None:
        """At the start of training (after the survival's): average through this object, and give every rank the
        inner states it keeps, so that a rank lost in the first period can be rebuilt: on a fresh start copies of its
        own initial state (alike on every rank, nothing sent), on a resumed one by a hand-over."""
        local = self.local
        local.survivor = self
        local.averager.interrupt = self.survival.survivors.interrupted
        if self.survival.survivors.options.keep_global_batch:
            optimizer = self.strategy.optimizers[0]
            self.replicas = Replicas(local.params, local.buffers, optimizer)
            self.handovers = HandOvers(self.survival.survivors, self.replicas, self.rank)
            if local.steps == 0:  # no step taken, nothing resumed: the same on every rank
                self.handovers.start_alike()
                return
            try:
                self.handovers.hand_over()
            except Exception as failure:
                if not is_peer_failure(failure):
                    raise
                raise RuntimeError(
                    "Fault-tolerant local SGD could not hand the inner optimizer states over at the start of the "
                    f"resumed training ({failure}). A rank lost before this first hand-over completes cannot be "
                    "rebuilt: no survivor holds its state yet. Restart the job from the last checkpoint."
                ) from failure

    # ------------------------------------------------------------------ each inner step
    def after_own_step(self) -> None:
        """After this rank's inner step: note its position, then step every replica on its own micro-batch there."""
        module = self.strategy.lightning_module
        survivors = self.survival.survivors
        if module is None or self.local.averages_gradients or survivors.batches is None:
            return
        settings = replay.snapshot(self.strategy.optimizers[0])
        step = Step(int(survivors.batches.sampler.epoch), module.trainer.fit_loop.epoch_loop.batch_idx, settings)
        self.positions.append(step)
        if self.replicas is not None:
            for logical in sorted(self.replicas.shadows):
                self._replica_step(logical, step)

    def _replica_step(self, logical: int, step: Step) -> None:
        """One inner step of ``logical``'s replica on that rank's micro-batch at ``step``, as Lightning's automatic
        optimization takes it (gradients zeroed, clipped as configured), with the optimizer's settings of ``step``."""
        strategy, replicas, batches = self.strategy, self.replicas, self.survival.survivors.batches
        module = strategy.lightning_module
        assert module is not None and replicas is not None and batches is not None
        batch = batches.batch(logical, step.batch_idx, step.epoch)
        if batch is None:
            return
        batch = strategy.batch_to_device(batch)
        trainer, optimizer = module.trainer, replicas.optimizer
        with (
            replicas.swapped(logical),
            replay.silenced(module),
            replay.settings(optimizer, step.settings),
            replay.trainable(module),
        ):
            optimizer.zero_grad(set_to_none=True)
            loss = self.survival.lost_loss(batch, step.batch_idx)
            with strategy.engine.grad_sync.no_sync():
                loss.backward()
            if trainer.gradient_clip_val:
                module.configure_gradient_clipping(
                    optimizer,
                    gradient_clip_val=trainer.gradient_clip_val,
                    gradient_clip_algorithm=trainer.gradient_clip_algorithm,
                )
            optimizer.step()

    # ------------------------------------------------------------------ a synchronisation (LocalSGD's survivor)
    def averaged_changes(self, indices: list[int]) -> list[Tensor]:
        """Wait for the states in flight, average, commit, send this synchronisation's states; after a peer failure,
        recover and finish or redo (see the module docstring). A loss during the recovery starts it again."""
        local, survivors, handovers = self.local, self.survival.survivors, self.handovers
        done = ended = False  # this rank has the average / has ended the period (its states sent)
        changes: list[Tensor] = []

        def once(failure: BaseException | None) -> list[Tensor]:
            nonlocal changes, done, ended
            if failure is not None:
                record = self.survival.recover(failure, progress=1 + int(done))
                changes, done = self._recovered(record, changes, done, ended)
            if not done:
                if handovers is not None:
                    handovers.finish()
                with torch.no_grad():
                    changes = self._changes(indices)
                    local.averager.average(changes, len(indices))  # the caller counts the wait (_collective)
                    if survivors.grad_scale != 1.0:
                        torch._foreach_mul_(changes, survivors.grad_scale)
                done = True
            self._commit()
            if handovers is not None:
                period, ended = (None if ended else self._ended()), True  # ended before the states leave
                handovers.commit(period)
                if failure is not None:  # the lost ranks' keepers were lost: the new ones hold their states now
                    handovers.finish()
            return changes

        tries = survivors.world_size
        return redone(
            once, tries, RuntimeError(f"Local SGD lost a rank in each of {tries} tries of a synchronisation.")
        )

    def _ended(self) -> Period:
        """The period this synchronisation ends, as a replay trains it (its anchor copied: the outer step moves it)."""
        assert self.replicas is not None
        return Period([a.detach().clone() for a in self.local.anchor], self.replicas.buffers_at_sync, self.positions)

    def _recovered(self, record: Recovery, changes: list[Tensor], done: bool, ended: bool) -> tuple[list[Tensor], bool]:
        """After a recovery in a synchronisation: the average from the lowest survivor that has it, where one does
        (it was complete); the lost ranks' replicas started; a rank one step behind caught up (it redoes its step).
        Returns the average and whether this rank has it (``False``: nobody has, it is redone)."""
        survivors = self.survival.survivors
        if record.lagging:
            source = min(r for r in record.members if r not in record.lagging)
            assert survivors.control_group is not None
            mine = changes if self.rank == source else None  # polled: a loss here is noticed promptly
            changes, done = broadcast_object(mine, source, survivors.control_group, survivors.interrupted), True
        self._adopt(current=not ended)
        if record.behind:
            self.survival.catch_up(record, None)
        return changes, done

    def after_recovery_between_steps(self) -> None:
        """A rank lost between steps: the replicas of the logical ranks this rank took over start from the states
        handed over and replay their micro-batches since."""
        self._adopt()

    def after_recovery_in_step(self) -> None:
        """A rank lost in an inner step (a Lightning collective in ``training_step``, ``sync_dist``): the replicas
        start as between steps, before the step is redone from its closure (the failed attempt's graph is dropped)."""
        self._adopt()

    def on_regroup(self) -> None:
        """Average over the survivors' new group, with a fresh reducer (the old one may still wait on the old group)."""
        local, survivors = self.local, self.survival.survivors
        reducer = outer_reducer(local.config.outer_precision, self.strategy.configure_reducer())
        local.averager.regroup(survivors.group, survivors.members, reducer)

    def _changes(self, indices: list[int]) -> list[Tensor]:
        """This rank's changes of ``indices`` (and buffers with the last), plus its replicas'."""
        local = self.local
        changes = local._changes(indices)
        if self.replicas is not None and self.replicas.shadows:
            extra = self.replicas.changes(local.anchor, indices)
            for total, more in zip(changes, extra, strict=False):  # the replicas' buffers only where ours are
                total += more
        return changes

    def _commit(self) -> None:
        """Say in the store that this rank has the average; wait until every member has said so (or one is lost)."""
        survivors = self.survival.survivors
        membership = survivors.membership
        assert membership is not None
        base = f"{PREFIX}/local/{membership.state.epoch}/{self.local.syncs}"
        membership.store.set(f"{base}/{self.rank}", "1")
        keys = [f"{base}/{r}" for r in survivors.members]
        while not membership.store.check(keys):
            reason = survivors.interrupted()
            if reason is not None:
                raise PeerLostError(f"a synchronisation could not commit: {reason}")
            time.sleep(0.002)

    def _adopt(self, current: bool = True) -> None:
        """In a recovery: start the replicas of the logical ranks this rank took over, from the states handed over
        (:meth:`HandOvers.settle` chose which) and the anchor they belong to, then replay the periods since; or take
        them whole from the survivors that trained them until now."""
        replicas, handovers, survivors = self.replicas, self.handovers, self.survival.survivors
        if replicas is None or handovers is None:
            return
        handovers.settle()
        mine = logical_shares(survivors.members, survivors.world_size)[self.rank]
        needed = [r for r in mine if r != self.rank and r not in replicas.shadows]
        kept, moved = handovers.take_over(needed)
        for surplus in [r for r in replicas.shadows if r not in mine]:  # given in a recovery cut short, received there
            del replicas.shadows[surplus]
        handed = {**handovers.handed, **kept}
        periods = list(handovers.periods)
        if current:  # the period in progress (not yet ended: its steps are not in `periods`)
            periods.append(Period(self.local.anchor, replicas.buffers_at_sync, self.positions))
        for logical in needed:
            if logical in moved:  # another survivor trained it until now: its replica, moved whole, is not replayed
                replicas.take(logical, moved[logical])
                continue
            state = handed[logical]
            for period in periods:  # each period from its anchor, with the inner state the last one ended on
                replicas.adopt(logical, state, period.anchor, period.buffers)
                for step in period.steps:
                    self._replica_step(logical, step)
                state = replicas.shadows[logical].state
            self.replayed.append(len(periods))

    def after_outer_step(self, indices: list[int]) -> None:
        """The replicas take the new global values; the period's positions start again."""
        local = self.local
        if self.replicas is not None:
            self.replicas.reset(indices, [local.anchor[i] for i in indices])
            self.replicas.buffers_at_sync = [b.detach().clone() for b in local.buffers]
        self.positions = []

    # ------------------------------------------------------------------ replacements (where the ranks are in sync)
    def ready_to_admit(self) -> bool:
        """Where the ranks are in sync (after validation): every replica then holds the anchor."""
        return self.local.in_sync

    def on_admit(self, joining: list[int]) -> dict[str, Any]:
        """Before the world is re-formed for ``joining`` (every survivor): the local SGD record with the replicas'
        inner optimizer states, for the leader's training state (gathered as a checkpoint's, a rank lost meanwhile
        survived), once the states in flight arrived (the groups they travel on are re-formed next)."""
        if self.handovers is not None:
            self.handovers.wait_quietly()
        record = self.checkpoint_record([o.state_dict() for o in self.strategy.optimizers])
        return {} if record is None else {"local_sgd": record}

    def after_admit(self, joining: list[int]) -> None:
        """The replacements train their own logical ranks: the replicas of them are dropped, and the inner states
        are handed over within the whole world again (a replacement's :meth:`start` meets this)."""
        if self.replicas is not None:
            for logical in joining:
                self.replicas.shadows.pop(logical, None)
            assert self.handovers is not None
            self.handovers.hand_over()

    def close(self) -> None:
        """At the end of training: the states in flight arrive (the groups they travel on are destroyed next)."""
        if self.handovers is not None:
            self.handovers.wait_quietly()

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_record(self, states: list[dict[str, Any]]) -> dict[str, Any] | None:
        """The checkpoint's ``"local_sgd"`` entry on the leader (``None`` on the others): every survivor's own state
        and its replicas' gathered to the leader through the control collectives. A rank lost meanwhile is
        survived: the gather is redone over the survivors, to the leader of then, the lost rank's state now from the
        replica its taker trains. No rank completes the gather before the leader holds every part (a barrier ends
        it), so a rank one collective behind already holds what it gathered."""
        module, survival = self.strategy.lightning_module, self.survival
        assert module is not None
        mine = rank_record(self.local, module, states)
        box: dict[str, Any] = {}

        def attempt(group: dist.ProcessGroup, interrupt: Interrupt) -> None:
            box.clear()
            parts = {self.strategy.global_rank: mine, **self.records()}
            box["gathered"] = gather_object(parts, survival.survivors.leader, group, interrupt)
            barrier(group, interrupt)

        survival.control.run(attempt)
        gathered = box.get("gathered")
        return None if gathered is None else merged_record(self.local, gathered, survival.survivors.world_size)

    def averaged_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` averaged over the original world's replicas: this rank's plus its replicas', summed over the
        survivors in one reduction through the control collectives, so a rank lost meanwhile is survived (the sum is
        redone over the survivors, the lost rank's part from the replica its taker now trains)."""
        keys = [k for k, v in state.items() if isinstance(v, Tensor) and averageable(v)]
        module, survivors = self.strategy.lightning_module, self.survival.survivors
        assert module is not None

        def flat(values: dict[str, Any]) -> Tensor:
            pieces = [values[k].detach().reshape(-1).to(torch.float32) for k in keys]
            return torch.cat(pieces) if pieces else torch.zeros(0)

        def attempt(group: dist.ProcessGroup, interrupt: Interrupt) -> Tensor:
            total = flat(state)
            for logical in sorted(self.replicas.shadows) if self.replicas is not None else []:
                with self.replicas.swapped(logical):  # type: ignore[union-attr]
                    total += flat(module.state_dict())
            summed = all_reduce(total, dist.ReduceOp.SUM, group, interrupt)
            return summed * (survivors.grad_scale / dist.get_world_size(group))

        averages = self.survival.control.run(attempt)
        averaged = dict(state)
        for k, piece in zip(keys, averages.split([state[k].numel() for k in keys]), strict=True):
            averaged[k] = piece.view_as(state[k]).to(state[k].dtype)
        return averaged

    def records(self) -> dict[int, dict[str, Any]]:
        """Each replica's checkpoint record as its rank would write it: module state (``None`` in sync), optimizer's."""
        module, replicas = self.strategy.lightning_module, self.replicas
        assert module is not None
        records: dict[int, dict[str, Any]] = {}
        for logical in sorted(replicas.shadows) if replicas is not None else []:
            with replicas.swapped(logical):  # type: ignore[union-attr]
                optimizers = [copied(o.state_dict()) for o in self.strategy.optimizers]
                records[logical] = rank_record(self.local, module, optimizers)
        return records
