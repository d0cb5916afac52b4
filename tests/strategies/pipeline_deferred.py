"""A LightningModule that builds its body on the meta device in ``configure_model``, on one device and pipelined.

Run as ``python -m tests.strategies.pipeline_deferred STAGES WORLD OUTDIR`` (``STAGES=0``: one device, where the
module initializes every block itself with :func:`materialize`, as each stage does for its own). Every rank writes
``OUTDIR/rank{r}.pt``: which blocks hold storage at the start and the end of ``fit`` and after it, and ``validate``
after ``fit``; rank 0 adds the trained parameters from the checkpoint ``ModelCheckpoint`` wrote during ``fit`` and
from the one ``trainer.save_checkpoint`` wrote after it. A fresh module then validates from that checkpoint and
resumes from it for a third epoch (``resume``). ``LDPS_UNINITIALIZABLE=1`` ends the body with a
block that cannot be initialized from meta; ``LDPS_FINETUNING=1`` adds a ``BaseFinetuning`` callback.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import BaseFinetuning, ModelCheckpoint
from torch import Tensor, nn

from lightning_dp_strategies.pipeline.materialize import materialize
from tests.strategies.pipeline_features import cpu_trainer, data, loader

SAMPLES = 64


class Scale(nn.Module):
    """A block with a parameter of its own and no ``reset_parameters()``: it cannot be initialized from meta."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gain


def build_body(uninitializable: bool = False) -> nn.Sequential:
    blocks = [nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 32), nn.Tanh()]
    return nn.Sequential(*blocks, nn.Linear(32, 4), *([Scale()] if uninitializable else []))


class DeferredNet(L.LightningModule):
    pipeline_body = "body"

    def __init__(self, one_device: bool) -> None:
        super().__init__()
        self.one_device = one_device

    def configure_model(self) -> None:
        if hasattr(self, "body"):
            return
        with torch.device("meta"):
            self.body = build_body(uninitializable=bool(os.environ.get("LDPS_UNINITIALIZABLE")))
        if self.one_device:  # what each stage does for its own blocks
            materialize(enumerate(self.body), torch.device("cpu"), seed=torch.initial_seed())

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(output, target)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = self.pipeline_loss(self.body(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", self.pipeline_loss(self.body(x), y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def built(module: L.LightningModule) -> list[bool]:
    """Per block of the body: whether it holds storage (is not on the meta device)."""
    return [not any(t.is_meta for t in block.parameters()) for block in module._modules["body"]]  # type: ignore[union-attr]


class Where(L.Callback):
    def __init__(self) -> None:
        self.seen: dict[str, list[bool]] = {}

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.seen["start"] = built(module)

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.seen["end"] = built(module)


class FreezeNothing(BaseFinetuning):
    def freeze_before_training(self, pl_module: L.LightningModule) -> None:
        pass

    def finetune_function(self, pl_module: L.LightningModule, epoch: int, optimizer: Any) -> None:
        pass


def main(stages: int, world: int, out: Path) -> None:
    L.seed_everything(7, verbose=False)
    where = Where()
    trainer, replica, replicas = cpu_trainer(
        stages,
        world,
        max_epochs=2,
        logger=False,
        enable_model_summary=False,
        callbacks=[
            where,
            ModelCheckpoint(dirpath=out / "ckpt", filename="last"),
            *([FreezeNothing()] if os.environ.get("LDPS_FINETUNING") else []),
        ],
    )
    train, val = loader(data(SAMPLES, 1), replica, replicas), loader(data(32, 2), replica, replicas)
    model = DeferredNet(one_device=stages == 0)
    trainer.fit(model, train, val)
    result: dict[str, Any] = {**where.seen, "after": built(model)}
    trainer.save_checkpoint(out / "after-fit.ckpt")  # every rank calls it; rank 0 writes, the stages stream to it
    result["validate"] = trainer.validate(model, val, verbose=False)
    trainer.save_checkpoint(out / "after-validate.ckpt")  # the stages still hold the blocks the fit trained
    if trainer.global_rank == 0:
        saved = {
            "params": out / "ckpt" / "last.ckpt",
            "after_fit_params": out / "after-fit.ckpt",
            "after_validate_params": out / "after-validate.ckpt",
        }
        for key, name in saved.items():
            checkpoint = torch.load(name, weights_only=False)
            result[key] = {k: v.clone() for k, v in checkpoint["state_dict"].items()}
            result[key.replace("params", "optimizer")] = checkpoint["optimizer_states"][0]["state"]
    result.update(resume(stages, world, out / "after-fit.ckpt", train, val))
    torch.save(result, out / f"rank{trainer.global_rank}.pt")


def resume(stages: int, world: int, path: Path, train: Any, val: Any) -> dict[str, Any]:
    """A fresh module, built on meta again, validated from the checkpoint ``path`` and trained on from it for one
    more epoch; with the torch warnings of loads into the meta device that did nothing."""
    trainer, _, _ = cpu_trainer(
        stages, world, max_epochs=3, logger=False, enable_model_summary=False, enable_checkpointing=False
    )
    fresh = DeferredNet(one_device=stages == 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = trainer.validate(fresh, val, ckpt_path=path, verbose=False)
        trainer.fit(fresh, train, val, ckpt_path=path)
    trainer.save_checkpoint(path.parent / "resumed.ckpt")
    noops = [str(w.message) for w in caught if "which is a no-op" in str(w.message)]
    result: dict[str, Any] = {"validate_loaded": loaded, "noop_loads": noops}
    if trainer.global_rank == 0:
        result["resumed_params"] = torch.load(path.parent / "resumed.ckpt", weights_only=False)["state_dict"]
    return result


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
