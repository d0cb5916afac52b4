"""Trainer runs for the check that data-parallel ranks read different batches (``test_distinct_batches.py``).

Run as ``python -m tests.strategies.same_batch_scenarios OUTDIR CASE[,CASE...]`` on the ranks a case names (started
as torchrun starts them). Each case fits a small regression for 3 steps; every rank writes ``OUTDIR/rank{r}.json``,
mapping each case to the messages of the warnings (``PossibleUserWarning``) it raised and to its first targets.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.warnings import PossibleUserWarning
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lightning_dp_strategies import HybridPipelineStrategy  # registers the strategy names too

SAMPLES, BATCH = 24, 4


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)  # alike on every rank
    return TensorDataset(torch.randn(SAMPLES, 6, generator=generator), torch.randn(SAMPLES, 1, generator=generator))


class Unsplit(IterableDataset):
    """An iterable dataset that does not split itself by rank: every rank reads it whole."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        data = dataset()
        return iter([data[i] for i in range(SAMPLES)])


class Regression(L.LightningModule):
    pipeline_body = "net"  # for hybrid_pipeline

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
        self.first: list[float] | None = None

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.first is None:
            self.first = y.flatten().tolist()
        return self.pipeline_loss(self.net(x), y)

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # for hybrid_pipeline
        return nn.functional.mse_loss(output, target)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


CASES: dict[str, tuple[Any, str]] = {
    # name: (strategy, data); on 2 ranks
    "ring_whole_loader": ("ring_allreduce", "whole"),  # use_distributed_sampler=False, no sampler of one's own
    "ring_lightning_sampler": ("ring_allreduce", "sampler"),  # Lightning's DistributedSampler
    "streaming_unsplit_iterable": ("streaming_diloco", "iterable"),
    "sharded_whole_loader": ("ring_allreduce_sharded", "whole"),
    # on 4 ranks: 2 stages x 2 replicas, each replica of a stage reading the loader whole
    "hybrid_whole_loader": (lambda: HybridPipelineStrategy(pipeline_stages=2), "whole"),
}


def run(strategy: Any, data: str, world: int) -> dict[str, Any]:
    L.seed_everything(0)
    model = Regression()
    if data == "iterable":
        loader = DataLoader(Unsplit(), batch_size=BATCH)
    else:
        loader = DataLoader(dataset(), batch_size=BATCH)
    trainer = L.Trainer(
        strategy=strategy if isinstance(strategy, str) else strategy(),
        accelerator="cpu",
        devices=world,
        max_steps=3,
        use_distributed_sampler=data == "sampler",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader)
    said = [str(w.message) for w in caught if issubclass(w.category, PossibleUserWarning)]
    return {"warnings": [m for m in said if "same first training batch" in m], "first": model.first}


def main(out: Path, names: list[str]) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # read before a fit's teardown clears them
    results = {name: run(*CASES[name], world) for name in names}
    (out / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2].split(","))
