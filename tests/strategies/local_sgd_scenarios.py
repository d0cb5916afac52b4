"""Trainer runs for the local_sgd tests, and the hand-written loops they are checked against.

Run as ``python -m tests.strategies.local_sgd_scenarios NAME[,NAME...] OUTDIR`` on 2 ranks (started as torchrun
starts them); the scenarios run one after the other in the same process group. Every rank writes
``OUTDIR/{name}/rank{r}.pt`` with its final parameters and buffers (after ``fit`` returns) and what it recorded.
:func:`reference_diloco` replays DiLoCo on the same shards in one process, two models side by side.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_dp_strategies import LocalSGDStrategy, RingAllReduceStrategy, bf16_compress
from lightning_dp_strategies.comm.quantized import dequantize, quantize
from lightning_dp_strategies.comm.shards import chunk_range
from lightning_dp_strategies.local_sgd import diloco_outer_optimizer, split_fragments

WORLD = 2
SAMPLES = 44  # 22 per rank: batches of 4,4,4,4,4,2 (an uneven final batch), 6 steps per epoch
PER_RANK_BATCH = 4
EPOCHS = 2


STREAM: dict[str, Any] = {"fragments": 2, "delay": 1, "mixing": 0.5}
STREAM_INT4: dict[str, Any] = {**STREAM, "outer_precision": "int4"}


@dataclass(frozen=True)
class Scenario:
    strategy: str = "local_sgd"  # or "ring_allreduce"
    sync_every: int = 4
    diloco: bool = False
    warmup: int = 0
    optimizer: str = "sgd"  # SGD with momentum and weight decay, or Adam
    accumulate: int = 1
    clip: float | None = None
    manual: bool = False
    batchnorm: bool = False
    validate: bool = False
    checkpoint: bool = False  # ModelCheckpoint at every epoch's end
    resume_from: str | None = None  # the scenario whose epoch-0 checkpoint this one resumes
    reducer: str | None = None
    post_local: tuple[int, bool] | None = None  # ring_allreduce with torch's post-local SGD: (period, local allreduce)
    extra: dict[str, Any] = field(default_factory=dict)


SCENARIOS = {
    # H = 1, plain averaging, SGD: ring_allreduce's training
    "h1": Scenario(sync_every=1),
    "h1@ring": Scenario(strategy="ring_allreduce"),
    # DiLoCo with Adam inside, H = 5: syncs after steps 5 and 10, and the partial period at the end of fit (12)
    "diloco": Scenario(sync_every=5, diloco=True, optimizer="adam"),
    # a checkpoint at the end of epoch 0 (step 6, two steps into the second period), then resumed from it
    "full": Scenario(diloco=True, optimizer="adam", checkpoint=True),
    "resumed": Scenario(diloco=True, optimizer="adam", resume_from="full"),
    "resumed@ring": Scenario(strategy="ring_allreduce", optimizer="adam", resume_from="full"),
    # features: warm-up, accumulation, clipping, BatchNorm, validation, manual optimization
    "warmup": Scenario(warmup=3, clip=0.05, batchnorm=True, validate=True),
    "accumulate": Scenario(sync_every=2, accumulate=2),
    "manual": Scenario(sync_every=3, manual=True),
    # the change averaged through bf16_compress("ring"): half the bytes of the plain ring's
    "plain4": Scenario(),
    "bf16": Scenario(reducer="bf16"),
    # torch's post-local SGD on RingAllReduceStrategy: 3 warm-up steps, then averages every `period` steps
    "postlocal1": Scenario(strategy="ring_allreduce", post_local=(1, False)),
    "postlocal4": Scenario(strategy="ring_allreduce", post_local=(4, True)),
    "postlocal4_local": Scenario(strategy="ring_allreduce", post_local=(4, False)),
    "several_optimizers": Scenario(manual=True, extra={"several_optimizers": True}),
    "unfrozen_later": Scenario(extra={"unfreeze_at_epoch": 1}),  # body[0] frozen in the optimizer, then unfrozen
    # streaming DiLoCo, H = 4, two fragments (turns at steps 2 and 4 of the period), the change applied a step later
    "stream_fp32": Scenario(diloco=True, optimizer="adam", extra={"streaming": STREAM}),
    "stream_int8": Scenario(diloco=True, optimizer="adam", extra={"streaming": {**STREAM, "outer_precision": "int8"}}),
    "stream_int4": Scenario(diloco=True, optimizer="adam", extra={"streaming": {**STREAM, "outer_precision": "int4"}}),
    # fragment 0 leaves at step 6 and is applied at step 7: a checkpoint after step 6 holds it in flight
    "stream_full": Scenario(diloco=True, optimizer="adam", checkpoint=True, extra={"streaming": STREAM_INT4}),
    "stream_resumed": Scenario(
        diloco=True, optimizer="adam", resume_from="stream_full", extra={"streaming": STREAM_INT4}
    ),
    "stream_validate": Scenario(diloco=True, optimizer="adam", validate=True, extra={"streaming": STREAM}),
    # the period chosen from a trial period's timings
    "stream_auto": Scenario(diloco=True, optimizer="adam", sync_every="auto", extra={"streaming": STREAM}),  # type: ignore[arg-type]
    # the streaming options at their DiLoCo values: the "diloco" scenario's training
    "stream_as_diloco": Scenario(
        sync_every=5,
        diloco=True,
        optimizer="adam",
        extra={"streaming": {"fragments": 1, "delay": 0, "mixing": 0.0, "outer_precision": "fp32"}},
    ),
}


def make_data() -> TensorDataset:
    gen = torch.Generator().manual_seed(1234)
    return TensorDataset(torch.randn(SAMPLES, 8, generator=gen), torch.randint(0, 3, (SAMPLES,), generator=gen))


def make_body(batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(0)
    norm: list[nn.Module] = [nn.BatchNorm1d(32)] if batchnorm else []
    return nn.Sequential(nn.Linear(8, 32), *norm, nn.Tanh(), nn.Linear(32, 3))


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-2)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-2)


class Net(L.LightningModule):
    def __init__(self, scenario: Scenario) -> None:
        super().__init__()
        self.scenario = scenario
        self.body = make_body(scenario.batchnorm)
        self.automatic_optimization = not scenario.manual
        self.records: list[dict[str, Any]] = []
        if "unfreeze_at_epoch" in scenario.extra:
            self.body[0].requires_grad_(False)

    def on_train_epoch_start(self) -> None:
        if self.current_epoch == self.scenario.extra.get("unfreeze_at_epoch"):
            self.body[0].requires_grad_(True)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor | None:
        x, y = batch
        loss = F.cross_entropy(self.body(x), y)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        self.manual_backward(loss)
        opt.step()
        opt.zero_grad()
        return None

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        if batch_idx == 0:  # the model validation sees: the same on every rank
            flat = torch.cat([p.detach().reshape(-1) for p in self.parameters()])
            self.records.append({"val_params": flat.clone(), "step": self.trainer.global_step})

    def on_train_end(self) -> None:  # the post-local SGD averager, before teardown closes it
        averager = self.trainer.strategy.engine.model_averager
        if averager is not None:
            self.records.append(averager.averager.reductions)

    def configure_optimizers(self) -> Any:
        opt = make_optimizer(self.scenario.optimizer, self.parameters())
        if self.scenario.extra.get("several_optimizers"):
            return [opt, make_optimizer("sgd", self.parameters())]
        return opt


def make_strategy(scenario: Scenario) -> Any:
    if scenario.post_local is not None:
        period, local_allreduce = scenario.post_local
        state = PostLocalSGDState(None, None, start_localSGD_iter=3, post_local_gradient_allreduce=local_allreduce)
        return RingAllReduceStrategy(
            ddp_comm_hook=post_localSGD_hook, ddp_comm_state=state, model_averaging_period=period
        )
    if scenario.strategy == "ring_allreduce":
        return RingAllReduceStrategy()
    outer = diloco_outer_optimizer() if scenario.diloco else None
    reducer = bf16_compress("ring") if scenario.reducer == "bf16" else scenario.reducer
    return LocalSGDStrategy(
        sync_every=scenario.sync_every,
        outer_optimizer=outer,
        warmup_steps=scenario.warmup,
        reducer=reducer,
        **scenario.extra.get("streaming", {}),
    )


class HeldSends(L.Callback):
    """Streaming: how many fragments' reductions wait unstarted at each batch's end, and at the next backward."""

    def __init__(self) -> None:
        self.at_batch_end: list[int] = []
        self.at_backward: list[int] = []

    @staticmethod
    def held(trainer: L.Trainer) -> int:
        local = getattr(trainer.strategy, "local_sgd", None)
        return 0 if local is None else sum(pending.work is not None for pending in local.in_flight)

    def on_train_batch_end(self, trainer: L.Trainer, *_: Any) -> None:
        self.at_batch_end.append(self.held(trainer))

    def on_before_backward(self, trainer: L.Trainer, *_: Any) -> None:
        self.at_backward.append(self.held(trainer))


def run(name: str, outdir: Path) -> None:
    scenario = SCENARIOS[name]
    out = outdir / name
    out.mkdir(parents=True, exist_ok=True)
    model = Net(scenario)
    held = HeldSends()
    callbacks: list[L.Callback] = [held]
    if scenario.checkpoint:
        callbacks.append(ModelCheckpoint(dirpath=out, filename="{epoch}", save_top_k=-1, save_on_train_epoch_end=True))
    trainer = L.Trainer(
        strategy=make_strategy(scenario),
        accelerator="cpu",
        devices=WORLD,
        max_epochs=EPOCHS,
        accumulate_grad_batches=scenario.accumulate,
        gradient_clip_val=scenario.clip,
        logger=False,
        enable_checkpointing=scenario.checkpoint,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    loader = DataLoader(make_data(), batch_size=PER_RANK_BATCH, shuffle=False)
    val = DataLoader(make_data(), batch_size=PER_RANK_BATCH) if scenario.validate else None
    ckpt = outdir / scenario.resume_from / "epoch=0.ckpt" if scenario.resume_from else None
    trainer.fit(model, loader, val, ckpt_path=ckpt)
    strategy = trainer.strategy
    averages = model.records.pop() if scenario.post_local is not None else None
    local = getattr(strategy, "local_sgd", None)
    torch.save(
        {
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "records": model.records,
            "syncs": local.syncs if local is not None else None,
            "steps": local.steps if local is not None else None,
            "chosen": (local.sync_every, local.delay) if local is not None else None,
            "ring_operations": strategy.grad_sync.totals.ring_operations,  # the gradients' reductions
            "comm": strategy.comm_stats.as_dict(),
            "averaged_bytes": local.averager.counter.bytes_sent if local is not None else None,
            "parameter_averages": averages,
            "held": (held.at_batch_end, held.at_backward),
        },
        out / f"rank{trainer.global_rank}.pt",
    )
    if ckpt is not None:  # the checkpoint evaluated under the same strategy: validation_step records the parameters
        trainer.validate(model, DataLoader(make_data(), batch_size=PER_RANK_BATCH), ckpt_path=ckpt, verbose=False)
        torch.save(model.records.pop()["val_params"], out / f"evaluated-rank{trainer.global_rank}.pt")


def rank_shards(epoch: int) -> list[list[list[int]]]:
    """Per step of ``epoch``, per rank, the sample indices it trains on (Lightning's ``DistributedSampler``)."""
    per_rank = []
    for rank in range(WORLD):
        sampler = DistributedSampler(range(SAMPLES), WORLD, rank, shuffle=True, seed=0)
        sampler.set_epoch(epoch)
        per_rank.append(list(sampler))
    steps = -(-len(per_rank[0]) // PER_RANK_BATCH)
    b = PER_RANK_BATCH
    return [[per_rank[r][k * b : (k + 1) * b] for r in range(WORLD)] for k in range(steps)]


def local_steps(replicas: list[nn.Module], inner: list[torch.optim.Optimizer]) -> Iterator[int]:
    """Every replica's optimizer step on its rank's shard, step after step of :data:`EPOCHS` epochs; yields the
    number of steps taken."""
    x, y = make_data().tensors
    step = 0
    for epoch in range(EPOCHS):
        for shards in rank_shards(epoch):
            for model, opt, shard in zip(replicas, inner, shards, strict=True):
                F.cross_entropy(model(x[shard]), y[shard]).backward()
                opt.step()
                opt.zero_grad()
            step += 1
            yield step


def reference_diloco(sync_every: int, optimizer: str = "adam") -> dict[str, Tensor]:
    """DiLoCo written out: two replicas with their own inner optimizers on their own shards; every ``sync_every``
    steps (and at the end) the anchor takes one Nesterov SGD step (lr 0.7, momentum 0.9) along the mean of
    ``anchor - replica``, and both replicas restart from it."""
    replicas = [make_body() for _ in range(WORLD)]
    inner = [make_optimizer(optimizer, m.parameters()) for m in replicas]
    anchor = [p.detach().clone().requires_grad_(True) for p in replicas[0].parameters()]
    outer = torch.optim.SGD(anchor, lr=0.7, momentum=0.9, nesterov=True)

    def sync() -> None:
        with torch.no_grad():
            for i, a in enumerate(anchor):
                a.grad = sum(a - list(m.parameters())[i] for m in replicas) / WORLD
            outer.step()
            for m in replicas:
                for p, a in zip(m.parameters(), anchor, strict=True):
                    p.copy_(a)

    steps = 0
    for steps in local_steps(replicas, inner):
        if steps % sync_every == 0:
            sync()
    if steps % sync_every:
        sync()
    return {n: p.detach().clone() for n, p in replicas[0].named_parameters()}


def _average(per_rank: list[list[Tensor]], bits: int | None) -> list[Tensor]:
    """The ranks' tensors averaged as the strategy's reduction averages them: in fp32, or with the other rank's
    part of each chunk of the flat vector quantized to ``bits``, summed in fp32 with the owner's own part and
    quantized again (2 ranks)."""
    flats = [torch.cat([t.reshape(-1) for t in tensors]) for tensors in per_rank]
    if bits is None:
        mean = sum(flats) / WORLD
    else:
        chunks = []
        for j in range(WORLD):
            a, b = chunk_range(flats[0].numel(), WORLD, j)
            parts = [f[a:b] if i == j else dequantize(quantize(f[a:b], bits)) for i, f in enumerate(flats)]
            total = (parts[j] + parts[1 - j]) / WORLD
            chunks.append(dequantize(quantize(total, bits)))
        mean = torch.cat(chunks)
    out, start = [], 0
    for t in per_rank[0]:
        out.append(mean[start : start + t.numel()].view_as(t))
        start += t.numel()
    return out


def reference_streaming(sync_every: int, stream: dict[str, Any], optimizer: str = "adam") -> dict[str, Tensor]:
    """Streaming DiLoCo written out: two replicas on their own shards; fragment ``p`` leaves at the steps ``s`` with
    ``s % H == (p + 1) * H // K % H``; ``delay`` steps later the averaged change takes one Nesterov SGD step on the
    fragment's anchor, and each replica's fragment becomes ``mixing * own + (1 - mixing) * anchor``. At the end, what
    is in flight is applied and the whole model is synchronised once (replaced by the anchor)."""
    fragments, delay, mixing = stream["fragments"], stream["delay"], stream["mixing"]
    bits = {"int8": 8, "int4": 4}.get(stream.get("outer_precision", "fp32"))
    replicas = [make_body() for _ in range(WORLD)]
    inner = [make_optimizer(optimizer, m.parameters()) for m in replicas]
    anchor = [p.detach().clone().requires_grad_(True) for p in replicas[0].parameters()]
    outer = torch.optim.SGD(anchor, lr=0.7, momentum=0.9, nesterov=True)
    runs = split_fragments(anchor, fragments)
    leaves = [(p + 1) * sync_every // fragments % sync_every for p in range(fragments)]

    def changes(indices: list[int]) -> list[list[Tensor]]:
        return [[anchor[i].detach() - list(m.parameters())[i].detach() for i in indices] for m in replicas]

    def apply(indices: list[int], averaged: list[Tensor], merge: bool) -> None:
        with torch.no_grad():
            for i, change in zip(indices, averaged, strict=True):
                anchor[i].grad = change
            outer.step()
            outer.zero_grad(set_to_none=True)
            for m in replicas:
                params = list(m.parameters())
                for i in indices:
                    params[i].copy_(torch.lerp(anchor[i], params[i], mixing) if merge else anchor[i])

    in_flight: list[tuple[int, list[int], list[Tensor]]] = []
    for step in local_steps(replicas, inner):
        while in_flight and in_flight[0][0] <= step:
            _, indices, averaged = in_flight.pop(0)
            apply(indices, averaged, merge=True)
        for p, leave in enumerate(leaves):
            if step % sync_every == leave:
                in_flight.append((step + delay, runs[p], _average(changes(runs[p]), bits)))
    for _, indices, averaged in in_flight:
        apply(indices, averaged, merge=True)
    everything = list(range(len(anchor)))
    apply(everything, _average(changes(everything), bits), merge=False)
    return {n: p.detach().clone() for n, p in replicas[0].named_parameters()}


if __name__ == "__main__":
    for scenario_name in sys.argv[1].split(","):
        run(scenario_name, Path(sys.argv[2]))
