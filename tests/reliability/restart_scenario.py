"""A training script run under ``torchrun --max-restarts 1`` in which one worker SIGKILLs itself once.

Run as ``torchrun ... -m tests.reliability.restart_scenario STRATEGY OUTDIR KILL [VICTIM]`` with ``STRATEGY`` one of
``ring_allreduce``, ``hybrid_pipeline``, ``local_sgd``, ``fabric_ring_allreduce`` or ``ddp`` (Lightning's own) and
``KILL`` one of:

- ``none``: the uninterrupted run;
- ``mid_epoch``: global rank ``VICTIM`` (default 1) SIGKILLs itself at the start of the 4th batch of epoch 1;
- ``during_save``: pipeline stage 1 SIGKILLs itself halfway through streaming its tensors to rank 0 for the
  checkpoint at the end of epoch 1 (``hybrid_pipeline`` only).

The victim kills itself once per ``OUTDIR`` (a ``killed`` file marks it), so the restarted workers train to the end.
The script is the recipe of the fault-tolerance page: ``ModelCheckpoint(save_last=True)`` at every epoch's end and
``trainer.fit(..., ckpt_path="last")`` (Fabric: ``latest_checkpoint``), which starts from scratch when there is no
checkpoint yet. At the end every rank takes part in writing ``final.ckpt``, the whole model's parameters.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_dp_strategies
from lightning_dp_strategies.core.checkpoint_files import latest_checkpoint

SAMPLES, BATCH, EPOCHS, LR = 64, 8, 3, 0.1
"""64 samples, a global batch of 8 (8 steps an epoch), 3 epochs of SGD."""
KILL_EPOCH, KILL_BATCH = 1, 3
TIMEOUT_S = float(os.environ.get("SCENARIO_TIMEOUT_S", "60"))
"""The strategies' collective timeout."""
STEP_S = float(os.environ.get("SCENARIO_STEP_S", "0"))
"""Seconds each step sleeps after its optimizer step, to stretch a run (the link-outage runs)."""


def make_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(SAMPLES, 8, generator=generator), torch.randint(0, 2, (SAMPLES,), generator=generator)
    )


def make_body() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))


def reference_state() -> dict[str, Tensor]:
    """The parameters of the uninterrupted run, trained on one device (``body.<i>.<name>``)."""
    body = make_body()
    optimizer = torch.optim.SGD(body.parameters(), lr=LR)
    data = make_data()
    for epoch in range(EPOCHS):  # the order of a shuffled DistributedSampler (seed 0): a global batch is 8 in a row
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(epoch))
        for start in range(0, SAMPLES, BATCH):
            x, y = data[order[start : start + BATCH]]
            optimizer.zero_grad()
            F.cross_entropy(body(x), y).backward()
            optimizer.step()
    return {f"body.{k}": v for k, v in body.state_dict().items()}


def kill_once(outdir: Path) -> None:
    """SIGKILL this process, unless a worker of this run already did so."""
    marker = outdir / "killed"
    if marker.exists():
        return
    marker.write_text(str(os.getpid()))
    print(f"rank {os.environ.get('RANK')} kills itself (restart {os.environ.get('TORCHELASTIC_RESTART_COUNT')})")
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def kill_during_stream(outdir: Path) -> None:
    """Make this stage SIGKILL itself after the first tensor it streams for the first save at the end of
    ``KILL_EPOCH``, so ``last.ckpt`` is still the previous epoch's."""
    from lightning_dp_strategies.pipeline.streamed import Outbox

    original = Outbox.send
    saves = [0]

    def send(self: Outbox, deliver: Any) -> None:
        saves[0] += 1
        if saves[0] != 2 * KILL_EPOCH + 1:  # two saves an epoch: epoch=<e>-step=<s>.ckpt, then last.ckpt
            original(self, deliver)
            return
        sent = [0]

        def deliver_then_die(tensor: Tensor) -> None:
            deliver(tensor)
            sent[0] += 1
            if sent[0] == 1:
                kill_once(outdir)

        original(self, deliver_then_die)

    setattr(Outbox, "send", send)  # noqa: B010  # a patch for this process only


class Net(L.LightningModule):
    pipeline_body = "body"  # the opt-in of hybrid_pipeline; other strategies ignore it

    def __init__(self) -> None:
        super().__init__()
        self.body = make_body()

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(output, target)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return self.pipeline_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


class KillMidEpoch(L.Callback):
    def __init__(self, victim: int, outdir: Path) -> None:
        self.victim, self.outdir = victim, outdir

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank == self.victim and (trainer.current_epoch, batch_idx) == (KILL_EPOCH, KILL_BATCH):
            kill_once(self.outdir)


class SlowSteps(L.Callback):
    def on_train_batch_end(self, *args: Any) -> None:
        time.sleep(STEP_S)


def layout() -> tuple[int, int, int]:
    """``(devices a node, nodes, world size)`` as torchrun set them."""
    devices, world = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["WORLD_SIZE"])
    return devices, world // devices, world


def train_with_trainer(name: str, outdir: Path, kill: str, victim: int) -> None:
    devices, nodes, world = layout()
    strategy: Any
    if name == "hybrid_pipeline":
        strategy = lightning_dp_strategies.HybridPipelineStrategy(pipeline_stages=2, micro_batches=2, timeout=TIMEOUT_S)
        replicas = world // 2
    elif name == "ring_allreduce":
        strategy, replicas = lightning_dp_strategies.RingAllReduceStrategy(timeout=TIMEOUT_S), world
    elif name == "local_sgd":
        from lightning_dp_strategies.strategies.local_sgd import LocalSGDStrategy

        strategy, replicas = LocalSGDStrategy(sync_every=3, timeout=TIMEOUT_S), world
    else:
        strategy, replicas = DDPStrategy(timeout=timedelta(seconds=TIMEOUT_S)), world
    if kill == "during_save" and os.environ["RANK"] == "1":
        kill_during_stream(outdir)
    callbacks: list[L.Callback] = [ModelCheckpoint(dirpath=outdir, save_last=True)]
    if kill == "mid_epoch":
        callbacks.append(KillMidEpoch(victim, outdir))
    if STEP_S:
        callbacks.append(SlowSteps())
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        num_nodes=nodes,
        max_epochs=EPOCHS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    loader = DataLoader(make_data(), batch_size=BATCH // replicas)
    trainer.fit(Net(), loader, ckpt_path="last")  # the newest last.ckpt, or a fresh start when there is none
    trainer.save_checkpoint(outdir / "final.ckpt")  # every rank: the hybrid streams its stages to rank 0


def train_with_fabric(outdir: Path, kill: str, victim: int) -> None:
    devices, nodes, world = layout()
    strategy = lightning_dp_strategies.FabricRingAllReduceStrategy(timeout=TIMEOUT_S)
    fabric = Fabric(accelerator="cpu", devices=devices, num_nodes=nodes, strategy=strategy)
    fabric.launch()
    module = make_body()
    body, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=LR))
    # the Trainer's order: shuffled with seed 0, the epoch set before each epoch (also the first one resumed)
    sampler: DistributedSampler[Any] = DistributedSampler(
        make_data(), num_replicas=world, rank=fabric.global_rank, shuffle=True, seed=0
    )
    loader = DataLoader(make_data(), batch_size=BATCH // world, sampler=sampler)
    state: dict[str, Any] = {"model": body, "optimizer": optimizer, "epoch": 0}
    last = latest_checkpoint(outdir, "last*.ckpt")  # None before the first save: a fresh start
    if last is not None:
        fabric.load(last, state)
        fabric.print(f"resumed from {last.name} at epoch {state['epoch']}")
    for epoch in range(state["epoch"], EPOCHS):
        sampler.set_epoch(epoch)
        for batch_idx, (x, y) in enumerate(loader):
            if kill == "mid_epoch" and fabric.global_rank == victim and (epoch, batch_idx) == (KILL_EPOCH, KILL_BATCH):
                kill_once(outdir)
            optimizer.zero_grad()
            fabric.backward(F.cross_entropy(body(x), y))
            optimizer.step()
            time.sleep(STEP_S)
        state["epoch"] = epoch + 1
        fabric.save(outdir / "last.ckpt", state)
    fabric.save(outdir / "final.ckpt", {"state_dict": {f"body.{k}": v for k, v in body.state_dict().items()}})


def main() -> None:
    name, outdir, kill = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    victim = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    torch.set_num_threads(1)
    if name == "fabric_ring_allreduce":
        train_with_fabric(outdir, kill, victim)
    else:
        train_with_trainer(name, outdir, kill, victim)
    print(f"rank {os.environ.get('RANK')} finished (restart {os.environ.get('TORCHELASTIC_RESTART_COUNT')})")


if __name__ == "__main__":
    main()
