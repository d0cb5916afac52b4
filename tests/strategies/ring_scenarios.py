"""Trainer runs for the ring_allreduce parity tests, and the single-process reference loop they are checked against.

Run as ``python -m tests.strategies.ring_scenarios NAME[@STRATEGY][,NAME...] OUTDIR [STRATEGY]``; Lightning's popen
launcher re-runs the same command for the other ranks, and the scenarios run one after the other in the same
processes. Every rank writes ``OUTDIR/{name}-{strategy}/rank{r}.pt`` with its final parameters and what it recorded
along the way; :func:`reference_parameters` replays the same global batches in one process.
"""

from __future__ import annotations

import os
import sys

if os.environ.get("LDPS_SIMULATE_NOTEBOOK"):
    sys.ps1 = ">>> "  # what Lightning checks (at import) to tell it runs inside Jupyter / an interactive shell
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_dp_strategies
from lightning_dp_strategies.reducers import AutoReducer, NativeReducer, Reducer
from lightning_dp_strategies.strategies import BucketedDataParallel
from tests.helpers.distributed import duplex_ranks

NUM_NODES = int(os.environ.get("LDPS_NUM_NODES", "1"))  # > 1 under torchrun --nnodes (TorchElasticEnvironment)


@dataclass(frozen=True)
class Scenario:
    world: int = 2
    optimizer: str = "sgd"  # SGD with momentum and weight decay, or Adam
    epochs: int = 2
    per_rank_batch: int = 4
    samples: int = 44  # 22 per rank at world 2: batches of 4,4,4,4,4,2 (an uneven final batch)
    accumulate: int = 1
    clip: float | None = None
    manual: bool = False
    unused: bool = False  # one parameter no rank uses, one that only rank 0 uses
    precision: str = "32-true"
    extra: dict[str, Any] = field(default_factory=dict)
    hook: str | None = None  # a torch DDP communication hook (see comm_hook_options)
    save: bool = False  # save OUTDIR/{name}-{strategy}/last.ckpt after fit
    resume_from: str | None = None  # resume from that scenario's last.ckpt (in the same OUTDIR, ring_allreduce)
    two_optimizers: bool = False  # manual: Adam over the first layer, SGD with momentum over the rest
    compiled: bool = False  # the body torch.compile'd (AOTAutograd's backward, run eagerly: no C++ compiler needed)
    checkpointed: bool = False  # the body after its first layer under reentrant activation checkpointing
    hook_clip: float | None = None  # clip_grad_norm_ in on_after_backward: a hook that changes the gradients


SCENARIOS = {
    "sgd": Scenario(extra={"log_comm_stats": True}),
    "adam3": Scenario(world=3, optimizer="adam", epochs=3, samples=45),  # 15 per rank: 4,4,4,3
    "sgd3": Scenario(world=3, epochs=3, samples=45),
    # 2 nodes x 2 processes (LDPS_NUM_NODES=2): the buckets reduced by one flat ring by default, or in two levels
    "nodes2x2": Scenario(world=4, samples=44),
    "adam2": Scenario(optimizer="adam"),
    "unused": Scenario(unused=True),
    "accumulate": Scenario(accumulate=2),
    "clip": Scenario(clip=0.05),
    "hook_clip": Scenario(hook_clip=0.05),
    "manual": Scenario(manual=True),
    "bf16": Scenario(precision="bf16-mixed"),
    "compiled": Scenario(compiled=True),
    "checkpointed": Scenario(checkpointed=True, accumulate=2),
    # torch's DDP communication hooks averaging the buckets
    "hook_allreduce": Scenario(hook="allreduce"),
    "hook_unused": Scenario(unused=True, hook="allreduce"),
    "hook_fp16": Scenario(hook="fp16", accumulate=2),
    "hook_powersgd": Scenario(hook="powersgd"),
    # sharded optimizer state (ZeRO-1)
    "zero_adam": Scenario(optimizer="adam", save=True, extra={"shard_optimizer_state": True, "log_comm_stats": True}),
    "adam_saved": Scenario(optimizer="adam", save=True),
    "zero_manual": Scenario(optimizer="adam", manual=True, extra={"shard_optimizer_state": True}),
    "zero_bf16": Scenario(optimizer="adam", precision="bf16-mixed", extra={"shard_optimizer_state": True}),
    "zero_two_optimizers": Scenario(manual=True, two_optimizers=True, extra={"shard_optimizer_state": True}),
    "zero_fp16": Scenario(optimizer="adam", precision="16-mixed", extra={"shard_optimizer_state": True}),
    "adam_fp16": Scenario(optimizer="adam", precision="16-mixed"),
    "zero3": Scenario(
        world=3,
        optimizer="adam",
        epochs=3,
        samples=45,
        unused=True,
        clip=0.05,
        accumulate=2,
        extra={"shard_optimizer_state": True},
    ),
    # the world-2 runs' checkpoints resumed by 3 processes for one more epoch, sharded or not
    "zero_resume3": Scenario(
        world=3, optimizer="adam", epochs=3, resume_from="zero_adam", extra={"shard_optimizer_state": True}
    ),
    "ring_resume3": Scenario(world=3, optimizer="adam", epochs=3, resume_from="zero_adam"),
}


def comm_hook_options(hook: str | None) -> dict[str, Any]:
    """The strategy arguments of a torch DDP communication hook, named as Lightning's DDPStrategy names them."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if hook is None:
        return {}
    if hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=3)
        return {"ddp_comm_hook": powerSGD_hook.powerSGD_hook, "ddp_comm_state": state}
    hooks = {"allreduce": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook}
    return {"ddp_comm_hook": hooks[hook]}


def make_data(scenario: Scenario) -> TensorDataset:
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(scenario.samples, 8, generator=gen)
    y = torch.randint(0, 3, (scenario.samples,), generator=gen)
    return TensorDataset(x, y)


class ParityNet(L.LightningModule):
    def __init__(self, scenario: Scenario) -> None:
        super().__init__()
        self.scenario = scenario
        torch.manual_seed(0)
        body = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3))
        self.body = torch.compile(body, backend="aot_eager") if scenario.compiled else body
        if scenario.unused:
            self.never_used = nn.Linear(3, 3)
            self.rank0_only = nn.Linear(8, 3)
        self.automatic_optimization = not scenario.manual
        self.records: list[dict[str, Any]] = []

    def loss(self, x: Tensor, y: Tensor, shard: int) -> Tensor:
        if self.scenario.checkpointed:  # recomputed in backward: its parameters' gradients arrive there, nested
            out = checkpoint(self.body[1:], self.body[0](x), use_reentrant=True)
        else:
            out = self.body(x)
        if self.scenario.unused and shard == 0:
            out = out + self.rank0_only(x)
        return F.cross_entropy(out, y)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor | None:
        x, y = batch
        if self.automatic_optimization:
            loss = self.loss(x, y, self.global_rank)
            self.log("train_loss", loss)
            return loss
        if self.scenario.two_optimizers:  # one backward, then each optimizer steps its own parameters
            self.manual_backward(self.loss(x, y, self.global_rank))
            for opt in self.optimizers():
                opt.step()
                opt.zero_grad()
            return None
        # manual optimization: accumulate the first half locally (no_sync), synchronise on the second
        opt = self.optimizers()
        strategy = self.trainer.strategy
        half = len(x) // 2
        before = strategy.comm_stats.ring_operations
        with strategy.no_backward_sync():
            self.manual_backward(self.loss(x[:half], y[:half], self.global_rank) / 2)
        after_local = strategy.comm_stats.ring_operations
        self.manual_backward(self.loss(x[half:], y[half:], self.global_rank) / 2)
        self.records.append({"local_ops": after_local - before, "sync_ops": strategy.comm_stats.ring_operations})
        opt.step()
        opt.zero_grad()
        return None

    def on_after_backward(self) -> None:
        if self.scenario.hook_clip is not None:  # under DDP the hook gets (and changes) the averaged gradients
            torch.nn.utils.clip_grad_norm_(self.parameters(), self.scenario.hook_clip)

    def configure_optimizers(self) -> Any:
        optimizers = make_optimizers(self.scenario, self)
        return optimizers if len(optimizers) > 1 else optimizers[0]


def make_optimizers(scenario: Scenario, model: ParityNet) -> list[torch.optim.Optimizer]:
    if not scenario.two_optimizers:
        return [make_optimizer(scenario, model.parameters())]
    first = list(model.body[0].parameters())
    rest = [p for p in model.parameters() if all(p is not q for q in first)]
    return [torch.optim.Adam(first, lr=1e-2), torch.optim.SGD(rest, lr=0.1, momentum=0.9)]


def make_optimizer(scenario: Scenario, params: Any) -> torch.optim.Optimizer:
    if scenario.optimizer == "adam":
        return torch.optim.Adam(params, lr=1e-2)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-2)


class Recorder(L.Callback):
    """Records, per batch, the communication counters and which gradients exist before each optimizer step.

    Saves ``rank{r}.pt`` at the end of training on every rank (inside ``fit``: with the fork launcher the code after
    ``fit`` runs in the parent process only).
    """

    def __init__(self, outdir: Path) -> None:
        self.outdir = outdir

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        stats = getattr(trainer.strategy, "comm_stats", None)
        buckets = getattr(trainer.strategy, "buckets", None)
        decision = getattr(getattr(getattr(trainer.strategy, "grad_sync", None), "reducer", None), "decision", None)
        sharding = getattr(trainer.strategy, "sharding", None)
        state_numel = sum(
            v.numel()
            for state in trainer.optimizers[0].state.values()
            for v in state.values()
            if isinstance(v, Tensor) and v.dim() > 0
        )
        torch.save(
            {
                # a compiled body's names without torch.compile's wrapper, as the reference's
                "params": {n.replace("_orig_mod.", ""): p.detach().clone() for n, p in module.named_parameters()},
                "state_numel": state_numel,
                "sharded": sharding is not None and sharding.attached,
                "records": module.records,
                "totals": stats.as_dict() if stats is not None else None,
                "duplex_ranks": duplex_ranks(buckets),
                "bucket_timeout": getattr(buckets, "timeout", None),
                "auto": None if decision is None else (decision.chosen, decision.predicted_step_seconds),
            },
            self.outdir / f"rank{trainer.global_rank}.pt",
        )

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        stats = getattr(trainer.strategy, "comm_stats", None)
        if stats is not None:
            module.records.append({"ops": stats.ring_operations, "skipped": stats.skipped_backwards})

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        module.records.append({"grad_is_none": {n: p.grad is None for n, p in module.named_parameters()}})


class MinimalBucketed(BucketedDataParallel):
    """The smallest strategy a user can write on the package's base: it only says how a bucket is reduced."""

    def configure_reducer(self) -> Reducer:
        return NativeReducer()


def make_strategy(scenario: Scenario, strategy: str) -> Any:
    if strategy == "ring_allreduce":
        return lightning_dp_strategies.RingAllReduceStrategy(**scenario.extra, **comm_hook_options(scenario.hook))
    if strategy == "minimal":
        return MinimalBucketed()
    if strategy == "flat":
        return lightning_dp_strategies.RingAllReduceStrategy(two_level=False)
    if strategy == "two_level":
        return lightning_dp_strategies.RingAllReduceStrategy(two_level=True)
    if strategy == "auto":  # the lossless candidates only, so that parity holds whichever it picks
        return lightning_dp_strategies.RingAllReduceStrategy(reducer=AutoReducer(allow="lossless", warmup_steps=4))
    return strategy


def run(name: str, outdir: Path, strategy: str) -> None:
    scenario = SCENARIOS[name]
    model = ParityNet(scenario)
    trainer = L.Trainer(
        strategy=make_strategy(scenario, strategy),
        accelerator="cpu",
        devices=scenario.world // NUM_NODES,
        num_nodes=NUM_NODES,
        max_epochs=scenario.epochs,
        accumulate_grad_batches=scenario.accumulate,
        gradient_clip_val=scenario.clip,
        precision=scenario.precision,  # type: ignore[arg-type]
        logger=CSVLogger(outdir, name="logs", version=0),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Recorder(outdir)],
    )
    loader = DataLoader(make_data(scenario), batch_size=scenario.per_rank_batch, shuffle=False)
    resume = None
    if scenario.resume_from is not None:
        resume = outdir.parent / f"{scenario.resume_from}-ring_allreduce" / "last.ckpt"
    trainer.fit(model, loader, ckpt_path=resume)
    if scenario.save:
        trainer.save_checkpoint(outdir / "last.ckpt")


def rank_shards(scenario: Scenario, epoch: int) -> list[list[list[int]]]:
    """Per step of ``epoch``, per rank, the sample indices that rank trains on.

    Lightning always gives a distributed training loader ``DistributedSampler(shuffle=True, seed=0)`` and calls
    ``set_epoch`` every epoch; replaying that sampler is what makes the reference see the same global batches.
    """
    per_rank = []
    for rank in range(scenario.world):
        sampler = DistributedSampler(range(scenario.samples), scenario.world, rank, shuffle=True, seed=0)
        sampler.set_epoch(epoch)
        per_rank.append(list(sampler))
    steps = -(-len(per_rank[0]) // scenario.per_rank_batch)
    b = scenario.per_rank_batch
    return [[per_rank[r][k * b : (k + 1) * b] for r in range(scenario.world)] for k in range(steps)]


def reference_parameters(name: str, per_shard: bool = False) -> dict[str, Tensor]:
    """Single-process training over the same global batches.

    With ``per_shard=False`` the loss is the mean over the whole global batch (one forward pass). With
    ``per_shard=True`` it is the mean of the per-rank losses, each computed on that rank's shard: the definition
    when the forward pass depends on the shard (a parameter only rank 0 uses) or when bf16 rounding depends on the
    batch shape.
    """
    scenario = SCENARIOS[name]
    model = ParityNet(replace(scenario, compiled=False, checkpointed=False))  # the specification: plain eager
    x, y = make_data(scenario).tensors
    optimizers = make_optimizers(scenario, model)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=scenario.precision == "bf16-mixed")
    for epoch in range(scenario.epochs):
        batches = rank_shards(scenario, epoch)
        for k, shards in enumerate(batches):
            if per_shard:
                # one autocast region and one backward per shard, as on the ranks (autocast caches the bf16 copy
                # of each weight within a region, which would sum the shards' weight gradients in bf16)
                for r, s in enumerate(shards):
                    with autocast:
                        loss = model.loss(x[s], y[s], r)
                    (loss / len(shards) / scenario.accumulate).backward()
            else:
                idx = [i for s in shards for i in s]
                (model.loss(x[idx], y[idx], shard=-1) / scenario.accumulate).backward()
            last = k == len(batches) - 1
            if (k + 1) % scenario.accumulate == 0 or last:
                clip = scenario.clip if scenario.clip is not None else scenario.hook_clip
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                for opt in optimizers:
                    opt.step()
                    opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def run_all(names: str, outdir: Path, default_strategy: str) -> None:
    """Run ``NAME[@STRATEGY],...`` one after the other in this process group (a launch costs seconds, a fit does
    not), each into ``OUTDIR/{name}-{strategy}``. All of them must have the same world size."""
    runs = [(name, strategy or default_strategy) for name, _, strategy in (s.partition("@") for s in names.split(","))]
    assert len({SCENARIOS[name].world for name, _ in runs}) == 1, f"{names}: one world size per launch"
    for name, strategy in runs:
        out = outdir / f"{name}-{strategy}"
        out.mkdir(parents=True, exist_ok=True)
        run(name, out, strategy)


if __name__ == "__main__":
    run_all(sys.argv[1], Path(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "ring_allreduce")
