"""Every strategy on two devices against the same run on one: on two CUDA devices (NCCL) where the machine has them,
and the same scenario on two CPU processes (gloo) or logical CPU replicas in CI, which keeps the scenario itself tested.

The GPU cases are skipped with fewer than two CUDA devices. Tolerance 1e-5 on the parameters after 12 SGD steps with
momentum: the two devices compute on half batches (the pipeline's stages on quarter micro-batches), whose sums round
differently from the whole batch's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.gpu.several_devices import STEPS, STRATEGIES
from tests.helpers.distributed import run_script

TOLERANCE = 1e-5
MULTI = [name for name in STRATEGIES if name != "single"]
BACKEND = {"cpu": "gloo", "gpu": "nccl"}


def train(name: str, accelerator: str, out: Path) -> dict[str, Any]:
    run_script(["-m", "tests.gpu.several_devices", name, accelerator, "2", str(out)], timeout=240)
    return torch.load(out / f"{name}.pt", weights_only=False)


def check(accelerator: str, tmp_path: Path) -> None:
    reference = train("single", accelerator, tmp_path)
    assert reference["steps"] == STEPS
    for name in MULTI:
        trained = train(name, accelerator, tmp_path)
        assert trained["steps"] == STEPS, name
        assert trained["device"] == ("cuda" if accelerator == "gpu" else "cpu"), name
        if name != "dp":  # one process: no process group
            assert trained["backend"] == BACKEND[accelerator], name
        for key, value in reference["params"].items():
            difference = float((trained["params"][key] - value).abs().max())
            assert difference <= TOLERANCE, f"{name} {key}: {difference:.3g} > {TOLERANCE}"


@pytest.mark.timeout(600)
def test_every_strategy_on_two_cpu_devices_trains_as_one_device(tmp_path: Path) -> None:
    check("cpu", tmp_path)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.timeout(600)
def test_every_strategy_on_two_gpus_trains_as_one_gpu(tmp_path: Path) -> None:
    check("gpu", tmp_path)
