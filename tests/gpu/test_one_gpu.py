"""Every strategy on one CUDA device, against Lightning's own single-device training on the same GPU.

Skipped without CUDA (CI has none). One GPU means one process per strategy (world size 1, NCCL where the strategy
starts a process group): this checks device placement, the process group on CUDA, the precision plugins (16-mixed
with its gradient scaler, bf16-mixed), checkpoints written from the GPU and loaded on the CPU, and the quantizer's
kernels on CUDA tensors. It cannot check a reduction over several GPUs: NCCL refuses two ranks on one device.

The user's module is the one a new user writes: a validation loop, a torchmetrics metric, a logger, and
``ModelCheckpoint(monitor="val_loss", save_top_k=2)``. Tolerances: fp32 and bf16-mixed parameters within 1e-5 of the
single-device run (the same kernels on the same device run in the same order, so they are expected to agree
exactly; the margin allows for a reordered reduction inside a kernel); 16-mixed within 1e-3 (a skipped step of the
gradient scaler would differ by a whole step, far more).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torchmetrics
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dp_strategies as ldp
from lightning_dp_strategies.comm.quantized import dequantize, quantize, quantized_all_reduce

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

STEPS = 12
TOLERANCE = {"32-true": 1e-5, "bf16-mixed": 1e-5, "16-mixed": 1e-3}


class Regressor(L.LightningModule):
    """A small MLP; ``net`` is the body ``hybrid_pipeline`` would split (``pipeline_body``, ``pipeline_loss``)."""

    pipeline_body = "net"

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
        self.val_mse = torchmetrics.MeanSquaredError()
        self.seen: set[tuple[str, str]] = set()
        """Where the loss's input and the first weight were, each training step (the module goes back to the CPU
        after ``fit``)."""

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        self.seen.add((output.device.type, next(self.parameters()).device.type))
        return nn.functional.mse_loss(output.float(), target)

    def training_step(self, batch: tuple[Tensor, Tensor], _: int) -> Tensor:
        x, y = batch
        loss = self.pipeline_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], _: int) -> None:
        x, y = batch
        out = self.net(x).float()
        self.val_mse(out, y)
        self.log("val_loss", nn.functional.mse_loss(out, y))
        self.log("val_mse", self.val_mse)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def loader(seed: int, n: int = 96) -> DataLoader:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=gen)
    y = x[:, :3].sum(dim=1, keepdim=True).tanh() + 0.05 * torch.randn(n, 1, generator=gen)
    return DataLoader(TensorDataset(x, y), batch_size=16)


def fit(
    strategy: Any, tmp_path: Path, precision: str = "32-true", accelerator: str = "cuda"
) -> tuple[Regressor, L.Trainer]:
    L.seed_everything(0)
    module = Regressor()
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val_loss", save_top_k=2, every_n_train_steps=4)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator=accelerator,
        devices=1,
        precision=precision,  # type: ignore[arg-type]
        max_steps=STEPS,
        val_check_interval=4,
        callbacks=[checkpoint],
        logger=CSVLogger(tmp_path / "logs"),
        use_distributed_sampler=False,  # one process: the same batches in the same order as Lightning's own run
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader(0), loader(1, 32))
    return module, trainer


def assert_alike(trained: Regressor, reference: Regressor, tolerance: float) -> None:
    assert trained.seen == {("cuda", "cuda")}
    for (name, a), b in zip(trained.state_dict().items(), reference.state_dict().values(), strict=True):
        difference = float((a.float() - b.float()).abs().max()) if a.numel() else 0.0
        assert difference <= tolerance, f"{name}: {difference:.3g} > {tolerance}"


STRATEGIES = {
    "ring_allreduce": lambda: "ring_allreduce",
    "ring_allreduce_sharded": lambda: "ring_allreduce_sharded",
    "dp": lambda: "dp",
    "local_sgd": lambda: ldp.LocalSGDStrategy(sync_every=4),
    "hybrid_pipeline": lambda: ldp.HybridPipelineStrategy(pipeline_stages=1, micro_batches=4),
}
"""Strategies that train one device as Lightning's single-device run does."""


@pytest.mark.parametrize("name", list(STRATEGIES))
@pytest.mark.timeout(300)
def test_each_strategy_trains_on_one_gpu_as_lightning_does(name: str, tmp_path: Path) -> None:
    reference, _ = fit("auto", tmp_path / "auto")
    trained, trainer = fit(STRATEGIES[name](), tmp_path / name)
    assert trainer.global_step == STEPS
    assert_alike(trained, reference, TOLERANCE["32-true"])
    best = trainer.checkpoint_callback.best_model_path  # type: ignore[union-attr]
    assert best and Path(best).exists()
    state = torch.load(best, map_location="cpu", weights_only=False)["state_dict"]
    cpu = Regressor()
    cpu.load_state_dict(state)  # written from the GPU, loaded on the CPU
    assert torch.isfinite(torch.cat([p.reshape(-1) for p in cpu.parameters()])).all()


@pytest.mark.timeout(300)
def test_streaming_diloco_on_one_gpu_trains_as_on_the_cpu(tmp_path: Path) -> None:
    """With a delay, a fragment's average replaces the step taken while it travelled, so streaming DiLoCo is not
    single-device training even on one device: the specification here is the same strategy on the CPU (1e-4: the
    GPU's and the CPU's matrix products round differently)."""

    def streaming() -> ldp.LocalSGDStrategy:
        return ldp.LocalSGDStrategy(sync_every=4, fragments=2, delay=1, outer_precision="int4")

    # Lightning keeps the process group of an earlier fit in this process: a gloo one for the CPU, NCCL for the GPU
    if dist.is_initialized():
        dist.destroy_process_group()
    on_cpu, _ = fit(streaming(), tmp_path / "cpu", accelerator="cpu")
    dist.destroy_process_group()
    on_gpu, trainer = fit(streaming(), tmp_path / "gpu")
    assert dist.get_backend() == "nccl"
    assert trainer.strategy.local_sgd.syncs > 0  # type: ignore[attr-defined]
    assert_alike(on_gpu, on_cpu, 1e-4)


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
@pytest.mark.parametrize("name", ["ring_allreduce", "local_sgd"])
@pytest.mark.timeout(300)
def test_mixed_precision_on_one_gpu_matches_lightning(name: str, precision: str, tmp_path: Path) -> None:
    reference, _ = fit("auto", tmp_path / "auto", precision)
    trained, trainer = fit(STRATEGIES[name](), tmp_path / name, precision)
    assert trainer.global_step == STEPS
    assert_alike(trained, reference, TOLERANCE[precision])


@pytest.mark.timeout(300)
def test_fabric_ring_allreduce_on_one_gpu_matches_plain_fabric() -> None:
    results = []
    for strategy in ("auto", ldp.FabricRingAllReduceStrategy()):
        fabric = L.Fabric(accelerator="cuda", devices=1, strategy=strategy)
        fabric.launch()
        fabric.seed_everything(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = fabric.setup(model, optimizer)
        for x, y in fabric.setup_dataloaders(loader(0)):
            optimizer.zero_grad()
            fabric.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
        results.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    assert results[1].device.type == "cuda"
    assert float((results[0] - results[1]).abs().max()) <= 1e-5


@pytest.mark.parametrize("bits", [8, 4])
def test_the_quantizer_gives_the_same_bytes_on_cuda_as_on_cpu(bits: int) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(100_003, generator=gen) * torch.rand(100_003, generator=gen) * 10
    on_cpu, on_cuda = quantize(x, bits), quantize(x.cuda(), bits)
    assert on_cuda.data.device.type == "cuda"
    assert torch.equal(on_cpu.data, on_cuda.data.cpu()) and torch.equal(on_cpu.scales, on_cuda.scales.cpu())
    assert torch.equal(dequantize(on_cpu), dequantize(on_cuda).cpu())
    alone = x.cuda()
    quantized_all_reduce(alone, bits)  # one process: the values as ``bits`` bits carry them, on the GPU
    assert torch.equal(alone.cpu(), dequantize(on_cpu))
