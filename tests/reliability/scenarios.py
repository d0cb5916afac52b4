"""Trainer runs for the reliability tests: stop mid-epoch and resume, and seeded runs repeated.

Run as ``python -m tests.reliability.scenarios MODE STRATEGY OUTDIR [TAG]``; Lightning's popen launcher re-runs the
same command for the other ranks. ``MODE`` is

- ``resume``: three fits in one process group: ``full`` (``TOTAL_STEPS`` steps), ``stopped`` (the same run, stopped
  after ``STOP_STEP`` steps, mid-epoch, with ``ModelCheckpoint(save_last=True)`` writing ``last.ckpt`` every step)
  and ``resumed`` (``fit(ckpt_path=last.ckpt)`` up to ``TOTAL_STEPS``); after ``full``, ``trainer.save_checkpoint``
  also writes ``full-after-fit.ckpt`` (after teardown);
- ``seeded``: two fits ``{TAG}-a`` and ``{TAG}-b`` of ``TOTAL_STEPS`` steps with dropout, each after
  ``seed_everything(SEED)``, for ``dp`` with ``Trainer(deterministic=True)``; for ``dp`` first two more without
  dropout and without that flag (``{TAG}-plain-a``, ``{TAG}-plain-b``).

At the end of every fit each rank saves ``{tag}-rank{r}.pt`` (its parameters, optimizer state, learning rates, the
batches it trained on) and ``trainer.save_checkpoint`` writes ``{tag}-final.ckpt`` (the whole run's state, as a
checkpoint holds it); both inside ``fit`` (``on_train_end``). At the end every rank saves
``writes-{resume or TAG}-rank{r}.json``: the names of the checkpoint files it wrote, in order.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dp_strategies
from lightning_dp_strategies.core.checkpoint_io import AtomicCheckpointIO

GLOBAL_BATCH = 8
SAMPLES = 32  # 4 steps per epoch for every strategy
STEPS_PER_EPOCH = SAMPLES // GLOBAL_BATCH
TOTAL_STEPS = 10  # 2.5 epochs
STOP_STEP = 6  # epoch 1, after its second batch: mid-epoch, past an epoch boundary
SEED = 1234


@dataclass(frozen=True)
class Setup:
    devices: int
    replicas: int  # data-parallel replicas, the number of shards of each global batch

    @property
    def per_replica_batch(self) -> int:
        return GLOBAL_BATCH // self.replicas


SETUPS = {
    "dp": Setup(devices=3, replicas=1),  # one process, three logical CPU replicas (the batch splits 3, 3, 2)
    "ring_allreduce": Setup(devices=2, replicas=2),
    "hybrid_pipeline": Setup(devices=4, replicas=2),  # 2 stages x 2 replicas
}


def make_strategy(name: str) -> Any:
    if name == "hybrid_pipeline":
        return lightning_dp_strategies.HybridPipelineStrategy(pipeline_stages=2, micro_batches=2)
    return name


# ---------------------------------------------------------------------------------------------- the data
class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` Lightning can resume mid-epoch: its state is the number of batches it yielded this epoch.

    Lightning 2.x saves ``state_dict()`` of every train loader that has ``state_dict``/``load_state_dict`` in the
    checkpoint (rank 0's) and calls ``load_state_dict`` before the resumed epoch starts. A count is the same on every
    rank, so rank 0's state resumes all of them. Like torchdata's ``StatefulDataLoader`` it reads its sampler's order
    when ``iter()`` is called (not at the first batch), so it also checks that the strategy gave the sampler the
    resumed epoch before that (see ``strategies/_trainer.py``). Single-process loading only (``num_workers=0``).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.yielded = 0
        self._skip = 0

    def state_dict(self) -> dict[str, int]:
        return {"yielded": self.yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._skip = int(state["yielded"])

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        skip, self._skip = self._skip, 0
        self.yielded = skip
        assert self.batch_sampler is not None
        return self._batches(list(self.batch_sampler)[skip:])  # the sampler's order, read now

    def _batches(self, batches: list[list[int]]) -> Iterator[Any]:
        for indices in batches:
            self.yielded += 1
            yield self.collate_fn([self.dataset[i] for i in indices])


def make_data() -> TensorDataset:
    gen = torch.Generator().manual_seed(SEED)
    return TensorDataset(torch.randn(SAMPLES, 8, generator=gen), torch.randint(0, 3, (SAMPLES,), generator=gen))


# ---------------------------------------------------------------------------------------------- the model
class Net(L.LightningModule):
    """Runs under all three strategies: ``self(x)`` (scattered by ``dp``) and the ``hybrid_pipeline`` opt-in."""

    pipeline_body = "body"

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(
            nn.Linear(8, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
        )
        self.batches: list[Tensor] = []  # the inputs of every step, in order

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(output, target)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        self.batches.append(x.detach().clone())
        return self.pipeline_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=0.05, weight_decay=1e-2)
        # per step, and far from constant: a scheduler that restarted at 0 (or stood still) changes every update
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.8**step)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class SaveFinal(L.Callback):
    """Saves what this rank ended with, and the checkpoint of the whole run, at the end of ``fit``."""

    def __init__(self, outdir: Path, tag: str) -> None:
        self.outdir = outdir
        self.tag = tag

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        assert isinstance(module, Net)
        optimizer = trainer.optimizers[0]
        # what this rank trains: under hybrid_pipeline its stage's parameters (the module's other blocks sit idle)
        trained = getattr(trainer.strategy, "bucketed_parameters", module.named_parameters)
        torch.save(
            {
                "params": {n: p.detach().clone() for n, p in trained()},
                "optimizer": optimizer.state_dict(),
                "lrs": [group["lr"] for group in optimizer.param_groups],
                "global_step": trainer.global_step,
                "batches": module.batches,
            },
            self.outdir / f"{self.tag}-rank{trainer.global_rank}.pt",
        )
        trainer.save_checkpoint(self.outdir / f"{self.tag}-final.ckpt")


def fit(strategy: str, outdir: Path, tag: str, max_steps: int, dropout: float = 0.0, **kwargs: Any) -> L.Trainer:
    setup = SETUPS[strategy]
    callbacks: list[L.Callback] = [SaveFinal(outdir, tag)]
    ckpt_path = kwargs.pop("ckpt_path", None)
    if kwargs.pop("checkpoint_every_step", False):
        callbacks.append(ModelCheckpoint(dirpath=outdir / "ckpts", save_last=True, save_top_k=0, every_n_train_steps=1))
    trainer = L.Trainer(
        strategy=make_strategy(strategy),
        accelerator="cpu",
        devices=setup.devices,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=len(callbacks) > 1,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        **kwargs,
    )
    loader = ResumableDataLoader(make_data(), batch_size=setup.per_replica_batch, shuffle=False)
    trainer.fit(Net(dropout), loader, ckpt_path=ckpt_path)
    return trainer


# ---------------------------------------------------------------------------------------------- who writes
WRITES: list[str] = []


def record_checkpoint_writes() -> None:
    """Wrap ``AtomicCheckpointIO.save_checkpoint`` (the strategies' default) and hybrid_pipeline's streamed write to
    note every file this rank writes."""
    original = AtomicCheckpointIO.save_checkpoint

    def save_checkpoint(self: AtomicCheckpointIO, checkpoint: dict[str, Any], path: Any, **kwargs: Any) -> None:
        WRITES.append(Path(path).name)
        original(self, checkpoint, path, **kwargs)

    AtomicCheckpointIO.save_checkpoint = save_checkpoint  # type: ignore[method-assign]
    # hybrid_pipeline streams its checkpoints into an atomic write of its own (no whole checkpoint in memory)
    from lightning_dp_strategies.strategies.hybrid_pipeline import strategy as hybrid

    streamed = hybrid.atomic_write

    def atomic_write(path: Any, write: Any) -> None:
        WRITES.append(Path(path).name)
        streamed(path, write)

    hybrid.atomic_write = atomic_write  # type: ignore[assignment]


def main(mode: str, strategy: str, outdir: Path, tag: str = "seeded") -> None:
    record_checkpoint_writes()
    if mode == "resume":
        full = fit(strategy, outdir, "full", TOTAL_STEPS)
        full.save_checkpoint(
            outdir / "full-after-fit.ckpt"
        )  # after teardown: hybrid_pipeline streams the stages to rank 0
        fit(strategy, outdir, "stopped", STOP_STEP, checkpoint_every_step=True)
        trainer = fit(strategy, outdir, "resumed", TOTAL_STEPS, ckpt_path=outdir / "ckpts" / "last.ckpt")
    elif mode == "seeded":
        # each configuration twice in one process: the second run after other work, so with another history
        runs: list[tuple[str, dict[str, Any]]] = []
        if strategy == "dp":  # first in the process, without dropout and with the default deterministic=False
            runs += [(f"{tag}-plain-{run}", {}) for run in ("a", "b")]
        # with dropout; dp's CPU replicas share one generator: they draw in a fixed order under deterministic=True
        runs += [(f"{tag}-{run}", {"dropout": 0.2, "deterministic": strategy == "dp"}) for run in ("a", "b")]
        for name, options in runs:
            L.seed_everything(SEED, verbose=False)
            trainer = fit(strategy, outdir, name, TOTAL_STEPS, **options)
    else:
        raise SystemExit(f"unknown mode {mode!r}: use 'resume' or 'seeded'")
    label = mode if mode == "resume" else tag
    (outdir / f"writes-{label}-rank{trainer.global_rank}.json").write_text(json.dumps(WRITES))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), *sys.argv[4:])
