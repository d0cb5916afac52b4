"""A ``ring_allreduce`` (``hybrid_pipeline``, ``local_sgd``) run in which one rank is SIGKILLed, or goes silent, at
the start of a training step.

Run as ``python -m tests.reliability.dead_rank_scenario STRATEGY VICTIM_RANK OUTDIR TIMEOUT_S [kill|hang]``;
Lightning's popen launcher re-runs the command for the other ranks. Every rank writes ``pid-rank{r}`` at the start of
training; ``ModelCheckpoint(save_last=True)`` writes ``last.ckpt`` after every step; at step ``KILL_STEP`` the victim
kills itself with SIGKILL (no cleanup, no goodbye: what an out-of-memory kill or a lost node looks like to the
others), or with ``hang`` sleeps for good, alive and silent (a stuck data loader, a paused node).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dp_strategies

KILL_STEP = 4


class Net(L.LightningModule):
    pipeline_body = "body"  # the opt-in of hybrid_pipeline; other strategies ignore it

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(output, target)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return self.pipeline_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Killer(L.Callback):
    def __init__(self, victim: int, outdir: Path, kind: str = "kill") -> None:
        self.victim, self.outdir, self.kind = victim, outdir, kind

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        (self.outdir / f"pid-rank{trainer.global_rank}").write_text(str(os.getpid()))

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if trainer.global_rank == self.victim and trainer.global_step == KILL_STEP:
            if self.kind == "hang":
                time.sleep(3600)
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    strategy_name, victim, outdir, timeout = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), float(sys.argv[4])
    kind = sys.argv[5] if len(sys.argv) > 5 else "kill"
    L.seed_everything(0)
    data = TensorDataset(torch.randn(256, 8), torch.randint(0, 2, (256,)))
    if strategy_name == "hybrid_pipeline":
        strategy: Any = lightning_dp_strategies.HybridPipelineStrategy(
            pipeline_stages=2, micro_batches=2, timeout=timeout
        )
    elif strategy_name == "local_sgd":  # averages over the gradient group after the step that KILL_STEP starts
        strategy = lightning_dp_strategies.LocalSGDStrategy(sync_every=KILL_STEP + 1, timeout=timeout)
    else:
        strategy = lightning_dp_strategies.RingAllReduceStrategy(timeout=timeout)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=KILL_STEP * 10,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            Killer(victim, outdir, kind),
            ModelCheckpoint(dirpath=outdir, save_last=True, every_n_train_steps=1),
        ],
    )
    trainer.fit(Net(), DataLoader(data, batch_size=8))


if __name__ == "__main__":
    main()
