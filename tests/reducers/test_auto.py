"""``reducer="auto"``: its options, the choice it makes from predictions, and the decision on two ranks."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import lightning_dp_strategies as ldp
from lightning_dp_strategies import FabricRingAllReduceStrategy, RingAllReduceStrategy
from lightning_dp_strategies.bucketing.sync import GradientSync
from lightning_dp_strategies.plan import CpuCosts, Link, Reduction, Topology
from lightning_dp_strategies.reducers import AutoReducer, GradBucket, ReducerBase, StepTiming, setup_reducer
from lightning_dp_strategies.reducers.auto import AutoChoice, choose
from tests.helpers.distributed import run_distributed

BUCKETS = [(4.0 * 2**20, [(1024, 1024)])] * 12  # 50 MB of fp32 gradients, twelve 1024 x 1024 matrices
CPU = CpuCosts(add=4e-11, add_low=1e-10, cast=1e-10, powersgd=4e-9)  # as measured on a 2-core CPU
GBE, FAST = Link(5e-5, 1.25e8), Link(5e-6, 2.5e10)


def test_allow_restricts_the_candidates_and_an_unknown_restriction_is_refused() -> None:
    assert AutoReducer().allow == ("none", "bf16", "powersgd")
    assert AutoReducer(allow="lossless").allow == ("none",)
    assert AutoReducer(allow=("powersgd",)).allow == ("none", "powersgd")  # the plain ring reduces the warm-up
    with pytest.raises(ValueError, match="Unknown `allow` 'fast' for reducer='auto': use 'all', 'lossless'"):
        AutoReducer(allow="fast")
    with pytest.raises(ValueError, match="`warmup_steps` must be an integer >= 2"):
        AutoReducer(warmup_steps=1)


@pytest.mark.parametrize(
    ("link", "per_node", "best"),
    [(GBE, 1, "powersgd"), (FAST, 1, "plain"), (GBE, 2, "two-level bf16"), (FAST, 2, "plain")],
)
def test_the_cheapest_prediction_wins(link: Link, per_node: int, best: str) -> None:
    """One process a node over 1 GbE: PowerSGD (its local work costs less than the wire it saves); over 200 Gbit/s:
    the plain ring. Two processes a node over 1 GbE: bf16 over two levels (a node sends half a gradient, and no
    factor products); over 200 Gbit/s, the plain flat ring (listed first, on a tie)."""
    candidates = {
        "plain": Reduction(),
        "two-level plain": Reduction(two_level=True),
        "two-level bf16": Reduction("bf16", two_level=True),
        "powersgd": Reduction("powersgd"),
    }
    if per_node == 1:
        candidates = {k: v for k, v in candidates.items() if not v.two_level}
    chosen, predicted = choose(candidates, BUCKETS, 0.1, 0.06, Topology(2, per_node, link, intra=FAST), CPU)
    assert chosen == best, predicted
    assert predicted[chosen] == min(predicted.values()) and set(predicted) == set(candidates)


def test_a_tie_keeps_the_first_listed_candidate() -> None:
    same = {"first": Reduction(), "second": Reduction()}
    assert choose(same, BUCKETS, 0.1, 0.06, Topology(2, 1, GBE), CPU)[0] == "first"


def test_the_probes_and_the_shared_figures_go_where_a_collective_over_the_group_takes_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NCCL takes CUDA tensors only: on it the probes, the calibration and the figures the ranks share live on the
    current device; on gloo, on the CPU."""
    import lightning_dp_strategies.reducers.auto as auto

    monkeypatch.setattr(auto.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(auto.torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(auto.dist, "get_backend", lambda group=None: "nccl")
    assert auto._device(None) == torch.device("cuda", 3)
    monkeypatch.setattr(auto.dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    assert auto._device(None) == torch.device("cuda", 3)
    monkeypatch.setattr(auto.dist, "get_backend", lambda group=None: "gloo")
    assert auto._device(None) == torch.device("cpu")


def test_the_gradient_sync_tells_the_reducer_how_each_step_went() -> None:
    seen: list[StepTiming] = []

    class Watching(ReducerBase):
        def __call__(self, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
            raise AssertionError("no bucket expected")

        def observe_step(self, timing: StepTiming) -> None:
            seen.append(timing)

    sync = GradientSync()
    sync.reducer = Watching()
    sync.record_step()  # the first step has no start to measure from
    sync.record_step()
    sync.record_step()
    assert len(seen) == 2 and all(t.interval >= 0 and t.backward == 0 and t.exposed == 0 for t in seen)


def _decide(rank: int, world_size: int, logs: str) -> None:
    handler = logging.FileHandler(Path(logs) / f"rank{rank}.log")
    logging.getLogger("lightning_dp_strategies").addHandler(handler)
    reducer = AutoReducer(warmup_steps=3)
    setup_reducer(reducer, None, list(range(world_size)))
    shapes = [torch.Size([64, 32]), torch.Size([64])]
    for step in range(4):
        buffer = torch.full((64 * 32 + 64,), float(rank + step))
        reducer(GradBucket(buffer, shapes=shapes, op="avg")).wait()
        if step < 3:  # the plain ring reduces the warm-up steps: the exact average
            assert torch.equal(buffer, torch.full_like(buffer, step + 0.5))
        reducer.observe_step(StepTiming(interval=0.1 * (rank + 1), backward=0.05, exposed=0.01))
    decision = reducer.decision
    assert decision is not None
    chosen = [None] * world_size
    dist.all_gather_object(chosen, (decision.chosen, decision.compute_seconds, decision.predicted_step_seconds))
    assert all(c == chosen[0] for c in chosen)  # the same choice and inputs on every rank
    assert decision.compute_seconds == pytest.approx(0.2 - 0.01)  # the slowest rank's step less its wait
    assert set(decision.predicted_step_seconds) == {"flat plain", "flat bf16", "flat powersgd r4"}
    reducer.close()
    handler.close()


@pytest.mark.timeout(120)
def test_two_ranks_decide_alike_after_the_timed_steps_and_only_rank_0_logs(tmp_path: Path) -> None:
    run_distributed(_decide, 2, str(tmp_path))
    log = (tmp_path / "rank0.log").read_text()
    chosen = re.search(r"reducer='auto' chose '([^']+)'", log)
    assert chosen is not None, log
    how = AutoChoice().candidates(nodes=1, per_node=2)[chosen.group(1)]
    assert f'pass {how.arguments} in place of reducer="auto"' in log, "the log does not name the fixed reducer"
    assert (tmp_path / "rank1.log").read_text() == ""


@pytest.mark.parametrize("strategy", [RingAllReduceStrategy, FabricRingAllReduceStrategy])
def test_the_fixed_arguments_the_log_names_reduce_as_the_choice(strategy: type) -> None:
    """Every candidate's ``Reduction.arguments``, passed to a ring strategy, make a strategy that the planner prices
    with that very reduction (the plain flat ring, the default, as ``None``)."""
    candidates = list(AutoChoice().candidates(nodes=2, per_node=2).values())
    candidates += [Reduction("fp16"), Reduction("fp16", two_level=True), Reduction("powersgd", rank=2)]
    names = {n: getattr(ldp, n) for n in ldp.__all__}
    for how in candidates:
        made = eval(f"strategy({how.arguments})", {"strategy": strategy, **names})  # as a user would paste it
        assert (made.cost_model.reduction or Reduction()) == how, how.arguments


def _decide_on_two_nodes(rank: int, world_size: int) -> None:
    reducer = AutoReducer(warmup_steps=2, per_node=2)
    setup_reducer(reducer, None, list(range(world_size)))
    for step in range(3):
        buffer = torch.full((4096,), float(rank + step))
        reducer(GradBucket(buffer, shapes=[torch.Size([64, 64])], op="avg")).wait()
        if step < 2:  # the warm-up steps go through the two-level plain ring: the exact average
            assert torch.equal(buffer, torch.full_like(buffer, step + 1.5))
        reducer.observe_step(StepTiming(interval=0.1, backward=0.05, exposed=0.01))
    decision = reducer.decision
    assert decision is not None
    topology = decision.topology
    # every link probed as the reductions load it: across nodes, inside them, and the flat ring over all four
    assert topology.intra is not None and topology.flat is not None
    assert all(0.0 <= b <= 1.0 for b in (topology.inter_busy, topology.intra_busy, topology.flat_busy))
    everyone: list[object] = [None] * world_size
    dist.all_gather_object(everyone, (decision.chosen, topology))
    assert all(e == everyone[0] for e in everyone)
    reducer.close()


@pytest.mark.timeout(180)
def test_two_nodes_of_two_processes_probe_every_link_and_decide_alike() -> None:
    run_distributed(_decide_on_two_nodes, 4)
