"""A user's model and data for the comparison tests, importable as ``tests.helpers.compare_models:<factory>``.

Not the demo: a regression model with a frozen embedding-like input layer, a dict batch, a LightningDataModule, and no
``pipeline_body`` opt-in (so ``hybrid_pipeline`` cannot run it).
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset


class Pairs(Dataset[dict[str, Tensor]]):
    def __init__(self, n: int = 64) -> None:
        gen = torch.Generator().manual_seed(7)
        self.x = torch.randn(n, 6, generator=gen)
        self.y = self.x[:, :2].sum(dim=1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.head = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.frozen(x))

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = F.mse_loss(self(batch["x"]), batch["y"])
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class PairsData(L.LightningDataModule):
    def setup(self, stage: str) -> None:
        self.train = Pairs()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=8, shuffle=False, drop_last=True)


def odd_batches() -> DataLoader:
    """Global batches of 9 samples: they do not split over two devices."""
    return DataLoader(Pairs(), batch_size=9, drop_last=True)
