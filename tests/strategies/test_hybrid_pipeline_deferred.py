"""hybrid_pipeline with a body built on the meta device in ``configure_model`` (deferred initialization).

Each stage allocates and initializes only its own blocks; the other stages' blocks stay on the meta device through
``fit`` and after it. Training matches one device initializing every block the same way (``materialize``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.distributed import run_ranks

TOLERANCE = 1e-5  # fp32: the stages and replicas add the same terms in another order
WITH_PARAMETERS = [0, 2, 3, 4, 6]  # the body's blocks that have parameters (Linear, LayerNorm)


def run(tmp: Path, stages: int, world: int) -> list[dict[str, Any]]:
    run_ranks("tests.strategies.pipeline_deferred", [str(stages), str(world), str(tmp)], world, timeout=200)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.mark.numerics
@pytest.mark.timeout(300)
def test_each_stage_builds_only_its_own_blocks_and_trains_as_on_one_device(tmp_path: Path) -> None:
    (one_device,) = run(tmp_path / "one", 0, 1)
    ranks = run(tmp_path / "s2d2", 2, 4)
    stage_blocks = {0: {0, 2}, 1: {3, 4, 6}}  # balance="parameters" from the shapes on meta: blocks 0-2 and 3-6
    for rank, got in enumerate(ranks):
        owned = stage_blocks[rank // 2]
        for moment in ("start", "end", "after"):
            built = {i for i in WITH_PARAMETERS if got[moment][i]}
            assert built == owned, f"rank {rank} at {moment}: built {sorted(built)}, owns {sorted(owned)}"
        assert abs(got["validate"][0]["val_loss"] - one_device["validate"][0]["val_loss"]) <= TOLERANCE
        # a fresh module built on meta takes its stage's entries of the checkpoint at setup, once the blocks exist:
        # validated from it as the module that saved it, resumed from it as one device resumes
        assert abs(got["validate_loaded"][0]["val_loss"] - got["validate"][0]["val_loss"]) <= TOLERANCE, rank
        assert got["noop_loads"] == [], got["noop_loads"][:2]
    for name, value in one_device["resumed_params"].items():
        assert (ranks[0]["resumed_params"][name] - value).abs().max().item() <= TOLERANCE, f"resumed: {name}"
    # the checkpoints saved during fit, after it and after a validate that follows it hold the whole trained model
    # and its optimizer state, streamed stage by stage to rank 0
    for key in ("params", "after_fit_params", "after_validate_params"):
        assert ranks[0][key].keys() == one_device["params"].keys()
        for name, value in one_device["params"].items():
            assert (ranks[0][key][name] - value).abs().max().item() <= TOLERANCE, f"{key}: {name}"
        optimizer, expected = (
            ranks[0][key.replace("params", "optimizer")],
            one_device[key.replace("params", "optimizer")],
        )
        assert sorted(optimizer) == sorted(expected), key
        for index, entry in expected.items():
            for slot, value in entry.items():
                assert (optimizer[index][slot] - value).abs().max().item() <= TOLERANCE, f"{key}: {index} {slot}"


@pytest.mark.timeout(150)
def test_a_block_no_stage_can_initialize_fails_at_setup_on_every_rank(tmp_path: Path) -> None:
    argv = ["2", "2", str(tmp_path)]
    with pytest.raises(AssertionError) as failure:
        run_ranks("tests.strategies.pipeline_deferred", argv, 2, timeout=120, env={"LDPS_UNINITIALIZABLE": "1"})
    output = str(failure.value)
    message = "Block 7 (Scale) was built on the meta device"
    assert output.count(message) >= 2, output[-4000:]  # stage 0 does not own it and still raises
    assert "Define `reset_parameters()`" in output


@pytest.mark.timeout(150)
def test_a_finetuning_callback_with_a_body_on_meta_fails_at_setup_on_every_rank(tmp_path: Path) -> None:
    """BaseFinetuning compares parameters with torch.equal, which the other stages' meta blocks cannot run."""
    argv = ["2", "2", str(tmp_path)]
    with pytest.raises(AssertionError) as failure:
        run_ranks("tests.strategies.pipeline_deferred", argv, 2, timeout=120, env={"LDPS_FINETUNING": "1"})
    output = str(failure.value)
    assert output.count("A BaseFinetuning callback compares parameters by value") >= 2, output[-4000:]
    assert "Build the body eagerly" in output and "aten::equal" not in output
