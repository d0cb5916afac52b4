"""The comparison command: argument errors, the demo's global batches, a short real run and crash isolation."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from lightning_dp_strategies.cli import main
from lightning_dp_strategies.compare import DemoConfig, GlobalBatchSampler, default_strategies
from lightning_dp_strategies.compare.spec import DEMO_GLOBAL_BATCH


def test_unknown_strategy_lists_the_available_ones(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", "--strategies", "single,ring_alreduce"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown strategy 'ring_alreduce'" in err
    assert all(name in err for name in ("single", "dp", "ring_allreduce", "ddp"))
    assert "fsdp" not in err and "deepspeed" not in err


def test_global_batch_must_split_over_devices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["compare", "--devices", "3", "--global-batch", "64"])
    assert "must be a multiple of --devices 3" in capsys.readouterr().err


def test_defaults_include_the_baseline_and_lightning_ddp() -> None:
    names = default_strategies()
    assert names[0] == "single" and {"dp", "ring_allreduce", "ddp"} <= set(names)


def test_the_parsers_demo_default_is_the_demos() -> None:
    """The parser checks --global-batch without importing the demo: its copy of the default must agree."""
    assert DEMO_GLOBAL_BATCH == DemoConfig().global_batch


@pytest.mark.parametrize("replicas", [2, 4])
def test_replicas_together_see_exactly_the_single_device_global_batches(replicas: int) -> None:
    config = DemoConfig(steps=70, global_batch=16, samples=256)  # 70 steps cross several epochs
    whole = list(GlobalBatchSampler(256, config))
    parts = [list(GlobalBatchSampler(256, config, replicas, r)) for r in range(replicas)]
    for step, batch in enumerate(whole):
        assert [i for part in parts for i in part[step]] == batch
    assert len({tuple(b) for b in whole[:16]}) == 16 and sorted(i for b in whole[:16] for i in b) == list(range(256))


@pytest.mark.timeout(300)
def test_short_run_writes_table_json_and_png_and_isolates_a_crash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "compare",
            "--strategies",
            "single,crashes_at_setup,ddp",
            "--steps",
            "6",
            "--model-size",
            "small",
            "--accelerator",
            "cpu",
            "--output",
            str(tmp_path),
            "--import",
            "tests.helpers.crashing_strategy",
        ]
    )
    assert code == 1, "a failed strategy makes the command fail, after the others ran"
    out = capsys.readouterr().out
    assert "ddp" in out and "max |dθ|" in out
    data = json.loads((tmp_path / "comparison.json").read_text())
    rows = {r["strategy"]: r for r in data["results"]}
    assert list(rows) == ["single", "crashes_at_setup", "ddp"]
    assert rows["crashes_at_setup"]["status"] == "failed"
    assert rows["crashes_at_setup"]["error"] == "RuntimeError: this strategy always fails at setup"
    assert "always fails at setup" in (tmp_path / "logs" / "crashes_at_setup.log").read_text()
    ddp = rows["ddp"]
    assert ddp["status"] == "ok" and ddp["processes"] == 2
    assert ddp["max_param_diff"] <= 1e-5, "ddp drifted from the single-device baseline"
    assert rows["single"]["max_param_diff"] == 0.0
    assert len(ddp["loss_curve"]) == 6 and all(torch.isfinite(torch.tensor(ddp["loss_curve"])))
    assert ddp["loss_curve"] == pytest.approx(rows["single"]["loss_curve"], abs=1e-5), "the global batch's loss"
    assert ddp["samples_per_second"] > 0 and ddp["comm_mb_per_step"] is None  # DDP's traffic is inside torch
    assert 0.0 <= ddp["accuracy"] <= 1.0 and ddp["final_loss"] == pytest.approx(rows["single"]["final_loss"])
    assert not list(tmp_path.rglob("*.ckpt")), "checkpoints are kept only when asked for"
    assert (tmp_path / "comparison.png").stat().st_size > 10_000


def test_import_takes_a_module_from_the_working_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--import my_names`` finds ``my_names.py`` in the folder the command runs in, as ``--model`` does, also when
    started by the console script (whose ``sys.path`` has no working folder)."""
    (tmp_path / "names_beside_the_user.py").write_text('raise RuntimeError("imported from the working folder")\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "names_beside_the_user", raising=False)
    with pytest.raises(RuntimeError, match="imported from the working folder"):
        main(["compare", "--import", "names_beside_the_user", "--output", str(tmp_path / "out")])


def test_processes_come_from_the_registered_strategy_class() -> None:
    """A user's subclass registered under a new name starts as many processes as its base says (not a name match)."""
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_dp_strategies import ScatterGatherStrategy
    from lightning_dp_strategies.compare.catalogue import processes_for

    class Threads(ScatterGatherStrategy):
        pass

    StrategyRegistry.register("my_threads_for_test", Threads, override=True)
    try:
        assert processes_for("my_threads_for_test", 4) == 1  # replicas are threads, whatever the name
        assert processes_for("ring_allreduce", 4) == 4 and processes_for("ddp", 4) == 4
    finally:
        StrategyRegistry.remove("my_threads_for_test")
