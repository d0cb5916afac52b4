"""Trainer runs of ``fault_tolerant`` strategies on gloo ranks (three unless said) launched as torchrun launches them.

The job's store is hosted by the test process, as torchrun's agent hosts it (``TORCHELASTIC_USE_AGENT_STORE``), so it
outlives any worker; each rank sees the environment a torchrun worker sees on its own node (one process a node).
A rank planned to fail is SIGKILLed by a callback at the start of a chosen step.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torchmetrics
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp_strategies.comm.failures import PeerLostError
from lightning_dp_strategies.core import elastic
from lightning_dp_strategies.core.failures import FailureInjector, FailureKind
from lightning_dp_strategies.core.fault_tolerance import JOIN_ENV, PREFIX, RESTART_ENV, FaultTolerance
from tests.helpers.distributed import _PRELOAD

WORLD = 3
BATCH = 4
STEPS_PER_EPOCH = 5
TOLERANCE = FaultTolerance(timeout_s=5.0, heartbeat_s=0.2, stale_s=1.5)
"""Short bounds, so that a test's failure costs seconds."""


class Regression(L.LightningModule):
    """A small MLP regressing a fixed teacher, with a validation loop, a torchmetrics metric and logged losses."""

    def __init__(
        self, schedule: bool = False, batch_norm: bool = False, tensor_lr: bool = False, in_step: str | None = None
    ) -> None:
        super().__init__()
        self.schedule, self.tensor_lr, self.in_step = schedule, tensor_lr, in_step
        norm = [nn.BatchNorm1d(16)] if batch_norm else []
        self.net = nn.Sequential(nn.Linear(8, 16), *norm, nn.Tanh(), nn.Linear(16, 1))
        self.val_mse = torchmetrics.MeanSquaredError()
        self.test_mse = torchmetrics.MeanSquaredError()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=self.in_step == "sync_dist")
        if self.in_step == "all_gather":
            self.log("train_loss_spread", self.all_gather(loss.detach()).std())
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        prediction = self.net(x)
        self.val_mse(prediction, y)
        self.log("val_loss", nn.functional.mse_loss(prediction, y), sync_dist=True)
        self.log("val_mse", self.val_mse)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        prediction = self.net(x)
        self.test_mse(prediction, y)
        self.log("test_loss", nn.functional.mse_loss(prediction, y), sync_dist=True)
        self.log("test_mse", self.test_mse)

    def configure_optimizers(self) -> Any:
        lr = torch.tensor(0.05) if self.tensor_lr else 0.05  # a tensor: the scheduler fills it in place
        optimizer = torch.optim.SGD(self.parameters(), lr=lr, momentum=0.9)
        if not self.schedule:
            return optimizer
        decay = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + 0.3 * step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": decay, "interval": "step"}}


def data(samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 8, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).sin())


class Pace(L.Callback):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, *args: Any) -> None:
        time.sleep(self.seconds)


class Stumble(L.Callback):
    """A peer failure raised on ``rank`` after step ``step``'s reduction completed everywhere: its step fails
    while the others' complete, as when a link goes down in the last milliseconds of a reduction."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step, self.fired = rank, step, False

    def on_before_optimizer_step(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step and not self.fired:
            self.fired = True
            raise PeerLostError("injected: the step failed on this rank only")


class AverageFails(L.Callback):
    """Local SGD: at synchronisation ``syncs`` the others get the average and ``rank``'s reduction fails, its buffer
    left half-reduced."""

    def __init__(self, rank: int, syncs: int) -> None:
        self.rank, self.syncs, self.fired = rank, syncs, False

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        local = trainer.strategy.local_sgd  # type: ignore[attr-defined]
        if trainer.global_rank != self.rank:
            return
        average = local.averager.average

        def flaky(tensors: list[torch.Tensor], lossy: int | None = None) -> None:
            average(tensors, lossy)
            if local.syncs == self.syncs and not self.fired:
                self.fired = True
                torch._foreach_mul_(tensors, 0.5)  # what a reduction cut short leaves: not the average
                raise PeerLostError("injected: the average completed elsewhere, then failed on this rank only")

        local.averager.average = flaky


class Fail(L.Callback):
    """``rank`` fails (``kind``: SIGKILL, or a hang) at the start of optimizer step ``step`` (FailureInjector)."""

    def __init__(self, rank: int, step: int, kind: FailureKind) -> None:
        self.injector = FailureInjector().fail(rank=rank, step=step, kind=kind)

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.injector.step(trainer.global_rank, trainer.global_step)


class DieBetweenSteps(L.Callback):
    """``rank`` is SIGKILLed in epoch ``epoch`` between optimizer steps: at its first validation or test batch
    (``during="validation"`` or ``"test"``), or while a checkpoint is being saved, before it is written: before the
    strategy's save began (``"save"``), or once the strategy made what the leader writes, collectively, and before
    the write (``"gathered"``: wraps the strategy's ``checkpoint_to_write``); or as a checkpoint's model state is
    made, before the strategy's collective for it (``"state"``: wraps ``lightning_module_state_dict``)."""

    def __init__(self, during: str, rank: int, epoch: int) -> None:
        self.during, self.rank, self.epoch = during, rank, epoch

    def _maybe_die(self, trainer: L.Trainer, during: str) -> None:
        if (during, trainer.global_rank, trainer.current_epoch) == (self.during, self.rank, self.epoch):
            os.kill(os.getpid(), signal.SIGKILL)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        own = strategy.checkpoint_to_write  # type: ignore[attr-defined]

        def then_die(checkpoint: dict[str, Any]) -> dict[str, Any]:
            written = own(checkpoint)
            self._maybe_die(trainer, "gathered")
            return written

        strategy.checkpoint_to_write = then_die  # type: ignore[attr-defined]
        state_dict = strategy.lightning_module_state_dict

        def die_first() -> dict[str, Any]:
            self._maybe_die(trainer, "state")
            return state_dict()

        strategy.lightning_module_state_dict = die_first  # type: ignore[method-assign]

    def on_validation_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._maybe_die(trainer, "validation")

    def on_test_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._maybe_die(trainer, "test")

    def on_save_checkpoint(self, trainer: L.Trainer, *args: Any) -> None:
        self._maybe_die(trainer, "save")


class DieAdmitting(L.Callback):
    """``rank`` is SIGKILLed while the survivors admit a replacement, before the leader answers it: at the first
    epoch start with a rank missing, once a join request waits (``"request"``: it waits for one there, so the others
    wait in the collective that shares the requests), or as the admission's strategy state is made (``"on_admit"``:
    on entering the strategy's hook)."""

    def __init__(self, where: str, rank: int) -> None:
        self.where, self.rank = where, rank

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        hooks = trainer.strategy.survival.hooks  # type: ignore[attr-defined]
        membership = trainer.strategy.survivors.membership  # type: ignore[attr-defined]
        if trainer.global_rank != self.rank:
            return
        ready, on_admit = hooks.ready_to_admit, hooks.on_admit

        def ready_then_die() -> bool:
            keys = [f"{PREFIX}/join/{r}" for r in range(trainer.world_size) if r != self.rank]
            deadline = time.monotonic() + 60.0
            while not any(membership.store.check([key]) for key in keys) and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
            return ready()

        def die_first(joining: list[int]) -> dict[str, Any]:
            os.kill(os.getpid(), signal.SIGKILL)
            return on_admit(joining)

        if self.where == "request":
            hooks.ready_to_admit = ready_then_die
        else:
            hooks.on_admit = die_first


class DiesHandingOver(L.Callback):
    """Local SGD: ``rank`` is SIGKILLed in the first hand-over of inner states at or after step ``step``, after the
    synchronisation committed: as it starts the all-to-all of the sizes (``where="sizes"``: the survivors' hand-over
    fails) or, the sizes exchanged, of the bytes (``"bytes"``: the survivors' states from it never arrive)."""

    def __init__(self, where: str, rank: int, step: int) -> None:
        self.dtype = {"sizes": torch.int64, "bytes": torch.uint8}[where]
        self.rank, self.step = rank, step

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_rank != self.rank:
            return
        original = dist.all_to_all_single

        def dying(output: torch.Tensor, sent: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if trainer.global_step >= self.step and sent.dtype == self.dtype:
                os.kill(os.getpid(), signal.SIGKILL)
            return original(output, sent, *args, **kwargs)

        dist.all_to_all_single = dying  # this process's own, for the rest of its short life


class DiesRecovering(L.Callback):
    """``rank`` is SIGKILLed as it starts its part of a recovery's collectives (its ``nth`` call of ``where``), so
    the other survivors lose it inside their recovery. Local SGD: on entering ``HandOvers.settle`` (the survivors'
    choice of handed-over states, ``where="settle"``), ``HandOvers.take_over`` (once that choice is agreed,
    ``"take_over"``) or the take-over's exchanges (``"exchange"``: the first of each take-over says who needs what,
    the second sends the states and replicas); or, with ``where="_start"``, as it starts sending its states once a
    recovery in a synchronisation ended the period (its first ``HandOvers._start`` after a recovery); or, with
    ``where="hand_over"``, as it starts a hand-over that waits (the first: at the start of a resumed run). The ring: on
    entering ``TrainerSurvival.catch_up`` (a completed step's state handed to a rank one step behind,
    ``"catch_up"``)."""

    def __init__(self, where: str, rank: int, nth: int = 1) -> None:
        self.where, self.rank, self.nth = where, rank, nth

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        from lightning_dp_strategies.strategies import local_handover
        from lightning_dp_strategies.strategies.survival import TrainerSurvival

        if trainer.global_rank != self.rank:
            return
        owner: Any = {"catch_up": TrainerSurvival, "exchange": local_handover}.get(self.where, local_handover.HandOvers)
        original, calls = getattr(owner, self.where), [0]

        def dying(*args: Any, **kwargs: Any) -> Any:
            if self.where != "_start" or args[0].survivors.recoveries:
                calls[0] += 1
            if calls[0] == self.nth:
                os.kill(os.getpid(), signal.SIGKILL)
            return original(*args, **kwargs)

        setattr(owner, self.where, dying)  # this process's, for the rest of its short life


def _stumble_once() -> None:
    """This process's next control reduction completes (the others get its result), then raises a peer failure."""
    from lightning_dp_strategies.strategies import control

    reduce = control.all_reduce

    def flaky(*args: Any, **kwargs: Any) -> torch.Tensor:
        reduce(*args, **kwargs)
        control.all_reduce = reduce
        raise PeerLostError("injected: the reduction completed elsewhere, then failed on this rank only")

    control.all_reduce = flaky


class ReductionStumbles(L.Callback):
    """``where = ("validation", epoch)``: in that epoch's validation, ``rank``'s first reduction completes and then
    fails there, so the others go on to the next collective, one ahead of it. ``("before_step", step)``: every rank
    reduces a value before optimizer step ``step`` (a callback's collective between steps) and ``rank``'s fails so,
    so the others go on into the step's gradient reduction. ``("in_step", step)``: ``rank``'s first reduction in
    step ``step`` (``training_step``'s, with ``Run.in_step``) fails so."""

    def __init__(self, rank: int, where: tuple[str, int]) -> None:
        self.rank, self.where = rank, where

    def on_validation_start(self, trainer: L.Trainer, *args: Any) -> None:
        if (trainer.global_rank, ("validation", trainer.current_epoch)) == (self.rank, self.where):
            _stumble_once()

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if (trainer.global_rank, ("in_step", trainer.global_step)) == (self.rank, self.where):
            _stumble_once()
        if self.where == ("before_step", trainer.global_step):
            if trainer.global_rank == self.rank:
                _stumble_once()
            trainer.strategy.reduce(torch.tensor(float(trainer.global_rank)), reduce_op="sum")


@dataclass(frozen=True)
class Run:
    steps: int = 3 * STEPS_PER_EPOCH
    victim: int | None = None
    fail_at: int = 3
    also: tuple[int, int] | None = None
    """``(rank, step)``: another rank that fails as ``victim`` does, at the start of that step."""
    world: int = WORLD
    state_copies: int = 1
    kind: FailureKind = "kill"
    keep_global_batch: bool = True
    replace: bool = False
    """Start a replacement for the victim once it is gone (``LDPS_JOIN=1``)."""
    restarted: bool = False
    """With ``replace``: the replacement is the victim's worker restarted by its torchrun agent (its restart count
    set, ``LDPS_JOIN`` not)."""
    restart_while_beating: int | None = None
    """Every rank is a worker its torchrun agent restarted (the whole job restarting), while that rank's worker of
    the attempt before still beats (:func:`_previous_attempt`)."""
    stumble: tuple[int, int] | None = None
    """``(rank, step)``: that rank's step fails after its gradients were averaged (the others' completed)."""
    pace_s: float = 0.0
    """Seconds every rank sleeps after each batch (so a replacement's start-up spans a few epochs)."""
    sync_every: int | None = None
    """Train with ``LocalSGDStrategy(sync_every=...)`` instead of the ring."""
    average_fails: tuple[int, int] | None = None
    """Local SGD, ``(rank, syncs)``: that rank's average at that synchronisation completes, then raises a peer
    failure there (the others got the average)."""
    evaluate_only: str | None = None
    """``"validate"`` or ``"test"``: that Trainer method alone, instead of ``fit``."""
    reduction_stumbles: tuple[int, tuple[str, int]] | None = None
    """``(rank, where)``: :class:`ReductionStumbles`."""
    resume_from: str | None = None
    """``fit(..., ckpt_path=...)``: resume from this checkpoint."""
    checkpoint_every: int | None = None
    """Also a checkpoint every that many steps (``ModelCheckpoint(every_n_train_steps=...)``, into ``steps/``)."""
    dies_admitting: tuple[str, int] | None = None
    """``(where, rank)``: :class:`DieAdmitting` (with ``replace``: the victim's replacement is being admitted)."""
    dies_between_steps: tuple[str, int, int] | None = None
    """``(during, rank, epoch)``: that rank is killed in validation, testing or a save (:class:`DieBetweenSteps`)."""
    schedule: bool = False
    """The learning rate decays at every step (a ``LambdaLR`` with ``interval="step"``)."""
    tensor_lr: bool = False
    """The learning rate is a tensor (which a scheduler changes in place)."""
    batch_norm: bool = False
    """A ``BatchNorm1d`` after the first layer (its running statistics are buffers local SGD averages)."""
    dies_handing_over: tuple[str, int, int] | None = None
    """``(where, rank, step)``: :class:`DiesHandingOver`."""
    dies_recovering: tuple[str, int] | tuple[str, int, int] | None = None
    """``(where, rank)``: :class:`DiesRecovering`."""
    strategy_timeout_s: float = 60.0
    """The strategy's ``timeout``: the bound of Lightning's collectives between steps (their group's)."""
    in_step: str | None = None
    """A collective of ``training_step``: ``"sync_dist"`` (its loss logged with ``sync_dist=True``) or
    ``"all_gather"`` (the spread of the ranks' losses logged)."""


def train(rank: int, run: Run, root: str) -> dict[str, Any]:
    """One rank's Trainer run; its final parameters and what its strategy recorded."""
    from lightning_dp_strategies import LocalSGDStrategy, RingAllReduceStrategy

    L.seed_everything(0, verbose=False)
    model = Regression(schedule=run.schedule, batch_norm=run.batch_norm, tensor_lr=run.tensor_lr, in_step=run.in_step)
    options = {"keep_global_batch": run.keep_global_batch, "state_copies": run.state_copies}
    tolerance = FaultTolerance(**{**TOLERANCE.__dict__, **options})
    strategy: RingAllReduceStrategy | LocalSGDStrategy
    if run.sync_every is None:
        strategy = RingAllReduceStrategy(fault_tolerant=tolerance, timeout=timedelta(seconds=run.strategy_timeout_s))
    else:
        timeout = timedelta(seconds=run.strategy_timeout_s)
        strategy = LocalSGDStrategy(sync_every=run.sync_every, fault_tolerant=tolerance, timeout=timeout)
    callbacks: list[L.Callback] = [ModelCheckpoint(dirpath=f"{root}/ckpt", monitor="val_loss", save_top_k=1)]
    if run.victim is not None and not _replacement():
        callbacks.append(Fail(run.victim, run.fail_at, run.kind))
    if run.also is not None:
        callbacks.append(Fail(*run.also, run.kind))
    if run.stumble is not None:
        callbacks.append(Stumble(*run.stumble))
    if run.pace_s:
        callbacks.append(Pace(run.pace_s))
    if run.average_fails is not None:
        callbacks.append(AverageFails(*run.average_fails))
    if run.reduction_stumbles is not None:
        callbacks.append(ReductionStumbles(*run.reduction_stumbles))
    if run.dies_admitting is not None and not _replacement():
        callbacks.append(DieAdmitting(*run.dies_admitting))
    if run.dies_between_steps is not None:
        callbacks.append(DieBetweenSteps(*run.dies_between_steps))
    if run.dies_handing_over is not None:
        callbacks.append(DiesHandingOver(*run.dies_handing_over))
    if run.dies_recovering is not None:
        callbacks.append(DiesRecovering(*run.dies_recovering))
    if run.checkpoint_every is not None:
        every = run.checkpoint_every
        callbacks.append(
            ModelCheckpoint(dirpath=f"{root}/steps", filename="{step}", every_n_train_steps=every, save_top_k=-1)
        )
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        num_nodes=run.world,
        max_steps=run.steps,
        logger=CSVLogger(root, name="logs"),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    train_loader = DataLoader(data(run.world * BATCH * STEPS_PER_EPOCH, 1), batch_size=BATCH, shuffle=True)
    val_loader = DataLoader(data(run.world * BATCH * 2, 2), batch_size=BATCH)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if run.evaluate_only == "validate":
            trainer.validate(model, val_loader)
        elif run.evaluate_only == "test":
            trainer.test(model, val_loader)
        else:
            trainer.fit(model, train_loader, val_loader, ckpt_path=run.resume_from)
    survivors, survival = strategy.survivors, strategy.survival
    assert survivors is not None and survival is not None
    return {
        "params": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist(),
        "global_step": trainer.global_step,
        "recoveries": [(r.step, r.lost, r.members) for r in survivors.recoveries],
        "behind": [r.behind for r in survivors.recoveries],
        "lagging": [r.lagging for r in survivors.recoveries],
        "behind_control": [r.behind_control for r in survivors.recoveries],
        "best": trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else None,
        "is_global_zero": trainer.is_global_zero,
        **{
            name: float(trainer.callback_metrics[name])
            for name in ("val_mse", "test_mse")
            if name in trainer.callback_metrics
        },
        "step_bytes": strategy.comm_stats.bytes_sent,
        "joins": survival.joins,
        "admitted_at": None if survival.admission is None else survival.admission.epoch,
        "best_params": _checkpoint_params(trainer),
        "warnings": [str(w.message) for w in caught],
        "replayed": getattr(getattr(strategy, "local_survival", None), "replayed", None),
    }


def _checkpoint_params(trainer: L.Trainer) -> list[float] | None:
    """The parameters of the best checkpoint's model (the leader's file), ``None`` where this rank wrote none."""
    best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
    if not trainer.is_global_zero or not best:
        return None
    state = torch.load(best, weights_only=False)["state_dict"]
    return torch.cat([v.flatten() for k, v in state.items() if k.startswith("net.")]).tolist()


def _replacement() -> bool:
    return os.environ.get(JOIN_ENV) == "1" or os.environ.get(RESTART_ENV, "0") != "0"


def _rank(rank: int, port: int, run: Run, root: str, results: Any, join: bool = False) -> None:
    if join or run.restart_while_beating is not None:
        os.environ[RESTART_ENV if run.restarted or not join else JOIN_ENV] = "1"
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_RUN_ID="fault-tolerant-test",
        TORCHELASTIC_USE_AGENT_STORE="True",
        RANK=str(rank),
        GROUP_RANK=str(rank),
        LOCAL_RANK="0",
        WORLD_SIZE=str(run.world),
        LOCAL_WORLD_SIZE="1",
    )
    try:
        results.put((rank, train(rank, run, root)))
    except BaseException:
        results.put((rank, RuntimeError(traceback.format_exc())))


def _previous_attempt(server: dist.TCPStore, rank: int, world: int) -> None:
    """The attempt before this one as its workers left it in the agent's store: every rank's heartbeat counter, and
    ``rank``'s still moving (its worker has not failed yet) until a restarted worker asks to join that attempt; then
    it stops (that worker failed too)."""
    server.set(f"{elastic.PREFIX}/current", "previous")
    store = dist.PrefixStore(f"{elastic.PREFIX}/previous/ft/", server)
    for r in range(world):
        store.add(f"{PREFIX}/heartbeat/{r}", 5)

    def beat() -> None:
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline and not any(store.check([f"{PREFIX}/join/{r}"]) for r in range(world)):
            store.add(f"{PREFIX}/heartbeat/{rank}", 1)
            time.sleep(TOLERANCE.heartbeat_s)

    threading.Thread(target=beat, daemon=True).start()


def launch(
    run: Run, root: Path, timeout: float = 120.0, expected: int | None = None, linger: float = 10.0
) -> tuple[dict[int, Any], list[int | None], float]:
    """Run ``train`` on ``run.world`` ranks forked from the suite's fork server, the store hosted here; each rank's
    result (or error), the exit codes, and the wall time until ``expected`` ranks reported (default: every rank).
    Ranks alive ``linger`` s after that, or after ``timeout`` s, are killed (exit -9)."""
    expected = run.world if expected is None else expected
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    server = dist.TCPStore("127.0.0.1", 0, run.world, is_master=True, wait_for_workers=False)
    results = ctx.SimpleQueue()
    if run.restart_while_beating is not None:
        _previous_attempt(server, run.restart_while_beating, run.world)
    procs = [
        ctx.Process(target=_rank, args=(r, server.port, run, str(root), results), daemon=True) for r in range(run.world)
    ]
    start = time.monotonic()
    for p in procs:
        p.start()
    deadline = start + timeout
    outcomes: dict[int, Any] = {}
    replaced = False
    while len(outcomes) < expected and time.monotonic() < deadline:
        if run.replace and run.victim is not None and not replaced and procs[run.victim].exitcode is not None:
            replaced = True  # the victim is gone: its replacement starts, as a new torchrun agent would start it
            procs.append(
                ctx.Process(target=_rank, args=(run.victim, server.port, run, str(root), results, True), daemon=True)
            )
            procs[-1].start()
        if not results.empty():
            rank, value = results.get()
            outcomes[rank] = value
        elif all(not p.is_alive() for p in procs) and (replaced or not run.replace):
            break
        else:
            time.sleep(0.05)
    elapsed = time.monotonic() - start
    for p in procs:
        p.join(max(0.0, min(deadline - time.monotonic(), linger)))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    while not results.empty():
        rank, value = results.get()
        outcomes[rank] = value
    return outcomes, [p.exitcode for p in procs], elapsed


def result(outcomes: dict[int, Any], rank: int) -> dict[str, Any]:
    """Rank ``rank``'s result; fails naming what it reported instead, and what the other ranks that failed did."""
    value = outcomes.get(rank)
    failed = [(r, v) for r, v in sorted(outcomes.items()) if r != rank and not isinstance(v, dict)]
    others = "".join(f"\n--- rank {r}: {v}" for r, v in failed)
    assert isinstance(value, dict), f"rank {rank} did not finish: {value}{others}"
    return value


def final_params(outcomes: dict[int, Any], rank: int) -> torch.Tensor:
    return torch.tensor(result(outcomes, rank)["params"])


def assert_survived(
    outcomes: dict[int, Any],
    codes: list[int | None],
    victim: int | list[int],
    reference: torch.Tensor,
    tolerance: float,
    world: int = WORLD,
) -> list[int]:
    """``victim`` (one rank or several) was SIGKILLed and every other rank finished, after one recovery that lost
    it, within ``tolerance`` of the ``reference`` parameters; the survivors."""
    lost = [victim] if isinstance(victim, int) else sorted(victim)
    survivors = [r for r in range(world) if r not in lost]
    assert codes == [-9 if r in lost else 0 for r in range(world)], outcomes
    for rank in survivors:
        recoveries = result(outcomes, rank)["recoveries"]
        assert [(gone, members) for _, gone, members in recoveries] == [(lost, survivors)], recoveries
        assert (final_params(outcomes, rank) - reference).abs().max().item() <= tolerance
    return survivors


def uninterrupted_params(run: Run, root: Path) -> torch.Tensor:
    """The final parameters of ``run`` without a failure, checked equal on every rank."""
    outcomes, codes, _ = launch(run, root)
    assert codes == [0] * run.world, outcomes
    final = [final_params(outcomes, r) for r in range(run.world)]
    assert all(torch.equal(final[0], f) for f in final[1:])
    return final[0]


def assert_departs(run: Run, root: Path, reference: torch.Tensor) -> None:
    """``run`` (rank 1 killed, the batch shrinking) ends on parameters the survivors share, far from ``reference``."""
    outcomes, codes, _ = launch(run, root)
    assert codes == [0, -9, 0], outcomes
    assert (final_params(outcomes, 0) - reference).abs().max().item() > 1e-4
    assert torch.equal(final_params(outcomes, 0), final_params(outcomes, 2))
