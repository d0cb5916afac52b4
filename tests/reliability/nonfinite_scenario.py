"""A run whose loss turns NaN on one rank at step ``BAD_STEP``, under ``nonfinite_grads="skip"`` or ``"raise"``.

Run as ``python -m tests.reliability.nonfinite_scenario STRATEGY MODE OUTDIR``. With ``skip`` every rank saves
``result-rank{r}.pt`` at the end of training: its parameters and optimizer state just before and just after the bad
step, its final parameters, and the strategy's ``nonfinite.skipped_steps``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dp_strategies

BAD_STEP = 3
STEPS = 6


class Net(L.LightningModule):
    pipeline_body = "body"

    def __init__(self, bad_rank: int) -> None:
        super().__init__()
        self.bad_rank = bad_rank
        self.body = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3))

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        loss = F.cross_entropy(output, target)
        if self.trainer.global_step == BAD_STEP and self.global_rank == self.bad_rank:
            loss = loss * float("nan")
        return loss

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return self.pipeline_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _snapshot(module: L.LightningModule) -> dict[str, Any]:
    optimizer = module.trainer.optimizers[0]
    return {
        # hybrid_pipeline: the other stages' blocks are on the meta device on this rank (nothing to compare)
        "params": {n: p.detach().clone() for n, p in module.named_parameters() if not p.is_meta},
        "momentum": [optimizer.state[p].get("momentum_buffer") for p in module.parameters() if p in optimizer.state],
    }


class Recorder(L.Callback):
    def __init__(self, outdir: Path) -> None:
        self.outdir = outdir
        self.result: dict[str, Any] = {}

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == BAD_STEP:
            self.result["before"] = _snapshot(module)

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == BAD_STEP + 1:
            self.result["after"] = _snapshot(module)

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.result["final"] = _snapshot(module)["params"]
        self.result["skipped_steps"] = trainer.strategy.nonfinite.skipped_steps  # type: ignore[attr-defined]
        torch.save(self.result, self.outdir / f"result-rank{trainer.global_rank}.pt")


def main() -> None:
    strategy_name, mode, outdir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    L.seed_everything(0)
    if strategy_name == "dp":
        strategy: Any = lightning_dp_strategies.ScatterGatherStrategy(nonfinite_grads=mode)
        devices, bad_rank = 2, 0
    elif strategy_name == "hybrid_pipeline":
        strategy = lightning_dp_strategies.HybridPipelineStrategy(
            pipeline_stages=2, micro_batches=2, nonfinite_grads=mode, timeout=60
        )
        devices, bad_rank = 2, 1  # the last stage computes the loss
    else:
        strategy = lightning_dp_strategies.RingAllReduceStrategy(nonfinite_grads=mode, timeout=60)
        devices, bad_rank = 2, 1
    data = TensorDataset(torch.randn(96, 6), torch.randint(0, 3, (96,)))
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Recorder(outdir)],
    )
    trainer.fit(Net(bad_rank), DataLoader(data, batch_size=8))


if __name__ == "__main__":
    main()
