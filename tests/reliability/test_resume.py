"""Exact resume: stopped mid-epoch with a checkpoint and resumed, a run ends where the uninterrupted run ends.

For each strategy one launch of :mod:`tests.reliability.scenarios` (``resume`` mode) trains ``full`` (10 steps),
``stopped`` (the same run stopped after step 6: mid-epoch 1, ``last.ckpt`` written every step) and ``resumed``
(``fit(ckpt_path=last.ckpt)`` to step 10). The model uses Adam with weight decay and a per-step ``LambdaLR``; the
training loader is resumable (``state_dict``/``load_state_dict``), which Lightning requires to resume mid-epoch.

Tolerance: max absolute difference <= 1e-6 for parameters and for every optimizer-state tensor (fp32; observed: 0,
bitwise equal); learning rates, scheduler states and the sequence of training batches must match exactly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.distributed import run_ranks
from tests.reliability.scenarios import SETUPS, STEPS_PER_EPOCH, STOP_STEP, TOTAL_STEPS, Net

# numerically sensitive: CI runs this file again under other CPU kernel paths and thread counts
pytestmark = pytest.mark.numerics


TOLERANCE = 1e-6
STRATEGIES = ["dp", "ring_allreduce", "hybrid_pipeline"]


def max_diff(a: Any, b: Any, where: str = "") -> float:
    """Largest absolute difference over two nested structures; anything but tensors and floats must be equal."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape, where
        return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {list(a)} != {list(b)}"
        return max([max_diff(a[k], b[k], f"{where}[{k!r}]") for k in a], default=0.0)
    if isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        return max([max_diff(x, y, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a, b, strict=True))], default=0.0)
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b)
    assert a == b, f"{where}: {a!r} != {b!r}"
    return 0.0


def world(strategy: str) -> int:
    return 1 if strategy == "dp" else SETUPS[strategy].devices  # dp: one process, its devices are threads


def load(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=False)


@pytest.fixture(scope="module", params=STRATEGIES)
def resumed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    strategy = request.param
    out = tmp_path_factory.mktemp(f"resume-{strategy}")
    run_ranks("tests.reliability.scenarios", ["resume", strategy, str(out)], world(strategy), timeout=240)
    return strategy, out


@pytest.mark.timeout(300)
def test_the_checkpoint_is_taken_mid_epoch_after_a_full_epoch(resumed: tuple[str, Path]) -> None:
    _, out = resumed
    checkpoint = load(out / "ckpts" / "last.ckpt")
    assert checkpoint["global_step"] == STOP_STEP and STOP_STEP % STEPS_PER_EPOCH != 0
    assert checkpoint["epoch"] == STOP_STEP // STEPS_PER_EPOCH == 1
    assert checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [
        {"yielded": STOP_STEP % STEPS_PER_EPOCH}
    ]
    # the resume has work to do: training after the checkpoint moved the parameters
    full, stopped = load(out / "full-final.ckpt"), load(out / "stopped-final.ckpt")
    assert max_diff(full["state_dict"], stopped["state_dict"]) > 1e-3


@pytest.mark.timeout(300)
def test_resumed_run_trains_on_the_batches_the_uninterrupted_run_trained_on(resumed: tuple[str, Path]) -> None:
    """Lost mid-epoch position (a loader that restarts the epoch, or the resumed epoch's sampler order) fails here."""
    strategy, out = resumed
    for rank in range(world(strategy)):
        full, again = load(out / f"full-rank{rank}.pt"), load(out / f"resumed-rank{rank}.pt")
        assert len(full["batches"]) == TOTAL_STEPS and len(again["batches"]) == TOTAL_STEPS - STOP_STEP
        for step, (x, y) in enumerate(
            zip(full["batches"][STOP_STEP:], again["batches"], strict=True), start=STOP_STEP + 1
        ):
            assert torch.equal(x, y), f"rank {rank}: step {step} trained on other samples after the resume"


@pytest.mark.timeout(300)
def test_resumed_run_ends_with_the_parameters_optimizer_and_scheduler_of_the_uninterrupted_run(
    resumed: tuple[str, Path],
) -> None:
    strategy, out = resumed
    full, again = load(out / "full-final.ckpt"), load(out / "resumed-final.ckpt")
    assert full["global_step"] == again["global_step"] == TOTAL_STEPS
    assert max_diff(full["state_dict"], again["state_dict"], "state_dict") <= TOLERANCE
    assert max_diff(full["optimizer_states"], again["optimizer_states"], "optimizer_states") <= TOLERANCE
    assert max_diff(full["lr_schedulers"], again["lr_schedulers"], "lr_schedulers") == 0.0
    # what every rank holds in memory, not only what rank 0 wrote (each pipeline stage holds its own part)
    for rank in range(world(strategy)):
        mine, theirs = load(out / f"full-rank{rank}.pt"), load(out / f"resumed-rank{rank}.pt")
        assert max_diff(mine["params"], theirs["params"], f"rank {rank} params") <= TOLERANCE
        assert max_diff(mine["optimizer"], theirs["optimizer"], f"rank {rank} optimizer") <= TOLERANCE
        assert mine["lrs"] == theirs["lrs"] == pytest.approx([0.05 * 0.8**TOTAL_STEPS])  # the LambdaLR went on
        assert "exp_avg" in next(iter(mine["optimizer"]["state"].values()))


@pytest.mark.timeout(300)
def test_checkpoints_hold_the_whole_model_in_the_single_device_format(resumed: tuple[str, Path]) -> None:
    """Also ``trainer.save_checkpoint`` after ``fit`` (hybrid_pipeline: the optimizers then hold one stage each)."""
    _, out = resumed
    full = load(out / "full-final.ckpt")
    single = Net()
    single.load_state_dict(full["state_dict"])  # strict: every key of the whole model
    optimizer = single.configure_optimizers()["optimizer"]
    optimizer.load_state_dict(full["optimizer_states"][0])
    assert len(optimizer.state) == len(list(single.parameters()))  # a state for every parameter
    after = load(out / "full-after-fit.ckpt")
    assert max_diff(full["state_dict"], after["state_dict"], "state_dict") == 0.0
    assert max_diff(full["optimizer_states"], after["optimizer_states"], "optimizer_states") == 0.0


@pytest.mark.timeout(300)
def test_only_rank_0_writes_checkpoints(resumed: tuple[str, Path]) -> None:
    strategy, out = resumed
    written = {
        int(p.stem.rsplit("rank", 1)[1]): json.loads(p.read_text()) for p in out.glob("writes-resume-rank*.json")
    }
    assert sorted(written) == list(range(world(strategy)))
    expected = ["full-final.ckpt", "full-after-fit.ckpt", *["last.ckpt"] * STOP_STEP, "stopped-final.ckpt"]
    assert written[0] == [*expected, "resumed-final.ckpt"]
    assert all(files == [] for rank, files in written.items() if rank != 0)
    assert sorted(p.name for p in (out / "ckpts").iterdir()) == ["last.ckpt"]  # no temporary file left behind
