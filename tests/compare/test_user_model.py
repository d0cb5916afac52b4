"""The comparison on a user's model (not the demo), from Python and from the command line, and every bad value refused
before a process starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp_strategies import cli as lightning_dp_strategies_cli
from lightning_dp_strategies.compare import compare, runner

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


def _never_starts_a_process(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a worker process was started before the bad value was refused")

    monkeypatch.setattr(subprocess, "Popen", refuse)  # the fork server and every fresh worker start through it


@pytest.mark.timeout(240)
def test_api_runs_a_test_defined_model_and_marks_what_cannot_run_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class TinyNet(L.LightningModule):  # defined here: it travels to the workers by value (cloudpickle)
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(5, 12), nn.ReLU(), nn.Linear(12, 3))

        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.2)

        def configure_callbacks(self) -> list[L.Callback]:  # the model's own checkpoints, in the Trainer's root
            return [ModelCheckpoint(every_n_train_steps=2)]

    def batches() -> DataLoader:
        gen = torch.Generator().manual_seed(3)
        data = TensorDataset(torch.randn(48, 5, generator=gen), torch.randint(0, 3, (48,), generator=gen))
        return DataLoader(data, batch_size=8)

    messages: list[str] = []
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # where the model's own ModelCheckpoint would write, under a default root
    results = compare(
        ["single", "ring_allreduce", "hybrid_pipeline", "hybrid_pipeline_notebook", "ring_allreduce_spawn"],
        devices=2,
        out=tmp_path,
        model=TinyNet,
        train_dataloaders=batches,
        steps=5,
        progress=messages.append,
        progress_every=0.0,
        accelerator="cpu",  # the CPU path on any machine: forked ranks, one core a device
    )
    rows = {r.strategy: r for r in results}
    single, ring, hybrid = rows["single"], rows["ring_allreduce"], rows["hybrid_pipeline"]
    assert single.status == ring.status == "ok", [r.error for r in results]
    assert single.max_param_diff == 0.0
    assert ring.max_param_diff is not None and ring.max_param_diff <= 1e-5, "ring_allreduce drifted from one device"
    assert ring.comm_mb_per_step and ring.comm_mb_per_step > 0
    assert ring.peak_mb_per_rank and len(ring.peak_mb_by_rank) == 2 and min(ring.peak_mb_by_rank) > 10
    assert ring.samples_per_second and ring.samples_per_second > 0
    assert single.final_loss is not None and ring.final_loss == pytest.approx(single.final_loss, abs=1e-5)
    assert len(ring.loss_curve) == 5
    # no pipeline_body opt-in: refused at setup, one line that names the fix, not a traceback
    assert hybrid.status == "n/a" and hybrid.error is not None
    assert "pipeline_body" in hybrid.error and "\n" not in hybrid.error and "Traceback" not in hybrid.error
    # the same where the refusal happens in a rank that a fork launcher started (not the process that called fit)
    assert (rows["hybrid_pipeline_notebook"].status, rows["hybrid_pipeline_notebook"].error) == ("n/a", hybrid.error)
    # a spawn launch pickles the model's class by reference, and the test's class cannot be imported: the fix named
    spawn = rows["ring_allreduce_spawn"]
    assert spawn.status == "n/a" and spawn.error is not None
    assert spawn.error.startswith("PicklingError: ") and "define it in an importable module" in spawn.error
    # live progress while a strategy runs; logs kept, checkpoints not
    assert any("step " in m and "/5" in m for m in messages), messages
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [f"{n}.log" for n in sorted(rows)]
    assert not list(tmp_path.rglob("*.ckpt"))  # neither the comparison's nor the model's own, in out or the cwd


@pytest.mark.timeout(240)
def test_cli_runs_the_readme_model_marks_what_cannot_run_it_and_keeps_checkpoints_when_asked(tmp_path: Path) -> None:
    """The README's user-model command (docs/examples/my_models.py: a frozen layer, dict batches, a DataModule)."""
    out = tmp_path / "out"
    command = ["compare", "--model", "my_models:Forecaster", "--data", "my_models:SeriesData"]
    command += ["--strategies", "single,dp,hybrid_pipeline", "--steps", "4", "--output", str(out), "--keep-checkpoints"]
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_dp_strategies", *command, "--accelerator", "cpu"],
        capture_output=True,
        text=True,
        timeout=230,
        cwd=EXAMPLES,
    )
    assert proc.returncode == 1, "a row that did not run makes the exit status 1\n" + proc.stdout + proc.stderr
    data = json.loads((out / "comparison.json").read_text())
    rows = {r["strategy"]: r for r in data["results"]}
    assert rows["dp"]["status"] == "ok" and rows["dp"]["max_param_diff"] <= 1e-5
    # no pipeline_body opt-in: the row says why in one line, the others ran
    assert rows["hybrid_pipeline"]["status"] == "n/a" and "pipeline_body" in rows["hybrid_pipeline"]["error"]
    assert "hybrid_pipeline (n/a): TypeError: Forecaster cannot run under HybridPipelineStrategy" in proc.stdout
    assert rows["dp"]["final_loss"] == pytest.approx(rows["single"]["final_loss"], abs=1e-5)
    assert data["config"]["model"] == "my_models:Forecaster"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["dp.ckpt", "single.ckpt"]
    assert "checkpoints/" in proc.stdout and "logs/" in proc.stdout and "comparison.json" in proc.stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--global-batch", "0"], "--global-batch 0: it must be at least 1"),
        (["--strategies", ",,"], "no strategy named"),
        (["--timeout", "0"], "--timeout 0: it must be a positive number"),
        (["--steps", "0"], "--steps 0"),
        (["--data", "tests.helpers.compare_models:PairsData"], "--data needs --model"),
        (["--model", "tests.helpers.compare_models"], "expected MODULE:FACTORY"),
        (["--model", "m:f", "--global-batch", "8"], "with --model, your data sets the batch"),
    ],
)
def test_values_wrong_anywhere_are_refused_by_the_parser_before_the_run(
    argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_dp_strategies.cli import run as run_module

    def refuse(*args: object, **kwargs: object) -> int:
        raise AssertionError("the command ran before the bad value was refused")

    monkeypatch.setattr(run_module, "run", refuse)
    with pytest.raises(SystemExit) as exit_info:
        lightning_dp_strategies_cli.main(["compare", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_help_in_a_fresh_interpreter_registers_the_names_and_runs_nothing() -> None:
    code = "import sys, lightning_dp_strategies.cli as c\ntry:\n    c.main(['compare', '--help'])\nexcept SystemExit:\n"
    code += "    from lightning.pytorch.strategies import StrategyRegistry\n"
    code += "    print('ring_allreduce' in StrategyRegistry, 'lightning_dp_strategies.cli.run' in sys.modules)\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip().splitlines()[-1] == "True False", proc.stdout + proc.stderr
    assert "--model MODULE:FACTORY" in proc.stdout and "--precision" in proc.stdout


def test_version_is_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    import lightning_dp_strategies

    with pytest.raises(SystemExit) as exit_info:
        lightning_dp_strategies_cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"lightning-dp-strategies {lightning_dp_strategies.__version__}"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--strategies", "single,nope"],
            "unknown strategy 'nope'; these run here: single, dp, hybrid_pipeline, ring_allreduce, ddp",
        ),
        (["--strategies", "fsdp"], "fsdp needs a GPU"),
        (["--strategies", "single,single"], "named twice"),
        (["--model", "tests.helpers.compare_models:Nope"], "has no attribute 'Nope'"),
        (["--model", "no_such_module_here:f"], "cannot import 'no_such_module_here'"),
        (["--model", "tests.helpers.compare_models:Pairs"], "returned Pairs, not a LightningModule"),
        (
            ["--model", "tests.helpers.compare_models:Regressor", "--data", "tests.helpers.compare_models:odd_batches"],
            "hold 9 samples, which does not split evenly over 2 devices",
        ),
        (["--accelerator", "gpu"], "no CUDA device"),
        (["--precision", "16-mixed", "--accelerator", "cpu"], "on CPU use bf16-mixed"),
    ],
)
def test_values_wrong_here_are_refused_before_any_process(
    argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    if "gpu" in argv and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    _never_starts_a_process(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        lightning_dp_strategies_cli.main(["compare", "--output", str(tmp_path), *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    if "nope" in argv:
        assert "fsdp" not in err and "deepspeed" not in err and "xla" not in err


def test_one_gpu_and_two_devices_runs_cpu_processes_under_auto_and_names_the_fix_under_gpu(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The README's command on a one-GPU machine: ``auto`` compares CPU processes and its headline says how to use the
    GPU; ``--accelerator gpu`` is refused before any process, naming ``devices=1``."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert runner._check_arguments(2, 300.0, None, None, "auto", "32-true") == "cpu"
    task = SimpleNamespace(label="the demo", steps=30)
    assert runner._headline(5, task, 2, "cpu", 64, auto=True).endswith(  # type: ignore[arg-type]
        "(this machine has 1 CUDA device: --accelerator gpu --devices 1)"
    )
    assert "CUDA device" not in runner._headline(5, task, 2, "cpu", 64, auto=False)  # type: ignore[arg-type]
    assert runner._check_arguments(1, 300.0, None, None, "auto", "32-true") == "cuda"
    _never_starts_a_process(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        lightning_dp_strategies_cli.main(["compare", "--output", str(tmp_path), "--accelerator", "gpu"])
    assert exit_info.value.code == 2
    assert "devices=2 but this machine has 1 CUDA device: use devices=1" in capsys.readouterr().err


def test_data_without_a_batch_is_refused_before_any_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _never_starts_a_process(monkeypatch)
    with pytest.raises(ValueError, match="the training data yields no batch"):
        compare(["single"], out=tmp_path, model="tests.helpers.compare_models:Regressor", train_dataloaders=list)


def test_an_instance_instead_of_a_factory_names_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.helpers.compare_models import Regressor

    _never_starts_a_process(monkeypatch)
    with pytest.raises(ValueError, match="pass its class or a function that returns it"):
        compare(["single"], out=tmp_path, model=Regressor(), train_dataloaders=lambda: [])
