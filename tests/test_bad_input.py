"""The bad-input catalogue: misuses of the three strategies, each refused before training with a message naming the fix.

Every entry does one wrong thing (a wrong type, an out-of-range option, an impossible device or stage layout, an
unsupported precision, a missing opt-in, a world size that does not fit) and states the exception, a regex for the
remedy the message must name, and *when* the error comes:

- ``construction`` / ``trainer``: building the strategy or the ``Trainer`` raises; nothing can have trained.
- ``environment``: ``strategy.setup_environment()``, the first thing ``fit`` does, raises (called directly: the
  check is about GPUs, which CI has none of).
- ``setup``: ``trainer.fit`` raises while setting up; the :class:`Probe` proves that ``training_step`` never ran.
- ``first step``: the mistake is only visible in the first batch (the arguments of ``forward``, the batch layout);
  the error comes before any backward or optimizer step and the parameters are untouched.

The multi-process strategies run here in-process with one rank (``devices=1``: Lightning's launcher starts no other
process), except the one layout that needs two pipeline stages, which runs on two ranks with a timeout.
"""

from __future__ import annotations

import os
import pickle
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import BaseFinetuning, ModelPruning, StochasticWeightAveraging, WeightAveraging
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp_strategies import (
    HybridPipelineStrategy,
    LocalSGDStrategy,
    RingAllReduceStrategy,
    ScatterGatherStrategy,
)
from lightning_dp_strategies.reducers import AutoReducer
from tests.helpers.distributed import run_distributed

QUIET: dict[str, Any] = {
    "accelerator": "cpu",
    "max_steps": 2,
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


# ---------------------------------------------------------------------------------------------- the probe
class Probe(L.LightningModule):
    """A tiny model opted in to every strategy that counts what training did (none of it may happen here)."""

    pipeline_body = "body"

    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(*[nn.Linear(4, 4) for _ in range(blocks)])
        self.initial: dict[str, Tensor] = {}
        self.started = 0  # training_step entered
        self.finished = 0  # training batches completed
        self.optimizer_steps = 0

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return F.mse_loss(output, target)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        self.started += 1
        x, y = batch
        return self.pipeline_loss(self(x), y)

    def on_train_batch_end(self, *args: Any) -> None:
        self.finished += 1

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer_steps += 1

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def snapshot(self) -> Probe:
        """Remember the parameters as they are before ``fit``."""
        self.initial = {n: p.detach().clone() for n, p in self.named_parameters() if not is_lazy(p)}
        return self

    def counts(self) -> dict[str, int]:
        moved = any(
            not torch.equal(p.detach().cpu(), self.initial[n]) for n, p in self.named_parameters() if not is_lazy(p)
        )
        return {
            "started": self.started,
            "finished": self.finished,
            "optimizer_steps": self.optimizer_steps,
            "moved": int(moved),
        }


def is_lazy(p: Tensor) -> bool:
    """A parameter a lazy module has not made yet (its first forward makes it, and training moves it), or one on
    the meta device (no values to compare)."""
    return isinstance(p, nn.parameter.UninitializedParameter) or p.is_meta


class Lazy(Probe):
    def __init__(self) -> None:
        super().__init__()
        self.body[0] = nn.LazyLinear(4)


class MetaBuilt(Probe):
    """A probe whose body is built on the meta device (shapes, no values), as deferred initialization does."""

    def __init__(self) -> None:
        super().__init__()
        with torch.device("meta"):
            self.body = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))


class SparseEmbedding(Probe):
    """A probe with an embedding table that gets sparse gradients (``sparse=True``)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(8, 4, sparse=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x) + self.table(torch.zeros(len(x), dtype=torch.long, device=x.device))


class Frozen(Probe):
    def __init__(self) -> None:
        super().__init__()
        self.requires_grad_(False)


class NoOptIn(Probe):
    pipeline_body = None  # type: ignore[assignment]


class NoPipelineLoss(Probe):
    pipeline_loss = None  # type: ignore[assignment]


class BodyNotSequential(Probe):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)  # type: ignore[assignment]


class Manual(Probe):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class WithBatchNorm(Probe):
    def __init__(self) -> None:
        super().__init__()
        self.body.append(nn.BatchNorm1d(4))


class CompiledBlock(Probe):
    def __init__(self) -> None:
        super().__init__()
        self.body[0] = torch.compile(self.body[0])


class MaskedForward(Probe):
    """forward takes a mask without the batch dimension: it cannot be scattered across replicas."""

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:  # type: ignore[override]
        return self.body(x * mask)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        self.started += 1
        x, y = batch
        return F.mse_loss(self(x, torch.ones(1, 4)), y)


class DictBatches(Probe):
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        self.started += 1
        return self.pipeline_loss(self(batch["x"]), batch["y"])


def loader(samples: int = 16, batch_size: int = 8) -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(samples, 4, generator=generator), torch.randn(samples, 4, generator=generator))
    return DataLoader(data, batch_size=batch_size)


def dict_loader() -> DataLoader:
    rows = [{"x": torch.randn(4), "y": torch.randn(4)} for _ in range(16)]
    return DataLoader(rows, batch_size=8)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- running a misuse
@dataclass
class Run:
    """What one attempt trained (nothing, if the catalogue holds): the probes it used, local or on other ranks."""

    tmp_path: Path
    monkeypatch: pytest.MonkeyPatch
    counts: list[dict[str, int]] = field(default_factory=list)
    probes: list[Probe] = field(default_factory=list)


class UnfreezeFirst(BaseFinetuning):
    """A fine-tuning schedule: the first block frozen, then unfrozen into a parameter group of its own at epoch 1."""

    def freeze_before_training(self, pl_module: L.LightningModule) -> None:
        self.freeze(pl_module.body[0])

    def finetune_function(self, pl_module: L.LightningModule, epoch: int, optimizer: Any) -> None:
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.body[0], optimizer)


def fit(run: Run, strategy: Any, model: Probe | None = None, data: DataLoader | None = None, **trainer: Any) -> None:
    model = (Probe() if model is None else model).snapshot()
    run.probes.append(model)
    L.Trainer(strategy=strategy, **{**QUIET, **trainer}).fit(model, data if data is not None else loader())


def hybrid(**options: Any) -> HybridPipelineStrategy:
    """A hybrid strategy that fits one rank (``pipeline_stages=1``) unless told otherwise."""
    return HybridPipelineStrategy(**{"pipeline_stages": 1, **options})


def _two_rank_worker(rank: int, world_size: int, out: str, blocks: int, strategy: str) -> None:
    """One rank of ``Trainer(devices=2)`` on ``blocks`` blocks: ``strategy="hybrid"`` is
    ``HybridPipelineStrategy(pipeline_stages=2)`` (``"hybrid-swa"``, ``"hybrid-ema"``, ``"hybrid-pruning"``: with
    Lightning's ``StochasticWeightAveraging``, ``WeightAveraging`` or ``ModelPruning``; ``"hybrid-tied"``: the first
    and last blocks' weights tied), ``"ring-sync_batchnorm"`` the ring with a BatchNorm probe and
    ``sync_batchnorm=True``.

    The gloo group is already up (``run_distributed``); ``LOCAL_RANK`` tells Lightning that the ranks exist already.
    Each rank writes the error its fit raised, the probe's counts and the warnings it gave.
    """
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size))
    batchnorm = strategy == "ring-sync_batchnorm"
    model = WithBatchNorm() if batchnorm else Probe(blocks)
    if strategy == "hybrid-tied":
        model.body[-1].weight = model.body[0].weight
    model.snapshot()
    error: BaseException | None = None
    caught: list[warnings.WarningMessage] = []
    try:
        chosen: Any = (
            RingAllReduceStrategy(timeout=60) if batchnorm else HybridPipelineStrategy(pipeline_stages=2, timeout=60)
        )
        whole_model = {
            "hybrid-swa": [StochasticWeightAveraging(swa_lrs=0.1)],
            "hybrid-ema": [WeightAveraging()],
            "hybrid-pruning": [ModelPruning("l1_unstructured", amount=0.5)],
        }
        callbacks = whole_model.get(strategy, [])
        trainer = L.Trainer(strategy=chosen, devices=2, sync_batchnorm=batchnorm, callbacks=callbacks, **QUIET)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(model, loader())
    except Exception as err:
        error = err
    with open(Path(out) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump({"error": error, "counts": model.counts(), "warnings": [str(w.message) for w in caught]}, f)


def fit_on_two_ranks(run: Run, blocks: int, strategy: str = "hybrid") -> None:
    """Run :func:`_two_rank_worker` on two ranks; re-raise rank 0's error after checking both ranks raised it."""
    run_distributed(_two_rank_worker, 2, str(run.tmp_path), blocks, strategy, timeout=90)
    results = []
    for rank in range(2):
        with open(run.tmp_path / f"rank{rank}.pkl", "rb") as f:
            results.append(pickle.load(f))
    run.counts.extend(r["counts"] for r in results)
    messages = {str(r["error"]) for r in results}
    assert len(messages) == 1, f"the ranks disagree: {messages}"
    if results[0]["error"] is not None:
        raise results[0]["error"]


def missing_backend() -> str:
    """A backend that this PyTorch build lacks (the CPU wheel has only gloo)."""
    for backend in ("mpi", "ucc", "nccl", "xccl"):
        if not dist.is_backend_available(backend):
            return backend
    pytest.skip("this PyTorch build has every process-group backend")


def unknown_cuda_device(run: Run) -> None:
    """No GPU in CI: pretend to have two and ask for a third (the check runs in ``setup_environment``)."""
    run.monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    ScatterGatherStrategy(parallel_devices=["cuda:0", "cuda:2"]).setup_environment()


# ---------------------------------------------------------------------------------------------- the catalogue
CONSTRUCTION, TRAINER, ENVIRONMENT, SETUP, FIRST_STEP = "construction", "trainer", "environment", "setup", "first step"


@dataclass(frozen=True)
class Misuse:
    id: str
    attempt: Callable[[Run], object]
    error: type[BaseException] | tuple[type[BaseException], ...]
    fix: str
    """A regex for the remedy (or the allowed values) the message must name."""
    when: str = CONSTRUCTION


OPTION_ERRORS = (ValueError, TypeError)

CATALOGUE = [
    # ------------------------------------------------------------------ ring_allreduce
    Misuse(
        "ring-bucket_cap_mb-negative",
        lambda run: RingAllReduceStrategy(bucket_cap_mb=-5),
        ValueError,
        r"`bucket_cap_mb` must be a positive number of MiB \(default 25\)",
    ),
    Misuse(
        "ring-first_bucket_cap_mb-wrong-type",
        lambda run: RingAllReduceStrategy(first_bucket_cap_mb="1"),  # type: ignore[arg-type]
        ValueError,
        r"`first_bucket_cap_mb` must be a positive number of MiB \(default 1\)",
    ),
    Misuse(
        "ring-process_group_backend-unknown",
        lambda run: RingAllReduceStrategy(process_group_backend="nccI"),
        ValueError,
        r"use one of \[.*'gloo'.*\].*leave it as None",
    ),
    Misuse(
        "ring-process_group_backend-not-in-this-build",
        lambda run: RingAllReduceStrategy(process_group_backend=missing_backend()),
        ValueError,
        r"which this PyTorch build does not have.*Use one of \[.*'gloo'.*\].*leave it as None",
    ),
    Misuse(
        "ring-timeout-negative",
        lambda run: RingAllReduceStrategy(timeout=-1),
        ValueError,
        r"must be a datetime\.timedelta or a positive number of seconds",
    ),
    Misuse(
        "ring-start_method-unknown",
        lambda run: RingAllReduceStrategy(start_method="thread"),  # type: ignore[arg-type]
        ValueError,
        r"use one of \['popen', 'spawn', 'fork', 'forkserver'\]",
    ),
    Misuse(
        "ring-reducer-not-callable",
        lambda run: RingAllReduceStrategy(reducer=42),  # type: ignore[arg-type]
        OPTION_ERRORS,
        "reducer",
    ),
    Misuse(
        "ring-reducer-auto-unknown-restriction",
        lambda run: RingAllReduceStrategy(reducer=AutoReducer(allow="fastest")),
        ValueError,
        r"use 'all', 'lossless' \(the plain ring only, one or two levels\) or a tuple of",
    ),
    Misuse(
        "ring-no-trainable-parameters",
        lambda run: fit(run, "ring_allreduce", Frozen(), devices=1),
        ValueError,
        r"Unfreeze at least one parameter",
        SETUP,
    ),
    Misuse(
        "ring-lazy-module",
        lambda run: fit(run, "ring_allreduce", Lazy(), devices=1),
        ValueError,
        r"`body\.0\.weight`, `body\.0\.bias` do not exist yet.*Run one forward on a sample batch before training",
        SETUP,
    ),
    Misuse(
        "ring-meta-built-module",
        lambda run: fit(run, "ring_allreduce", MetaBuilt(), devices=1),
        ValueError,
        r"`body\.0\.weight`.* are on the meta device.*Build the model on the CPU, or train with "
        r"strategy='hybrid_pipeline'",
        SETUP,
    ),
    Misuse(
        "ring-sparse-embedding",
        lambda run: fit(run, "ring_allreduce", SparseEmbedding(), devices=1),
        ValueError,
        r"`table\.weight` \(`nn\.Embedding\(\.\.\., sparse=True\)`\) gets sparse gradients.*Pass `sparse=False`",
        SETUP,
    ),
    Misuse(
        "local_sgd-finetuning-callback",  # it unfreezes parameters that local SGD would never average
        lambda run: fit(run, LocalSGDStrategy(sync_every=2), devices=1, callbacks=[UnfreezeFirst()]),
        ValueError,
        r"cannot run under local SGD.*trainable before `fit`.*strategy='ring_allreduce'",
        SETUP,
    ),
    Misuse(
        "ring-sharded-finetuning-callback",  # its groups name the module's parameters; the shards are not those
        lambda run: fit(run, RingAllReduceStrategy(shard_optimizer_state=True), devices=1, callbacks=[UnfreezeFirst()]),
        ValueError,
        r"cannot run with shard_optimizer_state=True.*shard_optimizer_state=False",
        SETUP,
    ),
    Misuse(
        "ring-sharded-lottery-ticket",  # it replaces parameters' storage, which the pieces view
        lambda run: fit(
            run,
            RingAllReduceStrategy(shard_optimizer_state=True),
            devices=1,
            callbacks=[ModelPruning("l1_unstructured", amount=0.5)],
        ),
        ValueError,
        r"ModelPruning with `use_lottery_ticket_hypothesis` \(its default\) cannot run with "
        r"shard_optimizer_state=True.*use_lottery_ticket_hypothesis=False",
        SETUP,
    ),
    Misuse(
        "ring-sparse-embedding-local-sgd-warm-up",  # the warm-up's gradients are averaged in the buckets
        lambda run: fit(run, LocalSGDStrategy(sync_every=2, warmup_steps=1), SparseEmbedding(), devices=1),
        ValueError,
        r"gets sparse gradients.*without `warmup_steps`",
        SETUP,
    ),
    Misuse(
        "ring-sync_batchnorm-on-cpu-processes",
        lambda run: fit_on_two_ranks(run, blocks=2, strategy="ring-sync_batchnorm"),
        ValueError,
        r"needs GPUs.*Drop `sync_batchnorm=True`",
        SETUP,
    ),
    # ------------------------------------------------------------------ scatter_gather / dp
    Misuse(
        "dp-dim-negative",
        lambda run: ScatterGatherStrategy(dim=-1),
        ValueError,
        r"`dim` must be a non-negative int \(the batch dimension, default 0\)",
    ),
    Misuse(
        "dp-dim-wrong-type",
        lambda run: ScatterGatherStrategy(dim="0"),  # type: ignore[arg-type]
        ValueError,
        r"`dim` must be a non-negative int",
    ),
    Misuse(
        "dp-devices-mixed-types",
        lambda run: ScatterGatherStrategy(parallel_devices=["cpu", "cuda:0"]),
        ValueError,
        r"needs devices of one type, e\.g\. \['cuda:0', 'cuda:1'\] or \['cpu'\] \* 3",
    ),
    Misuse(
        "dp-device-unknown",
        lambda run: ScatterGatherStrategy(parallel_devices=["tpu:0"]),
        ValueError,
        r"use 'cpu', 'cuda:<index>' or a torch\.device",
    ),
    Misuse(
        "dp-device-type-unsupported",
        lambda run: ScatterGatherStrategy(parallel_devices=["meta", "meta"]),
        ValueError,
        r"Use accelerator='cuda' \(one replica per GPU\) or accelerator='cpu'",
    ),
    Misuse(
        "dp-devices-empty",
        lambda run: ScatterGatherStrategy(parallel_devices=[]),
        ValueError,
        r"Expected a non-empty list of devices such as",
    ),
    Misuse(
        "dp-cuda-device-out-of-range",
        unknown_cuda_device,
        ValueError,
        r"Give explicit indices below 2, e\.g\. `devices=\[0, 1\]`",
        ENVIRONMENT,
    ),
    Misuse(
        "dp-num_nodes-more-than-one",
        lambda run: L.Trainer(strategy="dp", devices=2, num_nodes=2, **QUIET),
        ValueError,
        r"Drop `num_nodes`.*strategy='ring_allreduce'",
        TRAINER,
    ),
    Misuse(
        "dp-sync_batchnorm",
        lambda run: fit(run, "dp", WithBatchNorm(), devices=2, sync_batchnorm=True),
        ValueError,
        r"Drop `sync_batchnorm=True`",
        SETUP,
    ),
    Misuse(
        "dp-compiled-submodule",
        lambda run: fit(run, "dp", CompiledBlock(), devices=2),
        ValueError,
        r"train without torch\.compile here, or with one process per device \(strategy='ring_allreduce'",
        SETUP,
    ),
    Misuse(
        "dp-lazy-module",
        lambda run: fit(run, "dp", Lazy(), devices=2),
        ValueError,
        r"ScatterGatherStrategy needs every parameter when it sets up.*Run one forward on a sample batch",
        SETUP,
    ),
    Misuse(
        "dp-meta-built-module",
        lambda run: fit(run, "dp", MetaBuilt(), devices=2),
        ValueError,
        r"ScatterGatherStrategy holds the whole model on each of its devices.*Build the model on the CPU",
        SETUP,
    ),
    Misuse(
        "dp-no-trainable-parameters",
        lambda run: fit(run, "dp", Frozen(), devices=2),
        ValueError,
        r"Unfreeze at least one parameter",
        SETUP,
    ),
    Misuse(
        "dp-forward-argument-cannot-be-split",
        lambda run: fit(run, "dp", MaskedForward(), devices=2),
        ValueError,
        r"cannot split the arguments of forward.*pass tensors shared by all samples as module buffers",
        FIRST_STEP,
    ),
    # ------------------------------------------------------------------ hybrid_pipeline: options
    Misuse(
        "hybrid-pipeline_stages-zero",
        lambda run: HybridPipelineStrategy(pipeline_stages=0),
        ValueError,
        r"`pipeline_stages` must be an integer >= 1",
    ),
    Misuse(
        "hybrid-micro_batches-float",
        lambda run: HybridPipelineStrategy(micro_batches=2.0),  # type: ignore[arg-type]
        ValueError,
        r"`micro_batches` must be an integer >= 1",
    ),
    Misuse(
        "hybrid-fault_tolerant",
        lambda run: HybridPipelineStrategy(fault_tolerant=True),  # type: ignore[call-arg]
        TypeError,
        r"offered by the Trainer's RingAllReduceStrategy and LocalSGDStrategy only.*restart from the last checkpoint",
    ),
    Misuse(
        "hybrid-schedule-unknown",
        lambda run: HybridPipelineStrategy(schedule="interleaved"),  # type: ignore[arg-type]
        ValueError,
        r"use one of \['gpipe', '1f1b', 'interleaved_1f1b', 'looped_bfs', 'interleaved_zb', 'zbv'\]",
    ),
    Misuse(
        "hybrid-chunks-for-1f1b",
        lambda run: HybridPipelineStrategy(schedule="1f1b", virtual_stages=2),
        ValueError,
        r"use virtual_stages=1, or a schedule with several chunks per rank: \['interleaved_1f1b'",
    ),
    Misuse(
        "hybrid-balance-unknown-name",
        lambda run: HybridPipelineStrategy(balance="memory"),  # type: ignore[arg-type]
        ValueError,
        r"use 'parameters', 'time', or a list of blocks per stage",
    ),
    Misuse(
        "hybrid-balance-wrong-type",
        lambda run: HybridPipelineStrategy(balance=5),  # type: ignore[arg-type]
        ValueError,
        r"must be 'parameters', 'time', or a list of blocks per stage \(e\.g\. \[1, 1\]",
    ),
    Misuse(
        "hybrid-balance-wrong-length",
        lambda run: HybridPipelineStrategy(pipeline_stages=2, balance=[1, 1, 1]),
        ValueError,
        r"must list the number of blocks of each of the 2 stages, each >= 1",
    ),
    Misuse(
        "hybrid-bucket_cap_mb-zero",
        lambda run: HybridPipelineStrategy(bucket_cap_mb=0),
        ValueError,
        r"`bucket_cap_mb` must be a positive number of MiB",
    ),
    Misuse(
        "hybrid-timeout-wrong-type",
        lambda run: HybridPipelineStrategy(timeout="5 minutes"),  # type: ignore[arg-type]
        ValueError,
        r"a datetime\.timedelta or a positive number of seconds, got '5 minutes'; None picks",
    ),
    Misuse(
        "hybrid-process_group_backend-unknown",
        lambda run: HybridPipelineStrategy(process_group_backend="tcp"),
        ValueError,
        r"use one of \[.*'gloo'.*\]",
    ),
    Misuse(
        "hybrid-start_method-unknown",
        lambda run: HybridPipelineStrategy(start_method="threads"),  # type: ignore[arg-type]
        ValueError,
        r"use one of \['popen', 'spawn', 'fork', 'forkserver'\]",
    ),
    Misuse(
        "hybrid-reducer-not-callable",
        lambda run: HybridPipelineStrategy(reducer=42),  # type: ignore[arg-type]
        OPTION_ERRORS,
        "reducer",
    ),
    Misuse(
        "hybrid-reducer-auto",
        lambda run: HybridPipelineStrategy(reducer="auto"),
        ValueError,
        r"`reducer='auto'` is not supported by HybridPipelineStrategy.*Name one instead: reducer='ring'",
    ),
    Misuse(
        "hybrid-log_pipeline_stats-not-a-bool",
        lambda run: HybridPipelineStrategy(log_pipeline_stats="no"),  # type: ignore[arg-type]
        TypeError,
        r"`log_pipeline_stats` must be True or False",
    ),
    # ------------------------------------------------------------------ hybrid_pipeline: world and layout
    Misuse(
        "hybrid-world-not-divisible-by-stages",
        lambda run: L.Trainer(strategy=HybridPipelineStrategy(pipeline_stages=2), devices=3, **QUIET),
        ValueError,
        r"Use devices=2 or 4, or pipeline_stages in \[1, 3\]",
        TRAINER,
    ),
    Misuse(
        "hybrid-fewer-devices-than-stages",
        lambda run: L.Trainer(strategy=HybridPipelineStrategy(pipeline_stages=2), devices=1, **QUIET),
        ValueError,
        r"Use devices=2, or pipeline_stages in \[1\]",
        TRAINER,
    ),
    Misuse(
        "hybrid-nodes-times-devices-not-divisible",
        lambda run: L.Trainer(strategy=HybridPipelineStrategy(pipeline_stages=4), devices=1, num_nodes=2, **QUIET),
        ValueError,
        r"Use devices=2 per node \(2 nodes\), or pipeline_stages in \[1, 2\]",
        TRAINER,
    ),
    Misuse(
        "hybrid-sync_batchnorm",
        lambda run: L.Trainer(strategy=hybrid(), devices=1, sync_batchnorm=True, **QUIET),
        ValueError,
        r"Drop `sync_batchnorm=True`.*strategy='ring_allreduce'",
        TRAINER,
    ),
    *[
        Misuse(
            f"hybrid-{callback}-over-stages",
            lambda run, callback=callback: fit_on_two_ranks(run, blocks=2, strategy=f"hybrid-{callback}"),
            ValueError,
            r"is not supported by HybridPipelineStrategy.*Use strategy='ring_allreduce'",
            SETUP,
        )
        for callback in ("swa", "ema", "pruning")
    ],
    Misuse(
        "hybrid-tied-weights-across-stages",
        lambda run: fit_on_two_ranks(run, blocks=2, strategy="hybrid-tied"),
        ValueError,
        r"`body\.0\.weight` and `body\.1\.weight` are one tensor \(tied weights\).*block 0 on stage 0 and block 1 on "
        r"stage 1.*Untie them.*strategy='ring_allreduce'",
        SETUP,
    ),
    Misuse(
        "hybrid-more-stages-than-blocks",
        lambda run: fit_on_two_ranks(run, blocks=1),
        ValueError,
        r"Use at most pipeline_stages=1, or split the body into more blocks",
        SETUP,
    ),
    Misuse(
        "hybrid-empty-body",
        lambda run: fit(run, hybrid(), Probe(blocks=0), devices=1),
        ValueError,
        r"Put the model's layers into its nn\.Sequential, at least 1",
        SETUP,
    ),
    Misuse(
        "hybrid-lazy-module",
        lambda run: fit(run, hybrid(), Lazy(), devices=1),
        ValueError,
        r"HybridPipelineStrategy needs every parameter when it sets up.*Run one forward on a sample batch",
        SETUP,
    ),
    Misuse(
        "hybrid-balance-does-not-cover-the-blocks",
        lambda run: fit(run, hybrid(balance=[2]), Probe(blocks=3), devices=1),
        ValueError,
        r"make the entries sum to 3, or pass balance='parameters'",
        SETUP,
    ),
    Misuse(
        "hybrid-balance-time-without-example_input_array",
        lambda run: fit(run, hybrid(balance="time"), devices=1),
        ValueError,
        r"Set `self\.example_input_array = torch\.randn\(batch, \.\.\.\)`.*or use balance='parameters'",
        SETUP,
    ),
    # ------------------------------------------------------------------ hybrid_pipeline: the module's opt-in
    Misuse(
        "hybrid-opt-in-missing",
        lambda run: fit(run, hybrid(), NoOptIn(), devices=1),
        TypeError,
        r"class attribute `pipeline_body = \"<attribute>\"`.*For example",
        SETUP,
    ),
    Misuse(
        "hybrid-opt-in-pipeline_loss-missing",
        lambda run: fit(run, hybrid(), NoPipelineLoss(), devices=1),
        TypeError,
        r"a method `pipeline_loss\(self, output, target\) -> Tensor`",
        SETUP,
    ),
    Misuse(
        "hybrid-opt-in-body-not-sequential",
        lambda run: fit(run, hybrid(), BodyNotSequential(), devices=1),
        TypeError,
        r"wrap the blocks in nn\.Sequential",
        SETUP,
    ),
    Misuse(
        "hybrid-manual-optimization",
        lambda run: fit(run, hybrid(), Manual(), devices=1),
        ValueError,
        r"Remove `self\.automatic_optimization = False`",
        SETUP,
    ),
    Misuse(
        "hybrid-no-trainable-parameters",
        lambda run: fit(run, hybrid(), Frozen(), devices=1),
        ValueError,
        r"Unfreeze at least one parameter",
        SETUP,
    ),
    Misuse(
        "hybrid-precision-16-mixed",
        lambda run: fit(run, hybrid(), devices=1, plugins=[MixedPrecision("16-mixed", "cpu")]),
        ValueError,
        r"Use precision='bf16-mixed' or '32-true'",
        SETUP,
    ),
    # ------------------------------------------------------------------ hybrid_pipeline: batches
    Misuse(
        "hybrid-batch-smaller-than-micro_batches",
        lambda run: fit(run, hybrid(micro_batches=16), devices=1),
        ValueError,
        r"Use a batch size of at least 16 per data-parallel replica.*or micro_batches <= 8",
        SETUP,
    ),
    Misuse(
        "hybrid-batch-not-a-multiple-of-micro_batches",
        lambda run: fit(run, hybrid(micro_batches=3), devices=1),
        ValueError,
        r"Use a batch size that is a multiple of 3 \(e\.g\. \[6, 9, 12\]\), or micro_batches in \[1, 2\]",
        SETUP,
    ),
    Misuse(
        "hybrid-batch-not-inputs-and-target",
        lambda run: fit(run, hybrid(), DictBatches(), dict_loader(), devices=1),
        TypeError,
        r"Define `pipeline_split_batch\(self, batch\) -> \(inputs, target\)`",
        FIRST_STEP,
    ),
]


@pytest.fixture(autouse=True)
def _isolated_process_state() -> Iterator[None]:
    """Lightning's launcher sets ``LOCAL_RANK``, ``MASTER_PORT``... and the thread count; a one-rank run leaves a
    process group behind. Restore all of it so that no later test believes it is a launched rank."""
    environ, threads = dict(os.environ), torch.get_num_threads()
    try:
        yield
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads(threads)


def test_the_catalogue_covers_every_strategy_and_kind_of_mistake() -> None:
    ids = [m.id for m in CATALOGUE]
    assert len(ids) == len(set(ids)) and len(ids) >= 24
    for prefix in ("ring-", "dp-", "hybrid-"):
        assert sum(i.startswith(prefix) for i in ids) >= 8, prefix
    assert {m.when for m in CATALOGUE} == {CONSTRUCTION, TRAINER, ENVIRONMENT, SETUP, FIRST_STEP}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("misuse", CATALOGUE, ids=[m.id for m in CATALOGUE])
def test_misuse_is_refused_before_training_naming_the_fix(
    misuse: Misuse, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = Run(tmp_path, monkeypatch)
    with pytest.raises(misuse.error) as failure:
        misuse.attempt(run)
    message = str(failure.value)
    assert re.search(misuse.fix, message, re.DOTALL), f"the message does not name the fix {misuse.fix!r}:\n{message}"

    counts = run.counts + [probe.counts() for probe in run.probes]
    if misuse.when in (CONSTRUCTION, TRAINER, ENVIRONMENT):
        assert not counts, "an error before setup must not need a model"
    else:
        assert counts, "a setup or first-step error is raised by trainer.fit on a probe"
    if misuse.when == SETUP:
        assert all(c["started"] == 0 for c in counts), f"training_step ran before the error: {counts}"
    for c in counts:  # first step included: no batch completed, nothing was stepped, the parameters are untouched
        assert c["finished"] == c["optimizer_steps"] == c["moved"] == 0, f"training got under way: {counts}"


@pytest.mark.parametrize(
    ("strategy", "devices", "model"),
    [("dp", 2, Probe), ("ring_allreduce", 1, Probe), ("hybrid_pipeline", 1, Probe), ("local_sgd", 1, SparseEmbedding)],
)
@pytest.mark.timeout(120)
def test_the_probe_trains_when_used_correctly(strategy: str, devices: int, model: type[Probe]) -> None:
    """The control: the probe's counters do move, so zero counts above mean that training never started. Local SGD
    without warm-up averages no gradients, so it trains a sparse embedding."""
    chosen = hybrid() if strategy == "hybrid_pipeline" else strategy  # the registered name has 2 stages
    probe = model().snapshot()
    L.Trainer(strategy=chosen, devices=devices, **QUIET).fit(probe, loader())
    counts = probe.counts()
    assert counts["started"] == counts["finished"] == counts["optimizer_steps"] == 2 and counts["moved"] == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("move_to_device", [True, False], ids=["moved", "not-moved"])
@pytest.mark.parametrize("strategy", ["ring_allreduce", "local_sgd", "scatter_gather"])
def test_fabric_refuses_a_module_built_on_the_meta_device_naming_the_fix(strategy: str, move_to_device: bool) -> None:
    """Under Fabric the module moves to the device before the strategy sets it up: refused there, or in the set-up
    when ``move_to_device=False``."""
    fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=1)
    fabric.launch()
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"`0\.weight`, .* are on the meta device.*Build the model on the CPU"):
        fabric.setup(model, move_to_device=move_to_device)


class PlainModule(L.LightningModule):
    """A module that overrides no hook that sees the gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return F.mse_loss(self.layer(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ReadsGradients(PlainModule):
    """A module whose hook reads the gradients (as a gradient-norm logger does)."""

    def on_after_backward(self) -> None:
        self.norms = [p.grad.norm() for p in self.parameters() if p.grad is not None]


@pytest.mark.timeout(60)
def test_sharded_state_warns_of_a_hook_that_reads_the_module_gradients() -> None:
    """With sharded optimizer state the module's ``.grad`` is ``None`` in ``on_after_backward``: a module that
    overrides the hook is warned at setup, naming it and the fix; one that does not is not."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        L.Trainer(strategy="ring_allreduce_sharded", devices=1, **QUIET).fit(PlainModule(), loader())
        L.Trainer(strategy="ring_allreduce_sharded", devices=1, **QUIET).fit(ReadsGradients(), loader())
    found = [str(w.message) for w in caught if "will find no gradient" in str(w.message)]
    assert len(found) == 1, found
    assert re.match(r"ReadsGradients\.on_after_backward will find no gradient .*shard_optimizer_state=False", found[0])


@pytest.mark.timeout(150)
def test_hybrid_over_stages_warns_of_a_hook_that_reads_the_module_gradients(tmp_path: Path) -> None:
    """Over two stages a rank holds its stage's gradients only: the probe's ``on_before_optimizer_step`` is warned of
    on rank 0 (a norm computed there is the stage's), naming ``gradient_clip_val``."""
    run_distributed(_two_rank_worker, 2, str(tmp_path), 2, "hybrid", timeout=90)
    with open(tmp_path / "rank0.pkl", "rb") as f:
        result = pickle.load(f)
    assert result["error"] is None, result["error"]
    found = [w for w in result["warnings"] if "pipeline stage's gradients" in w]
    assert len(found) == 1, result["warnings"]
    assert re.match(
        r"Probe\.on_before_optimizer_step will find only this rank's pipeline stage's .*gradient_clip_val", found[0]
    )
