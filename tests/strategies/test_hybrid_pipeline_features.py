"""hybrid_pipeline under the Lightning features a user switches on, against the same run on one device.

The model (``pipeline_features.FeatureNet``) has a frozen first block and two parameter groups; the run has two
``ModelCheckpoint``s (min and max, top 1 and top 2), ``EarlyStopping``, ``LearningRateMonitor``, ``Timer``, a
``CSVLogger``, ``self.log(..., sync_dist=True)`` in training, epoch-end, validation and test hooks, torchmetrics
made in ``__init__``, ``setup`` and ``configure_model``, Lightning's model summary on ``example_input_array``, then
``validate``, ``test`` and ``predict`` after ``fit``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import RichModelSummary
from rich import get_console

from lightning_dp_strategies.pipeline import balance_by_parameters, stage_ranges
from lightning_dp_strategies.strategies.hybrid_pipeline.summary import PER_DEVICE
from tests.helpers.distributed import run_ranks

# The CI reruns tests marked numerics under other kernel paths and thread counts; one pipeline shape with replicas and
# one with a frozen stage stand for the others there (same code path, same tolerance).
NUMERICS = pytest.mark.numerics
TOLERANCE = 1e-5  # fp32: the stages and replicas add the same terms in another order
WHOLE_MODEL_PARAMETERS = 8  # FeatureNet's parameter tensors


def run(tmp: Path, stages: int, world: int, *options: str) -> dict[str, Any]:
    argv = [str(stages), str(world), str(tmp), *options]
    run_ranks("tests.strategies.pipeline_features", argv, world, timeout=240)
    result: dict[str, Any] = torch.load(tmp / "result.pt", weights_only=False)
    result["seen"] = [torch.load(tmp / f"rank{r}.pt")["seen_parameters"] for r in range(world)]
    return result


@pytest.fixture(scope="module")
def one_device(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run(tmp_path_factory.mktemp("one_device"), 0, 1)


@pytest.fixture(scope="module")
def one_device_unfreezing(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run(tmp_path_factory.mktemp("one_device_unfreezing"), 0, 1, "unfreeze")


def close(a: object, b: object) -> bool:
    try:
        x, y = float(a), float(b)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return a == b
    return math.isclose(x, y, rel_tol=TOLERANCE, abs_tol=TOLERANCE)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("stages", "world", "balance"),
    [
        pytest.param(2, 4, None, id="S2xD2", marks=NUMERICS),
        pytest.param(2, 2, None, id="S2xD1"),
        pytest.param(3, 3, None, id="S3xD1"),
        pytest.param(4, 4, None, id="S4xD1-frozen-stage", marks=NUMERICS),
        pytest.param(2, 2, "2,4", id="S2xD1-explicit-frozen-stage"),
    ],
)
def test_lightning_features_behave_as_on_one_device(
    tmp_path: Path, one_device: dict[str, Any], stages: int, world: int, balance: str | None
) -> None:
    got = run(tmp_path, stages, world, *([balance] if balance else []))
    assert_same_run(got, one_device, stages, world)
    assert_summary(got["summary"], one_device["summary"], stages, balance)
    assert torch.equal(got["params"]["body.0.weight"], one_device["params"]["body.0.weight"])  # frozen stays put


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("stages", "world", "balance"),
    [
        pytest.param(2, 4, None, id="S2xD2-new-param-group", marks=NUMERICS),
        pytest.param(2, 2, "2,4", id="S2xD1-frozen-stage-comes-alive"),
    ],
)
def test_parameters_unfrozen_during_training_are_trained_as_on_one_device(
    tmp_path: Path, one_device_unfreezing: dict[str, Any], stages: int, world: int, balance: str | None
) -> None:
    """BaseFinetuning adds body[0] in a new parameter group at epoch 1; body[2] (in the optimizer, frozen) is
    unfrozen at epoch 2. With balance 2,4 stage 0 holds only body[0] and a Tanh: it starts with nothing to train."""
    got = run(tmp_path, stages, world, *([balance] if balance else []), "unfreeze")
    assert got["epochs_run"] >= 3, "the run must reach the second unfreeze for this test to mean anything"
    assert_same_run(got, one_device_unfreezing, stages, world)
    assert_summary(got["summary"], one_device_unfreezing["summary"], stages, balance)
    initial = initial_parameters()
    for name in ("body.0.weight", "body.2.weight"):
        assert (got["params"][name] - initial[name]).abs().max().item() > 1e-3, f"{name} never trained"


def initial_parameters() -> dict[str, torch.Tensor]:
    from tests.strategies.pipeline_features import FeatureNet

    return {n: p.detach().clone() for n, p in FeatureNet().named_parameters()}


def assert_same_run(got: dict[str, Any], one_device: dict[str, Any], stages: int, world: int) -> None:
    # decisions across ranks: the checkpoints kept, their scores, the stopping epoch
    assert got["best"] == one_device["best"]
    assert got["kept"].__len__() == 2
    for kept, expected in zip(got["kept"], one_device["kept"], strict=True):
        assert kept.keys() == expected.keys()
        assert all(close(kept[k], expected[k]) for k in kept), (kept, expected)
    assert (got["stopped_epoch"], got["epochs_run"]) == (one_device["stopped_epoch"], one_device["epochs_run"])
    assert got["epochs_run"] < 8, "EarlyStopping must stop the run before max_epochs for this test to mean anything"
    assert got["timer_ran"]
    # configure_optimizers saw the whole model on every rank
    assert all(seen == [WHOLE_MODEL_PARAMETERS] for seen in got["seen"]), got["seen"]
    # every logged value, row by row (step, epoch, lr-SGD, losses, metrics)
    assert len(got["logged"]) == len(one_device["logged"])
    for row, expected in zip(got["logged"], one_device["logged"], strict=True):
        assert row.keys() == expected.keys(), (row, expected)
        assert all(close(row[k], expected[k]) for k in row), (row, expected)
    # the trained parameters (a frozen block included) and evaluation after fit
    for name, value in one_device["params"].items():
        assert (got["params"][name] - value).abs().max().item() <= TOLERANCE, name
    for key in ("validate", "test"):
        assert got[key][0].keys() == one_device[key][0].keys()
        assert all(close(got[key][0][k], v) for k, v in one_device[key][0].items()), key
    replicas = world // stages
    expected_predictions = one_device["predict"][0::replicas]  # rank 0 predicts replica 0's share
    assert (got["predict"] - expected_predictions).abs().max().item() <= TOLERANCE


def assert_summary(got: dict[str, Any], one_device: dict[str, Any], stages: int, balance: str | None) -> None:
    """What Lightning's ModelSummary callback printed on rank 0: the whole model's counts (trainable, total, size in MB,
    FLOPs) and table (in and out sizes of the forward pass on example_input_array) as on one device, a column with
    what rank 0's stage owns, and a line naming that stage."""
    from tests.strategies.pipeline_features import FeatureNet

    blocks = list(FeatureNet().body)
    whole = sum(p.numel() for block in blocks for p in block.parameters())
    chunks = [int(b) for b in balance.split(",")] if balance else balance_by_parameters(blocks, stages)
    stage_zero = sum(p.numel() for i in stage_ranges(chunks)[0] for p in blocks[i].parameters())
    assert got["counts"][0] == one_device["counts"][0] == whole, (got["counts"], whole)
    assert got["counts"] == one_device["counts"]
    columns = dict(got["columns"])
    assert columns.pop(PER_DEVICE) == [f"{stage_zero}  ", "0  ", "0  ", "0  "], got["columns"]
    assert columns == one_device["columns"]
    assert got["lines"][0].startswith(
        f"hybrid_pipeline: pipeline stage 0 of {stages} on this rank: {stage_zero} of {whole} params"
    ), got["lines"]
    # RichModelSummary shows the same table, the column of this rank's share included
    console, width = get_console(), get_console().width
    console.width = 200  # wide enough for every header on one line
    try:
        with console.capture() as captured:
            RichModelSummary.summarize(got["summary_data"], *got["counts"][:3], got["modes"], got["counts"][3])
    finally:
        console.width = width
    text = captured.get()
    assert PER_DEVICE in text and f" {stage_zero} " in text and f"Total params: {whole}" in text, text


def resumed(tmp: Path, stages: int, world: int, *ckpt: Path) -> dict[str, Any]:
    run_ranks("tests.strategies.pipeline_finetune_resume", [str(stages), str(world), str(tmp), *map(str, ckpt)], world)
    result: dict[str, Any] = torch.load(tmp / "resumed.pt", weights_only=False)
    return result


@NUMERICS
@pytest.mark.timeout(300)
def test_a_finetuning_schedule_resumed_in_its_middle_trains_as_on_one_device(tmp_path: Path) -> None:
    """BaseFinetuning records the optimizer's parameter groups by name and restores them when a fit resumes: the
    checkpoint must hold the whole model's groups (rank 0's optimizer holds only its stage's), and each stage must
    cut the restored groups back to its own before the optimizer state loads. Resumed pipelined, and on one device
    from the pipelined run's checkpoint, the run ends where one device's resumed run ends."""
    one = resumed(tmp_path / "one", 0, 1)
    pipelined = resumed(tmp_path / "s2d1", 2, 2)
    crossed = resumed(tmp_path / "cross", 0, 1, tmp_path / "s2d1" / "part" / "last.ckpt")
    assert one["groups"] == [4, 2, 2]  # the fast group, the rest, and the one added at epoch 1
    for got in (pipelined, crossed):
        assert got["groups"] == one["groups"]
        for name, value in one["params"].items():
            assert (got["params"][name] - value).abs().max().item() <= TOLERANCE, name
