"""FabricLocalSGDStrategy: ring_allreduce's training at H = 1, and a resume mid-period equal to the run it continues.

The scenarios run in one 2-rank launch on CPU/gloo (see :mod:`tests.fabric.local_sgd_scenarios`). Tolerance: max
absolute parameter difference <= 1e-6 (fp32).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fabric.fabric_scenarios import WORLD
from tests.helpers.distributed import run_ranks

TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fabric-local-sgd")
    run_ranks("tests.fabric.local_sgd_scenarios", [str(out)], WORLD, timeout=240)
    return out


def results(out: Path, name: str) -> list[dict[str, Any]]:
    return [torch.load(out / f"{name}-rank{r}.pt", weights_only=False) for r in range(WORLD)]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


@pytest.mark.timeout(300)
def test_sync_every_1_with_plain_averaging_and_sgd_trains_as_fabric_ring_allreduce(runs: Path) -> None:
    for mine, ring in zip(results(runs, "h1"), results(runs, "h1-ring"), strict=True):
        assert max_diff(mine["params"], ring["params"]) <= TOLERANCE


@pytest.mark.timeout(300)
def test_fabric_save_mid_period_and_load_resume_the_uninterrupted_run(runs: Path) -> None:
    ckpt = torch.load(runs / "mid-period.ckpt", weights_only=False)
    record = ckpt["local_sgd"]
    assert (record["steps"], record["since_sync"]) == (6, 2)
    own = [r["module"] for r in record["ranks"]]
    average = {k: (own[0][k] + own[1][k]) / 2 for k in own[0]}
    assert max_diff(ckpt["model"], average) <= TOLERANCE  # the averaged model under the module's key
    full, resumed = results(runs, "full"), results(runs, "resumed")
    for a, b in zip(full, resumed, strict=True):
        assert max_diff(a["params"], b["params"]) <= TOLERANCE
        assert a["syncs"] == b["syncs"] == 3  # steps 4, 8, 12
        assert b["remainder"] == ["step"]  # the local SGD record is the strategy's, not returned to the script
    assert max_diff(full[0]["params"], full[1]["params"]) == 0


@pytest.mark.timeout(300)
def test_streaming_diloco_resumes_with_a_fragment_in_flight(runs: Path) -> None:
    record = torch.load(runs / "stream-mid-period.ckpt", weights_only=False)["local_sgd"]
    assert [(p["fragment"], p["apply_at"]) for p in record["in_flight"]] == [(0, 7)]  # left at step 6
    full, resumed = results(runs, "stream-full"), results(runs, "stream-resumed")
    for a, b in zip(full, resumed, strict=True):
        assert max_diff(a["params"], b["params"]) <= TOLERANCE
        assert a["syncs"] == b["syncs"] == 7  # six fragment turns and the synchronisation at the end
    assert max_diff(full[0]["params"], full[1]["params"]) == 0
    assert max_diff(full[0]["params"], results(runs, "full")[0]["params"]) > 1e-3  # not DiLoCo's training


@pytest.mark.timeout(300)
def test_streaming_with_its_diloco_values_is_fabric_diloco(runs: Path) -> None:
    """The ``full`` run (DiLoCo, H = 4, 12 steps) and the same with the streaming options at their DiLoCo values."""
    for name in ("as-diloco-full", "as-diloco-resumed"):
        for a, b in zip(results(runs, name), results(runs, "full"), strict=True):
            assert max_diff(a["params"], b["params"]) <= TOLERANCE, name


def test_the_fabric_name_resolves_and_bad_options_fail_when_made() -> None:
    import lightning as L

    from lightning_dp_strategies import FabricLocalSGDStrategy

    fabric = L.Fabric(strategy="local_sgd", accelerator="cpu", devices=2)
    assert isinstance(fabric.strategy, FabricLocalSGDStrategy) and fabric.strategy.sync_every == 8
    with pytest.raises(ValueError, match="`sync_every` must be an int >= 1"):
        FabricLocalSGDStrategy(sync_every=0)
    with pytest.raises(ValueError, match="`warmup_steps` must be an int >= 0"):
        FabricLocalSGDStrategy(warmup_steps=-2)
    with pytest.raises(ValueError, match="every rank needs the whole optimizer state"):
        FabricLocalSGDStrategy(shard_optimizer_state=True)
    with pytest.raises(ValueError, match="Drop `reducer=`"):
        FabricLocalSGDStrategy(outer_precision="int8", reducer="ring")
    streaming = L.Fabric(strategy="streaming_diloco", accelerator="cpu", devices=2).strategy
    assert isinstance(streaming, FabricLocalSGDStrategy)
    options = (streaming.sync_every, streaming.fragments, streaming.delay, streaming.outer_precision)
    assert options == ("auto", 4, 1, "int4") and streaming.outer_optimizer is None


@pytest.mark.timeout(300)
def test_a_parameter_unfrozen_after_setup_is_refused_at_its_next_step_on_every_rank(runs: Path) -> None:
    """Local SGD averages the parameters that required grad at setup; one unfrozen since would train apart."""
    for got in results(runs, "unfrozen"):
        assert got["error"] is not None and "became trainable since" in got["error"], got["error"]
