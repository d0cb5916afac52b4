"""The planner prices every strategy name the package registers, as the strategy that name builds, under the Trainer
and under Fabric alike; a strategy whose reduction its formula does not price says so instead of pricing the ring."""

from __future__ import annotations

from typing import Any

import pytest
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

import lightning_dp_strategies as ldp
from lightning_dp_strategies.core.local_sgd import STREAMING_DEFAULTS
from lightning_dp_strategies.plan import (
    CpuCosts,
    Link,
    MiB,
    Reduction,
    Topology,
    Workload,
    cost_model_of,
    plan,
    predict,
)
from lightning_dp_strategies.plan.auto import AutoChoice
from lightning_dp_strategies.plan.formulas import local_sgd_cost_model

WORK = Workload(gradient_bytes=30 * MiB, compute_seconds=0.4, backward_seconds=0.25)
LINK = Link(latency_s=1e-4, bandwidth_bytes_per_s=2.5e7)  # 200 Mbit/s


def ours(registry: Any) -> list[str]:
    return sorted(
        n for n in registry.available_strategies() if registry[n]["strategy"].__module__.startswith("lightning_dp")
    )


def built(registry: Any, name: str) -> Any:
    entry = registry[name]
    return entry["strategy"](**entry["init_params"])


def priced(model: Any) -> tuple[Any, ...]:
    """What a cost model says about a step: its name, kind and the formula's numbers on one workload at 2 ranks."""
    numbers = model.formula(WORK, 2, LINK, 1, 1, (25.0, 1.0)) if not model.pipelined else None
    return model.name, model.pipelined, model.bucketed, model.reducer, numbers


@pytest.mark.parametrize("registry", [StrategyRegistry, STRATEGY_REGISTRY], ids=["trainer", "fabric"])
def test_every_registered_name_builds_and_is_priced_by_name(registry: Any) -> None:
    names = ours(registry)
    assert {"ring_allreduce", "local_sgd", "streaming_diloco"} <= set(names)
    for name in names:
        strategy = built(registry, name)  # a registered name that cannot build its strategy is a broken name
        assert priced(cost_model_of(name)) == priced(cost_model_of(strategy)), name


def test_a_registered_name_prices_the_options_it_stands_for_and_names_the_row() -> None:
    streaming = local_sgd_cost_model(
        STREAMING_DEFAULTS["sync_every"],
        STREAMING_DEFAULTS["fragments"],
        STREAMING_DEFAULTS["delay"],
        STREAMING_DEFAULTS["outer_precision"],
    )
    assert priced(cost_model_of("streaming_diloco")) == priced(streaming)
    assert cost_model_of("ring_allreduce_sharded").name == "ring_allreduce"
    assert cost_model_of("hybrid_pipeline_spawn").pipelined
    row = predict("streaming_diloco", WORK, 2, LINK)
    assert (
        row.strategy == "streaming_diloco"
        and row.bytes_per_rank < predict("ring_allreduce", WORK, 2, LINK).bytes_per_rank
    )
    assert predict("dp", WORK, 2, LINK).strategy == "scatter_gather"  # a built-in name keeps its model's name
    rows = plan(WORK, LINK, world_sizes=(2,), strategies=["ring_allreduce", "local_sgd_fault_tolerant"])
    assert [p.strategy for p in rows] == ["ring_allreduce", "local_sgd_fault_tolerant"]
    with pytest.raises(ValueError, match="streaming_diloco"):  # the error lists the registered names
        cost_model_of("streaming-diloco")


def test_fabric_strategies_carry_the_trainer_strategies_cost_models() -> None:
    options: dict[str, Any] = {"sync_every": 16, "fragments": 4, "delay": 1, "outer_precision": "int8"}
    trainer, fabric = ldp.LocalSGDStrategy(**options), ldp.FabricLocalSGDStrategy(**options)
    assert priced(cost_model_of(fabric)) == priced(cost_model_of(trainer))
    assert cost_model_of(fabric).name == "local_sgd(sync_every=16, fragments=4, delay=1, outer_precision='int8')"
    assert priced(cost_model_of(ldp.FabricRingAllReduceStrategy)) == priced(cost_model_of("ring_allreduce"))
    assert cost_model_of(ldp.FabricScatterGatherStrategy).name == "scatter_gather"
    assert "local_sgd_sharded" not in STRATEGY_REGISTRY  # local SGD never shards its optimizer state
    assert "local_sgd_auto" not in STRATEGY_REGISTRY and "local_sgd_auto" not in StrategyRegistry


@pytest.mark.parametrize(
    ("strategy", "label"),
    [
        pytest.param(lambda: ldp.RingAllReduceStrategy(reducer=ldp.PowerSGD("ring", rank=4)), "flat powersgd r4"),
        pytest.param(lambda: ldp.FabricRingAllReduceStrategy(reducer=ldp.bf16_compress("ring")), "flat bf16"),
        pytest.param(lambda: ldp.RingAllReduceStrategy(two_level=True), "two-level plain"),
        pytest.param(lambda: ldp.FabricRingAllReduceStrategy(two_level=True, reducer="native"), "two-level plain"),
        pytest.param(lambda: ldp.RingAllReduceStrategy(two_level=True, reducer=ldp.fp16_compress()), "two-level fp16"),
    ],
    ids=["trainer-powersgd", "fabric-bf16", "trainer-two-level", "fabric-two-level-native", "trainer-two-level-fp16"],
)
def test_a_strategy_is_priced_with_its_own_reduction(strategy: Any, label: str) -> None:
    topology = Topology(nodes=2, per_node=2, inter=LINK, intra=Link(latency_s=5e-6, bandwidth_bytes_per_s=5e9))
    sizes = (4 * 2**20,) * 7 + (2 * 2**20,)
    shapes = [(1024, 1024)] * 7 + [(512, 1024)]
    work = Workload(sum(sizes), tensor_bytes=sizes, shapes=shapes, compute_seconds=0.4, topology=topology)
    how = cost_model_of(strategy()).reduction
    assert how is not None and how.label == label
    row, given = predict(strategy(), work, 4, LINK), predict("ring_allreduce", work, 4, LINK, reduction=how)
    assert row.strategy == f"ring_allreduce: {label}"  # the model's name, then the reduction it is priced with
    assert (row.bytes_per_rank, row.messages_per_rank, row.step_seconds) == (
        given.bytes_per_rank,
        given.messages_per_rank,
        given.step_seconds,
    )
    plain = predict("ring_allreduce", work, 4, LINK)  # two levels send as many bytes, across the node in more steps
    assert (row.bytes_per_rank, row.messages_per_rank) != (plain.bytes_per_rank, plain.messages_per_rank)


def test_auto_takes_the_strategys_levels_and_keeps_its_own_where_the_strategy_leaves_them_open() -> None:
    assert cost_model_of(ldp.RingAllReduceStrategy(reducer="auto", two_level=True)).auto == AutoChoice(two_level=True)
    forced = ldp.FabricRingAllReduceStrategy(reducer=ldp.AutoReducer(two_level=False))
    assert cost_model_of(forced).auto == AutoChoice(two_level=False)


@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param(lambda: ldp.RingAllReduceStrategy(reducer=ldp.PowerSGD(rank=4, min_compression=3.0)), id="psgd3"),
        pytest.param(lambda: ldp.FabricRingAllReduceStrategy(reducer="int8"), id="fabric-int8"),
        pytest.param(lambda: ldp.RingAllReduceStrategy(reducer="per_tensor"), id="per-tensor"),
    ],
)
def test_a_reduction_the_formula_does_not_price_is_named_and_asked_for(strategy: Any) -> None:
    strategy = strategy()
    with pytest.raises(ValueError, match=r"reducer=.*pass the reduction to price as `reduction=plan.Reduction"):
        predict(strategy, WORK, 2, LINK)
    cheaper = predict(strategy, WORK, 2, LINK, reduction=Reduction("bf16"))
    plain = predict("ring_allreduce", WORK, 2, LINK).step_seconds
    assert cheaper.step_seconds is not None and plain is not None and cheaper.step_seconds < plain


def expected_choice(candidates: list[Reduction], work: Workload, world: int, link: Link) -> Reduction:
    """What reducer="auto" should pick, worked out from the plain ring's predictions: the fastest, unless a lossless
    candidate is within 5% of it."""
    step = {how: predict("ring_allreduce", work, world, link, reduction=how).step_seconds for how in candidates}
    fastest = min(step.values())
    close = [how for how in candidates if step[how] <= fastest * 1.05]
    return min([how for how in close if how.compression == "none"] or close, key=step.__getitem__)


@pytest.mark.parametrize(
    ("bandwidth", "label"),
    [(2.5e7, "flat powersgd r4"), (2.5e9, "flat plain")],
    ids=["200mbit", "20gbit"],
)
def test_ring_allreduce_auto_is_priced_as_the_reduction_it_would_choose(bandwidth: float, label: str) -> None:
    link = Link(latency_s=1e-4, bandwidth_bytes_per_s=bandwidth)
    sizes = (4 * 2**20,) * 7 + (2 * 2**20,)  # 30 MiB of 1024 x 1024 and 512 x 1024 fp32 matrices
    shapes = [(1024, 1024)] * 7 + [(512, 1024)]
    cpu = CpuCosts(add=4e-11, add_low=1e-10, cast=1e-10, powersgd=4e-9)
    work = Workload(sum(sizes), tensor_bytes=sizes, shapes=shapes, compute_seconds=0.4, backward_seconds=0.25, cpu=cpu)
    chosen = expected_choice([Reduction(), Reduction("bf16"), Reduction("powersgd", rank=4)], work, 2, link)
    assert chosen.label == label  # the setting exercises a lossy choice on slow links and the plain ring on a fast one
    for strategy in ("ring_allreduce_auto", ldp.FabricRingAllReduceStrategy(reducer="auto")):
        row = predict(strategy, work, 2, link)
        assert row.strategy.endswith(f": {label}")
        assert row.step_seconds == predict("ring_allreduce", work, 2, link, reduction=chosen).step_seconds
    with pytest.raises(ValueError, match="compute_seconds"):
        predict("ring_allreduce_auto", Workload(gradient_bytes=30 * MiB), 2, link)


def test_a_lossless_auto_on_several_nodes_chooses_between_one_and_two_levels() -> None:
    link, cpu = Link(latency_s=5e-5, bandwidth_bytes_per_s=1.25e8), CpuCosts(add=4e-11)
    topology = Topology(nodes=2, per_node=4, inter=link, intra=Link(latency_s=5e-6, bandwidth_bytes_per_s=5e9))
    work = Workload(gradient_bytes=64 * MiB, compute_seconds=0.3, backward_seconds=0.2, cpu=cpu, topology=topology)
    chosen = expected_choice([Reduction(two_level=True), Reduction()], work, 8, link)
    row = predict(ldp.RingAllReduceStrategy(reducer=ldp.AutoReducer(allow="lossless")), work, 8, link)
    assert row.strategy == f"ring_allreduce: {chosen.label}" and chosen.label == "two-level plain"


def test_the_plain_ring_under_any_spelling_is_priced_as_it_is() -> None:
    for reducer in (None, "ring", "native", ldp.RingReducer(), ldp.NativeReducer()):
        assert cost_model_of(ldp.RingAllReduceStrategy(reducer=reducer)).reducer is None
        assert cost_model_of(ldp.FabricRingAllReduceStrategy(reducer=reducer)).reducer is None
