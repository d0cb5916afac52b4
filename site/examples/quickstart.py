import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dp_strategies  # noqa: F401  (registers "ring_allreduce", "dp", "hybrid_pipeline")


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    data = TensorDataset(torch.randn(512, 16), torch.randint(0, 4, (512,)))
    trainer = L.Trainer(strategy="ring_allreduce", accelerator="cpu", devices=2, max_epochs=2)
    trainer.fit(Classifier(), DataLoader(data, batch_size=32))
    print(trainer.strategy.step_stats)  # type: ignore[attr-defined]
