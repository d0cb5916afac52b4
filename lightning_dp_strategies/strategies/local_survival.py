"""The Trainer side of fault-tolerant local SGD: a lost rank's share of every period is trained by a survivor.

:class:`LocalSurvival` is what a :class:`~lightning_dp_strategies.LocalSGDStrategy` with ``fault_tolerant`` holds
beside its :class:`~lightning_dp_strategies.strategies.survival.TrainerSurvival` (which forms the survivors' groups,
moves Lightning's collectives onto them and notices a lost rank). Inner steps send nothing, so a lost rank is met at
the next synchronisation, which runs as one transaction::

    hand over     each rank's inner optimizer states go to the next member in rank order, which keeps them
    average       the changes (this rank's, plus its replicas'), times members / world size
    commit        every member says in the store that it has the average; only then the outer step

A peer failure before the commit: the survivors agree, re-form their groups and compare whether any of them got the
average. If one did, it was complete (every rank had handed over and sent its change): it goes to the others, and the
lost ranks' takers start their replicas from the states handed over in this attempt. If none did, the takers start
the replicas from the states handed over at the last synchronisation, replay the lost ranks' micro-batches since
(rebuilt from their samplers) and the synchronisation is redone. Either way a lost rank's state first goes from the
member that kept it to its taker; where that member was lost too, the run stops with an error naming it. So the run
goes on on the uninterrupted run's parameters (``keep_global_batch``); without it nothing is handed over and the
survivors average alone.

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
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any, Protocol

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dp_strategies.comm.failures import PeerLostError
from lightning_dp_strategies.core.fault_tolerance import PREFIX
from lightning_dp_strategies.core.handover import handover_plan, takeover_plan
from lightning_dp_strategies.core.membership import is_peer_failure, logical_shares
from lightning_dp_strategies.local_sgd import LocalSGD
from lightning_dp_strategies.local_sgd.averaging import averageable, outer_reducer
from lightning_dp_strategies.local_sgd.checkpoint import merged_record, rank_record
from lightning_dp_strategies.local_sgd.replicas import InnerStates, Replicas, exchange
from lightning_dp_strategies.strategies.control import Interrupt, all_reduce, barrier, copied, gather_object
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


@contextmanager
def _silenced(module: pl.LightningModule) -> Generator[None, None, None]:
    """The module's ``log`` and ``log_dict`` do nothing inside (instance attributes over the methods, removed after)."""

    def ignore(*args: Any, **kwargs: Any) -> None:
        return None

    module.log = ignore  # type: ignore[method-assign]
    module.log_dict = ignore  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.log, module.log_dict


class LocalSurvival(SurvivalHooks):
    """Fault-tolerant local SGD under the Trainer (see the module docstring)."""

    def __init__(self, strategy: LocalSurvivingStrategy, survival: TrainerSurvival) -> None:
        self.strategy = strategy
        self.trains_lost_batches = False  # a lost rank's batches go to its replica, not into this rank's step
        self.survival = survival
        self.replicas: Replicas | None = None
        """The lost ranks' replicas this rank trains, and the inner states handed to it (``keep_global_batch``)."""
        self.positions: list[tuple[int, int]] = []
        """``(sampler epoch, batch_idx)`` of each inner step since the last synchronisation: what a replay trains."""
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
        """At the start of training (after the survival's): average through this object, and hand the inner states
        over once, so that a rank lost in the first period can be rebuilt."""
        local = self.local
        local.survivor = self
        local.averager.interrupt = self.survival.survivors.interrupted
        if self.survival.survivors.options.keep_global_batch:
            optimizer = self.strategy.optimizers[0]
            self.replicas = Replicas(local.params, local.buffers, optimizer)
            self.replicas.handed = self._hand_over()

    # ------------------------------------------------------------------ each inner step
    def after_own_step(self) -> None:
        """After this rank's inner step: note its position, then step every replica on its own micro-batch there."""
        module = self.strategy.lightning_module
        survivors = self.survival.survivors
        if module is None or self.local.averages_gradients or survivors.batches is None:
            return
        position = (int(survivors.batches.sampler.epoch), module.trainer.fit_loop.epoch_loop.batch_idx)
        self.positions.append(position)
        if self.replicas is not None:
            for logical in sorted(self.replicas.shadows):
                self._replica_step(logical, *position)

    def _replica_step(self, logical: int, epoch: int, batch_idx: int) -> None:
        """One inner step of ``logical``'s replica on that rank's micro-batch ``batch_idx`` of sampler epoch
        ``epoch``, as Lightning's automatic optimization takes it (gradients zeroed, clipped as configured)."""
        strategy, replicas, batches = self.strategy, self.replicas, self.survival.survivors.batches
        module = strategy.lightning_module
        assert module is not None and replicas is not None and batches is not None
        batch = batches.batch(logical, batch_idx, epoch)
        if batch is None:
            return
        batch = strategy.batch_to_device(batch)
        trainer, optimizer = module.trainer, replicas.optimizer
        with replicas.swapped(logical), _silenced(module):
            optimizer.zero_grad(set_to_none=True)
            loss = self.survival.lost_loss(batch, batch_idx)
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
        """Hand over, average, commit; after a peer failure, recover and finish or redo (see the module docstring)."""
        local, survivors = self.local, self.survival.survivors
        for _ in range(survivors.world_size):
            done, handed = False, None
            try:
                handed = self._hand_over() if self.replicas is not None else None
                with torch.no_grad():
                    changes = self._changes(indices)
                    local.averager.average(changes, len(indices))  # the caller counts the wait (_collective)
                    if survivors.grad_scale != 1.0:
                        torch._foreach_mul_(changes, survivors.grad_scale)
                done = True
                self._commit()
            except Exception as error:
                if not is_peer_failure(error):
                    raise
                record = self.survival.recover(error, progress=int(done))
                if not (record.behind or done):  # nobody has the average: the lost ranks' replicas replay, redo
                    self._adopt(self.replicas.handed if self.replicas is not None else {}, replay=True)
                    continue
                if record.behind:  # the average was complete somewhere: from the lowest rank that has it
                    source = min(r for r in record.members if r not in record.behind)
                    box = [changes if self.rank == source else None]
                    dist.broadcast_object_list(box, source, group=survivors.control_group)
                    changes = box[0]  # type: ignore[assignment]
                self._adopt(handed or {}, replay=False)
                handed = self._hand_over() if self.replicas is not None else None
            if self.replicas is not None and handed is not None:
                self.replicas.handed = handed
            return changes
        raise RuntimeError(f"Local SGD lost a rank in each of {survivors.world_size} tries of one synchronisation.")

    def after_recovery_between_steps(self) -> None:
        """A rank lost between steps: the replicas of the logical ranks this rank took over start from the states
        handed over at the last synchronisation and replay their micro-batches since."""
        self._adopt(self.replicas.handed if self.replicas is not None else {}, replay=True)

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

    def _hand_over(self) -> InnerStates:
        """Every logical rank's inner state to the member that keeps it (:func:`handover_plan`); the states handed to
        this rank (collective over the survivors)."""
        survivors, replicas = self.survival.survivors, self.replicas
        assert replicas is not None and survivors.group is not None
        plan = handover_plan(survivors.members, survivors.world_size, survivors.options.state_copies)
        states = replicas.states(self.rank)
        outgoing = {dst: {r: states[r] for r in held} for dst, held in plan.get(self.rank, {}).items()}
        sources = [src for src, targets in plan.items() if self.rank in targets]
        received = exchange(outgoing, sources, survivors.group, survivors.interrupted)
        return {r: state for part in received.values() for r, state in part.items()}

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

    def _adopt(self, handed: InnerStates, replay: bool) -> None:
        """Start the replicas of the logical ranks this rank took over in the last recovery, from ``handed`` and
        the anchor; with ``replay``, train them on their micro-batches since the last synchronisation."""
        replicas, survivors = self.replicas, self.survival.survivors
        if replicas is None:
            return
        mine = logical_shares(survivors.members, survivors.world_size)[self.rank]
        needed = [r for r in mine if r != self.rank and r not in replicas.shadows]
        kept, moved = self._take_over(handed, needed)
        handed = {**handed, **kept}
        for logical in needed:
            if logical in moved:  # another survivor trained it until now: its replica, moved whole, is not replayed
                replicas.take(logical, moved[logical])
                continue
            replicas.adopt(logical, handed[logical], self.local.anchor)
            for position in self.positions if replay else []:
                self._replica_step(logical, *position)

    def _take_over(self, handed: InnerStates, needed: list[int]) -> tuple[InnerStates, dict[int, Any]]:
        """What this rank needs to train the ``needed`` logical ranks (those it now trains and did not before): the
        states kept by other survivors, and the replicas other survivors trained until now, which this rank's
        replicas of them replace (:func:`takeover_plan`; collective over the survivors: who trains, keeps and needs
        which, then the states and replicas). A replica this rank gives away is dropped here.

        Raises:
            RuntimeError: on every survivor, where a logical rank needed was trained and kept by lost ranks only.
        """
        survivors, replicas = self.survival.survivors, self.replicas
        assert survivors.group is not None and replicas is not None
        others = [m for m in survivors.members if m != self.rank]
        mine = (sorted(handed), sorted(replicas.shadows), needed)
        told = {**exchange({m: mine for m in others}, others, survivors.group, survivors.interrupted), self.rank: mine}
        moves, sends, missing = takeover_plan(
            {m: t for m, (_, t, _) in told.items()},
            {m: k for m, (k, _, _) in told.items()},
            {m: n for m, (_, _, n) in told.items()},
        )
        if missing:
            copies = survivors.options.state_copies
            raise RuntimeError(
                f"Logical rank(s) {missing} cannot be rebuilt: the rank that trained it and the next {copies} "
                "member(s) in rank order, which kept its inner optimizer state at the last synchronisation, were all "
                "lost. Resume from the last checkpoint; to survive more ranks lost at once, pass "
                f"`fault_tolerant=FaultTolerance(state_copies={copies + 1})` (or `keep_global_batch=False`)."
            )
        outgoing: dict[int, dict[str, dict[int, Any]]] = {}
        for dst, logicals in sends.get(self.rank, {}).items():
            outgoing.setdefault(dst, {"kept": {}, "moved": {}})["kept"].update({r: handed[r] for r in logicals})
        for dst, logicals in moves.get(self.rank, {}).items():
            outgoing.setdefault(dst, {"kept": {}, "moved": {}})["moved"].update({r: replicas.give(r) for r in logicals})
        sources = sorted({src for plan in (moves, sends) for src, targets in plan.items() if self.rank in targets})
        received = exchange(outgoing, sources, survivors.group, survivors.interrupted)
        for logical in (r for targets in moves.get(self.rank, {}).values() for r in targets):
            del replicas.shadows[logical]  # sent: its new taker trains it from now on
        kept = {r: state for part in received.values() for r, state in part["kept"].items()}
        return kept, {r: replica for part in received.values() for r, replica in part["moved"].items()}

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
        """Before the world is re-formed for ``joining`` (every survivor): the local SGD record, with the inner
        optimizer states of the replicas the replacements take over, for the leader's training state (gathered as a
        checkpoint's, a rank lost meanwhile survived)."""
        record = self.checkpoint_record([o.state_dict() for o in self.strategy.optimizers])
        return {} if record is None else {"local_sgd": record}

    def after_admit(self, joining: list[int]) -> None:
        """The replacements train their own logical ranks: the replicas of them are dropped, and the inner states
        are handed over within the whole world again (a replacement's :meth:`start` meets this)."""
        if self.replicas is not None:
            for logical in joining:
                self.replicas.shadows.pop(logical, None)
            self.replicas.handed = self._hand_over()

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
        """Each replica's checkpoint record, as its rank would have written it: its module state (``None`` in sync)
        and its inner optimizer state."""
        module, replicas = self.strategy.lightning_module, self.replicas
        assert module is not None
        records: dict[int, dict[str, Any]] = {}
        for logical in sorted(replicas.shadows) if replicas is not None else []:
            with replicas.swapped(logical):  # type: ignore[union-attr]
                optimizers = [copied(o.state_dict()) for o in self.strategy.optimizers]
                records[logical] = rank_record(self.local, module, optimizers)
        return records
