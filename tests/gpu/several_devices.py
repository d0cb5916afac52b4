"""One run of :mod:`tests.gpu.test_several_gpus`: a strategy on several devices, or the one-device reference.

Run as ``python -m tests.gpu.several_devices NAME ACCELERATOR DEVICES OUTDIR``; Lightning's launcher starts the other
ranks. Every run trains the same global batches of 16 samples (a data-parallel rank reads its share through a
``DistributedSampler`` of its own; ``dp`` and the pipeline's stages read every batch whole) with SGD and momentum, and
rank 0 writes ``OUTDIR/NAME.pt``: the trained parameters, the process group's backend, the device type the
strategy trained on and the steps taken.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_dp_strategies as ldp

GLOBAL_BATCH, STEPS = 16, 12


class Regressor(L.LightningModule):
    pipeline_body = "net"

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return nn.functional.mse_loss(output, target)

    def training_step(self, batch: tuple[Tensor, Tensor], _: int) -> Tensor:
        return self.pipeline_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


STRATEGIES: dict[str, Any] = {
    "single": lambda devices: "auto",
    "ring_allreduce": lambda devices: "ring_allreduce",
    "ring_allreduce_sharded": lambda devices: "ring_allreduce_sharded",
    "local_sgd": lambda devices: ldp.LocalSGDStrategy(sync_every=1),  # plain averaging each SGD step: the ring's update
    "dp": lambda devices: "dp",
    "hybrid_pipeline": lambda devices: ldp.HybridPipelineStrategy(pipeline_stages=devices, micro_batches=4),
}
WHOLE_BATCHES = {"single", "dp", "hybrid_pipeline"}
"""The runs whose every process reads every global batch whole (one process, or pipeline stages of one replica)."""


def data() -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(GLOBAL_BATCH * STEPS, 8, generator=gen)
    return TensorDataset(x, x[:, :3].sum(dim=1, keepdim=True).tanh() + 0.05 * torch.randn(len(x), 1, generator=gen))


def main(name: str, accelerator: str, devices: int, out: Path) -> None:
    L.seed_everything(0)
    module = Regressor()
    trainer = L.Trainer(
        strategy=STRATEGIES[name](devices),
        accelerator=accelerator,
        devices=1 if name == "single" else devices,
        max_steps=STEPS,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    dataset = data()
    if name in WHOLE_BATCHES:
        loader = DataLoader(dataset, batch_size=GLOBAL_BATCH)
    else:
        sampler: DistributedSampler[Any] = DistributedSampler(
            dataset, num_replicas=devices, rank=trainer.global_rank, shuffle=False
        )
        loader = DataLoader(dataset, batch_size=GLOBAL_BATCH // devices, sampler=sampler)
    trainer.fit(module, loader)
    if trainer.global_rank == 0:
        result = {
            "params": {n: p.detach().cpu() for n, p in module.state_dict().items()},
            "backend": dist.get_backend() if dist.is_initialized() else None,
            "device": trainer.strategy.root_device.type,
            "steps": trainer.global_step,
        }
        torch.save(result, out / f"{name}.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]))
