"""A model whose blocks pass tuples of tensors, run on one device and under hybrid_pipeline.

Run as ``python -m tests.strategies.pipeline_tuples STAGES WORLD OUTDIR [BAD]`` (``STAGES=0``: one device, the
reference). The batch is ``(tokens, mask, target)``: the body's input is the tuple ``(tokens, mask)``, its blocks
carry ``(hidden, mask)`` (a float and a bool tensor), and its last block returns ``(logits, aux)``, which
``pipeline_loss`` receives. Rank 0 writes ``OUTDIR/result.pt`` (trained parameters, logged losses, ``validate`` and
``predict`` after ``fit``). ``BAD`` names a body whose blocks return something the pipeline cannot carry.
``LDPS_STRATEGY=<registered name>`` trains under that name instead; ``LDPS_SIMULATE_NOTEBOOK=1`` makes Lightning
believe it runs inside Jupyter; ``LDPS_PRECISION`` sets the Trainer's precision (default ``32-true``).
"""

from __future__ import annotations

import csv
import os
import sys

if os.environ.get("LDPS_SIMULATE_NOTEBOOK"):
    sys.ps1 = ">>> "  # what Lightning checks (at import) to tell it runs inside Jupyter / an interactive shell
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from tests.strategies.pipeline_features import cpu_trainer, loader

GLOBAL_BATCH, SAMPLES, TOKENS, WIDTH = 8, 48, 5, 12


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, WIDTH)

    def forward(self, inputs: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        tokens, mask = inputs
        return self.proj(tokens), mask


class MaskedBlock(nn.Module):
    """Mixes each position with the mean of the unmasked ones, residual stream beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, inputs: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        hidden, mask = inputs
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(1, keepdim=True) / weights.sum(1, keepdim=True).clamp(min=1)
        return hidden + torch.tanh(self.mix(self.norm(hidden + pooled))) * weights, mask


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(WIDTH, 3)

    def forward(self, inputs: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        hidden, mask = inputs
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)
        return self.out(pooled), hidden.pow(2).mean((1, 2))  # logits and a per-sample auxiliary term


class TupleNet(L.LightningModule):
    pipeline_body = "body"

    def __init__(self, bad: str | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bad = bad
        blocks: list[nn.Module] = [Embed(), MaskedBlock(), MaskedBlock(), MaskedBlock(), Head()]
        if bad is not None:
            blocks[2] = BAD[bad][0]()
            if BAD[bad][1]:
                self.example_input_array = (torch.zeros(4, TOKENS, 6), torch.ones(4, TOKENS, dtype=torch.bool))
        self.body = nn.Sequential(*blocks)

    def forward(self, tokens: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        return self.body((tokens, mask))

    def pipeline_split_batch(self, batch: Any) -> tuple[tuple[Tensor, Tensor], Tensor]:
        tokens, mask, target = batch
        return (tokens, mask), target

    def pipeline_loss(self, output: tuple[Tensor, Tensor], target: Tensor) -> Tensor:
        logits, aux = output
        return F.cross_entropy(logits, target) + 0.01 * aux.mean()

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        inputs, target = self.pipeline_split_batch(batch)
        if self.bad is not None:
            raise AssertionError("training started")
        loss = self.pipeline_loss(self.body(inputs), target)
        self.log("train_loss", loss, sync_dist=True, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        inputs, target = self.pipeline_split_batch(batch)
        self.log("val_loss", self.pipeline_loss(self.body(inputs), target), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        inputs, _ = self.pipeline_split_batch(batch)
        logits, _ = self.body(inputs)
        return logits

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)


class DictOut(nn.Module):
    def forward(self, inputs: tuple[Tensor, Tensor]) -> dict[str, Tensor]:
        return {"hidden": inputs[0], "mask": inputs[1]}


class PooledOut(nn.Module):
    def forward(self, inputs: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        return inputs[0], inputs[1].float().mean(0)  # the mask pooled over the batch: no batch dimension left


BAD: dict[str, tuple[type[nn.Module], bool]] = {  # the block, and whether the module sets example_input_array
    "dict": (DictOut, True),
    "pooled": (PooledOut, False),
}


def data(samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randn(samples, TOKENS, 6, generator=generator)
    lengths = torch.randint(1, TOKENS + 1, (samples,), generator=generator)
    mask = torch.arange(TOKENS).unsqueeze(0) < lengths.unsqueeze(1)
    target = (tokens[..., :3] * mask.unsqueeze(-1)).sum(1).argmax(1)
    return TensorDataset(tokens, mask, target)


def main(stages: int, world: int, out: Path, bad: str | None = None) -> None:
    trainer, replica, replicas = cpu_trainer(
        stages,
        world,
        os.environ.get("LDPS_STRATEGY"),  # a registered name: its defaults (2 stages, 4 micro-batches)
        precision=os.environ.get("LDPS_PRECISION", "32-true"),
        max_epochs=2,
        logger=CSVLogger(out, name="logs", version=0),
        log_every_n_steps=1,
        enable_checkpointing=False,
    )
    model = TupleNet(bad)
    val = loader(data(16, 2), replica, replicas, GLOBAL_BATCH)
    trainer.fit(model, loader(data(SAMPLES, 1), replica, replicas, GLOBAL_BATCH), val)
    result: dict[str, Any] = {"params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    if trainer.global_rank == 0:  # read now: a forked validate/predict starts a fresh metrics file
        with open(out / "logs" / "version_0" / "metrics.csv") as f:
            result["logged"] = [{k: v for k, v in row.items() if v != ""} for row in csv.DictReader(f)]
    result["validate"] = trainer.validate(model, val, verbose=False)
    predictions = trainer.predict(model, val)  # None under a launcher that forks or spawns (Lightning's rule)
    result["predict"] = torch.cat(predictions) if predictions else None  # type: ignore[arg-type]
    if trainer.global_rank == 0:
        torch.save(result, out / "result.pt")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else None)
