"""Trainer runs for the hybrid_pipeline tests, and the single-process reference loop they are checked against.

Run as ``python -m tests.strategies.pipeline_scenarios SUITE OUTDIR``; Lightning's popen launcher re-runs the same
command for the other ranks. A suite runs several configurations one after the other inside one process group
(each launch costs seconds; a fit does not). Every rank writes ``OUTDIR/{case}-rank{r}.pt`` from a callback's
``on_train_end``; :func:`reference` replays the same global batches in one process.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchmetrics import SumMetric

from lightning_dp_strategies import HybridPipelineStrategy
from tests.helpers.distributed import duplex_ranks


@dataclass(frozen=True)
class Case:
    name: str
    world: int = 2
    stages: int = 2
    micro_batches: int = 1
    schedule: str = "1f1b"
    epochs: int = 2
    per_replica_batch: int = 4
    samples: int = 38  # 19 per replica at 2 replicas: 4,4,4,4,3 (the last batch runs with 3 micro-batches at M=4)
    clip: float | None = None
    accumulate: int = 1
    balance: tuple[int, ...] | str = "parameters"
    reducer: str = "ring"
    hook: bool = False  # the replicas average through torch's DDP `allreduce_hook` instead of the reducer
    compiled: bool = False  # the first and last blocks torch.compile'd (dynamo's graphs, run eagerly)

    @property
    def replicas(self) -> int:
        return self.world // self.stages


PARITY_2 = [
    Case(f"s2d1-{sched}-m{m}", world=2, micro_batches=m, schedule=sched) for sched in ("gpipe", "1f1b") for m in (1, 4)
]
PARITY_4 = [
    Case(f"s2d2-{sched}-m{m}", world=4, micro_batches=m, schedule=sched) for sched in ("gpipe", "1f1b") for m in (1, 4)
]
SUITES: dict[str, list[Case]] = {
    "world2": [
        *PARITY_2,
        Case("s2d1-clip", clip=0.05, micro_batches=2, balance=(2, 3)),
        Case("s2d1-compiled", micro_batches=2, compiled=True),
    ],
    "world4": [
        *PARITY_4,
        Case("s2d2-accumulate", world=4, accumulate=2, micro_batches=2),
        Case("s2d2-native", world=4, micro_batches=2, reducer="native"),  # the replicas average with gloo's all-reduce
        Case("s2d2-hook", world=4, micro_batches=2, accumulate=2, hook=True),  # ... through torch's allreduce_hook
    ],
}
# the schedules with two chunks per rank (the 5 blocks cut into 4 chunks), each with clipping and accumulation
VIRTUAL = ("interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv")
SUITES["schedules2"] = [
    Case(f"s2d1-{s}", micro_batches=4, schedule=s, clip=0.05, accumulate=2, epochs=1) for s in VIRTUAL
]
SUITES["schedules4"] = [
    Case(f"s2d2-{s}", world=4, micro_batches=2, schedule=s, clip=0.05, accumulate=2, epochs=1) for s in VIRTUAL
]
CKPT = Case("ckpt", world=4, micro_batches=2, schedule="gpipe")
VAL_SAMPLES = 16


def make_data(samples: int, seed: int = 1234) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(samples, 8, generator=gen), torch.randint(0, 3, (samples,), generator=gen))


class PipeNet(L.LightningModule):
    """An ordinary module with the two-line opt-in: ``pipeline_body`` and ``pipeline_loss``."""

    pipeline_body = "body"

    def __init__(self, compiled: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
        if compiled:  # the stages are cut from the Sequential, so blocks are compiled, not the Sequential
            for index in (0, 4):  # a Linear block in each stage
                self.body[index] = torch.compile(self.body[index], backend="eager")
        self.seen = SumMetric()

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(output, target)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = self.pipeline_loss(self.body(x), y)
        self.log("train_loss", loss, prog_bar=True)
        self.seen.update(torch.tensor(float(len(x))))
        self.log("seen", self.seen, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", self.pipeline_loss(self.body(x), y), sync_dist=True)

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.body(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.parameters())


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-2)


class Recorder(L.Callback):
    """Saves ``{prefix}-rank{r}.pt`` with what the rank trained and measured, inside ``fit`` on every rank."""

    def __init__(self, prefix: Path) -> None:
        self.prefix = prefix

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, HybridPipelineStrategy)
        torch.save(
            {
                # what it trains, a compiled block's names without torch.compile's wrapper (as the reference's)
                "params": {n.replace("_orig_mod.", ""): p.detach().clone() for n, p in strategy.bucketed_parameters()},
                "progress_bar": {k: float(v) for k, v in trainer.progress_bar_metrics.items()},
                "seen": float(trainer.callback_metrics["seen"]),
                "bubble": strategy.pipeline_stats.last.bubble,
                "mean_bubble": strategy.pipeline_stats.mean_bubble,
                "micro_batches": strategy.pipeline_stats.last.micro_batches,
                "steps": strategy.pipeline_stats.steps,
                "p2p_total": (strategy.pipeline_stats.p2p_bytes_sent, strategy.pipeline_stats.p2p_bytes_received),
                "p2p_step": (strategy.step_stats.pipeline_bytes_sent, strategy.step_stats.pipeline_bytes_received),
                "ring_operations": strategy.comm_stats.ring_operations,
                "skipped": strategy.comm_stats.skipped_backwards,
                "synced": strategy.comm_stats.synced_backwards,
                "overlapped": strategy.comm_stats.overlapped_buckets,
                "buckets": len(strategy.buckets.buckets) if strategy.buckets is not None else 0,
                "reducer": type(strategy.buckets.reducer).__name__ if strategy.buckets is not None else None,
                "duplex_ranks": duplex_ranks(strategy.buckets),
            },
            f"{self.prefix}-rank{trainer.global_rank}.pt",
        )


class SaveAtEpochEnd(L.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.current_epoch == 0:
            trainer.save_checkpoint(self.path)


def trainer_for(
    case: Case, outdir: Path, callbacks: list[L.Callback], epochs: int | None = None, **options: Any
) -> L.Trainer:
    return L.Trainer(
        strategy=HybridPipelineStrategy(
            pipeline_stages=case.stages,
            micro_batches=case.micro_batches,
            schedule=case.schedule,
            balance=case.balance,
            reducer=None if case.hook else case.reducer,
            ddp_comm_hook=allreduce_hook if case.hook else None,
        ),  # type: ignore[arg-type]
        accelerator="cpu",
        devices=case.world,
        max_epochs=epochs or case.epochs,
        gradient_clip_val=case.clip,
        accumulate_grad_batches=case.accumulate,
        logger=CSVLogger(outdir, name=case.name, version=0),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        **options,
    )


def loader(samples: int, batch: int, seed: int = 1234) -> DataLoader:
    return DataLoader(make_data(samples, seed), batch_size=batch, shuffle=False)


class UserObjects(L.Callback):
    """Whether the module's own body and Lightning's precision plugin are as the user made them, during and after fit.

    The strategy may stand its own objects in their place while it trains; it must not change the user's."""

    def __init__(self, model: L.LightningModule, plugin: object) -> None:
        self.body, self.blocks, self.plugin = model.body, list(model.body), plugin
        self.checks: list[bool] = []

    def check(self) -> None:
        self.checks.append(
            len(self.body) == len(self.blocks)
            and all(a is b for a, b in zip(self.body, self.blocks, strict=True))
            and type(self.plugin).__name__ == "Precision"
            and "clip_grad_by_norm" not in vars(self.plugin)
        )

    def on_train_batch_end(self, *args: Any) -> None:
        self.check()


def run_case(case: Case, outdir: Path) -> tuple[L.Trainer, bool]:
    """Fit ``case``; also whether the user's objects stayed as they were (the body and the precision plugin)."""
    model = PipeNet(compiled=case.compiled)
    trainer = trainer_for(case, outdir, [Recorder(outdir / case.name)])
    user = UserObjects(model, trainer.precision_plugin)
    trainer.callbacks.append(user)
    trainer.fit(model, loader(case.samples, case.per_replica_batch))
    user.check()
    back = model.body is user.body and trainer.precision_plugin is user.plugin
    return trainer, back and len(user.checks) > 1 and all(user.checks)


def live_groups() -> int:
    """Process groups this rank belongs to right now (torch's private registry: the count is all a test needs)."""
    return len(dist.distributed_c10d._world.pg_map)


def run_suite(suite: str, outdir: Path) -> None:
    groups = []  # after each fit/predict/validate (the first one makes the default group): none may pile up
    untouched = []  # whether the module's body and the precision plugin are the user's own again after the fit
    for case in SUITES[suite]:
        trainer, kept = run_case(case, outdir)
        groups.append(live_groups())
        untouched.append(kept)
        if suite.startswith("schedules"):  # evaluation runs the schedule's forwards without its backwards
            metrics = trainer.validate(trainer.lightning_module, loader(VAL_SAMPLES, 4, seed=7))
            torch.save(metrics[0]["val_loss"], outdir / f"validate-{case.name}-rank{trainer.global_rank}.pt")
    if suite == "world2":
        # predict runs forward-only through the pipeline; afterwards the module is whole again on every rank
        model = PipeNet()
        trainer = trainer_for(replace(SUITES[suite][0], name="predict"), outdir, [])
        predictions = trainer.predict(model, loader(VAL_SAMPLES, 4, seed=7))
        torch.save(
            {"predictions": torch.cat(predictions), "params": dict(model.state_dict())},  # type: ignore[arg-type]
            outdir / f"predict-rank{trainer.global_rank}.pt",
        )
        groups.append(live_groups())
    if suite == "world4":
        run_checkpoints(outdir)
        groups.append(live_groups())
    if suite.startswith("schedules"):
        # after the last fit (zbv: rank 0 runs the first and the last chunk), a save gathers every stage's chunks
        trainer.save_checkpoint(outdir / "saved.ckpt")
        groups.append(live_groups())
    torch.save(groups, outdir / f"groups-rank{dist.get_rank()}.pt")
    torch.save(untouched, outdir / f"untouched-rank{dist.get_rank()}.pt")


def run_checkpoints(outdir: Path) -> None:
    """Save after epoch 1 under hybrid_pipeline, resume to epoch 2; resume also from a single-device checkpoint."""
    path = outdir / "hybrid.ckpt"
    model = PipeNet()
    trainer = trainer_for(CKPT, outdir, [SaveAtEpochEnd(path)], epochs=1)
    trainer.fit(model, loader(CKPT.samples, CKPT.per_replica_batch))
    rank = trainer.global_rank
    # validate the trained module through the pipeline (forward only): val_loss is synced over the replicas
    metrics = trainer.validate(model, loader(VAL_SAMPLES, 4, seed=7))
    torch.save(
        {"val_loss": metrics[0]["val_loss"], "params": {n: p.detach().clone() for n, p in model.named_parameters()}},
        outdir / f"validate-rank{rank}.pt",
    )

    resumed = trainer_for(replace(CKPT, name="resumed"), outdir, [Recorder(outdir / "resumed")])
    resumed.fit(PipeNet(), loader(CKPT.samples, CKPT.per_replica_batch), ckpt_path=path)

    # a checkpoint as a single device writes it: the reference loop's module and optimizer after epoch 1
    single = torch.load(path, weights_only=False)
    ref_model, ref_opt = reference_state(CKPT, epochs=1)
    single["state_dict"] = ref_model.state_dict()
    single["optimizer_states"] = [ref_opt.state_dict()]
    single_path = outdir / f"single-rank{rank}.ckpt"
    torch.save(single, single_path)
    from_single = trainer_for(replace(CKPT, name="from-single"), outdir, [Recorder(outdir / "from-single")])
    from_single.fit(PipeNet(), loader(CKPT.samples, CKPT.per_replica_batch), ckpt_path=single_path)


# ---------------------------------------------------------------------------------------------- bad input
class NoOptIn(L.LightningModule):
    """An ordinary module without ``pipeline_body`` / ``pipeline_loss``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 3))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        raise AssertionError("training started")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.parameters())


class OneBlock(PipeNet):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 3))


class Untrainable(PipeNet):
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        raise AssertionError("training started")


BAD = {
    "no-opt-in": (NoOptIn, Case("no-opt-in")),
    "more-stages-than-blocks": (OneBlock, Case("more-stages-than-blocks")),
    "batch-smaller-than-micro-batches": (Untrainable, Case("small", micro_batches=8)),
    "batch-not-divisible": (Untrainable, Case("indivisible", micro_batches=3)),
    "stages-train-on-different-batches": (Untrainable, Case("split-over-the-stages")),
    "stages-validate-on-different-batches": (PipeNet, Case("split-over-the-stages")),
}


def run_bad(name: str, outdir: Path) -> None:
    module_cls, case = BAD[name]
    if "different-batches" in name:  # the data split over every process, as under ring_allreduce
        trainer = trainer_for(case, outdir, [], use_distributed_sampler=False)
        data = make_data(case.samples)
        sampler = DistributedSampler(data, num_replicas=case.world, rank=trainer.global_rank, shuffle=False)
        split = DataLoader(data, batch_size=case.per_replica_batch, sampler=sampler)
        trainer.validate(module_cls(), split) if "validate" in name else trainer.fit(module_cls(), split)
        return
    trainer_for(case, outdir, []).fit(module_cls(), loader(case.samples, case.per_replica_batch))


# ---------------------------------------------------------------------------------------------- the reference
def replica_shards(case: Case, epoch: int) -> list[list[list[int]]]:
    """Per step of ``epoch``, per data-parallel replica, the sample indices it trains on.

    Lightning gives a distributed training loader ``DistributedSampler(shuffle=True, seed=0)`` over the
    data-parallel replicas (not the world) and calls ``set_epoch``; replaying it gives the same global batches.
    """
    per_replica = []
    for d in range(case.replicas):
        sampler = DistributedSampler(range(case.samples), case.replicas, d, shuffle=True, seed=0)
        sampler.set_epoch(epoch)
        per_replica.append(list(sampler))
    b = case.per_replica_batch
    steps = -(-len(per_replica[0]) // b)
    return [[per_replica[d][k * b : (k + 1) * b] for d in range(case.replicas)] for k in range(steps)]


def reference_state(case: Case, epochs: int | None = None) -> tuple[PipeNet, torch.optim.Optimizer]:
    """Single-process training over the same global batches: the mean of the replicas' batch-mean losses."""
    model = PipeNet()
    x, y = make_data(case.samples).tensors
    opt = make_optimizer(model.parameters())
    model.losses = []  # type: ignore[assignment]
    for epoch in range(epochs or case.epochs):
        batches = replica_shards(case, epoch)
        for k, shards in enumerate(batches):
            losses = [F.cross_entropy(model.body(x[s]), y[s]) for s in shards]
            model.losses.append(float(losses[0].detach()))  # type: ignore[operator]
            (torch.stack(losses).mean() / case.accumulate).backward()
            if (k + 1) % case.accumulate == 0 or k == len(batches) - 1:
                if case.clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
                opt.step()
                opt.zero_grad()
    return model, opt


def reference(case: Case, epochs: int | None = None) -> dict[str, Tensor]:
    model, _ = reference_state(case, epochs)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def case_by_name(name: str) -> Case:
    for case in [c for cases in SUITES.values() for c in cases] + [CKPT]:
        if case.name == name:
            return case
    raise KeyError(name)


if __name__ == "__main__":
    if sys.argv[1] in BAD:
        run_bad(sys.argv[1], Path(sys.argv[2]))
    else:
        run_suite(sys.argv[1], Path(sys.argv[2]))
