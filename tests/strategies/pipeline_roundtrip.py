"""One training run that changes strategy at every epoch through its checkpoints, and what a save communicates.

``python -m tests.strategies.pipeline_roundtrip PHASE OUTDIR``, ``PHASE`` one of:

- ``hybrid``: epoch 0 under ``hybrid_pipeline`` (2 stages, 2 ranks), saved as ``epoch=0.ckpt``;
- ``single``: epoch 1 on one device, resumed from ``epoch=0.ckpt``, saved as ``epoch=1.ckpt``; then the reference, four
  epochs on one device without a break;
- ``hybrid-ring``: epoch 2 under ``hybrid_pipeline`` from ``epoch=1.ckpt``, then epoch 3 under ``ring_allreduce``
  (2 ranks) from ``epoch=2.ckpt``.

Each run saves with ``ModelCheckpoint`` during ``fit`` and with ``trainer.save_checkpoint`` after it. Under
``hybrid_pipeline`` a :class:`CommSpy` records, per rank and per save, what the rank received: tensor bytes per
point-to-point receive, and tensor bytes inside objects of object collectives. :class:`Blocks` records which blocks
of the body each rank holds with storage during and after ``fit``. Every rank writes ``OUTDIR/{run}-rank{r}.pt``.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor

from lightning_dp_strategies import HybridPipelineStrategy
from tests.strategies.pipeline_features import SAMPLES, FeatureNet, cpu_trainer, data, loader


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors with storage inside ``obj``'s dicts, lists and tuples."""
    if isinstance(obj, Tensor):
        return 0 if obj.is_meta else obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(v) for v in obj)
    return 0


class CommSpy:
    """Wraps ``torch.distributed``'s receiving functions; counts what arrives while a save runs."""

    def __init__(self) -> None:
        self.saves: list[dict[str, int]] = []
        self._saving = False

    def install(self) -> None:
        # irecv stays as it is: the pipeline schedule's P2POp checks its identity (and a save never posts one)
        self._wrap("recv", lambda args, kwargs, result: ("recv", tensor_bytes(args[0] if args else kwargs["tensor"])))
        for name in ("gather_object", "all_gather_object", "broadcast_object_list", "scatter_object_list"):
            self._wrap(name, lambda args, kwargs, result: ("objects", tensor_bytes(args[0] if args else None)))
        for name in ("broadcast", "all_gather", "gather", "all_reduce", "all_gather_into_tensor"):
            self._wrap(name, lambda args, kwargs, result: ("collective", tensor_bytes(args[0] if args else None)))

    def _wrap(self, name: str, measure: Any) -> None:
        original = getattr(dist, name)

        @functools.wraps(original)
        def spied(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            if self._saving:
                kind, size = measure(args, kwargs, result)
                save = self.saves[-1]
                save[f"{kind}_total"] += size
                save[f"{kind}_max"] = max(save[f"{kind}_max"], size)
            return result

        setattr(dist, name, spied)

    def watch(self, trainer: L.Trainer) -> None:
        original = trainer.save_checkpoint

        def save_checkpoint(*args: Any, **kwargs: Any) -> None:
            self.saves.append({f"{k}_{m}": 0 for k in ("recv", "objects", "collective") for m in ("total", "max")})
            self._saving = True
            try:
                original(*args, **kwargs)
            finally:
                self._saving = False

        trainer.save_checkpoint = save_checkpoint  # type: ignore[method-assign]


SPY = CommSpy()  # one per process: it wraps torch.distributed's functions once


def built(module: L.LightningModule) -> list[int]:
    """The blocks of the body with parameters that hold storage (are not on the meta device)."""
    body = module._modules["body"]
    assert body is not None
    return [
        i
        for i, block in enumerate(body)
        if any(True for _ in block.parameters()) and not any(p.is_meta for p in block.parameters())
    ]


class Blocks(L.Callback):
    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        layout = getattr(trainer.strategy, "layout", None)
        self.seen["owned"] = list(layout.local_blocks) if layout is not None else None
        self.seen["start"] = built(module)


def run(name: str, stages: int, world: int, strategy: Any, epoch: int, out: Path, resume: Path | None) -> None:
    blocks, spy = Blocks(), SPY
    spy.saves = []
    saver = ModelCheckpoint(dirpath=out, filename="{epoch}", save_top_k=-1)  # epoch=0.ckpt, ...
    trainer, replica, replicas = cpu_trainer(
        stages,
        world,
        strategy,
        max_epochs=epoch + 1,
        logger=False,
        enable_model_summary=False,
        callbacks=[saver, blocks],
    )
    spy.watch(trainer)
    model = FeatureNet()
    trainer.fit(model, loader(data(SAMPLES, 1), replica, replicas), ckpt_path=resume)
    trainer.save_checkpoint(out / f"{name}-after-fit.ckpt")
    result = {**blocks.seen, "after": built(model), "saves": spy.saves}
    if trainer.global_rank == 0:
        result["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.save(result, out / f"{name}-rank{trainer.global_rank}.pt")


def main(phase: str, out: Path) -> None:
    if phase != "single":
        SPY.install()
    hybrid = HybridPipelineStrategy(pipeline_stages=2, micro_batches=2, timeout=60)
    if phase == "hybrid":
        run("hybrid0", 2, 2, hybrid, 0, out, None)
    elif phase == "single":
        run("single1", 0, 1, None, 1, out, out / "epoch=0.ckpt")
        run("reference", 0, 1, None, 3, out / "reference", None)
    else:
        run("hybrid2", 2, 2, hybrid, 2, out, out / "epoch=1.ckpt")
        run("ring3", 1, 2, "ring_allreduce", 3, out, out / "epoch=2.ckpt")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
