"""LocalSGDStrategy: anchored to ring_allreduce, to a hand-written DiLoCo loop, and to an uninterrupted run.

The scenarios run in one 2-rank launch on CPU/gloo (ranks started as torchrun starts them, a timeout on the launch;
see :mod:`tests.strategies.local_sgd_scenarios`). Tolerance: max absolute difference of the parameters <= 1e-6
(fp32; the averaged change is summed in the same order as the references sum it).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.distributed import run_ranks
from tests.strategies.local_sgd_scenarios import STREAM, WORLD, make_body, reference_diloco, reference_streaming

TOLERANCE = 1e-6
NAMES = [
    "h1",
    "h1@ring",
    "diloco",
    "full",
    "resumed",
    "resumed@ring",
    "warmup",
    "accumulate",
    "manual",
    "plain4",
    "bf16",
    "postlocal1",
    "postlocal4",
    "postlocal4_local",
    "stream_fp32",
    "stream_int8",
    "stream_int4",
    "stream_full",
    "stream_resumed",
    "stream_validate",
    "stream_as_diloco",
    "stream_auto",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("local-sgd")
    run_ranks("tests.strategies.local_sgd_scenarios", [",".join(NAMES), str(out)], WORLD, timeout=500)
    return out


def results(out: Path, name: str) -> list[dict[str, Any]]:
    return [torch.load(out / name / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[n].float() - b[n].float()).abs().max().item() for n in a)


def params(result: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {n.removeprefix("body."): t for n, t in result["state"].items() if "running" not in n and "batches" not in n}


@pytest.mark.timeout(600)
def test_sync_every_1_with_plain_averaging_and_sgd_trains_as_ring_allreduce(runs: Path) -> None:
    local, ring = results(runs, "h1"), results(runs, "h1@ring")
    for mine, theirs in zip(local, ring, strict=True):
        assert max_diff(mine["state"], theirs["state"]) <= TOLERANCE
        assert mine["syncs"] == 12 and mine["ring_operations"] == 0  # 12 steps; no gradient crossed the ranks
    init = {n: p.detach() for n, p in make_body().named_parameters()}
    assert max_diff(params(local[0]), init) > 1e-2, "training did not move the parameters"


@pytest.mark.timeout(600)
def test_diloco_outer_step_equals_a_hand_written_diloco_loop(runs: Path) -> None:
    ranks = results(runs, "diloco")
    reference = reference_diloco(sync_every=5)
    for result in ranks:
        assert max_diff(params(result), reference) <= TOLERANCE
        assert result["syncs"] == 3  # after steps 5 and 10, and the 2 steps left at the end of fit
    assert max_diff(ranks[0]["state"], ranks[1]["state"]) == 0  # fit returns one model on every rank


@pytest.mark.timeout(600)
def test_resume_mid_period_equals_an_uninterrupted_run(runs: Path) -> None:
    ckpt = torch.load(runs / "full" / "epoch=0.ckpt", weights_only=False)
    record = ckpt["local_sgd"]
    assert (record["steps"], record["since_sync"], record["sync_every"]) == (6, 2, 4)  # two steps into a period
    assert record["outer"]["state"], "the outer optimizer's momentum is in the checkpoint"
    own = [r["module"] for r in record["ranks"]]
    assert all(o is not None for o in own) and max_diff(own[0], own[1]) > 0  # the ranks differ mid-period
    average = {k: (own[0][k] + own[1][k]) / 2 for k in own[0]}
    assert max_diff(ckpt["state_dict"], average) <= TOLERANCE  # what another strategy loads: the averaged model
    assert all(len(r["optimizer"]) == 1 for r in record["ranks"])  # each rank's own inner Adam state
    for full, resumed in zip(results(runs, "full"), results(runs, "resumed"), strict=True):
        assert max_diff(full["state"], resumed["state"]) <= TOLERANCE
        assert resumed["steps"] == 12 and resumed["syncs"] == full["syncs"]
    ring = results(runs, "resumed@ring")  # the checkpoint resumes under ring_allreduce too
    assert max_diff(ring[0]["state"], ring[1]["state"]) == 0
    # `trainer.validate(ckpt_path=...)` under either strategy evaluates the averaged model on every rank
    averaged = torch.cat([v.reshape(-1) for v in ckpt["state_dict"].values()])  # the parameters, in order
    for name in ("resumed", "resumed@ring"):
        for rank in range(2):
            evaluated = torch.load(runs / name / f"evaluated-rank{rank}.pt")
            assert (evaluated - averaged).abs().max().item() <= TOLERANCE, (name, rank)


@pytest.mark.timeout(600)
def test_warmup_clipping_batchnorm_and_validation(runs: Path) -> None:
    ranks = results(runs, "warmup")
    for result in ranks:
        assert result["ring_operations"] == 3  # the 3 warm-up steps averaged their gradients (one bucket each)
        # local steps 4-6, synchronised before validation; 7-10 a full period; 11-12, synchronised before validation
        assert result["syncs"] == 3
    assert max_diff(ranks[0]["state"], ranks[1]["state"]) == 0  # BatchNorm statistics averaged too
    validated = [[r["val_params"] for r in result["records"]] for result in ranks]
    assert len(validated[0]) == 2
    assert all(torch.equal(a, b) for a, b in zip(*validated, strict=True)), "validation saw different models"


@pytest.mark.timeout(600)
def test_sync_every_counts_optimizer_steps_with_accumulation_and_manual_optimization(runs: Path) -> None:
    for name, steps, syncs in [("accumulate", 6, 3), ("manual", 12, 4)]:
        for result in results(runs, name):
            assert (result["steps"], result["syncs"], result["ring_operations"]) == (steps, syncs, 0), name


@pytest.mark.timeout(600)
def test_bf16_reducer_halves_the_bytes_of_the_average(runs: Path) -> None:
    plain, bf16 = results(runs, "plain4"), results(runs, "bf16")
    assert bf16[0]["averaged_bytes"] * 2 == plain[0]["averaged_bytes"] > 0
    # the strategy's statistics (what `compare` reports) count the averages: 3 periods of 4 steps
    assert plain[0]["comm"]["bytes_sent"] == plain[0]["averaged_bytes"] and plain[0]["comm"]["ring_operations"] == 3
    # no delay: the loop waits for each average, and the statistics count that wait as exposed
    assert 0 < plain[0]["comm"]["exposed_seconds"] <= plain[0]["comm"]["comm_seconds"] + 0.5
    assert 0 < max_diff(plain[0]["state"], bf16[0]["state"]) <= 1e-2  # bf16 rounding of the change
    assert max_diff(bf16[0]["state"], bf16[1]["state"]) == 0


@pytest.mark.timeout(600)
def test_streaming_diloco_equals_a_hand_written_streaming_loop(runs: Path) -> None:
    """Two fragments in turns, each change applied one step after it left and mixed half-and-half: the same as
    :func:`reference_streaming`, in fp32 and with the change sent as 8 bits (the reference quantizes the same
    chunks); every rank ends on the same model."""
    for name, precision in [("stream_fp32", "fp32"), ("stream_int8", "int8")]:
        ranks = results(runs, name)
        reference = reference_streaming(4, {**STREAM, "outer_precision": precision})
        for result in ranks:
            assert max_diff(params(result), reference) <= TOLERANCE, name
            assert result["syncs"] == 6 + 1  # fragment turns at steps 2,4,6,8,10,12 (the last applied at the end)
        assert max_diff(ranks[0]["state"], ranks[1]["state"]) == 0
    assert max_diff(params(results(runs, "stream_fp32")[0]), reference_diloco(sync_every=4)) > 1e-3


@pytest.mark.timeout(600)
def test_streaming_with_its_diloco_values_is_diloco(runs: Path) -> None:
    for mine, theirs in zip(results(runs, "stream_as_diloco"), results(runs, "diloco"), strict=True):
        assert max_diff(mine["state"], theirs["state"]) <= TOLERANCE
        assert mine["syncs"] == theirs["syncs"] == 3


@pytest.mark.timeout(600)
def test_4_bit_changes_send_an_eighth_of_the_bytes(runs: Path) -> None:
    fp32, int8, int4 = (results(runs, name)[0] for name in ("stream_fp32", "stream_int8", "stream_int4"))
    assert 0.25 <= int8["averaged_bytes"] / fp32["averaged_bytes"] <= 0.30  # 1 byte a value, a 4-byte scale a 128
    assert 0.125 <= int4["averaged_bytes"] / fp32["averaged_bytes"] <= 0.17
    assert 0 < max_diff(fp32["state"], int4["state"]) <= 5e-2  # 4-bit rounding of the change


@pytest.mark.timeout(600)
def test_resume_with_a_fragment_in_flight_equals_the_uninterrupted_run(runs: Path) -> None:
    checkpoint = torch.load(runs / "stream_full" / "epoch=0.ckpt", weights_only=False)
    record = checkpoint["local_sgd"]
    assert (record["steps"], record["phase"]) == (6, 6)
    assert [(p["fragment"], p["apply_at"]) for p in record["in_flight"]] == [(0, 7)]  # left at step 6
    for full, resumed in zip(results(runs, "stream_full"), results(runs, "stream_resumed"), strict=True):
        assert max_diff(full["state"], resumed["state"]) <= TOLERANCE
        assert resumed["steps"] == 12 and resumed["syncs"] == full["syncs"]
    # `trainer.validate(ckpt_path=...)` evaluates the checkpoint's model on every rank (nothing in flight is applied)
    saved = torch.cat([v.reshape(-1) for v in checkpoint["state_dict"].values()])
    for rank in range(2):
        evaluated = torch.load(runs / "stream_resumed" / f"evaluated-rank{rank}.pt")
        assert (evaluated - saved).abs().max().item() <= TOLERANCE, rank


@pytest.mark.timeout(600)
def test_a_mid_stream_checkpoint_holds_the_exact_mean_of_the_ranks_with_a_4_bit_outer_precision(runs: Path) -> None:
    """The outer gradient travels in 4 bits, but the model a checkpoint holds (what another strategy loads) is the
    ranks' parameters averaged exactly: sent through the 4-bit reduction, weights would be rounded to a fifteenth of
    their block's range."""
    ckpt = torch.load(runs / "stream_full" / "epoch=0.ckpt", weights_only=False)
    own = [r["module"] for r in ckpt["local_sgd"]["ranks"]]
    assert all(o is not None for o in own) and max_diff(own[0], own[1]) > 0  # the ranks differ mid-stream
    floating = [k for k in own[0] if own[0][k].is_floating_point()]
    average = {k: (own[0][k] + own[1][k]) / 2 for k in floating}
    assert max_diff({k: ckpt["state_dict"][k] for k in floating}, average) <= TOLERANCE


@pytest.mark.timeout(600)
def test_sync_every_auto_chooses_one_period_on_every_rank_after_a_trial_period(runs: Path) -> None:
    """Two fragments and a delay of one step: the trial period sends fragment 0 at step 1 and fragment 1 at step 2,
    applies them at steps 2 and 3, and chooses at step 3 (on loopback a fragment of a few hundred values usually takes
    less than an inner step: a period of 2, one fragment a step)."""
    ranks = results(runs, "stream_auto")
    period, delay = ranks[0]["chosen"]
    assert ranks[1]["chosen"] == (period, delay) and period % 2 == 0 and 1 <= delay < period
    # the trial period's two turns; the turns of steps 4-12 (fragment 0 at period/2, fragment 1 at 0 mod period);
    # the synchronisation of the whole model at the end of fit
    turns = sum(1 for phase in range(1, 10) if phase % period in (period // 2, 0))
    assert all(r["syncs"] == 2 + turns + 1 for r in ranks)
    assert max_diff(ranks[0]["state"], ranks[1]["state"]) == 0


@pytest.mark.timeout(600)
def test_streaming_validation_sees_one_model_on_every_rank(runs: Path) -> None:
    ranks = results(runs, "stream_validate")
    validated = [[r["val_params"] for r in result["records"]] for result in ranks]
    assert len(validated[0]) == 2
    assert all(torch.equal(a, b) for a, b in zip(*validated, strict=True)), "validation saw different models"


@pytest.mark.timeout(600)
def test_a_fragment_starts_travelling_when_the_next_batch_starts(runs: Path) -> None:
    """Under the Trainer a fragment's reduction is held from the step it leaves until the next batch starts (after
    Lightning's per-batch broadcast), and started before that batch's backward."""
    for result in results(runs, "stream_fp32"):
        at_batch_end, at_backward = result["held"]
        # `syncs` counts every fragment's outer step and the whole-model synchronisation at the end of `fit`
        assert sum(at_batch_end) == result["syncs"] - 1, "a fragment was not held at the end of the step it left"
        assert not any(at_backward), "a held fragment was not started when the next batch began"


@pytest.mark.timeout(600)
def test_ring_allreduce_runs_torchs_post_local_sgd_with_model_averaging_period(runs: Path) -> None:
    """``PostLocalSGDState(start_localSGD_iter=3)``, ``post_localSGD_hook``, ``model_averaging_period``: averages after
    steps 4, 8 and 12 (torch's ``PeriodicModelAverager`` schedule) on CPU/gloo."""
    ring = results(runs, "h1@ring")
    # averaging every step after the warm-up, no gradient averaging then: SGD's training all the same (linear)
    for mine, theirs in zip(results(runs, "postlocal1"), ring, strict=True):
        assert max_diff(mine["state"], theirs["state"]) <= TOLERANCE
        assert mine["parameter_averages"] == 9
    # the intra-node group (made at setup, here both ranks: one node) averages the gradients after the warm-up
    for mine, theirs in zip(results(runs, "postlocal4"), ring, strict=True):
        assert max_diff(mine["state"], theirs["state"]) <= TOLERANCE
        assert mine["parameter_averages"] == 3
    local = results(runs, "postlocal4_local")  # truly local steps in between
    assert max_diff(local[0]["state"], local[1]["state"]) == 0 and local[0]["parameter_averages"] == 3
    assert max_diff(local[0]["state"], ring[0]["state"]) > TOLERANCE


@pytest.mark.parametrize(
    ("options", "fix"),
    [
        ({"model_averaging_period": 4}, "pass it with `ddp_comm_state=PostLocalSGDState(...)`"),
        ({"ddp_comm_state": "post_local", "model_averaging_period": 0}, "`model_averaging_period` must be an int >= 1"),
        ({"ddp_comm_state": "post_local"}, "pass `model_averaging_period=N`"),
    ],
)
def test_post_local_sgd_options_are_checked_when_the_strategy_is_made(options: dict[str, Any], fix: str) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook

    from lightning_dp_strategies import RingAllReduceStrategy

    if options.get("ddp_comm_state") == "post_local":
        options = {**options, "ddp_comm_state": PostLocalSGDState(None, None, 3)}
    with pytest.raises(ValueError, match=re.escape(fix)):
        RingAllReduceStrategy(ddp_comm_hook=post_localSGD_hook, **options)


@pytest.mark.timeout(300)
def test_several_optimizers_are_refused_at_setup_on_every_rank(tmp_path: Path) -> None:
    with pytest.raises(AssertionError) as failure:
        run_ranks("tests.strategies.local_sgd_scenarios", ["several_optimizers", str(tmp_path)], WORLD, timeout=240)
    output = str(failure.value)
    assert output.count("counts `sync_every` in steps of one optimizer") >= WORLD, output


@pytest.mark.timeout(300)
def test_a_parameter_unfrozen_after_training_began_is_refused_at_its_first_step_on_every_rank(tmp_path: Path) -> None:
    """Local SGD averages the parameters that required grad when training began; one unfrozen later (here at epoch 1,
    already in the optimizer) would train apart on each rank, never averaged, and end the fit different on each."""
    with pytest.raises(AssertionError) as failure:
        run_ranks("tests.strategies.local_sgd_scenarios", ["unfrozen_later", str(tmp_path)], WORLD, timeout=240)
    output = str(failure.value)
    assert output.count("`body.0.weight`, `body.0.bias` became trainable since") >= WORLD, output[-3000:]


@pytest.mark.timeout(300)
def test_compare_runs_it_and_reports_what_its_averages_send(tmp_path: Path) -> None:
    """``lightning-dp-strategies compare --strategies single,local_sgd``: two processes, plain averaging every 8
    steps; its row counts the synchronisations' traffic, averaged over the steps."""
    import json

    from lightning_dp_strategies.cli import main

    argv = [
        "compare",
        "--strategies",
        "single,local_sgd",
        "--steps",
        "8",
        "--model-size",
        "small",
        "--accelerator",
        "cpu",
    ]
    assert main([*argv, "--output", str(tmp_path)]) == 0
    rows = {r["strategy"]: r for r in json.loads((tmp_path / "comparison.json").read_text())["results"]}
    local = rows["local_sgd"]
    assert local["status"] == "ok" and local["processes"] == 2
    assert len(local["loss_curve"]) == 8 and local["max_param_diff"] > 0  # local steps: not single-device training
    assert local["comm_mb_per_step"] > 0


# ---------------------------------------------------------------------------------------------- without a launch


@pytest.mark.parametrize(
    ("options", "error", "fix"),
    [
        ({"sync_every": 0}, ValueError, r"`sync_every` must be an int >= 1"),
        ({"sync_every": 2.5}, ValueError, r"`sync_every` must be an int >= 1"),
        ({"sync_every": True}, ValueError, r"`sync_every` must be an int >= 1"),
        ({"warmup_steps": -1}, ValueError, r"`warmup_steps` must be an int >= 0"),
        ({"outer_optimizer": "sgd"}, TypeError, r"`outer_optimizer` must be a callable `factory\(params\)"),
        ({"average_buffers": "yes"}, TypeError, r"`average_buffers` must be True or False"),
        ({"reducer": "tree"}, ValueError, r"Unknown reducer 'tree'"),
        ({"shard_optimizer_state": True}, ValueError, r"every rank needs the whole optimizer state"),
        ({"fragments": 0}, ValueError, r"`fragments` must be an int >= 1"),
        ({"sync_every": 4, "delay": 4}, ValueError, r"must be applied before its next turn"),
        ({"sync_every": 4, "fragments": 5}, ValueError, r"Pass `fragments` at most `sync_every`"),
        ({"mixing": 1.0}, ValueError, r"`mixing` must be a number in \[0, 1\)"),
        ({"outer_precision": "int2"}, ValueError, r"`outer_precision` must be one of 'fp32', 'bf16'"),
        ({"outer_precision": "int4", "reducer": "native"}, ValueError, r"Drop `reducer=`"),
        ({"sync_every": "often"}, ValueError, r"`sync_every` must be an int >= 1 .*or 'auto'"),
    ],
)
def test_bad_options_fail_when_the_strategy_is_made(options: dict[str, Any], error: type, fix: str) -> None:
    from lightning_dp_strategies import LocalSGDStrategy

    with pytest.raises(error, match=fix):
        LocalSGDStrategy(**options)


def test_an_outer_factory_that_returns_no_optimizer_over_its_parameters_is_refused_at_setup() -> None:
    from lightning_dp_strategies.local_sgd import FlatAverager, LocalSGD, LocalSGDConfig
    from lightning_dp_strategies.reducers import NativeReducer

    model = torch.nn.Linear(2, 2)
    bad = LocalSGD(LocalSGDConfig(outer_optimizer=lambda params: None), FlatAverager(NativeReducer()))
    with pytest.raises(TypeError, match=r"returned NoneType, not a torch\.optim\.Optimizer"):
        bad.start(model)
    wrong = LocalSGD(
        LocalSGDConfig(outer_optimizer=lambda params: torch.optim.SGD(model.parameters(), lr=1)),
        FlatAverager(NativeReducer()),
    )
    with pytest.raises(ValueError, match="over the parameters it is given"):
        wrong.start(model)


def test_a_model_with_fewer_tensors_than_the_names_fragments_is_told_the_strategy_that_fits_it() -> None:
    """The registered name's refusal names a construction that is the name's options with fewer fragments."""
    from lightning_dp_strategies import LocalSGDStrategy
    from lightning_dp_strategies.core.local_sgd import STREAMING_DEFAULTS
    from lightning_dp_strategies.local_sgd import split_fragments

    with pytest.raises(ValueError, match="fragments") as refused:
        split_fragments([torch.empty(3), torch.empty(2)], STREAMING_DEFAULTS["fragments"])
    suggested = re.search(r"`strategy=(LocalSGDStrategy\(.*?\))`", str(refused.value))
    assert suggested is not None, str(refused.value)
    strategy = eval(suggested.group(1), {"LocalSGDStrategy": LocalSGDStrategy})
    assert {**STREAMING_DEFAULTS, "fragments": 2} == {k: getattr(strategy.local_config, k) for k in STREAMING_DEFAULTS}


def test_the_names_resolve_and_the_cost_model_divides_the_ring_by_sync_every() -> None:
    import lightning as L

    from lightning_dp_strategies import LocalSGDStrategy, plan
    from lightning_dp_strategies.plan.formulas import local_sgd_cost_model

    trainer = L.Trainer(strategy="local_sgd_notebook", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, LocalSGDStrategy) and trainer.strategy.sync_every == 8
    workload, link, caps = plan.Workload(gradient_bytes=52_000_000), _gbe_link(), (1e9, 1e9)  # one bucket
    ring_row = plan.RING_ALLREDUCE.formula(workload, 2, link, 1, 1, caps)
    local_row = local_sgd_cost_model(8).formula(workload, 2, link, 1, 1, caps)
    assert local_row[0] == pytest.approx(ring_row[0] / 8)  # bytes per step
    assert local_row[2] == pytest.approx(ring_row[2] / 8)  # seconds per step
    h16 = plan.cost_model_of(LocalSGDStrategy(sync_every=16)).formula(workload, 2, link, 1, 1, caps)
    assert h16[0] == pytest.approx(ring_row[0] / 16)


def test_the_cost_model_prices_streaming_fragments_precision_delay_and_auto_as_the_strategy_runs_them() -> None:
    """Streaming DiLoCo's price: the outer precision's bytes, the fragments' reductions in turns, the part a delay
    does not hide, and ``sync_every="auto"`` at the period the strategy would choose (tolerance: float rounding)."""
    from lightning_dp_strategies import LocalSGDStrategy, plan
    from lightning_dp_strategies.plan.streaming import BYTES_PER_VALUE, choose_period

    link, caps = plan.Link(0.0, 25e6), (25.0, 1.0)  # 200 Mbit/s, no latency: seconds are bytes / bandwidth

    def row(strategy: LocalSGDStrategy, compute: float | None) -> tuple[float, int, float, float, float]:
        work = plan.Workload(gradient_bytes=29_000_000, compute_seconds=compute)
        return plan.cost_model_of(strategy).formula(work, 2, link, 1, 1, caps)

    whole = 29e6  # 2 ranks: the ring sends 2(N-1)/N = 1x the bytes a rank reduces
    int4 = BYTES_PER_VALUE["int4"] / 4
    fragment_seconds = whole * int4 / 4 / 25e6  # one int4 fragment of four: 0.04 s
    streamed = LocalSGDStrategy(sync_every=16, fragments=4, delay=1, outer_precision="int4")
    nbytes, messages, comm, exposed, _ = row(streamed, compute=0.6)
    assert nbytes == pytest.approx(whole * int4 / 16) and messages == 1  # four fragments of 2 messages in 16 steps
    assert comm == pytest.approx(4 * fragment_seconds / 16) and exposed == 0.0  # one 0.6 s step hides 0.04 s
    # a step of 0.01 s hides a quarter of each fragment's 0.04 s: the rest is exposed
    assert row(streamed, compute=0.01)[3] == pytest.approx(4 * (fragment_seconds - 0.01) / 16)
    # a fragment a step, each applied 3 steps later: their 0.16 s a period outlast its 4 steps of 0.01 s, so the
    # reductions queue on the channel and the loop waits for the excess, more than each delay's shortfall
    queued = LocalSGDStrategy(sync_every=4, fragments=4, delay=3, outer_precision="int4")
    assert row(queued, compute=0.01)[3] == pytest.approx((4 * fragment_seconds - 4 * 0.01) / 4)
    # without a delay (or without a compute time) nothing hides
    blocking = LocalSGDStrategy(sync_every=16, fragments=4, delay=0, outer_precision="int4")
    assert row(blocking, 0.6)[3] == pytest.approx(row(blocking, 0.6)[2]) == pytest.approx(comm)
    assert row(streamed, None)[3] == pytest.approx(comm)
    # "auto": the period choose_period picks from the predicted fragment and the compute, as the strategy would
    auto = LocalSGDStrategy(sync_every="auto", fragments=4, delay=1, outer_precision="int4")
    for compute in (0.6, 0.01):
        period, _ = choose_period(4, 1, compute, fragment_seconds)
        assert row(auto, compute)[0] == pytest.approx(whole * int4 / period)
    assert choose_period(4, 1, 0.6, fragment_seconds)[0] == 4 and choose_period(4, 1, 0.01, fragment_seconds)[0] == 16
    assert row(auto, None)[0] == pytest.approx(whole * int4 / 16)  # no compute time: priced at 16 steps
    # the prediction's step is the compute plus what is exposed; its row is named after the options
    work = plan.Workload(gradient_bytes=29_000_000, compute_seconds=0.01)
    predicted = plan.predict(streamed, work, 2, link)
    assert predicted.step_seconds == pytest.approx(0.01 + 4 * (fragment_seconds - 0.01) / 16)
    assert predicted.strategy == "local_sgd(sync_every=16, fragments=4, delay=1, outer_precision='int4')"


def _gbe_link() -> Any:
    """A 1 GbE link, built with whichever argument names :class:`~lightning_dp_strategies.plan.Link` takes."""
    import inspect

    from lightning_dp_strategies.plan import Link

    names = list(inspect.signature(Link).parameters)
    return Link(**{names[0]: 5e-5, names[1]: 1.25e8})


def test_the_benchmark_variants_are_strategies_and_its_summary_times_ddps_loss() -> None:
    """``benchmarks/bench_local_sgd.py`` without a cluster: every variant is a strategy the Trainer takes, and the
    time to ddp's final loss is read at the first evaluation that reaches it."""
    import importlib.util

    import lightning as L

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_local_sgd.py"
    spec = importlib.util.spec_from_file_location("bench_local_sgd", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for variant in bench.VARIANTS:
        strategy = bench.make_strategy(variant)
        assert isinstance(strategy, str) or isinstance(strategy, L.pytorch.strategies.Strategy), variant

    def point(step: int, seconds: float, loss: float) -> dict[str, float]:
        return {"step": step, "samples": 64 * step, "seconds": seconds, "val_loss": loss}

    curves = {
        "ddp": [point(0, 0, 1.0), point(8, 10, 0.5)],
        "local_sgd_8": [point(0, 0, 1.0), point(8, 4, 0.6), point(16, 6, 0.45)],
    }
    summary = bench.summarize(curves)
    local = summary["variants"]["local_sgd_8"]
    assert summary["target_loss"] == 0.5 and local["ratio_to_ddp"] == pytest.approx(0.6)
    assert local["loss_at_ddp_samples"] == 0.6 and local["steps_to_target"] == 16
    x_train, _, x_val, y_val = bench.make_task(8, 32)
    assert x_train.shape == (32, 8) and y_val.shape == (bench.VAL_SAMPLES, bench.OUT_DIM)
    assert torch.equal(bench.make_task(8, 64)[2], x_val)  # the held-out set does not depend on the run's length
