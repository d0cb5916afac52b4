"""What a comparison trains: the demo or the user's model and data, checked in the parent, pickled for the workers.

A :class:`Task` holds factories, never built objects: every strategy's worker builds the model afresh under the same
seed, so every run starts from the same weights. Factories are pickled by reference when they are importable, and by
value with ``cloudpickle`` when they live in a notebook or script (``__main__``).
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor

from lightning_dp_strategies.compare.demo import DemoClassifier, DemoConfig
from lightning_dp_strategies.compare.spec import PRECISIONS
from lightning_dp_strategies.data_parallel.pytree import _children, _rebuild

Factory = Callable[[], Any]


@dataclass
class Task:
    """One comparison's workload, identical for every strategy: the model and data factories and the Trainer settings.

    ``demo`` is set for the built-in demo, whose model slices each global batch itself; otherwise ``data`` (or the
    model's own ``train_dataloader``) yields global batches and each data-parallel replica trains on its slice.
    """

    model: Factory
    data: Factory | None = None
    demo: DemoConfig | None = None
    steps: int = 30
    seed: int = 0
    precision: str = "32-true"
    accelerator: str = "cpu"
    label: str = "demo"

    def build_model(self) -> L.LightningModule:
        """The model, built under the comparison's seed (the same initial weights in every run)."""
        L.seed_everything(self.seed, verbose=False)
        model = self.model()
        if not isinstance(model, L.LightningModule):
            raise ValueError(
                f"the model factory {self.label!r} returned {type(model).__name__}, not a LightningModule; pass the"
                " LightningModule class or a function that returns an instance"
            )
        return model

    def build_data(self) -> L.LightningDataModule | Iterable[Any] | None:
        """The user's data: a LightningDataModule or an iterable of global batches (``None``: the model's own)."""
        if self.data is None:
            return None
        L.seed_everything(self.seed, verbose=False)
        data = self.data()
        if isinstance(data, L.LightningDataModule) or (isinstance(data, Iterable) and not isinstance(data, Tensor)):
            return data
        raise ValueError(
            f"the data factory returned {type(data).__name__}; it must return a LightningDataModule or a DataLoader"
        )


def resolve(reference: str) -> Factory:
    """``"package.module:attribute"`` to the callable it names, importing the module (the current folder first).

    Examples:
        >>> resolve("lightning_dp_strategies.compare.demo:DemoConfig")().steps
        30
        >>> resolve("no_colon")
        Traceback (most recent call last):
        ...
        ValueError: 'no_colon' is not of the form package.module:factory (a module path, a colon, a callable's name)
    """
    module_name, sep, attribute = reference.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(
            f"{reference!r} is not of the form package.module:factory (a module path, a colon, a callable's name)"
        )
    if os.getcwd() not in sys.path:  # as `python -m` does: modules beside the user are importable
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{reference!r}: cannot import {module_name!r} ({err}); check the module path") from err
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{reference!r}: module {module_name!r} has no attribute {attribute!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{reference!r} is a {type(obj).__name__}, not a callable that builds the object")
    return obj


def _as_factory(value: Any, what: str) -> tuple[Factory, str]:
    if isinstance(value, str):
        return resolve(value), value
    if isinstance(value, (L.LightningModule, L.LightningDataModule, torch.utils.data.DataLoader)):
        raise ValueError(
            f"{what} must be built afresh for every strategy: pass its class or a function that returns it, not the"
            f" {type(value).__name__} instance"
        )
    if not callable(value):
        raise ValueError(f"{what} must be a callable (a class or a function) or 'package.module:factory'")
    return value, getattr(value, "__qualname__", repr(value))


def make_task(
    model: Any = None,
    data: Any = None,
    *,
    demo: DemoConfig | None = None,
    steps: int | None = None,
    seed: int = 0,
    precision: str = "32-true",
    accelerator: str = "cpu",
) -> Task:
    """Check what to train and build a :class:`Task`; every mistake is a ``ValueError`` naming the fix.

    Examples:
        >>> task = make_task(demo=DemoConfig(steps=4, model_size="small"))
        >>> task.label, task.steps, type(task.build_model()).__name__
        ('the demo (small MLP)', 4, 'DemoClassifier')
        >>> make_task(data="x:y")
        Traceback (most recent call last):
        ...
        ValueError: the data (datamodule= or train_dataloaders=) needs model=: the demo brings its own data
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    if steps is not None and steps < 1:
        raise ValueError(f"steps must be at least 1 (got {steps})")
    if model is None:
        if data is not None:
            raise ValueError("the data (datamodule= or train_dataloaders=) needs model=: the demo brings its own data")
        config = demo or DemoConfig()
        if steps is not None and steps != config.steps:
            config = replace(config, steps=steps)
        if config.global_batch < 1:
            raise ValueError(f"the global batch must be at least 1 (got {config.global_batch})")
        label = f"the demo ({config.model_size} MLP)"
        return Task(_DemoFactory(config), None, config, config.steps, config.seed, precision, accelerator, label)
    if demo is not None:
        raise ValueError("the demo's settings (model size, global batch) do not apply to your model: drop them")
    factory, label = _as_factory(model, "model")
    data_factory = _as_factory(data, "data")[0] if data is not None else None
    return Task(factory, data_factory, None, steps or 30, seed, precision, accelerator, label)


@dataclass(frozen=True)
class _DemoFactory:
    config: DemoConfig

    def __call__(self) -> DemoClassifier:
        return DemoClassifier(self.config)


# ------------------------------------------------------------------------------------------ pickling for the workers


def dump_task(task: Task, path: Path) -> None:
    """Write the task for the workers: plain pickle when every factory is importable, else ``cloudpickle``."""
    buffer = io.BytesIO()
    try:
        if any(getattr(f, "__module__", None) == "__main__" for f in (task.model, task.data) if f is not None):
            raise pickle.PicklingError("defined in __main__")
        pickle.dump(task, buffer)
    except (pickle.PicklingError, AttributeError, TypeError) as err:
        try:
            import cloudpickle
        except ImportError:
            raise ValueError(
                f"the model or data factory cannot be sent to the worker processes ({err}): define it in an"
                " importable module and pass 'module:factory', or `pip install cloudpickle` (the `notebooks` extra"
                " installs it) so that notebook-defined factories travel by value"
            ) from None
        buffer = io.BytesIO()
        cloudpickle.dump(task, buffer)
    path.write_bytes(buffer.getvalue())


def load_task(path: Path) -> Task:
    """The task :func:`dump_task` wrote (``cloudpickle`` output is ordinary pickle to load)."""
    task = pickle.loads(path.read_bytes())
    assert isinstance(task, Task)
    return task


# ---------------------------------------------------------------------------------------------- global batches


def replica_slice(batch: Any, replicas: int, rank: int) -> Any:
    """Replica ``rank``'s contiguous slice (dim 0) of every tensor in a nested batch; other leaves are shared.

    Examples:
        >>> x, y = replica_slice((torch.arange(6).view(6, 1), torch.arange(6)), replicas=2, rank=1)
        >>> x.flatten().tolist(), y.tolist()
        ([3, 4, 5], [3, 4, 5])
        >>> replica_slice(torch.zeros(5), replicas=2, rank=0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: a batch of 5 samples does not split evenly over 2 data-parallel replicas: use a batch size ...
    """
    if replicas == 1:
        return batch
    if isinstance(batch, Tensor):
        if batch.dim() == 0:
            return batch
        size = batch.shape[0]
        if size % replicas:
            raise ValueError(
                f"a batch of {size} samples does not split evenly over {replicas} data-parallel replicas: use a batch"
                f" size that is a multiple of {replicas} (and drop_last=True)"
            )
        per = size // replicas
        return batch.narrow(0, rank * per, per)
    children = _children(batch)
    if children is None:
        return batch
    return _rebuild(batch, [replica_slice(child, replicas, rank) for _, child in children])


class ReplicaSlices:
    """Iterates the user's global batches and yields this replica's slice of each."""

    def __init__(self, loader: Iterable[Any], replicas: int, rank: int) -> None:
        self.loader, self.replicas, self.rank = loader, replicas, rank

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            yield replica_slice(batch, self.replicas, self.rank)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]


def _replicas(trainer: L.Trainer) -> tuple[int, int]:
    if trainer.world_size == 1:  # one process (single device, scatter/gather): the whole global batch
        return 1, 0
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return int(kwargs.get("num_replicas", trainer.world_size)), int(kwargs.get("rank", trainer.global_rank))


class GlobalBatches(L.LightningDataModule):
    """The user's data (a LightningDataModule, a DataLoader, or the model's own ``train_dataloader``) with each
    global batch cut into the data-parallel replicas' slices, so every strategy trains on the same global batches."""

    def __init__(self, data: L.LightningDataModule | Iterable[Any] | None) -> None:
        super().__init__()
        self.data = data

    def prepare_data(self) -> None:
        if isinstance(self.data, L.LightningDataModule):
            self.data.prepare_data()

    def setup(self, stage: str) -> None:
        if isinstance(self.data, L.LightningDataModule):
            self.data.trainer = self.trainer
            self.data.setup(stage)

    def train_dataloader(self) -> Any:
        assert self.trainer is not None
        if isinstance(self.data, L.LightningDataModule):
            loader = self.data.train_dataloader()
        elif self.data is None:
            loader = self.trainer.lightning_module.train_dataloader()
        else:
            loader = self.data
        return ReplicaSlices(loader, *_replicas(self.trainer))


def first_global_batch(task: Task, model: L.LightningModule) -> Any:
    """The first global batch of the task's training data, built in this process. Errors in the user's data propagate;
    ``None`` when the data is the model's own ``train_dataloader`` and that needs a Trainer."""
    data = task.build_data()
    if data is None:
        try:
            return next(iter(model.train_dataloader()))
        except Exception:
            return None
    if isinstance(data, L.LightningDataModule):
        data.prepare_data()
        data.setup("fit")
        data = data.train_dataloader()
    for batch in data:
        return batch
    raise ValueError("the training data yields no batch: check the DataLoader (or the DataModule's train_dataloader)")


def training_loss(model: L.LightningModule, batch: Any) -> float | None:
    """The model's ``training_step`` loss on ``batch``, in eval mode and without gradients (``None`` if it needs more
    than the batch, such as a Trainer)."""
    model.eval()
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # self.log() without a Trainer warns and does nothing
            out = model.training_step(batch, 0)
    except Exception:
        return None
    loss = out.get("loss") if isinstance(out, dict) else out
    return float(loss) if isinstance(loss, Tensor) and loss.numel() == 1 else None
