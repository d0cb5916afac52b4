"""A LightningModule with the Lightning features a user switches on, run on one device and under hybrid_pipeline.

Run as ``python -m tests.strategies.pipeline_features STAGES WORLD OUTDIR [BALANCE] [unfreeze]`` (``STAGES=0``:
one device, the reference; ``BALANCE`` like ``2,4``; ``unfreeze`` adds the fine-tuning schedule :class:`Unfreeze`).
Rank 0 writes ``OUTDIR/result.pt``: the checkpoints each ``ModelCheckpoint`` kept, the epoch ``EarlyStopping``
stopped at, every logged value, what Lightning's model summary callback printed (the module sets
``example_input_array``, so the summary runs it), the trained parameters and what ``validate``/``test``/``predict``
return after ``fit``. Every rank writes ``OUTDIR/rank{r}.pt`` with what its ``configure_optimizers`` saw. Each
replica reads its share of every global batch, so both runs train on the same global batches.
"""

from __future__ import annotations

import csv
import logging
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.callbacks import (
    BaseFinetuning,
    EarlyStopping,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelSummary,
    Timer,
)
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

from lightning_dp_strategies import HybridPipelineStrategy

GLOBAL_BATCH = 16
SAMPLES, VAL_SAMPLES = 96, 32


class FeatureNet(L.LightningModule):
    pipeline_body = "body"

    def __init__(self, unfreeze: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(
            nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 4)
        )
        self.body[0].requires_grad_(False)  # a frozen first block, as when fine-tuning
        self.unfreeze = unfreeze
        if unfreeze:
            self.body[2].requires_grad_(False)  # in the optimizer from the start, unfrozen at epoch 2
        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=4)  # made in __init__
        self.seen_parameters: list[int] = []

    def setup(self, stage: str) -> None:
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=4)  # made in setup

    def configure_model(self) -> None:
        if not hasattr(self, "val_mean_loss"):
            self.val_mean_loss = torchmetrics.MeanMetric()  # made in configure_model

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(output, target)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        out = self.body(x)
        loss = self.pipeline_loss(out, y)
        self.train_acc(out, y)
        self.log("train_loss", loss, sync_dist=True, on_step=True, on_epoch=True)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def on_train_epoch_end(self) -> None:
        self.log("last_batch_loss", self.trainer.callback_metrics["train_loss_step"], sync_dist=True)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        out = self.body(x)
        loss = F.cross_entropy(out, y)
        self.val_acc(out, y)
        self.val_mean_loss(loss)
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_acc", self.val_acc)
        self.log("val_mean_loss", self.val_mean_loss)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", F.cross_entropy(self.body(x), y), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self.body(batch[0])

    def configure_optimizers(self) -> Any:
        self.seen_parameters.append(len(list(self.parameters())))
        fast = [*self.body[2].parameters(), *self.body[4].parameters()]
        rest = [p for p in self.parameters() if all(p is not f for f in fast)]
        if self.unfreeze:  # body[0] joins the optimizer when BaseFinetuning unfreezes it
            rest = [p for p in rest if p.requires_grad]
        optimizer = torch.optim.SGD([{"params": fast, "lr": 0.6}, {"params": rest}], lr=0.3, momentum=0.5)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.8)}


class Unfreeze(BaseFinetuning):
    """A fine-tuning schedule: body[0] unfrozen into a new parameter group at epoch 1, body[2] unfrozen at epoch 2."""

    def freeze_before_training(self, pl_module: L.LightningModule) -> None:
        self.freeze(pl_module.body[0])

    def finetune_function(self, pl_module: L.LightningModule, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.body[0], optimizer, lr=0.2, initial_denom_lr=1.0)
        if epoch == 2:
            pl_module.body[2].requires_grad_(True)


class ReplicaShards(Sampler[int]):
    """Replica ``r`` of ``D`` reads samples ``b * G + r, b * G + r + D, ...`` of every global batch ``b``."""

    def __init__(self, samples: int, replica: int, replicas: int) -> None:
        self.indices = [i for i in range(samples) if i % replicas == replica]

    def __iter__(self) -> Any:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def data(samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 8, generator=generator)
    return TensorDataset(x, (x[:, :4] + 0.5 * torch.randn(samples, 4, generator=generator)).argmax(1))


def loader(dataset: TensorDataset, replica: int, replicas: int, global_batch: int = GLOBAL_BATCH) -> DataLoader:
    """Replica ``replica``'s share of every global batch of ``global_batch`` samples."""
    sampler = ReplicaShards(len(dataset), replica, replicas)
    return DataLoader(dataset, batch_size=global_batch // replicas, sampler=sampler)


def cpu_trainer(stages: int, world: int, strategy: Any = None, **options: Any) -> tuple[L.Trainer, int, int]:
    """A CPU Trainer on one device (``stages=0``, the reference) or on ``world`` processes under ``strategy`` (default
    ``HybridPipelineStrategy(stages, micro_batches=2)``), with Lightning's distributed sampler off: each replica reads
    its share through :func:`loader`. Returns the trainer, this rank's replica and the number of replicas."""
    if stages == 0:
        strategy, devices, replicas = "auto", 1, 1
    else:
        strategy = strategy or HybridPipelineStrategy(pipeline_stages=stages, micro_batches=2, timeout=60)
        devices, replicas = world, world // stages
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        use_distributed_sampler=False,
        enable_progress_bar=False,
        **options,
    )
    return trainer, trainer.global_rank % replicas, replicas


class Summary(ModelSummary):
    """Lightning's model summary callback, recording what it prints on rank 0 (the totals and the table's columns)
    and the lines logged while it runs (``hybrid_pipeline``'s line on this rank's stage)."""

    printed: dict[str, Any] | None = None

    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        lines: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
        loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]  # rank_zero_info's
        for logger in loggers:
            logger.addHandler(handler)
        try:
            super().on_fit_start(trainer, module)
        finally:
            for logger in loggers:
                logger.removeHandler(handler)
        if self.printed is not None:
            self.printed["lines"] = lines

    def summarize(  # type: ignore[override]  # an instance method, to record what Lightning's static one prints
        self,
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        self.printed = {
            "counts": (total_parameters, trainable_parameters, model_size, total_flops),
            "modes": total_training_modes,
            "columns": dict(summary_data),
            "summary_data": summary_data,
        }
        ModelSummary.summarize(
            summary_data, total_parameters, trainable_parameters, model_size, total_training_modes, total_flops
        )


def main(stages: int, world: int, out: Path, balance: Any = "parameters", unfreeze: bool = False) -> None:
    strategy = HybridPipelineStrategy(pipeline_stages=stages, micro_batches=2, balance=balance) if stages else None
    checkpoints = [
        ModelCheckpoint(dirpath=out / "ckpt", monitor="val_loss", mode="min", save_top_k=1, filename="min-{epoch}"),
        ModelCheckpoint(dirpath=out / "ckpt", monitor="val_acc", mode="max", save_top_k=2, filename="max-{epoch}"),
    ]
    stopping = EarlyStopping(monitor="val_loss", mode="min", patience=1, min_delta=0.03)
    timer, summary = Timer(duration="00:00:10:00"), Summary()
    trainer, replica, replicas = cpu_trainer(
        stages,
        world,
        strategy,
        max_epochs=8,
        logger=CSVLogger(out, name="logs", version=0),
        log_every_n_steps=1,
        callbacks=[
            *checkpoints,
            stopping,
            LearningRateMonitor(logging_interval="epoch"),
            timer,
            summary,
            *([Unfreeze()] if unfreeze else []),
        ],
    )
    model = FeatureNet(unfreeze)
    model.example_input_array = torch.zeros(4, 8)  # the summary runs the model on it (in and out sizes, FLOPs)
    train, val = loader(data(SAMPLES, 1), replica, replicas), loader(data(VAL_SAMPLES, 2), replica, replicas)
    trainer.fit(model, train, val)
    result: dict[str, Any] = {
        "best": [Path(c.best_model_path).name for c in checkpoints],
        "kept": [{Path(k).name: float(v) for k, v in c.best_k_models.items()} for c in checkpoints],
        "stopped_epoch": stopping.stopped_epoch,
        "epochs_run": trainer.current_epoch,
        "summary": summary.printed,
        "timer_ran": timer.time_elapsed("train") > 0,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }
    result["validate"] = trainer.validate(model, val, verbose=False)
    result["test"] = trainer.test(model, val, verbose=False)
    predictions = trainer.predict(model, loader(data(VAL_SAMPLES, 2), replica, replicas))
    result["predict"] = torch.cat(predictions)  # type: ignore[arg-type]
    torch.save({"seen_parameters": model.seen_parameters}, out / f"rank{trainer.global_rank}.pt")
    if trainer.global_rank == 0:
        with open(out / "logs" / "version_0" / "metrics.csv") as f:
            result["logged"] = [{k: v for k, v in row.items() if v != ""} for row in csv.DictReader(f)]
        torch.save(result, out / "result.pt")


if __name__ == "__main__":
    options = sys.argv[4:]
    unfreeze = "unfreeze" in options
    options = [o for o in options if o != "unfreeze"]
    balance = [int(b) for b in options[0].split(",")] if options else "parameters"
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), balance, unfreeze)
