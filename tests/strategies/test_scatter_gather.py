"""ScatterGatherStrategy ("dp"): parity with single-device training is the specification.

One process, so every Trainer runs in-process on logical CPU replicas (``accelerator="cpu", devices=N``). Each parity
test trains the same model on the same batches with ``strategy="dp"`` and with ``strategy="auto"`` on one device and
compares. Tolerance: max absolute parameter difference <= 1e-6 after 12 optimizer steps (fp32; observed ~1e-8);
bf16-mixed: <= 2e-2 (bf16 rounding differs with the split).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dp_strategies
from lightning_dp_strategies import ScatterGatherStrategy

# numerically sensitive: CI runs this file again under other CPU kernel paths and thread counts
pytestmark = pytest.mark.numerics


TOLERANCE = 1e-6
BF16_TOLERANCE = 2e-2
STEPS = 12
QUIET = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}


class Net(L.LightningModule):
    """A small MLP; ``output`` picks what forward returns: a tensor, a tuple or a dict."""

    def __init__(self, output: str = "tensor", manual: bool = False, lr: float = 0.1) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 2)
        self.output, self.lr = output, lr
        self.automatic_optimization = not manual
        self.forward_threads: set[int] = set()  # shared by the replicas (shallow copies)
        self.forward_rows: list[int] = []
        self.lock = threading.Lock()

    def forward(self, x: Tensor) -> Any:
        with self.lock:
            self.forward_threads.add(threading.get_ident())
            self.forward_rows.append(x.shape[0])
        hidden = self.body(x)
        out = self.head(hidden)
        if self.output == "tuple":
            return out, hidden
        if self.output == "dict":
            return {"out": out, "extras": (hidden, hidden.sum(1))}
        return out

    def loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        result = self(x)
        if self.output == "tuple":
            out, hidden = result
            return nn.functional.mse_loss(out, y) + 0.01 * hidden.pow(2).mean()
        if self.output == "dict":
            hidden, total = result["extras"]
            return nn.functional.mse_loss(result["out"], y) + 0.01 * hidden.pow(2).mean() + 1e-3 * total.mean()
        return nn.functional.mse_loss(result, y)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor | None:
        loss = self.loss(batch)
        self.log("train_loss", loss)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()  # type: ignore[union-attr]
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")  # type: ignore[arg-type]
        opt.step()  # type: ignore[union-attr]
        return None

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch))

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("test_loss", self.loss(batch))

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Any:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=1e-3)


def data(rows: int, batch_size: int) -> DataLoader:
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(rows, 6, generator=generator)
    return DataLoader(TensorDataset(x, torch.sin(x[:, :2] * 2)), batch_size=batch_size)


def fit(
    model: L.LightningModule,
    loader: DataLoader,
    strategy: str | ScatterGatherStrategy = "dp",
    devices: int = 3,
    ckpt_path: Path | None = None,
    **kw: Any,
) -> L.Trainer:
    trainer_kw: dict[str, Any] = {**QUIET, "max_steps": STEPS, "log_every_n_steps": 1, **kw}
    single = strategy == "auto"
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1 if single else devices, **trainer_kw)
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    return trainer


def seeded(factory: Any = Net, **kw: Any) -> Any:
    torch.manual_seed(0)
    return factory(**kw)


def max_diff(a: nn.Module, b: nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return max((sa[k].float() - sb[k].float()).abs().max().item() for k in sa)


def assert_trained_alike(dp: nn.Module, single: nn.Module, tolerance: float = TOLERANCE) -> None:
    diff = max_diff(dp, single)
    assert diff <= tolerance, f"dp drifted from single-device training by {diff}"
    assert max_diff(single, seeded()) > 1e-2, "training did not move the parameters"


def test_names_registered_and_trainer_builds_three_cpu_replicas() -> None:
    assert StrategyRegistry["dp"]["strategy"] is ScatterGatherStrategy
    assert StrategyRegistry["scatter_gather"]["strategy"] is ScatterGatherStrategy
    lightning_dp_strategies.register_all()  # idempotent
    trainer = L.Trainer(strategy="dp", accelerator="cpu", devices=3, **QUIET)
    strategy = trainer.strategy
    assert isinstance(strategy, ScatterGatherStrategy)
    assert strategy.parallel_devices == [torch.device("cpu")] * 3 and strategy.root_device == torch.device("cpu")
    assert trainer.num_devices == 3 and trainer.world_size == 1 and trainer.global_rank == 0
    assert strategy.launcher is None and not trainer._accelerator_connector.is_distributed


@pytest.mark.parametrize(
    ("devices", "batch_size", "rows"), [(2, 7, 7 * 11 + 1), (3, 10, 10 * 12), (4, 11, 11 * 11 + 2)]
)
def test_parity_with_single_device_for_uneven_splits(devices: int, batch_size: int, rows: int) -> None:
    single = seeded()
    fit(single, data(rows, batch_size), "auto")
    dp = seeded()
    trainer = fit(dp, data(rows, batch_size), devices=devices)
    assert_trained_alike(dp, single)
    stats = trainer.strategy.stats  # type: ignore[attr-defined]
    assert stats.forward_calls == STEPS and len(dp.forward_threads) > 1
    # every step but the (short) last one ran on all devices, in chunks as even as possible
    assert stats.replica_calls == (STEPS - 1) * devices + min(devices, rows - (STEPS - 1) * batch_size)
    assert max(dp.forward_rows) - min(dp.forward_rows[: devices * (STEPS - 1)]) <= 1
    # the optimizer holds the real parameters, and the strategy did not wrap the module
    assert trainer.strategy.model is dp
    assert {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]} == {
        id(p) for p in dp.parameters()
    }


@pytest.mark.parametrize("output", ["tuple", "dict"])
def test_modules_returning_tuples_and_dicts(output: str) -> None:
    single = seeded(output=output)
    fit(single, data(100, 10), "auto")
    dp = seeded(output=output)
    fit(dp, data(100, 10))
    assert_trained_alike(dp, single)


def test_manual_optimization_with_clipping() -> None:
    single = seeded(manual=True)
    fit(single, data(100, 10), "auto")
    dp = seeded(manual=True)
    trainer = fit(dp, data(100, 10), devices=4)
    assert_trained_alike(dp, single)
    assert trainer.strategy.stats.forward_calls == STEPS  # type: ignore[attr-defined]


class NormRecorder(L.Callback):
    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        grads = [p.grad.norm() for p in module.parameters() if p.grad is not None]
        self.norms.append(torch.stack(grads).norm().item())  # before clipping


def test_gradient_accumulation_and_clipping() -> None:
    kw: dict[str, Any] = {"accumulate_grad_batches": 3, "gradient_clip_val": 0.05, "max_steps": 5}
    single, seen_single = seeded(), NormRecorder()
    fit(single, data(150, 10), "auto", callbacks=[seen_single], **kw)
    dp, seen_dp = seeded(), NormRecorder()
    trainer = fit(dp, data(150, 10), callbacks=[seen_dp], **kw)
    assert_trained_alike(dp, single)
    assert trainer.strategy.stats.forward_calls == 15  # type: ignore[attr-defined]
    assert len(seen_dp.norms) == 5 and min(seen_dp.norms) > 0.05  # clipping was active on every step
    assert max(abs(a - b) for a, b in zip(seen_dp.norms, seen_single.norms, strict=True)) <= TOLERANCE


class AutocastProbe(Net):
    def forward(self, x: Tensor) -> Any:
        out = super().forward(x)
        with self.lock:
            self.forward_rows.append(-1 if out.dtype == torch.bfloat16 else -2)  # -1: autocast was on here
        return out


def test_bf16_mixed_applies_inside_every_replica() -> None:
    single = seeded(AutocastProbe)
    fit(single, data(100, 10), "auto", precision="bf16-mixed")
    dp = seeded(AutocastProbe)
    fit(dp, data(100, 10), precision="bf16-mixed")
    markers = [r for r in dp.forward_rows if r < 0]
    assert len(markers) == 3 * STEPS and set(markers) == {-1}, "a replica ran without autocast"
    assert len(dp.forward_threads) > 1 and all(p.dtype == torch.float32 for p in dp.parameters())
    assert_trained_alike(dp, single, tolerance=BF16_TOLERANCE)


def test_validation_test_and_predict_equal_single_device() -> None:
    torch.manual_seed(0)
    model = Net()
    loader = data(47, 10)  # last batch of 7: uneven on 3 devices
    single = L.Trainer(strategy="auto", accelerator="cpu", devices=1, **QUIET)
    dp = L.Trainer(strategy="dp", accelerator="cpu", devices=3, **QUIET)
    for a, b in zip(single.validate(model, loader), dp.validate(model, loader), strict=True):
        assert a.keys() == b.keys() == {"val_loss"} and abs(a["val_loss"] - b["val_loss"]) <= TOLERANCE
    for a, b in zip(single.test(model, loader), dp.test(model, loader), strict=True):
        assert abs(a["test_loss"] - b["test_loss"]) <= TOLERANCE
    expected, got = single.predict(model, loader), dp.predict(model, loader)
    assert expected is not None and got is not None
    torch.testing.assert_close(torch.cat(got), torch.cat(expected), atol=TOLERANCE, rtol=0)  # type: ignore[arg-type]
    stats = dp.strategy.stats  # type: ignore[attr-defined]
    assert stats.forward_calls == 3 * len(loader) and stats.last_num_replicas == 3


@dataclass
class Features:
    x: Tensor
    tag: str


class Inputs(NamedTuple):
    features: Features
    extra: list[Tensor]


class NestedNet(Net):
    """forward takes a named tuple of a dataclass and a list, a 0-dim tensor and a keyword; returns a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.transfers: list[str] = []

    def forward(self, inputs: Inputs, scale: Tensor, *, mode: str) -> Any:  # type: ignore[override]
        assert inputs.features.tag == "nested" and mode == "train" and scale.dim() == 0
        x = inputs.features.x * scale + inputs.extra[0][:, None]
        return {"out": self.head(self.body(x)), "tag": inputs.features.tag}

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        self.transfers.append("transfer")
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self.transfers.append("after")
        x, y = batch
        return {"inputs": Inputs(Features(x, "nested"), [x[:, 0]]), "scale": torch.tensor(0.5), "y": y}

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:  # type: ignore[override]
        result = self(batch["inputs"], batch["scale"], mode="train")
        assert result["tag"] == "nested"
        return nn.functional.mse_loss(result["out"], batch["y"])


def test_nested_batches_and_batch_transfer_hooks() -> None:
    single = seeded(NestedNet)
    fit(single, data(100, 10), "auto")
    dp = seeded(NestedNet)
    trainer = fit(dp, data(100, 10))
    assert_trained_alike(dp, single)
    assert dp.transfers == ["transfer", "after"] * STEPS  # the hooks the removed Lightning DP skipped
    assert trainer.strategy.stats.replica_calls == 3 * STEPS  # type: ignore[attr-defined]


def test_checkpoint_round_trip_between_dp_and_no_strategy(tmp_path: Path) -> None:
    paths = {name: tmp_path / f"{name}.ckpt" for name in ("dp", "auto")}
    for name, path in paths.items():
        fit(seeded(), data(40, 10), name, max_steps=4).save_checkpoint(path)
    saved = {name: torch.load(path, weights_only=False) for name, path in paths.items()}
    assert saved["dp"]["state_dict"].keys() == Net().state_dict().keys()  # plain names, no "module." prefix
    plain = Net()
    plain.load_state_dict(saved["dp"]["state_dict"])  # strict: loads into a model that never saw the strategy
    assert_trained_alike(plain, Net.load_from_checkpoint(paths["auto"]))
    momentum = [s["momentum_buffer"] for s in saved["dp"]["optimizer_states"][0]["state"].values()]
    expected = [s["momentum_buffer"] for s in saved["auto"]["optimizer_states"][0]["state"].values()]
    assert max((a - b).abs().max().item() for a, b in zip(momentum, expected, strict=True)) <= TOLERANCE

    # resuming (optimizer state included) goes on alike across strategies: dp -> none, none -> dp, none -> none
    resumed = {}
    for source, target in (("dp", "auto"), ("auto", "dp"), ("auto", "auto")):
        resumed[source, target] = seeded()
        fit(resumed[source, target], data(40, 10), target, max_steps=8, ckpt_path=paths[source])
    assert_trained_alike(resumed["dp", "auto"], resumed["auto", "auto"])
    assert_trained_alike(resumed["auto", "dp"], resumed["auto", "auto"])


class BypassesForward(Net):
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return nn.functional.mse_loss(self.head(self.body(batch[0])), batch[1])


def test_warns_once_when_a_step_never_calls_forward() -> None:
    with pytest.warns(
        UserWarning, match=r"training_step` never called the module's forward.*call `self\(batch\)`"
    ) as w:
        trainer = fit(seeded(BypassesForward), data(60, 10), max_steps=4)
    assert sum("never called the module's forward" in str(r.message) for r in w) == 1
    assert trainer.strategy.stats.forward_calls == 0  # type: ignore[attr-defined]


def test_no_warning_when_forward_is_called(recwarn: pytest.WarningsRecorder) -> None:
    fit(seeded(), data(60, 10), max_steps=2)
    assert not [r for r in recwarn if "never called the module's forward" in str(r.message)]


def test_module_hooks_run_once_on_the_whole_batch() -> None:
    model = seeded()
    sizes: list[int] = []
    model.register_forward_hook(lambda module, args, out: sizes.append(out.shape[0]))
    fit(model, data(30, 10), max_steps=3)
    assert sizes == [10, 10, 10]


class BadMask(Net):
    def forward(self, x: Tensor, mask: Tensor) -> Tensor:  # type: ignore[override]
        return super().forward(x * mask)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self(batch[0], torch.ones(1, 6)).sum()  # mask has no batch dimension of 10


def test_batch_that_cannot_be_split_fails_at_first_step_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"cannot split the arguments of forward.*1 rows.*module buffers"):
        fit(seeded(BadMask), data(30, 10), max_steps=1)


@pytest.mark.parametrize(
    ("devices", "message"),
    [(["cpu", "cuda:0"], "mix the device types"), (["tpu:0"], "Unknown device"), (["meta"], "not supported")],
)
def test_bad_devices_fail_at_construction(devices: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ScatterGatherStrategy(parallel_devices=devices)


def test_unknown_cuda_device_fails_at_setup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    strategy = ScatterGatherStrategy(parallel_devices=["cuda:0", "cuda:5"])
    with pytest.raises(ValueError, match=r"Unknown CUDA device\(s\) \['cuda:5'\].*devices=\[0, 1\]"):
        strategy.setup_environment()
    with pytest.raises(ValueError, match="list every CUDA device once"):
        ScatterGatherStrategy(parallel_devices=[0, 0]).setup_environment()


def test_sync_batchnorm_is_rejected_with_the_fix() -> None:
    with pytest.raises(ValueError, match="Drop `sync_batchnorm=True`"):
        fit(seeded(), data(30, 10), sync_batchnorm=True, max_steps=1)


def test_strategy_instance_with_dim_and_devices() -> None:
    with pytest.raises(ValueError, match="non-negative int"):
        ScatterGatherStrategy(dim=-1)
    strategy = ScatterGatherStrategy(parallel_devices=["cpu", "cpu"])
    model = seeded()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=2, **QUIET)
    trainer.fit(model, data(20, 10))
    assert strategy.stats.replica_calls == 4 and strategy.stats.last_num_replicas == 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_parity_with_single_gpu() -> None:
    devices = min(2, torch.cuda.device_count())
    single = seeded()
    L.Trainer(strategy="auto", accelerator="cuda", devices=1, max_steps=STEPS, **QUIET).fit(single, data(40, 10))
    dp = seeded()
    trainer = L.Trainer(strategy="dp", accelerator="cuda", devices=devices, max_steps=STEPS, **QUIET)
    trainer.fit(dp, data(40, 10))
    assert trainer.strategy.stats.last_num_replicas == devices  # type: ignore[attr-defined]
    assert_trained_alike(dp.cpu(), single.cpu(), tolerance=1e-5)
