"""A model and data of your own, compared across the strategies (README "Try it", docs/compare.md):

    cd docs/examples
    lightning-dp-strategies compare --model my_models:Forecaster --data my_models:SeriesData

``--model`` and ``--data`` name importable callables: a LightningModule class (or a function returning one) and a
LightningDataModule class (or a function returning a DataModule or a DataLoader of global batches).
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset


class Windows(Dataset[dict[str, Tensor]]):
    """Windows of 24 steps of a noisy sum of sines, and the 4 steps that follow each one."""

    def __init__(self, count: int = 2048, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        t = torch.arange(count + 28, dtype=torch.float32)
        series = torch.sin(t / 7) + 0.5 * torch.sin(t / 3) + 0.05 * torch.randn(len(t), generator=gen)
        self.windows = series.unfold(0, 28, 1)[:count]

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"history": self.windows[i, :24], "future": self.windows[i, 24:]}


class SeriesData(L.LightningDataModule):
    def __init__(self, batch_size: int = 64) -> None:
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        self.train = Windows()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True, drop_last=True)


class Forecaster(L.LightningModule):
    """An MLP forecaster behind a frozen smoothing layer (a pretrained part you do not train)."""

    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.smooth = nn.Conv1d(1, 1, kernel_size=3, padding=1, bias=False)
        nn.init.constant_(self.smooth.weight, 1 / 3)
        self.smooth.requires_grad_(False)
        self.body = nn.Sequential(
            nn.Linear(24, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 4)
        )

    def forward(self, history: Tensor) -> Tensor:
        return self.body(self.smooth(history.unsqueeze(1)).squeeze(1))

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = F.mse_loss(self(batch["history"]), batch["future"])
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=1e-2)
