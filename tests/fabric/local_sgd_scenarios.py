"""Fabric runs for the Fabric local_sgd tests.

Run as ``python -m tests.fabric.local_sgd_scenarios OUTDIR`` on 2 ranks (started as torchrun starts them). Every
scenario writes ``OUTDIR/{scenario}-rank{r}.pt``:

- ``h1``: ``FabricLocalSGDStrategy(sync_every=1)`` with SGD; ``h1-ring``: the same loop under ``"ring_allreduce"``;
- ``full``: Adam inside, DiLoCo outside, H = 4, 12 steps, ``fabric.save`` after step 6 (mid-period);
  ``resumed``: a fresh model and optimizer, ``fabric.load`` of that file, steps 7 to 12;
- ``stream-full`` / ``stream-resumed``: the same with streaming DiLoCo (two fragments, a delay of one step, 4-bit
  changes), saved with fragment 0's change in flight; ``as-diloco-full`` / ``as-diloco-resumed``: the streaming
  options at their DiLoCo values;
- ``unfrozen``: a parameter frozen at setup and unfrozen after two steps; the error its next step raised.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lightning_dp_strategies import FabricLocalSGDStrategy
from lightning_dp_strategies.local_sgd import diloco_outer_optimizer
from tests.fabric.fabric_scenarios import EPOCHS, PER_RANK_BATCH, WORLD, make_data, make_model, make_optimizer, params


def batches(fabric: L.Fabric) -> list[Any]:
    loader = fabric.setup_dataloaders(DataLoader(make_data(), batch_size=PER_RANK_BATCH))
    return [batch for _ in range(EPOCHS) for batch in loader]


def train(fabric: L.Fabric, model: Any, opt: Any, steps: list[Any]) -> None:
    for x, y in steps:
        fabric.backward(F.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()


def parity(out: Path, name: str, strategy: Any) -> None:
    fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=WORLD)
    fabric.launch()
    model = make_model()
    model, opt = fabric.setup(model, make_optimizer(model))
    train(fabric, model, opt, batches(fabric))
    torch.save({"params": params(model)}, out / f"{name}-rank{fabric.global_rank}.pt")


STREAM = {"fragments": 2, "delay": 1, "mixing": 0.5, "outer_precision": "int4"}
AS_DILOCO = {"fragments": 1, "delay": 0, "mixing": 0.0, "outer_precision": "fp32"}


def resume(out: Path, prefix: str = "", **streaming: Any) -> None:
    def setup() -> tuple[L.Fabric, Any, Any, FabricLocalSGDStrategy]:
        strategy = FabricLocalSGDStrategy(sync_every=4, outer_optimizer=diloco_outer_optimizer(), **streaming)
        fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=WORLD)
        fabric.launch()
        model = make_model()
        model, opt = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2))
        return fabric, model, opt, strategy

    fabric, model, opt, strategy = setup()
    steps = batches(fabric)
    train(fabric, model, opt, steps[:6])
    fabric.save(out / f"{prefix}mid-period.ckpt", {"model": model, "optimizer": opt, "step": 6})
    train(fabric, model, opt, steps[6:])
    strategy.synchronize()
    result = {"params": params(model), "syncs": strategy.local_sgd.syncs}
    torch.save(result, out / f"{prefix}full-rank{fabric.global_rank}.pt")

    fabric, model, opt, strategy = setup()
    remainder = fabric.load(out / f"{prefix}mid-period.ckpt", {"model": model, "optimizer": opt})
    train(fabric, model, opt, steps[remainder["step"] :])
    strategy.synchronize()
    result = {"params": params(model), "syncs": strategy.local_sgd.syncs, "remainder": sorted(remainder)}
    torch.save(result, out / f"{prefix}resumed-rank{fabric.global_rank}.pt")


def unfrozen(out: Path) -> None:
    """A parameter frozen when the model is set up and unfrozen after two steps: the next step must refuse it."""
    fabric = L.Fabric(strategy=FabricLocalSGDStrategy(sync_every=4), accelerator="cpu", devices=WORLD)
    fabric.launch()
    model = make_model()
    first = next(model.parameters())
    first.requires_grad_(False)
    model, opt = fabric.setup(model, make_optimizer(model))
    steps = batches(fabric)
    train(fabric, model, opt, steps[:2])
    first.requires_grad_(True)
    try:
        train(fabric, model, opt, steps[2:3])
        error = None
    except RuntimeError as failure:
        error = str(failure)
    torch.save({"error": error}, out / f"unfrozen-rank{fabric.global_rank}.pt")


if __name__ == "__main__":
    outdir = Path(sys.argv[1])
    parity(outdir, "h1", FabricLocalSGDStrategy(sync_every=1))
    parity(outdir, "h1-ring", "ring_allreduce")
    resume(outdir)
    resume(outdir, "stream-", **STREAM)
    resume(outdir, "as-diloco-", **AS_DILOCO)
    unfrozen(outdir)
