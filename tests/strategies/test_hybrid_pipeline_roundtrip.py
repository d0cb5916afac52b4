"""hybrid_pipeline's checkpoints across strategies, what a save communicates, and which blocks a rank holds.

One run of four epochs changes strategy at every epoch through its checkpoints: hybrid_pipeline -> one device ->
hybrid_pipeline -> ring_allreduce (``tests/strategies/pipeline_roundtrip.py``). The optimizer (SGD with momentum, two
parameter groups, a StepLR schedule) and the loops resume each time, so the end must match four epochs on one device.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.distributed import run_ranks

TOLERANCE = 1e-5  # fp32: the stages and ranks add the same terms in another order
WITH_PARAMETERS = [0, 2, 4, 5]  # FeatureNet's blocks with parameters
LARGEST_TENSOR = 16 * 16 * 4  # bytes: FeatureNet's largest parameter (and momentum buffer)


def load(out: Path, name: str, ranks: int) -> list[dict[str, Any]]:
    return [torch.load(out / f"{name}-rank{r}.pt", weights_only=False) for r in range(ranks)]


@pytest.fixture(scope="module")
def roundtrip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("roundtrip")
    for phase, world in (("hybrid", 2), ("single", 1), ("hybrid-ring", 2)):
        run_ranks("tests.strategies.pipeline_roundtrip", [phase, str(out)], world, timeout=200)
    return out


@pytest.mark.numerics
@pytest.mark.timeout(400)
def test_a_run_resumed_under_another_strategy_every_epoch_ends_as_on_one_device(roundtrip: Path) -> None:
    (reference,) = load(roundtrip / "reference", "reference", 1)
    (ring,) = load(roundtrip, "ring3", 2)[:1]
    for name, value in reference["params"].items():
        assert (ring["params"][name] - value).abs().max().item() <= TOLERANCE, name
    final = torch.load(roundtrip / "epoch=3.ckpt", weights_only=False)
    expected = torch.load(roundtrip / "reference" / "epoch=3.ckpt", weights_only=False)
    assert final["epoch"] == expected["epoch"] == 3 and final["global_step"] == expected["global_step"]
    got_opt, want_opt = final["optimizer_states"][0], expected["optimizer_states"][0]
    assert [g["params"] for g in got_opt["param_groups"]] == [g["params"] for g in want_opt["param_groups"]]
    assert [g["lr"] for g in got_opt["param_groups"]] == pytest.approx([g["lr"] for g in want_opt["param_groups"]])
    assert got_opt["state"].keys() == want_opt["state"].keys()
    for index, state in want_opt["state"].items():
        got = got_opt["state"][index]["momentum_buffer"]
        assert (got - state["momentum_buffer"]).abs().max().item() <= TOLERANCE, index
    assert final["lr_schedulers"] == expected["lr_schedulers"]


@pytest.mark.timeout(400)
def test_hybrid_checkpoints_during_and_after_fit_are_whole_and_alike(roundtrip: Path) -> None:
    """The file ModelCheckpoint streamed during fit and the one saved after fit hold the same whole model."""
    for epoch, name in ((0, "hybrid0"), (2, "hybrid2")):
        during = torch.load(roundtrip / f"epoch={epoch}.ckpt", weights_only=False)
        after = torch.load(roundtrip / f"{name}-after-fit.ckpt", weights_only=False)
        (rank0,) = load(roundtrip, name, 2)[:1]
        assert list(during["state_dict"]) == list(after["state_dict"]) == [*rank0["params"]]
        for key, value in rank0["params"].items():
            assert torch.equal(during["state_dict"][key], value) and torch.equal(after["state_dict"][key], value), key
        assert during["optimizer_states"][0]["state"].keys() == after["optimizer_states"][0]["state"].keys()


@pytest.mark.timeout(400)
def test_no_save_gathers_the_stages_onto_a_rank(roundtrip: Path) -> None:
    """Rank 0 receives the other stage's tensors one at a time; rank 1 receives nothing; no object collective carries
    tensor data (a gather of the stages' states would)."""
    for name in ("hybrid0", "hybrid2"):
        ranks = load(roundtrip, name, 2)
        for rank, got in enumerate(ranks):
            assert len(got["saves"]) == 2, "ModelCheckpoint's save and the one after fit"
            for save in got["saves"]:
                assert save["objects_total"] == 0 and save["collective_total"] == 0, (rank, save)
                assert save["recv_max"] <= LARGEST_TENSOR, (rank, save)
                if rank == 0:
                    assert save["recv_total"] > 0, "the other stage's tensors reach the writer"  # the spy sees them
                else:
                    assert save["recv_total"] == 0, save


@pytest.mark.timeout(400)
def test_each_rank_holds_only_its_stage_and_rank_zero_the_whole_model_after_fit(roundtrip: Path) -> None:
    for name in ("hybrid0", "hybrid2"):
        ranks = load(roundtrip, name, 2)
        for rank, got in enumerate(ranks):
            owned = [i for i in got["owned"] if i in WITH_PARAMETERS]
            assert got["start"] == owned, (name, rank, got)
            assert got["after"] == (WITH_PARAMETERS if rank == 0 else owned), (name, rank, got)
        assert ranks[0]["owned"] != ranks[1]["owned"]
