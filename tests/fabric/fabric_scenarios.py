"""Fabric runs for the Fabric ring_allreduce tests, and the single-process reference loop they are checked against.

Run as ``python -m tests.fabric.fabric_scenarios OUTDIR``: ``Fabric(strategy="ring_allreduce", devices=2)`` with
Fabric's popen launcher re-runs the same command for rank 1, and every scenario runs one after the other in the same
two processes (a launch costs seconds of imports, a scenario does not). Every rank writes
``OUTDIR/{scenario}-rank{r}.pt``; :func:`reference_parameters` replays the same global batches in one process.
"""

from __future__ import annotations

import functools
import itertools
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.fabric.utilities.warnings import PossibleUserWarning
from lightning.fabric.wrappers import _FabricModule
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_dp_strategies  # noqa: F401  # registers the Fabric names
from lightning_dp_strategies import FabricRingAllReduceStrategy
from lightning_dp_strategies.core.agreement import RankMismatchError
from lightning_dp_strategies.reducers import AutoReducer, NativeReducer, Reducer

WORLD = 2
SAMPLES = 44  # 22 per rank: batches of 4,4,4,4,4,2 (an uneven final batch), 6 optimizer steps per epoch
PER_RANK_BATCH = 4
EPOCHS = 2


def make_data() -> TensorDataset:
    gen = torch.Generator().manual_seed(1234)
    return TensorDataset(torch.randn(SAMPLES, 8, generator=gen), torch.randint(0, 3, (SAMPLES,), generator=gen))


def make_model(seed: int = 0, width: int = 32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 3))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2)


def params(model: nn.Module) -> dict[str, Tensor]:
    """The parameters by their own names (a set-up model's wrapper left out)."""
    module = model.module if isinstance(model, _FabricModule) else model
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def global_batches(epoch: int) -> list[list[int]]:
    """Per step of ``epoch``, the sample indices of the global batch: Fabric's ``DistributedSampler`` (no shuffling
    for a sequential loader), replayed rank by rank and joined."""
    shards = [list(DistributedSampler(range(SAMPLES), WORLD, r, shuffle=False)) for r in range(WORLD)]
    steps = -(-len(shards[0]) // PER_RANK_BATCH)
    b = PER_RANK_BATCH
    return [[i for r in range(WORLD) for i in shards[r][k * b : (k + 1) * b]] for k in range(steps)]


def reference_parameters() -> dict[str, Tensor]:
    """Plain single-process training on the same global batches: one forward and backward per step."""
    model, (x, y) = make_model(), make_data().tensors
    opt = make_optimizer(model)
    for epoch in range(EPOCHS):
        for idx in global_batches(epoch):
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
            opt.zero_grad()
    return params(model)


def launch(strategy: str | FabricRingAllReduceStrategy = "ring_allreduce") -> L.Fabric:
    fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=WORLD)
    fabric.launch()
    return fabric


# ---------------------------------------------------------------------------------------------------- scenarios
def sgd(out: Path, strategy_arg: str | FabricRingAllReduceStrategy = "ring_allreduce") -> dict[str, Any]:
    """The parity run: the registered name, rank 0's initial parameters, Fabric's loader, ``fabric.backward``,
    statistics per step."""
    fabric = launch(strategy_arg)
    model = make_model(seed=fabric.global_rank)  # rank 1 starts elsewhere: setup broadcasts rank 0's parameters
    model, opt = fabric.setup(model, make_optimizer(model))
    loader = fabric.setup_dataloaders(DataLoader(make_data(), batch_size=PER_RANK_BATCH))
    strategy = fabric.strategy
    steps = []
    for _ in range(EPOCHS):
        for x, y in loader:
            fabric.backward(F.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
            steps.append(strategy.step_stats.as_dict())
    result = {"params": params(model), "steps": steps, "buckets": len(strategy.buckets.buckets)}
    strategy.teardown()
    result["closed_totals"] = strategy.comm_stats.as_dict()
    return result


def accumulate(out: Path) -> dict[str, Any]:
    """Each step: half of the rank's batch backward inside ``no_backward_sync``, the other half synchronised."""
    fabric = launch(FabricRingAllReduceStrategy(reducer="native"))
    model = make_model()
    model, opt = fabric.setup(model, make_optimizer(model))
    loader = fabric.setup_dataloaders(DataLoader(make_data(), batch_size=PER_RANK_BATCH))
    strategy = fabric.strategy
    records = []
    for _ in range(EPOCHS):
        for x, y in loader:
            half = len(x) // 2
            before = strategy.comm_stats.copy()
            with fabric.no_backward_sync(model):
                fabric.backward(F.cross_entropy(model(x[:half]), y[:half]) * half / len(x))
            local = strategy.comm_stats - before
            fabric.backward(F.cross_entropy(model(x[half:]), y[half:]) * (len(x) - half) / len(x))
            opt.step()
            opt.zero_grad()
            records.append({"local": local.as_dict(), "step": strategy.step_stats.as_dict()})
    strategy.teardown()
    return {"params": params(model), "records": records}


def resume(out: Path) -> dict[str, Any]:
    """Save after 3 steps, train 3 more; load the checkpoint into the same objects and train the same 3 again."""
    fabric = launch("ring_allreduce")
    model = make_model()
    model, opt = fabric.setup(model, make_optimizer(model))
    loader = fabric.setup_dataloaders(DataLoader(make_data(), batch_size=PER_RANK_BATCH))
    batches = list(loader)

    def train(steps: list[tuple[Tensor, Tensor]]) -> None:
        for x, y in steps:
            fabric.backward(F.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()

    train(batches[:3])
    path = out / "resume.ckpt"
    fabric.save(path, {"model": model, "optimizer": opt, "step": 3})
    saved = {"params": params(model), "momentum": [s["momentum_buffer"].clone() for s in opt.state.values()]}
    train(batches[3:])
    uninterrupted = params(model)
    state = {"model": model, "optimizer": opt, "step": 0}
    fabric.load(path, state)
    loaded = {"params": params(model), "momentum": [s["momentum_buffer"].clone() for s in opt.state.values()]}
    train(batches[3:])
    fabric.strategy.teardown()
    return {
        "saved": saved,
        "loaded": loaded,
        "step": state["step"],
        "uninterrupted": uninterrupted,
        "resumed": params(model),
        "checkpoint_keys": sorted(torch.load(path, weights_only=True)["model"]),
    }


def refusals(out: Path) -> dict[str, Any]:
    """Ranks that build different models fail together at setup; a second trainable module and a sparse embedding
    are refused."""
    fabric = launch("ring_allreduce")
    errors = {}
    try:
        fabric.setup(make_model(width=32 + fabric.global_rank))  # rank 1's layers are wider
    except RankMismatchError as err:
        errors["mismatch"] = str(err)
    fabric.strategy.teardown()
    fabric = launch("ring_allreduce")
    fabric.setup(make_model())
    fabric.setup(make_model().requires_grad_(False))  # a frozen second module is fine
    try:
        fabric.setup(make_model())
    except ValueError as err:
        errors["second"] = str(err)
    fabric.strategy.teardown()
    fabric = launch("ring_allreduce")
    try:
        fabric.setup(nn.Sequential(nn.Embedding(8, 4, sparse=True), nn.Linear(4, 2)))
    except ValueError as err:
        errors["sparse"] = str(err)
    fabric.strategy.teardown()
    return errors


def nonfinite(out: Path, shard_optimizer_state: bool = False) -> dict[str, Any]:
    """``nonfinite_grads="skip"``: an Inf on rank 1 only skips that step on both ranks."""
    strategy = FabricRingAllReduceStrategy(nonfinite_grads="skip", shard_optimizer_state=shard_optimizer_state)
    fabric = launch(strategy)
    model = make_model()
    model, opt = fabric.setup(model, make_optimizer(model))
    x, y = make_data().tensors
    before = params(model)
    if shard_optimizer_state:  # an Inf in the first layer's bias only: in rank 1's pieces, none of rank 0's
        hook = model.module[0].bias.register_hook(lambda g: g + float("inf") * (fabric.global_rank == 1))
        fabric.backward(F.cross_entropy(model(x[:4]), y[:4]))
        hook.remove()
    else:
        loss = F.cross_entropy(model(x[:4]), y[:4]) * (float("inf") if fabric.global_rank == 1 else 1.0)
        fabric.backward(loss)
    opt.step()
    opt.zero_grad()
    skipped_unchanged = all(torch.equal(before[n], p) for n, p in params(model).items())
    fabric.backward(F.cross_entropy(model(x[:4]), y[:4]))
    opt.step()
    moved = not all(torch.equal(before[n], p) for n, p in params(model).items())
    strategy = fabric.strategy
    strategy.teardown()
    return {"skipped": strategy.nonfinite.skipped_steps, "unchanged": skipped_unchanged, "moved": moved}


def auto(out: Path) -> dict[str, Any]:
    """The parity run with ``reducer="auto"`` restricted to the lossless candidates, and what it chose."""
    strategy = FabricRingAllReduceStrategy(reducer=AutoReducer(allow="lossless", warmup_steps=3))
    reducer: list[Any] = []
    original = strategy.arrange_reducer

    def keep(given: Any) -> Any:  # the AutoReducer the strategy sets up, kept to read its decision after teardown
        reducer.append(original(given))
        return reducer[-1]

    strategy.arrange_reducer = keep  # type: ignore[method-assign]
    result = sgd(out, strategy)
    decision = reducer[0].decision
    return {**result, "chosen": decision.chosen, "predicted": decision.predicted_step_seconds}


def hook(out: Path) -> dict[str, Any]:
    """The parity run with torch's DDP ``allreduce_hook`` averaging the buckets instead of the ring."""
    return sgd(out, FabricRingAllReduceStrategy(ddp_comm_hook=allreduce_hook))


class NativeFabric(FabricRingAllReduceStrategy):
    """A Fabric strategy of a user's own that only picks its reducer."""

    def configure_reducer(self) -> Reducer:
        return NativeReducer()


def own_reducer(out: Path) -> dict[str, Any]:
    """The parity run under a subclass that only overrides ``configure_reducer``."""
    return sgd(out, NativeFabric())


def sharded_reference(steps: int, clip: float) -> dict[str, Tensor]:
    """Single-process Adam with clipping by norm over the first ``steps`` global batches of epoch 0."""
    model, (x, y) = make_model(), make_data().tensors
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for idx in global_batches(0)[:steps]:
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return params(model)


def sharded(out: Path) -> dict[str, Any]:
    """``shard_optimizer_state=True``: Adam clipped by the global norm, saved after 3 steps, 3 more; loaded into the
    same objects and the same 3 again."""
    fabric = launch(FabricRingAllReduceStrategy(shard_optimizer_state=True))
    model = make_model()
    model, opt = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    batches = list(fabric.setup_dataloaders(DataLoader(make_data(), batch_size=PER_RANK_BATCH)))

    def train(steps: list[tuple[Tensor, Tensor]]) -> None:
        for x, y in steps:
            fabric.backward(F.cross_entropy(model(x), y))
            fabric.clip_gradients(model, opt, max_norm=0.05)
            opt.step()
            opt.zero_grad()

    train(batches[:3])
    path = out / "sharded.ckpt"
    fabric.save(path, {"model": model, "optimizer": opt})
    train(batches[3:])
    uninterrupted = params(model)
    state_numel = sum(v.numel() for st in opt.state.values() for v in st.values() if v.dim() > 0)
    fabric.load(path, {"model": model, "optimizer": opt})
    train(batches[3:])
    strategy = fabric.strategy
    strategy.teardown()
    return {"uninterrupted": uninterrupted, "resumed": params(model), "state_numel": state_numel, "steps": 6}


def same_inputs(out: Path) -> dict[str, Any]:
    """Two steps of ``ring_allreduce`` and of ``local_sgd`` on a loader every rank reads whole
    (``use_distributed_sampler=False``), and of ``ring_allreduce`` on Fabric's sampler: the warnings each gave on this
    rank, and the forward pre-hooks the module kept after its first step."""
    result: dict[str, Any] = {}
    for name, strategy, distributed in [
        ("ring_whole", "ring_allreduce", False),
        ("local_sgd_whole", "local_sgd", False),
        ("ring_sampled", "ring_allreduce", True),
    ]:
        fabric = launch(strategy)
        model = make_model()
        model, opt = fabric.setup(model, make_optimizer(model))
        data = DataLoader(make_data(), batch_size=PER_RANK_BATCH)
        loader = fabric.setup_dataloaders(data, use_distributed_sampler=distributed)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for x, y in itertools.islice(loader, 2):
                fabric.backward(F.cross_entropy(model(x), y))
                opt.step()
                opt.zero_grad()
        said = [str(w.message) for w in caught if issubclass(w.category, PossibleUserWarning)]
        result[name] = {"warnings": said, "hooks": len(model.module._forward_pre_hooks)}
        fabric.strategy.teardown()
    return result


SCENARIOS: dict[str, Callable[[Path], dict[str, Any]]] = {
    "sgd": sgd,
    "sharded": sharded,
    "hook": hook,
    "own_reducer": own_reducer,
    "auto": auto,
    "accumulate": accumulate,
    "resume": resume,
    "refusals": refusals,
    "nonfinite": nonfinite,
    # sharded: the Inf lands in some ranks' pieces only, and every rank still skips
    "nonfinite_sharded": functools.partial(nonfinite, shard_optimizer_state=True),
    "same_inputs": same_inputs,
}


if __name__ == "__main__":
    outdir = Path(sys.argv[1])
    for name, scenario in SCENARIOS.items():
        result = scenario(outdir)
        torch.save(result, outdir / f"{name}-rank{torch.distributed.get_rank()}.pt")
