"""RingAllReduceStrategy: parity with single-process training is the specification.

The parity tests read real 2- or 3-process Trainer runs on CPU/gloo (Lightning's popen launcher, a timeout on every
launch; the scenarios of one world size run one after the other in one launch) and compare the final parameters
with :func:`reference_parameters`, a plain single-process loop over the same global batches. Tolerance: max absolute
parameter difference <= 1e-5 (fp32; observed ~1e-7).
"""

from __future__ import annotations

import csv
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.distributed import run_ranks, run_script
from tests.strategies.ring_scenarios import SCENARIOS, ParityNet, reference_parameters

# numerically sensitive: CI runs the parity tests again under other CPU kernel paths and thread counts (not the
# launch and bad-input tests, whose numerics are those of the world-2 parity)
NUMERICS = pytest.mark.numerics


TOLERANCE = 1e-5
NAMES = "'ring', 'native', 'per_tensor', 'auto', 'int8', 'int4'"  # the reducer names an error lists
TORCH_POWERSGD_HERE = not torch.cuda.is_available()
"""torch's PowerSGD hook fails on CPU buckets in a process that sees a GPU (it synchronizes CUDA on the bucket's
device): its scenario runs only on machines without one."""
HOOKS = ["hook_allreduce", "hook_unused", "hook_fp16", *(["hook_powersgd"] if TORCH_POWERSGD_HERE else [])]
# the scenarios of one world size share one launch (each launch costs seconds of imports, a fit does not)
WORLD_2 = ["sgd", "sgd@ddp", "adam2", "unused", "accumulate", "clip", "hook_clip", "manual", "bf16", *HOOKS]
WORLD_2 += ["compiled", "checkpointed"]  # torch.compile, activation checkpointing
WORLD_3 = ["sgd3", "adam3", "sgd3@minimal"]


def launch(names: list[str], out: Path, strategy: str = "ring_allreduce", **env: str) -> None:
    """Run the scenarios in one launch: at world size 2 through Lightning's own launcher, at 3 as ``torchrun`` starts
    ranks (:func:`run_ranks`, which skips the per-rank imports)."""
    out.mkdir(parents=True, exist_ok=True)
    argv = [",".join(names), str(out), strategy]
    (world,) = {SCENARIOS[name.partition("@")[0]].world for name in names}
    if world == 2:
        run_script(["-m", "tests.strategies.ring_scenarios", *argv], timeout=420, env=env)
    else:
        run_ranks("tests.strategies.ring_scenarios", argv, world, timeout=420, env=env)


def results(out: Path, name: str, strategy: str = "ring_allreduce") -> list[dict[str, Any]]:
    return [torch.load(out / f"{name}-{strategy}" / f"rank{r}.pt") for r in range(SCENARIOS[name].world)]


@pytest.fixture(scope="module")
def world2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ring-world2")
    launch(WORLD_2, out)
    return out


@pytest.fixture(scope="module")
def world3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ring-world3")
    launch(WORLD_3, out)
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


def assert_parity(ranks: list[dict[str, Any]], name: str, per_shard: bool = False) -> None:
    reference = reference_parameters(name, per_shard=per_shard)
    for rank, result in enumerate(ranks):
        diff = max_diff(result["params"], reference)
        assert diff <= TOLERANCE, f"rank {rank} drifted from single-process training by {diff}"
    init = dict(ParityNet(SCENARIOS[name]).named_parameters())
    init = {n.replace("_orig_mod.", ""): p.detach() for n, p in init.items()}  # as the ranks' records name them
    assert max_diff(init, reference) > 1e-2, "training did not move parameters"


@NUMERICS
@pytest.mark.timeout(600)
def test_parity_world_2_sgd_momentum_weight_decay_and_equal_to_lightning_ddp(world2: Path) -> None:
    ring = results(world2, "sgd")
    assert_parity(ring, "sgd")
    ddp = results(world2, "sgd", strategy="ddp")
    assert max_diff(ring[0]["params"], ddp[0]["params"]) <= 1e-6
    # the per-step statistics reached the logger (log_comm_stats=True): every step sent 2(N-1)/N of the buffer
    rows = list(csv.DictReader(open(world2 / "sgd-ring_allreduce" / "logs" / "version_0" / "metrics.csv")))
    sent = [float(r["comm/bytes_sent"]) for r in rows if r.get("comm/bytes_sent")]
    model = ParityNet(SCENARIOS["sgd"])
    buffer_bytes = 4 * (sum(p.numel() for p in model.parameters()) + len(list(model.parameters())))
    assert len(sent) == 12 and all(s == buffer_bytes for s in sent), sent  # N = 2: 2(N-1)/N = 1
    assert ring[0]["totals"]["ring_operations"] == 12
    # two ranks on gloo: the buckets carry a second group over both ranks (each ring direction its own connection)
    assert [r["duplex_ranks"] for r in ring] == [[0, 1], [0, 1]]


@NUMERICS
@pytest.mark.parametrize("name", ["adam2", "sgd3", "adam3"])
@pytest.mark.timeout(600)
def test_parity_other_world_sizes_and_optimizers(request: pytest.FixtureRequest, name: str) -> None:
    ranks = results(request.getfixturevalue("world2" if SCENARIOS[name].world == 2 else "world3"), name)
    assert_parity(ranks, name)
    world = SCENARIOS[name].world
    assert all(r["duplex_ranks"] == ([0, 1] if world == 2 else None) for r in ranks)  # a second group at 2 ranks only


@NUMERICS
@pytest.mark.timeout(600)
def test_a_subclass_that_only_says_its_reducer_trains_at_parity(world3: Path) -> None:
    """``MinimalBucketed`` defines nothing but ``configure_reducer``: the base agrees the ranks, broadcasts rank 0's
    weights and attaches the buckets by itself (the same tolerance as the ring: 1e-5)."""
    assert_parity(results(world3, "sgd3", strategy="minimal"), "sgd3")


@NUMERICS
@pytest.mark.timeout(600)
def test_unused_parameters_need_no_flag(world2: Path) -> None:
    ranks = results(world2, "unused")
    # only rank 0 uses `rank0_only`; the reference averages the per-rank losses, each on its own shard
    assert_parity(ranks, "unused", per_shard=True)
    for result in ranks:
        grads = [r["grad_is_none"] for r in result["records"] if "grad_is_none" in r]
        assert len(grads) == 12
        # no rank used it: .grad stays None (so weight decay never touched it, which the parity above also proves)
        assert all(g["never_used.weight"] and g["never_used.bias"] for g in grads)
        # rank 0 used it: every rank, rank 1 included, got the averaged gradient
        assert not any(g["rank0_only.weight"] for g in grads)


@NUMERICS
@pytest.mark.timeout(600)
def test_gradient_accumulation_does_not_communicate(world2: Path) -> None:
    ranks = results(world2, "accumulate")
    assert_parity(ranks, "accumulate")
    counters = [r for r in ranks[0]["records"] if "ops" in r]
    ops = [c["ops"] for c in counters]
    assert len(ops) == 12
    # batches 0, 2, 4, ... accumulate (no ring operation); 1, 3, 5, ... synchronise (one bucket here)
    per_batch = [ops[0]] + [b - a for a, b in itertools.pairwise(ops)]
    assert per_batch == [0, 1] * 6, per_batch
    assert counters[-1]["skipped"] == 6


@NUMERICS
@pytest.mark.timeout(600)
def test_gradient_clipping_sees_averaged_gradients(world2: Path) -> None:
    assert_parity(results(world2, "clip"), "clip")


@NUMERICS
@pytest.mark.timeout(600)
def test_a_gradient_change_in_on_after_backward_acts_on_the_averaged_gradients(world2: Path) -> None:
    """``clip_grad_norm_`` in ``on_after_backward`` trains as clipping the global batch's gradient on one device, as
    under DDP: the hook runs once the buckets are reduced, not while they are (when the ranks drifted apart)."""
    assert_parity(results(world2, "hook_clip"), "hook_clip")


@NUMERICS
@pytest.mark.timeout(600)
def test_manual_optimization_with_no_backward_sync(world2: Path) -> None:
    ranks = results(world2, "manual")
    assert_parity(ranks, "manual")
    steps = [r for r in ranks[0]["records"] if "local_ops" in r]
    assert len(steps) == 12
    assert all(s["local_ops"] == 0 for s in steps), "a backward inside no_backward_sync() communicated"
    assert [s["sync_ops"] for s in steps] == list(range(1, 13))


@NUMERICS
@pytest.mark.timeout(600)
def test_a_torch_compiled_body_trains_at_parity(world2: Path) -> None:
    """``self.body = torch.compile(...)``: the compiled backward hands every gradient to the buckets as eager
    autograd does (``aot_eager``: AOTAutograd's graphs, run by eager kernels), against the eager reference."""
    ranks = results(world2, "compiled")
    assert_parity(ranks, "compiled")
    assert all(r["totals"]["ring_operations"] == 12 for r in ranks)  # one bucket a step, none skipped


@NUMERICS
@pytest.mark.timeout(600)
def test_reentrant_activation_checkpointing_trains_at_parity(world2: Path) -> None:
    """The recomputation runs a nested backward inside the outer one, where the checkpointed layers' gradients
    arrive: each goes into its bucket once, with gradient accumulation (2) as well."""
    ranks = results(world2, "checkpointed")
    assert_parity(ranks, "checkpointed")
    assert all(r["totals"]["ring_operations"] == 6 for r in ranks)  # 12 batches, every second one averages


@NUMERICS
@pytest.mark.timeout(600)
def test_bf16_mixed_precision(world2: Path) -> None:
    # bf16 rounding depends on the batch shape, so the reference runs each rank's shard under autocast
    assert_parity(results(world2, "bf16"), "bf16", per_shard=True)


@pytest.mark.timeout(300)
def test_notebook_form_trains_where_popen_is_refused(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="ring_allreduce_notebook"):
        launch(["sgd"], tmp_path, strategy="ring_allreduce_spawn", LDPS_SIMULATE_NOTEBOOK="1")
    launch(["sgd"], tmp_path, strategy="ring_allreduce_notebook", LDPS_SIMULATE_NOTEBOOK="1")
    assert_parity(results(tmp_path, "sgd", strategy="ring_allreduce_notebook"), "sgd")


# ---------------------------------------------------------------------------------------------- bad input, set-up


@pytest.mark.parametrize(
    ("options", "fix"),
    [
        ({"bucket_cap_mb": 0}, "`bucket_cap_mb` must be a positive number of MiB"),
        ({"bucket_cap_mb": -5}, "`bucket_cap_mb` must be a positive number of MiB"),
        ({"bucket_cap_mb": "25"}, "`bucket_cap_mb` must be a positive number of MiB"),
        ({"first_bucket_cap_mb": True}, "`first_bucket_cap_mb` must be a positive number of MiB"),
        ({"start_method": "thread"}, r"use one of \['popen', 'spawn', 'fork', 'forkserver'\]"),
        ({"process_group_backend": "nccI"}, "Unknown `process_group_backend`"),
        ({"timeout": -1}, "`timeout` must be a datetime.timedelta or a positive number of seconds"),
        (
            {"reducer": "tree"},
            r"Unknown reducer 'tree': use one of \['ring', 'native', 'per_tensor', 'auto', 'int8', 'int4'\]",
        ),
        (
            {"reducer": 42},
            r"`reducer` must be one of \['ring', 'native', 'per_tensor', 'auto', 'int8', 'int4'\] or a callable",
        ),
        ({"shard_optimizer_state": 1}, "`shard_optimizer_state` must be True or False"),
        ({"shard_optimizer_state": True, "two_level": True}, "cannot be combined with `two_level=True`"),
        ({"shard_optimizer_state": True, "reducer": "auto"}, "cannot be combined with `reducer='auto'`"),
        ({"shard_optimizer_state": True, "model_averaging_period": 4}, "cannot be combined with `ddp_comm_hook`"),
    ],
)
def test_bad_options_fail_at_construction_naming_the_fix(options: dict[str, Any], fix: str) -> None:
    from lightning_dp_strategies import RingAllReduceStrategy

    with pytest.raises((ValueError, TypeError), match=fix):
        RingAllReduceStrategy(**options)


def test_unknown_option_is_rejected() -> None:
    from lightning_dp_strategies import RingAllReduceStrategy

    with pytest.raises(TypeError, match="find_unused_parameters"):
        RingAllReduceStrategy(find_unused_parameters=True)  # type: ignore[call-arg]


FROZEN_SCRIPT = """
import lightning as L, torch
from lightning.pytorch.demos.boring_classes import BoringModel
import lightning_dp_strategies

class Frozen(BoringModel):
    def training_step(self, batch, batch_idx):
        raise AssertionError("training started")

model = Frozen().requires_grad_(False)
L.Trainer(strategy="ring_allreduce", accelerator="cpu", devices=2, max_steps=1, logger=False,
          enable_progress_bar=False, enable_checkpointing=False).fit(model)
"""


@pytest.mark.timeout(120)
def test_model_without_trainable_parameters_fails_at_setup_on_every_rank(tmp_path: Path) -> None:
    script = tmp_path / "frozen.py"  # a file, not `-c`: the popen launcher re-runs sys.argv for rank 1
    script.write_text(FROZEN_SCRIPT)
    with pytest.raises(AssertionError) as failure:
        run_script([str(script)], timeout=90)
    output = str(failure.value)
    assert "has no parameter that requires grad" in output and "Unfreeze at least one parameter" in output
    assert "training started" not in output


def test_importing_twice_and_reloading_registers_without_raising() -> None:
    import importlib
    import warnings

    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_dp_strategies

    importlib.reload(lightning_dp_strategies)
    lightning_dp_strategies.register_all()
    for prefix, cls in [("ring_allreduce", "RingAllReduceStrategy"), ("hybrid_pipeline", "HybridPipelineStrategy")]:
        for suffix, start_method in [("", "popen"), ("_spawn", "spawn"), ("_notebook", "fork")]:
            assert StrategyRegistry[prefix + suffix]["init_params"] == {"start_method": start_method}
            assert StrategyRegistry[prefix + suffix]["strategy"].__name__ == cls
    # a name another package registered first is left alone, with a warning
    sentinel = type("Theirs", (lightning_dp_strategies.RingAllReduceStrategy,), {"__module__": "their_package"})
    StrategyRegistry.register("ring_allreduce", sentinel, override=True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lightning_dp_strategies.register_all()
        assert StrategyRegistry["ring_allreduce"]["strategy"] is sentinel
        assert any("already registered by their_package" in str(w.message) for w in caught)
    finally:
        StrategyRegistry.register(
            "ring_allreduce", lightning_dp_strategies.RingAllReduceStrategy, override=True, start_method="popen"
        )
        lightning_dp_strategies.register_all()


def test_trainer_resolves_the_names() -> None:
    import lightning as L
    from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher

    import lightning_dp_strategies

    trainer = L.Trainer(strategy="ring_allreduce_notebook", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, lightning_dp_strategies.RingAllReduceStrategy)
    assert isinstance(trainer.strategy.launcher, _MultiProcessingLauncher)
    assert trainer.strategy.launcher.is_interactive_compatible
    trainer = L.Trainer(strategy="ring_allreduce_sharded", accelerator="cpu", devices=2, logger=False)
    assert trainer.strategy.shard_optimizer_state and not trainer.strategy.two_level


@pytest.mark.timeout(300)
def test_two_nodes_through_torchrun_keep_parity(tmp_path: Path) -> None:
    """2 nodes x 1 process on loopback: Lightning's TorchElasticEnvironment sets the ranks, not our launcher."""
    import sys

    from tests.helpers.distributed import free_port, run_commands

    out = tmp_path / "nodes"
    out.mkdir()
    port = str(free_port())
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
    rendezvous = ["--master-addr", "127.0.0.1", "--master-port", port]
    script = ["-m", "tests.strategies.ring_scenarios", "sgd", str(out)]
    run_commands(
        [[*torchrun, "--node-rank", str(node), *rendezvous, *script] for node in range(2)],
        timeout=240,
        env={"LDPS_NUM_NODES": "2"},
    )
    assert_parity(results(out, "sgd"), "sgd")


@NUMERICS
@pytest.mark.timeout(300)
def test_two_nodes_of_two_processes_reduce_in_two_levels_at_parity(tmp_path: Path) -> None:
    """2 nodes x 2 processes on loopback (the ranks numbered as torchrun numbers them on two nodes): the default is
    one flat ring, as `two_level=False`; `two_level=True` reduces inside each node, then across nodes, at the flat
    ring's tolerance (1e-5). Per rank both send 2(N-1)/N = 1.5x the buffer, but the two-level one sends only a third
    of it (half a buffer) across nodes, so a node sends 1x the buffer over its link instead of 1.5x."""
    from tests.helpers.distributed import run_ranks

    argv = ["nodes2x2,nodes2x2@two_level,nodes2x2@auto", str(tmp_path)]
    run_ranks("tests.strategies.ring_scenarios", argv, 4, timeout=280, env={"LDPS_NUM_NODES": "2"}, per_node=2)
    two_level, flat = results(tmp_path, "nodes2x2", strategy="two_level"), results(tmp_path, "nodes2x2")
    assert_parity(two_level, "nodes2x2")
    assert_parity(flat, "nodes2x2")
    # reducer="auto" restricted to lossless candidates: after 4 warm-up steps (3 timed) it picks flat or two-level,
    # the same on every rank, and stays at parity
    auto = results(tmp_path, "nodes2x2", strategy="auto")
    assert_parity(auto, "nodes2x2")
    choices = {auto[rank]["auto"][0] for rank in range(4)}
    assert len(choices) == 1 and choices <= {"flat plain", "two-level plain"}, choices
    assert set(auto[0]["auto"][1]) == {"flat plain", "two-level plain"}
    for rank in range(4):
        totals, flat_totals = two_level[rank]["totals"], flat[rank]["totals"]
        assert flat_totals["inter_node_bytes_sent"] == 0
        assert totals["bytes_sent"] == pytest.approx(flat_totals["bytes_sent"], rel=0.01)
        assert totals["inter_node_bytes_sent"] == pytest.approx(totals["bytes_sent"] / 3, rel=0.01)


@pytest.mark.parametrize("fabric", [False, True])
def test_bad_two_level_options_fail_when_the_strategy_is_made(fabric: bool) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from lightning_dp_strategies import FabricRingAllReduceStrategy, PowerSGD, RingAllReduceStrategy

    strategy = FabricRingAllReduceStrategy if fabric else RingAllReduceStrategy
    with pytest.raises(TypeError, match="`two_level` must be None"):
        strategy(two_level="yes")
    with pytest.raises(ValueError, match="Pass `two_level=False`, or a reducer instead of the hook"):
        strategy(two_level=True, ddp_comm_hook=allreduce_hook)
    with pytest.raises(ValueError, match="Pass `two_level=False` for PowerSGD"):
        strategy(two_level=True, reducer=PowerSGD("ring", rank=2))
    assert strategy(ddp_comm_hook=allreduce_hook).two_level is None  # the default picks flat with a hook


def test_options_read_from_the_config_and_stay_read_only() -> None:
    """The option attributes from before ``config`` existed read it, and cannot drift from it by assignment."""
    from lightning_dp_strategies import RingAllReduceStrategy

    strategy = RingAllReduceStrategy(bucket_cap_mb=3, first_bucket_cap_mb=0.5, broadcast_buffers=False)
    assert (strategy.bucket_cap_mb, strategy.first_bucket_cap_mb) == (3, 0.5)
    assert (strategy.broadcast_buffers, strategy.log_comm_stats) == (False, False)
    with pytest.raises(AttributeError, match=r"read-only.*bucket_cap_mb="):
        strategy.bucket_cap_mb = 4  # type: ignore[misc]
    assert strategy.config.bucket_cap_mb == 3


@NUMERICS
@pytest.mark.timeout(600)
def test_torch_ddp_comm_hooks_average_the_buckets(world2: Path) -> None:
    # allreduce_hook: each rank divides by 2 and gloo sums two values, as the ring does: the same bits as the ring
    hooked, ring = results(world2, "hook_allreduce"), results(world2, "sgd")
    assert_parity(hooked, "hook_allreduce")
    for mine, theirs in zip(hooked, ring, strict=True):
        assert all(torch.equal(mine["params"][n], theirs["params"][n]) for n in mine["params"])
        assert mine["totals"]["ring_operations"] == 12  # one bucket per step, through the hook
        assert mine["bucket_timeout"] == 300.0  # a hook's future that never completes fails at the gloo timeout
    # the presence flags are summed apart from the hook's buffer: unused parameters behave as without a hook
    unused = results(world2, "hook_unused")
    assert_parity(unused, "hook_unused", per_shard=True)
    for result in unused:
        grads = [r["grad_is_none"] for r in result["records"] if "grad_is_none" in r]
        assert all(g["never_used.weight"] and not g["rank0_only.weight"] for g in grads)
    # fp16 compression (with accumulation: the hook runs on synchronising steps only): fp16 rounding of the average
    fp16 = results(world2, "hook_fp16")
    drift = max(max_diff(r["params"], reference_parameters("hook_fp16")) for r in fp16)
    assert TOLERANCE < drift <= 1e-3, drift
    assert fp16[0]["totals"]["ring_operations"] == 6
    # PowerSGD (rank 1 from step 3): the ranks agree exactly; the model is the low-rank approximation's, near the exact
    if TORCH_POWERSGD_HERE:
        powersgd = results(world2, "hook_powersgd")
        assert max_diff(powersgd[0]["params"], powersgd[1]["params"]) == 0
        drift = max_diff(powersgd[0]["params"], reference_parameters("hook_powersgd"))
        assert TOLERANCE < drift <= 0.1, drift
