"""A fine-tuning schedule resumed in its middle, on one device and pipelined.

Run as ``python -m tests.strategies.pipeline_finetune_resume STAGES WORLD OUTDIR [CKPT]`` (``STAGES=0``: one device).
``pipeline_features.Unfreeze`` (a ``BaseFinetuning``) adds a parameter group at epoch 1; the callback records the
optimizer's groups by parameter name in the checkpoint and puts them back when a fit resumes. Without ``CKPT`` a fit of
2 epochs saves ``OUTDIR/part/last.ckpt`` and a fresh module resumes from it for a third epoch; with ``CKPT`` only the
resume runs, from ``CKPT``. Rank 0 writes ``OUTDIR/resumed.pt``: the resumed run's last ``state_dict`` and the sizes
of its saved optimizer's parameter groups.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from tests.strategies.pipeline_features import FeatureNet, Unfreeze, cpu_trainer, data, loader


def fit(stages: int, world: int, out: Path, epochs: int, ckpt: Path | None = None) -> L.Trainer:
    L.seed_everything(1, verbose=False)
    callbacks = [Unfreeze(), ModelCheckpoint(dirpath=out, save_last=True)]
    trainer, replica, replicas = cpu_trainer(
        stages, world, max_epochs=epochs, logger=False, enable_model_summary=False, callbacks=callbacks
    )
    train, val = loader(data(64, 1), replica, replicas), loader(data(32, 2), replica, replicas)
    trainer.fit(FeatureNet(unfreeze=True), train, val, ckpt_path=ckpt)
    return trainer


def main(stages: int, world: int, out: Path, ckpt: Path | None) -> None:
    if ckpt is None:
        fit(stages, world, out / "part", 2)
        ckpt = out / "part" / "last.ckpt"
    trainer = fit(stages, world, out / "resumed", 3, ckpt)
    if trainer.global_rank == 0:
        saved = torch.load(out / "resumed" / "last.ckpt", weights_only=False)
        groups = [len(group["params"]) for group in saved["optimizer_states"][0]["param_groups"]]
        torch.save({"params": saved["state_dict"], "groups": groups}, out / "resumed.pt")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]) if len(sys.argv) > 4 else None)
