"""FabricRingAllReduceStrategy: parity with a plain single-process loop is the specification.

The scenarios run in one real 2-process Fabric launch on CPU/gloo (Fabric's popen launcher, a timeout on the launch;
see :mod:`tests.fabric.fabric_scenarios`) and are compared with :func:`reference_parameters`, a plain loop over the
same global batches. Tolerance: max absolute parameter difference <= 1e-5, the Trainer strategy's (fp32; observed
~6e-8).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY

import lightning_dp_strategies
from lightning_dp_strategies import FabricRingAllReduceStrategy
from tests.fabric.fabric_scenarios import WORLD, make_model, reference_parameters, sharded_reference
from tests.helpers.distributed import run_script

NUMERICS = pytest.mark.numerics  # CI re-runs these under other CPU kernel paths and thread counts

TOLERANCE = 1e-5
STEPS = 12  # 2 epochs of 6 steps


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fabric-ring")
    run_script(["-m", "tests.fabric.fabric_scenarios", str(out)], timeout=180)
    return out


def results(out: Path, name: str) -> list[dict[str, Any]]:
    return [torch.load(out / f"{name}-rank{r}.pt", weights_only=False) for r in range(WORLD)]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


def assert_parity(ranks: list[dict[str, Any]]) -> None:
    reference = reference_parameters()
    for rank, result in enumerate(ranks):
        diff = max_diff(result["params"], reference)
        assert diff <= TOLERANCE, f"rank {rank} drifted from single-process training by {diff}"
    init = {n: p.detach() for n, p in make_model().named_parameters()}
    assert max_diff(init, reference) > 1e-2, "training did not move the parameters"


def buffer_bytes() -> int:
    """The one bucket of the model: every gradient plus one presence flag per parameter, fp32."""
    model = make_model()
    return 4 * (sum(p.numel() for p in model.parameters()) + len(list(model.parameters())))


@NUMERICS
@pytest.mark.timeout(240)
def test_fabric_backward_averages_gradients_like_a_single_process_loop(runs: Path) -> None:
    ranks = results(runs, "sgd")
    assert_parity(ranks)
    for result in ranks:
        # step_stats per optimizer step: one synced backward, the bucket sent once (2(N-1)/N = 1 at N = 2)
        assert len(result["steps"]) == STEPS and result["buckets"] == 1
        assert all(s["synced_backwards"] == 1 and s["ring_operations"] == 1 for s in result["steps"])
        assert all(s["bytes_sent"] == buffer_bytes() for s in result["steps"])
        assert result["closed_totals"]["ring_operations"] == STEPS  # comm_stats kept after teardown


@NUMERICS
@pytest.mark.timeout(240)
def test_a_subclass_that_only_picks_its_reducer_trains_at_parity(runs: Path) -> None:
    """``NativeFabric`` overrides nothing but ``configure_reducer`` (the backend's all-reduce): the same tolerance
    as the ring's run."""
    assert_parity(results(runs, "own_reducer"))


@NUMERICS
@pytest.mark.timeout(240)
def test_a_torch_ddp_comm_hook_averages_the_buckets_under_fabric(runs: Path) -> None:
    hooked, ring = results(runs, "hook"), results(runs, "sgd")
    assert_parity(hooked)
    for mine, theirs in zip(hooked, ring, strict=True):
        # allreduce_hook divides by 2 and sums two values, as the ring does: the same bits
        assert all(torch.equal(mine["params"][n], theirs["params"][n]) for n in mine["params"])
        assert all(s["synced_backwards"] == 1 and s["ring_operations"] == 1 for s in mine["steps"])


@NUMERICS
@pytest.mark.timeout(240)
def test_reducer_auto_times_three_steps_then_keeps_one_choice_at_parity(runs: Path) -> None:
    """``reducer=AutoReducer(allow="lossless")``: one node, so one candidate level (flat); it is chosen on both ranks
    after the timed steps and training stays at parity (1e-5)."""
    ranks = results(runs, "auto")
    assert_parity(ranks)
    assert [r["chosen"] for r in ranks] == ["flat plain"] * WORLD
    assert list(ranks[0]["predicted"]) == ["flat plain"] and ranks[0]["predicted"]["flat plain"] > 0


@NUMERICS
@pytest.mark.timeout(240)
def test_no_backward_sync_accumulates_locally_and_the_next_backward_averages(runs: Path) -> None:
    ranks = results(runs, "accumulate")
    assert_parity(ranks)  # half the batch accumulated locally, half synchronised: the whole batch's average
    for result in ranks:
        assert len(result["records"]) == STEPS
        for record in result["records"]:
            local, step = record["local"], record["step"]
            assert local["ring_operations"] == 0 and local["bytes_sent"] == 0 and local["synced_backwards"] == 0
            assert local["skipped_backwards"] == 1
            assert step["skipped_backwards"] == 1 and step["synced_backwards"] == 1 and step["ring_operations"] == 1


@pytest.mark.timeout(240)
def test_fabric_save_and_load_resume_the_same_parameters_and_optimizer_state(runs: Path) -> None:
    for result in results(runs, "resume"):
        assert result["checkpoint_keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"]  # the plain state_dict
        assert max_diff(result["loaded"]["params"], result["saved"]["params"]) == 0
        momentum = zip(result["loaded"]["momentum"], result["saved"]["momentum"], strict=True)
        assert len(result["saved"]["momentum"]) == 4 and all(torch.equal(a, b) for a, b in momentum)
        assert result["step"] == 3  # plain values in the state come back too
        assert max_diff(result["resumed"], result["uninterrupted"]) <= 1e-7
        assert max_diff(result["resumed"], result["saved"]["params"]) > 1e-3  # the resumed steps did train


@pytest.mark.timeout(240)
def test_sharded_optimizer_state_clips_saves_and_loads_at_parity(runs: Path) -> None:
    """Adam with ``shard_optimizer_state=True`` and ``fabric.clip_gradients`` (the global norm) equals single-process
    Adam (2e-5) holding half the state per rank; ``fabric.save`` writes the whole state and ``fabric.load`` resumes
    it exactly."""
    reference = sharded_reference(steps=6, clip=0.05)
    ranks = results(runs, "sharded")
    full = 2 * sum(p.numel() for p in make_model().parameters())
    assert sum(r["state_numel"] for r in ranks) == full
    for result in ranks:
        assert max_diff(result["uninterrupted"], reference) <= 2e-5
        assert max_diff(result["resumed"], result["uninterrupted"]) <= 1e-7
        assert result["state_numel"] <= 0.55 * full
    whole = torch.load(runs / "sharded.ckpt", weights_only=True)["optimizer"]
    optimizer = torch.optim.Adam(make_model().parameters(), lr=1e-2)
    optimizer.load_state_dict(whole)  # the whole state, as a single-device optimizer holds it
    assert [tuple(s["exp_avg"].shape) for s in whole["state"].values()] == [(32, 8), (32,), (3, 32), (3,)]


@pytest.mark.timeout(240)
def test_ranks_that_disagree_fail_together_and_a_second_module_or_a_sparse_one_is_refused(runs: Path) -> None:
    for result in results(runs, "refusals"):
        assert "parameter '0.weight' is [[32, 8]" in result["mismatch"] and "[[33, 8]" in result["mismatch"]
        assert "one `nn.Module`" in result["second"]
        assert "`0.weight` (`nn.Embedding(..., sparse=True)`) gets sparse gradients" in result["sparse"]


@pytest.mark.timeout(240)
def test_nonfinite_skip_skips_the_step_on_every_rank(runs: Path) -> None:
    for name in ("nonfinite", "nonfinite_sharded"):
        for result in results(runs, name):
            assert result == {"skipped": 1, "unchanged": True, "moved": True}, name


@pytest.mark.timeout(240)
def test_ranks_given_the_same_inputs_are_warned_once_on_rank_0_and_the_hook_goes(runs: Path) -> None:
    """A loader every rank reads whole: the first training forward's inputs are the same on both ranks."""
    ranks = results(runs, "same_inputs")
    for name in ("ring_whole", "local_sgd_whole"):
        (message,) = ranks[0][name]["warnings"]
        assert "(ranks 0, 1)" in message and "use_distributed_sampler=True` in `setup_dataloaders`" in message
        assert "num_replicas=fabric.world_size, rank=fabric.global_rank" in message, message
        assert ranks[1][name]["warnings"] == [], name
    assert ranks[0]["ring_sampled"]["warnings"] == ranks[1]["ring_sampled"]["warnings"] == []
    assert all(rank[name]["hooks"] == 0 for rank in ranks for name in rank), "the check's hook removed itself"


# ---------------------------------------------------------------------------------------------------- in-process
@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"bucket_cap_mb": 0}, ValueError, "`bucket_cap_mb` must be a positive number"),
        ({"first_bucket_cap_mb": "1"}, ValueError, "`first_bucket_cap_mb` must be a positive number"),
        ({"reducer": "rnig"}, ValueError, "rnig"),
        ({"broadcast_buffers": "no"}, TypeError, "`broadcast_buffers` must be True or False"),
        ({"nonfinite_grads": "ignore"}, ValueError, "Unknown `nonfinite_grads`"),
        ({"process_group_backend": "mpi2"}, ValueError, "Unknown `process_group_backend`"),
        ({"timeout": -1}, ValueError, "`timeout` must be"),
        ({"start_method": "thread"}, ValueError, "Unknown `start_method`"),
    ],
)
def test_a_bad_option_fails_when_the_strategy_is_made(options: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        FabricRingAllReduceStrategy(**options)


def test_names_registered_with_fabric_idempotently_with_their_launchers() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lightning_dp_strategies.register_all()
        lightning_dp_strategies.register_all()
    for name, start_method in [
        ("ring_allreduce", "popen"),
        ("ring_allreduce_spawn", "spawn"),
        ("ring_allreduce_notebook", "fork"),
    ]:
        assert STRATEGY_REGISTRY[name]["strategy"] is FabricRingAllReduceStrategy
        assert STRATEGY_REGISTRY[name]["init_params"] == {"start_method": start_method}
    assert STRATEGY_REGISTRY["ring_allreduce_auto"]["init_params"] == {"reducer": "auto"}
    assert STRATEGY_REGISTRY["ring_allreduce_sharded"]["init_params"] == {"shard_optimizer_state": True}
    assert STRATEGY_REGISTRY["dp"]["strategy"].__module__.startswith("lightning.fabric")  # Fabric keeps its own
    fabric = L.Fabric(strategy="ring_allreduce_spawn", accelerator="cpu", devices=2)
    strategy = fabric.strategy
    assert isinstance(strategy, FabricRingAllReduceStrategy) and strategy._start_method == "spawn"
    assert strategy.world_size == 2 and strategy.buckets is None  # nothing launched or set up yet


@pytest.mark.parametrize("strategy", ["FabricRingAllReduceStrategy", "FabricLocalSGDStrategy"])
def test_fault_tolerant_is_refused_under_fabric_naming_the_restart_recipe(strategy: str) -> None:
    """Going on without a lost rank needs the Trainer's loop; a Fabric strategy refuses the option at construction."""
    with pytest.raises(TypeError, match=r"'fault_tolerant'.*Trainer's RingAllReduceStrategy.*'The recipe'"):
        getattr(lightning_dp_strategies, strategy)(fault_tolerant=True)
