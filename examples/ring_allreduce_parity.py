"""Train with ``Trainer(strategy="ring_allreduce", devices=2)`` and check it against a plain single-process loop.

    python examples/ring_allreduce_parity.py

Rank 0 then replays the same global batches (both ranks' shards, in the order Lightning's distributed sampler gave
them) in an ordinary PyTorch loop and prints the largest parameter difference; it exits non-zero above 1e-5.
"""

from __future__ import annotations

import sys

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_dp_strategies  # noqa: F401  (registers "ring_allreduce")

WORLD, BATCH, EPOCHS, TOLERANCE = 2, 8, 3, 1e-5


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 16, generator=g)
    return TensorDataset(x, (x[:, :4].argmax(1) + (x[:, 4] > 1).long()) % 4)


def plain_loop() -> Classifier:
    """One process, global batches of WORLD x BATCH samples, in the order the ranks saw them."""
    model, data = Classifier(), dataset()
    opt = model.configure_optimizers()
    for epoch in range(EPOCHS):
        shards = []
        for rank in range(WORLD):  # what Lightning gives each rank: DistributedSampler(shuffle=True, seed=0)
            sampler = DistributedSampler(data, WORLD, rank, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            shards.append(list(sampler))
        for start in range(0, len(shards[0]), BATCH):
            x, y = data[[i for shard in shards for i in shard[start : start + BATCH]]]
            opt.zero_grad()
            F.cross_entropy(model.net(x), y).backward()
            opt.step()
    return model


def main() -> None:
    model = Classifier()
    trainer = L.Trainer(
        strategy="ring_allreduce",
        accelerator="cpu",
        devices=WORLD,
        max_epochs=EPOCHS,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, DataLoader(dataset(), batch_size=BATCH))
    if not trainer.is_global_zero:
        return
    stats = trainer.strategy.step_stats  # type: ignore[attr-defined]
    reference = dict(plain_loop().named_parameters())
    diff = max((p - reference[n]).abs().max().item() for n, p in model.named_parameters())
    print(f"last step: {stats.bytes_sent} bytes sent in {stats.ring_operations} bucket(s), {stats.messages} messages")
    print(f"max |ring_allreduce - single-process loop| = {diff:.2e} (tolerance {TOLERANCE})")
    sys.exit(0 if diff <= TOLERANCE else 1)


if __name__ == "__main__":
    main()
