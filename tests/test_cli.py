"""The strategies configured through Lightning's ``LightningCLI``: every registered name, and each strategy class by
``class_path`` with ``init_args`` from the command line or a YAML file, as a user of the CLI writes them.

``LightningCLI`` builds the Trainer from the strategy's ``__init__`` signature (jsonargparse), so an option whose type
the CLI cannot read, or a signature it cannot see through, breaks configuration files without touching Python users.
Each case builds the Trainer only (``run=False``): nothing is launched.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import Strategy, StrategyRegistry
from torch import Tensor, nn

import lightning_dp_strategies  # registers the names
from lightning_dp_strategies import (
    HybridPipelineStrategy,
    LocalSGDStrategy,
    RingAllReduceStrategy,
    ScatterGatherStrategy,
)


class CliNet(L.LightningModule):
    pipeline_body = "body"

    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 2))

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(output, target)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.pipeline_loss(self.body(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class CliData(L.LightningDataModule):
    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.batch_size = batch_size


@pytest.fixture(autouse=True)
def cli_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI reads ``args`` alone, as in a script run with none: pytest's own command line is not the CLI's."""
    monkeypatch.setattr(sys, "argv", ["train.py"])


def build(*args: str) -> Strategy:
    """The strategy of the Trainer ``LightningCLI`` builds from ``args`` (2 CPU devices unless ``args`` say so)."""
    cli = LightningCLI(
        CliNet,
        CliData,
        run=False,
        args=["--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.logger=false", *args],
        save_config_kwargs={"overwrite": True},
        seed_everything_default=False,
    )
    return cli.trainer.strategy


PACKAGE_NAMES = sorted(
    name
    for name, entry in StrategyRegistry.items()
    if entry["strategy"].__module__.partition(".")[0] == lightning_dp_strategies.__name__
)


def test_the_package_names_are_found() -> None:
    assert {"ring_allreduce", "streaming_diloco", "hybrid_pipeline", "dp"} <= set(PACKAGE_NAMES)


@pytest.mark.parametrize("name", PACKAGE_NAMES)
def test_every_registered_name_builds_its_strategy(name: str) -> None:
    """Bug: a registered name that the CLI passes on but the Trainer cannot build (or builds as another class)."""
    strategy = build(f"--trainer.strategy={name}")
    assert type(strategy) is StrategyRegistry[name]["strategy"]


def test_ring_allreduce_options_from_the_command_line() -> None:
    """Bug: an option the CLI drops or misreads (a ``Literal``, a union with ``None``, a timeout in seconds)."""
    strategy = build(
        "--trainer.strategy=lightning_dp_strategies.RingAllReduceStrategy",
        "--trainer.strategy.bucket_cap_mb=2",
        "--trainer.strategy.reducer=native",
        "--trainer.strategy.two_level=true",
        "--trainer.strategy.nonfinite_grads=skip",
        "--trainer.strategy.timeout=30",
    )
    assert isinstance(strategy, RingAllReduceStrategy)
    assert (strategy.config.bucket_cap_mb, strategy.config.two_level) == (2.0, True)
    assert strategy.reduction.reducer == "native" and strategy.engine.nonfinite.mode == "skip"
    assert strategy._timeout is not None and strategy._timeout.total_seconds() == 30  # Lightning keeps it there


def test_streaming_diloco_options_from_the_command_line() -> None:
    strategy = build(
        "--trainer.strategy=lightning_dp_strategies.LocalSGDStrategy",
        "--trainer.strategy.sync_every=auto",
        "--trainer.strategy.fragments=2",
        "--trainer.strategy.delay=1",
        "--trainer.strategy.outer_precision=int8",
    )
    assert isinstance(strategy, LocalSGDStrategy)
    config = strategy.local_config
    assert (config.sync_every, config.fragments, config.delay, config.outer_precision) == ("auto", 2, 1, "int8")


def test_diloco_outer_optimizer_from_a_config_file(tmp_path: Path) -> None:
    """Bug: ``outer_optimizer`` typed so that the CLI cannot make a factory of it from ``class_path``/``init_args``."""
    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n"
        "  strategy:\n"
        "    class_path: lightning_dp_strategies.LocalSGDStrategy\n"
        "    init_args:\n"
        "      sync_every: 16\n"
        "      outer_optimizer:\n"
        "        class_path: torch.optim.SGD\n"
        "        init_args: {lr: 0.7, momentum: 0.9, nesterov: true}\n"
    )
    strategy = build(f"--config={config}")
    assert isinstance(strategy, LocalSGDStrategy) and strategy.local_config.sync_every == 16
    factory: Any = strategy.local_config.outer_optimizer
    outer = factory([nn.Parameter(torch.zeros(2))])
    assert type(outer) is torch.optim.SGD
    assert (outer.defaults["lr"], outer.defaults["momentum"], outer.defaults["nesterov"]) == (0.7, 0.9, True)


def test_hybrid_pipeline_and_scatter_gather_options_from_the_command_line() -> None:
    hybrid = build(
        "--trainer.strategy=lightning_dp_strategies.HybridPipelineStrategy",
        "--trainer.strategy.pipeline_stages=2",
        "--trainer.strategy.micro_batches=4",
        "--trainer.strategy.schedule=gpipe",
        "--trainer.strategy.balance=[1, 2]",
    )
    assert isinstance(hybrid, HybridPipelineStrategy)
    assert (hybrid.config.micro_batches, hybrid.config.schedule, hybrid.config.balance) == (4, "gpipe", (1, 2))
    dp = build(
        "--trainer.strategy=lightning_dp_strategies.ScatterGatherStrategy", "--trainer.strategy.nonfinite_grads=raise"
    )
    assert isinstance(dp, ScatterGatherStrategy) and dp.nonfinite.mode == "raise"


def test_a_bad_option_value_is_refused_with_the_strategys_own_message() -> None:
    """Bug: a bad value accepted by the CLI and failing later, or refused without saying what is allowed."""
    with pytest.raises(ValueError, match="`outer_precision` must be one of 'fp32', 'bf16', 'int8', 'int4', got 'int3'"):
        build("--trainer.strategy=lightning_dp_strategies.LocalSGDStrategy", "--trainer.strategy.outer_precision=int3")
