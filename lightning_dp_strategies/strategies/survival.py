"""The Trainer side of ``fault_tolerant``: a Lightning strategy's hooks over :class:`~lightning_dp_strategies.core.
fault_tolerance.Survivors`.

A bucketed strategy with ``fault_tolerant`` holds one :class:`TrainerSurvival` and hands it these hooks::

    setup_distributed   init_process_group()    the default group (a replacement: asks to join, waits, joins the
                        start()                 world the live ranks re-form); the survivors' groups, heartbeats
    setup               check_survivable()      refusals (manual optimization, accumulation)
    configure_ddp       receive_state(trainer)  a replacement: the leader's training state, restored by Lightning
    on_train_start      on_train_start(trainer) the train loader (lost ranks' batches), the metrics' group, and
                                                _before_batch in place of Lightning's SIGTERM broadcast
    before each batch   admit_replacements()    at an epoch's start, replacements waiting for every lost rank
    optimizer_step      step(run, closure)      a peer failure: agree, regroup, redo the step (or catch up)
    backward            backward(run, loss)     the lost ranks' micro-batches too, one reduction
    post_backward       scale_gradients()       members / world size (global batch kept)
    barrier, broadcast, reduce, all_gather, reduce_boolean_decision, metric syncs: over the survivors, redone over
                        them after a peer failure between steps (ControlCollectives); is_global_zero: the leader
    teardown            teardown()              heartbeat stopped, metrics' groups and Lightning's loop put back

Edits of objects the strategy does not own, each put back at teardown: the module's torchmetrics metrics get the
survivors' control group as ``process_group`` and an instance ``_sync_dist`` that syncs through ControlCollectives;
the fit loop's ``_broadcast_sigterm_tensor`` (Lightning broadcasts a SIGTERM flag from rank 0 over the whole world
before every batch, which a lost rank blocks until the world's timeout) is replaced by :func:`_before_batch`: the
replacements' admission at an epoch's start, and each rank stopping on its own SIGTERM.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor

from lightning_dp_strategies.comm.failures import PeerLostError
from lightning_dp_strategies.comm.groups import new_group
from lightning_dp_strategies.core.elastic import DistributedStrategy, init_strategy_process_group, running_attempt_store
from lightning_dp_strategies.core.fault_tolerance import (
    Admission,
    Recovery,
    Survivors,
    join_running_job,
    restarted_into_running_job,
    wants_to_join,
)
from lightning_dp_strategies.core.module_state import broadcast_module_buffers, sync_module_states
from lightning_dp_strategies.strategies import replay
from lightning_dp_strategies.strategies.control import ControlCollectives, Interrupt, broadcast_object, redone
from lightning_dp_strategies.strategies.survival_hooks import SurvivalHooks, SurvivingStrategy

__all__ = ["TrainerSurvival", "check_survivable"]


def _is_metric(module: object) -> bool:
    from torchmetrics import Metric

    return isinstance(module, Metric)


def check_survivable(trainer: pl.Trainer) -> None:
    """A clear error, at setup, where ``fault_tolerant`` cannot redo a step over the survivors."""
    module = trainer.lightning_module
    if module is not None and not module.automatic_optimization:
        raise ValueError(
            "`fault_tolerant=True` redoes a failed step through Lightning's closure, which manual optimization does "
            "not use: set `self.automatic_optimization = True`, or pass `fault_tolerant=False`."
        )
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(
            "`fault_tolerant=True` cannot redo a step whose earlier micro-batches were accumulated before the "
            f"failure (accumulate_grad_batches={trainer.accumulate_grad_batches}): raise the batch size instead, or "
            "pass `fault_tolerant=False`."
        )


def _before_batch(trainer: pl.Trainer, survival: TrainerSurvival) -> None:
    """Before every batch, instead of Lightning's SIGTERM broadcast: at an epoch's start, admit the replacements
    waiting; stop on its own SIGTERM. No collective (a rank a step ahead meets the others in the step redone)."""
    if trainer.fit_loop.epoch_loop.batch_progress.current.ready == 0:
        survival.admit_replacements(trainer)
    if getattr(trainer, "received_sigterm", False):
        raise SIGTERMException()


class TrainerSurvival:
    """What a Trainer strategy does with ``fault_tolerant`` (see the module docstring)."""

    def __init__(self, strategy: SurvivingStrategy, survivors: Survivors) -> None:
        self.strategy = strategy
        self.survivors = survivors
        self.admission: Admission | None = None
        """A replacement's: when it joined and from whom; ``None`` in a process that started with the job."""
        self.joining = wants_to_join()
        """A replacement until the live ranks' training state arrived (Lightning's collectives wait till then)."""
        self.joins: list[tuple[int, list[int]]] = []
        """``(global_step, ranks)`` of each admission of replacements this rank took part in."""
        self.hooks = SurvivalHooks()
        """What the strategy adds at fixed points (local SGD: its replicas)."""
        self.control = ControlCollectives(survivors, self._recover_between_steps, lambda r: self.catch_up(r, None))
        """Lightning's collectives over the survivors, redone after a peer failure between steps."""
        self._store: dist.Store | None = None  # the job's store, under this attempt's prefix
        self._loop: Any = None  # the fit loop whose SIGTERM broadcast is replaced

    @property
    def leader(self) -> int:
        """The lowest live rank; in a replacement, until it has the live ranks' state, the leader that admitted it."""
        return self.admission.leader if self.joining and self.admission else self.survivors.leader

    def init_process_group(self, strategy: DistributedStrategy) -> None:
        """The default group: as every strategy makes it, or, in a replacement (``LDPS_JOIN=1``, or a worker that
        torchrun restarted as the others train on), the one the live ranks make for it at the epoch it is admitted.
        A restarted worker whose job ends before it is admitted (the whole job restarting) starts as usual."""
        init_strategy_process_group(strategy, init=False)  # its timeout set
        assert strategy._timeout is not None
        rank, world, options = self.strategy.global_rank, self.strategy.world_size, self.survivors.options
        self.joining = self.joining or restarted_into_running_job(rank, world, options, strategy._timeout)
        joined = join_running_job(rank, world, options, strategy._timeout) if self.joining else None
        self.joining = joined is not None
        init_strategy_process_group(strategy, init=not self.joining)
        if joined is None:
            self._store = running_attempt_store("ft/", strategy._timeout)
        else:
            self._store, self.admission = joined
            self._init_world(self.admission.epoch)

    def _init_world(self, epoch: int) -> None:
        store = self._store
        assert store is not None and self.strategy._timeout is not None
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"world/{epoch}/", store),
            rank=self.strategy.global_rank,
            world_size=self.strategy.world_size,
            timeout=self.strategy._timeout,
        )

    # ------------------------------------------------------------------ setup
    def start(self) -> None:
        """Form the survivors' groups (gloo only) and have the gradient sync average over theirs."""
        strategy = self.strategy
        backend = strategy._get_process_group_backend()
        if backend != "gloo":
            raise ValueError(
                f"`fault_tolerant=True` runs on gloo only (CPU training), got process_group_backend={backend!r}: "
                "NCCL cannot re-form its communicators in place. Pass `fault_tolerant=False` on GPUs."
            )
        # torchrun's agent store under this attempt's prefix, else the default group's (hosted by rank 0)
        store = self._store if self._store is not None else dist.distributed_c10d._get_default_store()
        assert strategy._timeout is not None
        epoch = self.admission.epoch if self.admission is not None else 0
        self.survivors.start(store, strategy.global_rank, strategy.world_size, strategy._timeout, epoch)
        assert self.survivors.group is not None
        reducer = strategy.arrange_reducer(strategy.configure_reducer())
        strategy.engine.grad_sync.use_group(self.survivors.group, reducer)
        strategy.engine.grad_sync.interrupt = self.survivors.interrupted

    def on_train_start(self, trainer: pl.Trainer) -> None:
        """The train loader checked (the lost ranks' batches come from it), the metrics and the SIGTERM broadcast
        moved to the survivors' groups."""
        module = trainer.lightning_module
        assert module is not None
        self.survivors.use_loader(trainer.train_dataloader)
        self.watch_metrics(module)
        self._loop = trainer.fit_loop.epoch_loop
        self._loop._broadcast_sigterm_tensor = functools.partial(_before_batch, trainer, self)
        self.joining = False  # a replacement's setup is over: Lightning's collectives meet the others again

    def watch_metrics(self, module: pl.LightningModule) -> None:
        """The module's torchmetrics metrics sync over the survivors, through :attr:`control` (at the start of
        training, validation and testing; each metric once)."""
        self.control.watch_metrics(m for m in module.modules() if _is_metric(m))  # first: it reads their own group
        self.survivors.watch_metrics(module.modules(), _is_metric)

    # ------------------------------------------------------------------ replacements
    def admit_replacements(self, trainer: pl.Trainer) -> None:
        """At an epoch's start, where ranks are missing and a replacement waits for each: re-form the world with
        them, then give them the leader's training state (the steps :meth:`receive_state` mirrors). Until the leader
        answers the replacements, a rank lost is survived through :attr:`control`, and the admission waits for a
        later epoch's start."""
        survivors = self.survivors
        if not survivors.started or len(survivors.members) == survivors.world_size or not self.hooks.ready_to_admit():
            return
        members = list(survivors.members)

        def attempt(group: dist.ProcessGroup, interrupt: Interrupt) -> dict[int, str]:
            requests = survivors.join_requests() if self.is_leader() else {}
            every = len(requests) == survivors.world_size - len(survivors.members)
            return broadcast_object(requests if every else {}, survivors.leader, group, interrupt)

        requests = self.control.run(attempt)
        if not requests or survivors.members != members:
            return
        assert survivors.membership is not None
        epoch, leader, joining = survivors.membership.state.epoch + 1, survivors.leader, sorted(requests)
        extra = self.hooks.on_admit(joining)
        if survivors.members != members:
            return
        state = {**self._training_state(trainer), **extra} if self.is_leader() else None
        if self.is_leader():
            survivors.admit(requests, epoch)
        dist.destroy_process_group()  # every group: the world, the gradient and control groups over the lost ranks
        self._init_world(epoch)
        survivors.readmit(epoch)
        self._regroup()
        # what a replacement's setup runs (configure_ddp, then receive_state), mirrored
        assert self.strategy.lightning_module is not None
        self.strategy._check_ranks_agree()
        sync_module_states(self.strategy.lightning_module, leader)
        self._share_state(leader, joining, state)
        self.hooks.after_admit(joining)
        self.control.restart()
        self.joins.append((trainer.global_step, joining))

    def _training_state(self, trainer: pl.Trainer) -> dict[str, Any]:
        state = trainer._checkpoint_connector.dump_checkpoint()
        state["lightning_dp_strategies/rng"] = torch.get_rng_state()
        return state

    def _share_state(self, leader: int, joining: list[int], state: Any) -> Any:
        """The leader's training state to the replacements (a collective of the leader and them)."""
        if self.strategy.global_rank not in (leader, *joining):
            return None
        box = [state]
        group = new_group([leader, *joining], "gloo", use_local_synchronization=True)
        dist.broadcast_object_list(box, leader, group=group)
        return box[0]

    def receive_state(self, trainer: pl.Trainer) -> None:
        """In a replacement, at the end of its setup: the leader's training state, restored by Lightning next (the
        optimizer states and the loops' progress) and here (the weights, callbacks' state, RNG)."""
        if not self.joining or self.admission is None:
            return
        admission = self.admission
        state = self._share_state(admission.leader, admission.joining, None)
        torch.set_rng_state(state.pop("lightning_dp_strategies/rng"))
        connector = trainer._checkpoint_connector
        connector._loaded_checkpoint = state
        connector.restore_model()
        connector.restore_datamodule()
        connector.restore_callbacks()

    def _recover_between_steps(self, error: BaseException) -> Recovery:
        record = self.recover(error)
        self.hooks.after_recovery_between_steps()
        return record

    def _regroup(self) -> None:
        strategy, survivors = self.strategy, self.survivors
        assert survivors.group is not None
        strategy.engine.grad_sync.regroup(survivors.group, strategy.arrange_reducer(strategy.configure_reducer()))
        strategy._build_buckets()
        self.hooks.on_regroup()

    # ------------------------------------------------------------------ one step
    def step(self, run: Callable[[], Any], closure: Callable[[], Any]) -> Any:
        """``run()`` (Lightning's optimizer step with ``closure``), redone over the survivors after each peer failure
        in it (the closure zeroes the gradients and recomputes them). A survivor whose step failed while the others'
        completed takes their result instead (:meth:`catch_up`). Lightning's collectives inside the step fail with
        it, and the step is redone."""

        def once(failure: BaseException | None) -> tuple[bool, Any]:
            if failure is not None and self._recovered(self.recover(failure), closure):
                return True, None  # caught up: the step's state came from a survivor that completed it
            self.control.new_attempt()
            return False, run()

        with self.control.in_step():
            tries = self.strategy.world_size
            gave_up = PeerLostError(f"An optimizer step met {tries} peer failures in a row; giving up.")
            caught_up, output = redone(once, tries, gave_up)
            if not caught_up:
                self.hooks.after_own_step()
            return output

    def _recovered(self, record: Recovery, closure: Callable[[], Any]) -> bool:
        """After a recovery in a step: a rank between steps one collective behind gets its result; whether this rank
        was a step behind and took the completed step's state (then its step is done)."""
        self.hooks.after_recovery_in_step()
        if record.behind_control and not record.behind:  # a rank between steps is one collective behind
            self.control.hand_over(record)
        self.control.completed = record.control  # the step is redone: its collectives again, by all
        return bool(record.behind) and self.catch_up(record, closure)

    def catch_up(self, record: Recovery, closure: Callable[[], Any] | None) -> bool:
        """Survivors one step behind (every survivor takes part): their collectives of the step return what they
        did, and what failed on them only; where ranks hold alike states (:attr:`SurvivalHooks.alike`), the lowest
        survivor's that completed the step are sent to them. Whether this rank was behind and is done (the closure
        run once more without communicating, as Lightning expects of a step; nothing stepped); else it redoes it."""
        strategy, rank, survivors = self.strategy, self.strategy.global_rank, self.survivors
        module = strategy.lightning_module
        assert module is not None and survivors.control_group is not None
        handed = [self.control.hand_over(record)] if record.missed else []
        behind = rank in record.behind
        if behind:
            self.control.fall_behind(handed if rank in record.missed else [])
        if not self.hooks.alike:
            return False
        source = min(r for r in record.members if r not in record.behind)
        if behind:
            assert closure is not None, "a rank between steps is never a step behind"
            with strategy.engine.grad_sync.no_sync():
                closure()
        state = {"module": module.state_dict(), "optimizers": [o.state_dict() for o in strategy.optimizers]}
        mine = state if rank == source else None  # polled: a loss here is noticed promptly
        received: dict[str, Any] = broadcast_object(mine, source, survivors.control_group, survivors.interrupted)
        if behind:
            module.load_state_dict(received["module"])
            for optimizer, optimizer_state in zip(strategy.optimizers, received["optimizers"], strict=True):
                optimizer.load_state_dict(optimizer_state)
        return behind

    def recover(self, error: BaseException, progress: int | None = None) -> Recovery:
        """Agree on the survivors (comparing ``progress`` where given); average over their new group from now on
        (buckets built anew)."""
        strategy, survivors = self.strategy, self.survivors
        assert strategy.lightning_module is not None
        step = strategy.lightning_module.trainer.global_step
        record = survivors.recover(step, error, progress, self.control.completed)
        self._regroup()
        return record

    def backward(self, run: Callable[[Tensor], Tensor], closure_loss: Tensor) -> Tensor:
        """``run(loss)`` (Lightning's backward) for this rank's loss, then for each lost rank's micro-batch this rank
        holds, accumulated locally until the last one, whose backward reduces them all."""
        lost = self._lost_batches() if self.hooks.trains_lost_batches else []
        if not lost:
            return run(closure_loss)
        with self.strategy.engine.grad_sync.no_sync():
            output = run(closure_loss)
            for batch in lost[:-1]:
                run(self.lost_loss(batch))
        run(self.lost_loss(lost[-1]))
        return output

    def _lost_batches(self) -> list[Any]:
        module = self.strategy.lightning_module
        if module is None or not self.survivors.lost_ranks():
            return []
        batch_idx = module.trainer.fit_loop.epoch_loop.batch_idx
        return [self.strategy.batch_to_device(batch) for batch in self.survivors.lost_batches(batch_idx)]

    def lost_loss(self, batch: Any, batch_idx: int | None = None) -> Tensor:
        """The training loss of a lost rank's micro-batch ``batch_idx`` (default: the current one), computed here with
        the module's logging silenced and collectives refused (:func:`~.replay.as_lost_rank`)."""
        module = self.strategy.lightning_module
        assert module is not None
        batch_idx = module.trainer.fit_loop.epoch_loop.batch_idx if batch_idx is None else batch_idx
        with replay.as_lost_rank(module, self.control), self.strategy.precision_plugin.train_step_context():
            output = module.training_step(batch, batch_idx)
        loss = output.get("loss") if isinstance(output, Mapping) else output
        if not isinstance(loss, Tensor):
            raise RuntimeError(
                "`fault_tolerant` trains a lost rank's batch with `training_step`, which returned no loss for it "
                f"({type(output).__name__}); return the loss (or a dict with 'loss') for every batch."
            )
        return loss

    def scale_gradients(self) -> None:
        """After a reduction: the average over the survivors times ``members / world_size`` (global batch kept)."""
        scale, module = self.survivors.grad_scale, self.strategy.lightning_module
        if scale != 1.0 and module is not None:
            for param in module.parameters():
                if param.grad is not None:
                    param.grad.mul_(scale)

    # ------------------------------------------------------------------ Lightning's collectives
    def is_leader(self) -> bool:
        return self.strategy.global_rank == self.survivors.leader

    def barrier(self) -> None:
        if not self.joining:  # a replacement's setup meets nobody: the live ranks are training
            self.control.barrier()

    def broadcast(self, obj: Any, src: int) -> Any:
        """Lightning's broadcast over the survivors; rank 0's part is the leader's (a replacement's setup: its own)."""
        if self.joining:
            return obj
        return self.control.broadcast(obj, src)

    def reduce_boolean_decision(self, decision: bool, all: bool) -> bool:
        total = self.strategy.reduce(torch.tensor(int(decision), device=self.strategy.root_device), reduce_op="sum")
        return bool(total == len(self.survivors.members)) if all else bool(total)

    def broadcast_buffers(self) -> None:
        module = self.strategy.lightning_module
        if module is not None:
            broadcast_module_buffers(module, self.survivors.control_group, self.survivors.leader)

    # ------------------------------------------------------------------ teardown
    def teardown(self) -> None:
        self.survivors.close()
        self.control.close()
        loop, self._loop = self._loop, None
        if loop is not None:
            del loop._broadcast_sigterm_tensor  # Lightning's own method again
