"""Trainer runs whose ranks get equal or unequal numbers of training batches (``test_even_batches.py``).

Run as ``python -m tests.strategies.uneven_batches_scenarios OUTDIR CASE[,CASE...]`` on 2 ranks started as torchrun
starts them. Each case fits a small classifier with a validation loop; every rank writes ``OUTDIR/rank{r}.json``,
mapping each case to the error the fit raised (its type and message, or ``None``), the batches each rank trained on,
the optimizer steps it took and the warnings it gave of epochs in which the rank had no batch. Cases that raise come
last: a fit that fails leaves the process group usable, but a case after it would prove nothing about a clean start.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader, IterableDataset, Sampler, TensorDataset

from lightning_dp_strategies import FaultTolerance, HybridPipelineStrategy, LocalSGDStrategy, RingAllReduceStrategy

TIMEOUT = timedelta(seconds=60)  # an undetected mismatch fails the test by its deadline, not by this


class Stream(IterableDataset):
    """An ``IterableDataset`` split by rank that yields ``counts[rank]`` batches of 4: each rank its own, or with
    ``alike`` the same ones (the stages of one pipeline read one batch)."""

    def __init__(self, counts: tuple[int, int], alike: bool) -> None:
        self.counts, self.alike = counts, alike

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        rank = int(os.environ["RANK"])
        generator = torch.Generator().manual_seed(0 if self.alike else rank)
        for _ in range(self.counts[rank]):
            x = torch.randn(4, 6, generator=generator)
            yield x, (x.sum(1) > 0).long()


class Once(IterableDataset):
    """An iterable whose 3 batches come in one pass only: the first (a user's mistake: an exhausted iterator), or with
    ``late`` the second (the first epoch has none)."""

    def __init__(self, late: bool = False) -> None:
        generator = torch.Generator().manual_seed(int(os.environ["RANK"]))
        self.batches = [(x, (x.sum(1) > 0).long()) for x in torch.randn(3, 4, 6, generator=generator)]
        self.passes = [[], self.batches] if late else [self.batches]

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        return iter(self.passes.pop(0) if self.passes else [])


class RankShare(Sampler[int]):
    """A sampler of one's own that gives rank ``r`` the indices ``r, r + 2, ...``, rank 1 four fewer."""

    def __init__(self, size: int) -> None:
        rank = int(os.environ["RANK"])
        self.indices = list(range(rank, size, 2))[: size // 2 - 4 * rank]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class Classifier(L.LightningModule):
    pipeline_body = "net"  # for hybrid_pipeline

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
        self.trained = 0

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:  # for hybrid_pipeline
        return F.cross_entropy(output, target)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self.trained += 1
        x, y = batch
        return self.pipeline_loss(self(x), y)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class IteratorStep(Classifier):
    """The classifier with a ``training_step`` that reads its batch from ``dataloader_iter``."""

    def training_step(self, dataloader_iter: Iterator[Any]) -> Tensor:  # type: ignore[override]
        batch, batch_idx, _ = next(dataloader_iter)
        return super().training_step(batch, batch_idx)


def loader(data: str, alike: bool) -> DataLoader:
    if data in ("once", "late"):
        return DataLoader(Once(late=data == "late"), batch_size=None)
    if data.startswith("stream"):  # stream5-4: 5 batches on rank 0, 4 on rank 1
        counts = tuple(int(n) for n in data[len("stream") :].split("-"))
        return DataLoader(Stream(counts, alike), batch_size=None)  # type: ignore[arg-type]
    generator = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(36, 6, generator=generator), torch.randint(0, 2, (36,), generator=generator))
    return DataLoader(dataset, batch_size=4, sampler=RankShare(len(dataset)))  # 5 batches on rank 0, 4 on rank 1


def strategy(name: str) -> Any:
    if name == "ring_allreduce":
        return RingAllReduceStrategy(timeout=TIMEOUT)
    if name == "ring_fault_tolerant":  # not checked: a batch the others never join fails its tries and gives up
        tolerance = FaultTolerance(timeout_s=3.0, heartbeat_s=0.2, stale_s=1.5, keep_global_batch=False)
        return RingAllReduceStrategy(fault_tolerant=tolerance, timeout=TIMEOUT)
    if name == "streaming_diloco":
        return LocalSGDStrategy(sync_every=2, fragments=2, delay=1, outer_precision="int8", timeout=TIMEOUT)
    return HybridPipelineStrategy(pipeline_stages=2, timeout=TIMEOUT)  # 1 replica of 2 stages


CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # name: (strategy, training data, Trainer arguments)
    "even_stream": ("streaming_diloco", "stream4-4", {"max_epochs": 2}),
    "even_stream_dataloader_iter": ("streaming_diloco", "stream4-4", {"max_epochs": 2, "dataloader_iter": True}),
    "uneven_stream_limited": ("ring_allreduce", "stream5-4", {"max_epochs": 2, "limit_train_batches": 3}),
    "uneven_stream_max_steps": ("ring_allreduce", "stream5-4", {"max_steps": 3}),  # ends before either runs out
    "exhausted_stream": ("ring_allreduce", "once", {"max_epochs": 3}),  # no rank has a batch after the first epoch
    "late_stream": ("streaming_diloco", "late", {"max_epochs": 2}),  # no rank has a batch in the first epoch
    "exhausted_reloaded": ("ring_allreduce", "once", {"max_epochs": 3, "reload_dataloaders_every_n_epochs": 1}),
    # resumed from the checkpoint of an epoch's end, saved without validation: the next epoch has no batch
    "late_after_epoch_end": ("ring_allreduce", "late", {"max_epochs": 3, "resume_after_epochs": 1}),
    # resumed from the checkpoint of the last batch of its last epoch: nothing left to run, nothing to warn of
    "resumed_after_last_batch": ("ring_allreduce", "stream4-4", {"max_epochs": 2, "resume_at_step": 8}),
    "uneven_stream_ring": ("ring_allreduce", "stream5-4", {"max_epochs": 1}),
    "uneven_stream_streaming": ("streaming_diloco", "stream5-4", {"max_epochs": 1}),
    "uneven_stream_accumulating": ("ring_allreduce", "stream5-4", {"max_epochs": 1, "accumulate_grad_batches": 3}),
    "uneven_stream_hybrid": ("hybrid_pipeline", "stream5-4", {"max_epochs": 1}),
    "uneven_sampler": ("ring_allreduce", "sampler", {"max_epochs": 1, "use_distributed_sampler": False}),
    "uneven_stream_fault_tolerant": ("ring_fault_tolerant", "stream5-4", {"max_epochs": 1}),
    "uneven_stream_dataloader_iter": ("ring_allreduce", "stream5-4", {"max_epochs": 1, "dataloader_iter": True}),
    "uneven_sampler_dataloader_iter": (
        "ring_allreduce",
        "sampler",
        {"max_epochs": 1, "use_distributed_sampler": False, "dataloader_iter": True},
    ),
}


def trainer(name: str, arguments: dict[str, Any], checkpoint: ModelCheckpoint | None = None) -> L.Trainer:
    return L.Trainer(
        strategy=strategy(name),
        accelerator="cpu",
        devices=2,
        logger=False,
        enable_checkpointing=checkpoint is not None,
        callbacks=[checkpoint] if checkpoint is not None else None,
        enable_progress_bar=False,
        enable_model_summary=False,
        **arguments,
    )


def first_fit(out: Path, name: str, data: str, arguments: dict[str, Any], alike: bool) -> str | None:
    """The checkpoint a fit resumes from, written by a first fit (popped from ``arguments``): with ``resume_at_step``
    the one of that step, after its training step; with ``resume_after_epochs`` the one of that many epochs' end, of
    a fit without validation on 3 batches a rank."""
    if (step := arguments.pop("resume_at_step", None)) is not None:
        checkpoint = ModelCheckpoint(dirpath=out / "at_step", every_n_train_steps=step, save_top_k=-1)
        trainer(name, arguments, checkpoint).fit(Classifier(), loader(data, alike), loader("stream2-2", alike))
        return str(out / "at_step" / f"epoch={arguments['max_epochs'] - 1}-step={step}.ckpt")
    if (epochs := arguments.pop("resume_after_epochs", None)) is not None:
        checkpoint = ModelCheckpoint(dirpath=out / "at_epoch_end", save_top_k=-1)
        trainer(name, {"max_epochs": epochs}, checkpoint).fit(Classifier(), loader("stream3-3", alike))
        return str(out / "at_epoch_end" / f"epoch={epochs - 1}-step={3 * epochs}.ckpt")
    return None


def run(out: Path, name: str, data: str, arguments: dict[str, Any]) -> dict[str, Any]:
    L.seed_everything(0)
    arguments, alike = dict(arguments), name == "hybrid_pipeline"  # its 2 ranks are the 2 stages of one pipeline
    model = IteratorStep() if arguments.pop("dataloader_iter", False) else Classifier()
    ckpt_path = first_fit(out, name, data, arguments, alike)
    fit = trainer(name, arguments)
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fit.fit(model, loader(data, alike), loader("stream2-2", alike), ckpt_path=ckpt_path)
        except Exception as exc:  # the case records what was raised
            error = [type(exc).__name__, str(exc)]
    empty = [str(w.message) for w in caught if "had no training batch" in str(w.message)]
    return {"error": error, "trained": model.trained, "steps": fit.global_step, "empty_epochs_warned": empty}


def main(out: Path, names: list[str]) -> None:
    rank = int(os.environ["RANK"])
    results = {name: run(out, *CASES[name]) for name in names}
    (out / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2].split(","))
