"""Two ranks that disagree: rank 1 builds a wider layer (``model``) or uses another bucket cap (``option``).

Run as ``python -m tests.reliability.mismatch_scenario STRATEGY WHAT OUTDIR``. A rank that ever reaches a training
step writes ``stepped-rank{r}``: the tests require that none does.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dp_strategies


class Net(L.LightningModule):
    pipeline_body = "body"

    def __init__(self, hidden: int, outdir: Path) -> None:
        super().__init__()
        self.outdir = outdir
        self.body = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 2))

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(output, target)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        (self.outdir / f"stepped-rank{self.global_rank}").write_text("")
        x, y = batch
        return self.pipeline_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    strategy_name, what, outdir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    rank = int(os.environ.get("LOCAL_RANK", "0"))  # set by the launcher for the ranks it starts
    hidden = 9 if what == "model" and rank == 1 else 8
    cap = 5.0 if what == "option" and rank == 1 else 25.0
    options: dict[str, Any] = {"bucket_cap_mb": cap, "timeout": 60}
    if strategy_name == "hybrid_pipeline":
        strategy: Any = lightning_dp_strategies.HybridPipelineStrategy(pipeline_stages=2, micro_batches=2, **options)
    else:
        strategy = lightning_dp_strategies.RingAllReduceStrategy(**options)
    data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Net(hidden, outdir), DataLoader(data, batch_size=8))


if __name__ == "__main__":
    main()
