"""A script that catches a failed ``fit`` and fits again, as a sweep or an out-of-memory retry does, on two ranks
started by Lightning's script launcher.

Run as ``python -m tests.reliability.retry_scenario STRATEGY OUTDIR``; the launcher re-runs the command for rank 1.
The first fit raises ``ValueError`` at its third batch on every rank; the script catches it and fits a fresh module
with a new Trainer, which must train on both ranks. Each rank writes that module's parameters to ``final-rank{r}.pt``.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_dp_strategies import HybridPipelineStrategy, RingAllReduceStrategy

WORLD, BATCH, SAMPLES, EPOCHS, LR = 2, 16, 64, 2, 0.1
FAIL_AT = 2


def dataset() -> TensorDataset:
    x = torch.randn(SAMPLES, 8, generator=torch.Generator().manual_seed(1))
    return TensorDataset(x, (x[:, 0] > 0).long())


def fresh_body() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


class Net(L.LightningModule):
    pipeline_body = "body"  # the opt-in of hybrid_pipeline; other strategies ignore it

    def __init__(self, fail: bool) -> None:
        super().__init__()
        self.body, self.fail = fresh_body(), fail

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(output, target)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        if self.fail and batch_idx == FAIL_AT:
            raise ValueError("the first fit fails here")
        x, y = batch
        return self.pipeline_loss(self.body(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


def reference() -> dict[str, Tensor]:
    """One device, the whole batch of ``BATCH`` samples a step, ``EPOCHS`` epochs in order."""
    body, data = fresh_body(), dataset()
    optimizer = torch.optim.SGD(body.parameters(), lr=LR, momentum=0.9)
    for _ in range(EPOCHS):
        for x, y in DataLoader(data, batch_size=BATCH):
            optimizer.zero_grad()
            F.cross_entropy(body(x), y).backward()
            optimizer.step()
    return {f"body.{name}": value for name, value in body.state_dict().items()}


def fit(strategy_name: str, fail: bool) -> tuple[L.Trainer, Net]:
    timeout = timedelta(seconds=60)  # a rank that went missing fails the fit in a minute, not torch's 30
    strategy = (
        HybridPipelineStrategy(pipeline_stages=2, timeout=timeout)
        if strategy_name == "hybrid_pipeline"
        else RingAllReduceStrategy(timeout=timeout)
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_epochs=EPOCHS,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = Net(fail)
    data = dataset()
    if strategy_name == "hybrid_pipeline":  # one replica: both stages read the whole batch
        loader = DataLoader(data, batch_size=BATCH)
    else:
        sampler = DistributedSampler(data, num_replicas=WORLD, rank=trainer.global_rank, shuffle=False)
        loader = DataLoader(data, batch_size=BATCH // WORLD, sampler=sampler)
    trainer.fit(module, loader)
    return trainer, module


def main() -> None:
    strategy_name, outdir = sys.argv[1], Path(sys.argv[2])
    try:
        fit(strategy_name, fail=True)
    except ValueError as error:
        print(f"first fit raised: {error}", flush=True)
    trainer, module = fit(strategy_name, fail=False)
    state = {k: v for k, v in module.state_dict().items() if not v.is_meta}
    torch.save(state, outdir / f"final-rank{trainer.global_rank}.pt")
    print(f"rank {trainer.global_rank} fit again: {trainer.global_step} steps", flush=True)


if __name__ == "__main__":
    main()
