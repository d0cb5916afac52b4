"""Fabric's explicit loop with the package's ring all-reduce: `python docs/examples/fabric_ring_allreduce.py`."""

import os

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning_dp_strategies  # noqa: F401  # registers "ring_allreduce" with Fabric

fabric = L.Fabric(strategy="ring_allreduce", accelerator="cpu", devices=2)
fabric.launch()  # re-runs this script for rank 1 (use "ring_allreduce_notebook" inside Jupyter)

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))  # rank 0's weights everywhere
data = TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))
loader = fabric.setup_dataloaders(DataLoader(data, batch_size=8))  # each rank reads its shard

for step, (x, y) in enumerate(loader):
    accumulating = step % 2 == 0
    with fabric.no_backward_sync(model, enabled=accumulating):  # local only: nothing is sent
        fabric.backward(F.cross_entropy(model(x), y) / 2)  # otherwise: .grad is the average over the ranks
    if not accumulating:
        optimizer.step()
        optimizer.zero_grad()
        fabric.print(fabric.strategy.step_stats)  # one synced and one skipped backward per step

checkpoint = os.path.join(os.environ.get("LDPS_FABRIC_EXAMPLE_DIR", "."), "fabric-ring.ckpt")
fabric.save(checkpoint, {"model": model, "optimizer": optimizer})  # the plain state_dict, written by rank 0
