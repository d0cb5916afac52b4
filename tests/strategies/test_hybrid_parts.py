"""The collaborators of HybridPipelineStrategy that run in one process: the step driver, the checkpointer, placement
and the data-group collectives. Each test names the bug it catches."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_dp_strategies.bucketing.sync import GradientSync
from lightning_dp_strategies.pipeline.materialize import cpu_keeps_meta
from lightning_dp_strategies.pipeline.runner import StepResult
from lightning_dp_strategies.strategies.hybrid_pipeline import checkpointer as checkpointer_module, collectives
from lightning_dp_strategies.strategies.hybrid_pipeline.checkpointer import StreamedCheckpointer
from lightning_dp_strategies.strategies.hybrid_pipeline.collectives import (
    MetricGroups,
    check_same_targets,
    data_group_or,
    target_digest,
    vote,
)
from lightning_dp_strategies.strategies.hybrid_pipeline.config import HybridPipelineConfig
from lightning_dp_strategies.strategies.hybrid_pipeline.driver import StepDriver, StepState
from lightning_dp_strategies.strategies.hybrid_pipeline.placement import StagePlacement


# ---------------------------------------------------------------------------------------------------- fakes
class FakeRunner:
    """Stands in for PipelineRunner: its step writes ``grad`` into ``.grad`` as the schedule's backward would."""

    def __init__(self, params: list[nn.Parameter], grad: float = 1.0, error: Exception | None = None) -> None:
        self.params, self.grad, self.error = params, grad, error
        self.before_last_backward: Callable[..., Any] | None = None
        self.after_last_backward: Callable[..., Any] | None = None
        self.hooks_seen: tuple[Any, Any] | None = None

    def train_step(self, inputs: Any, target: Any, loss_fn: Any, scale: float) -> StepResult:
        self.hooks_seen = (self.before_last_backward, self.after_last_backward)
        if self.error is not None:
            raise self.error
        for p in self.params:
            p.grad = torch.full_like(p, self.grad * scale)
        return StepResult(output=None, loss=torch.tensor(0.5))


class FakeBuckets:
    """Records what the driver asks of the gradient buckets."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.base: dict[nn.Parameter, Tensor | None] | None = None
        self.sync_blocked = False

    def arm(self, deferred: bool = False, base: dict[nn.Parameter, Tensor | None] | None = None) -> None:
        self.calls.append("arm_deferred" if deferred else "arm")
        self.base = base

    def accept(self, *args: Any) -> None: ...

    def take(self, *args: Any) -> None: ...

    def flush(self) -> None:
        self.calls.append("flush")

    def finish(self) -> None:
        self.calls.append("finish")

    def skip(self) -> None:
        self.calls.append("skip")


def _sync(buckets: FakeBuckets | None = None, blocked: bool = False) -> GradientSync:
    sync = GradientSync()
    sync.buckets = buckets  # type: ignore[assignment]
    sync.blocked = blocked
    return sync


def _step(driver: StepDriver, runner: FakeRunner, sync: GradientSync, overlap: bool, optimized: set[int]) -> None:
    step = (torch.zeros(1), torch.zeros(1), 1.0, lambda output, target: output)
    driver.run(runner, runner.params, sync, step, overlap, lambda: optimized)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------- driver
def test_pending_gradients_survive_zero_grad_and_reach_grad_in_backward() -> None:
    """Bug: the schedule's gradients written straight into ``.grad`` (Lightning's zero_grad would erase them), or
    not added to what accumulated before."""
    p = nn.Parameter(torch.zeros(2))
    p.grad = torch.full((2,), 10.0)  # accumulated by an earlier micro-step
    driver, runner = StepDriver(), FakeRunner([p], grad=1.0)
    _step(driver, runner, _sync(), overlap=False, optimized=set())
    assert driver.state is StepState.PENDING
    assert torch.equal(p.grad, torch.full((2,), 10.0))  # .grad as it was
    driver.apply_gradients(_sync())
    assert torch.equal(p.grad, torch.full((2,), 11.0))
    assert driver.state is StepState.IDLE and driver.pending == {}


def test_backward_arms_and_finishes_the_buckets_or_skips_them_when_blocked() -> None:
    """Bug: the pending gradients applied but never averaged, or averaged inside ``no_backward_sync``."""
    p = nn.Parameter(torch.zeros(1))
    for blocked, expected in ((False, ["arm", "finish"]), (True, ["skip"])):
        buckets = FakeBuckets()
        driver = StepDriver()
        _step(driver, FakeRunner([p]), _sync(buckets, blocked), overlap=False, optimized=set())
        assert buckets.sync_blocked is blocked  # silenced during the schedule, restored after it
        driver.apply_gradients(_sync(buckets, blocked))
        assert buckets.calls == expected


def test_overlapped_step_reduces_in_the_schedule_and_backward_only_waits() -> None:
    """Bug: a step whose reduction started in the schedule averaged again in backward, or its gradients also held
    as pending (counted twice)."""
    p = nn.Parameter(torch.zeros(1))
    buckets, driver, runner = FakeBuckets(), StepDriver(), FakeRunner([p])
    _step(driver, runner, _sync(buckets), overlap=True, optimized=set())
    assert driver.state is StepState.REDUCING and driver.pending == {}
    assert buckets.calls == ["arm_deferred", "flush"]
    assert runner.hooks_seen == (buckets.accept, buckets.take)
    assert runner.before_last_backward is None and runner.after_last_backward is None  # hooks removed after
    driver.apply_gradients(_sync(buckets))
    assert buckets.calls == ["arm_deferred", "flush", "finish"] and driver.state is StepState.IDLE


def test_overlap_keeps_accumulated_gradients_only_when_zero_grad_does_not_follow() -> None:
    """Bug: what Lightning's zero_grad is about to clear fed into the buckets as this step's base (stale gradients
    averaged in), or an accumulation step's gradients dropped."""
    p = nn.Parameter(torch.zeros(1))
    old = torch.ones(1)
    for zero_grad_follows, expected_base in ((True, {}), (False, {p: old})):
        p.grad = old
        buckets, driver = FakeBuckets(), StepDriver()
        driver.zero_grad_follows = zero_grad_follows
        _step(driver, FakeRunner([p]), _sync(buckets), overlap=True, optimized={id(p)})
        assert buckets.base == expected_base
        assert (p.grad is None) if zero_grad_follows else (p.grad is old)


def test_a_lost_neighbour_becomes_a_named_failure_and_grad_is_restored() -> None:
    """Bug: a connection error raised as is (no hint), or ``.grad`` left cleared after the failure."""
    p = nn.Parameter(torch.zeros(1))
    p.grad = torch.ones(1)
    driver = StepDriver()
    driver.start_run(rank=3)
    runner = FakeRunner([p], error=RuntimeError("Connection reset by peer"))
    with pytest.raises(RuntimeError, match="failed on rank 3 while exchanging"):
        _step(driver, runner, _sync(), overlap=False, optimized=set())
    assert torch.equal(p.grad, torch.ones(1)) and driver.state is StepState.IDLE
    other = FakeRunner([p], error=RuntimeError("shape mismatch"))
    with pytest.raises(RuntimeError, match=r"^shape mismatch$"):
        _step(driver, other, _sync(), overlap=False, optimized=set())


def test_abort_stops_waiting_for_the_reduction_and_reset_drops_everything() -> None:
    """Bug: after an exception, backward (or teardown) still waiting for buckets that were aborted."""
    driver = StepDriver()
    driver.state = StepState.REDUCING
    driver.abort()
    assert driver.state is StepState.IDLE
    driver.pending, driver.state = {nn.Parameter(torch.zeros(1)): None}, StepState.PENDING
    driver.reset()
    assert driver.pending == {} and driver.state is StepState.IDLE


def test_p2p_bytes_are_counted_per_optimizer_step() -> None:
    """Bug: the point-to-point counters never reset, so each step reports the total since setup."""
    driver = StepDriver()
    result = StepResult(output=None, loss=None)
    result.stats.p2p_bytes_sent, result.stats.p2p_bytes_received = 5, 7
    driver.record(result)
    driver.record(result)
    assert driver.take_p2p() == (10, 14) and driver.take_p2p() == (0, 0)


# ---------------------------------------------------------------------------------------------------- checkpointer
def test_finish_sends_the_begun_save_once_and_starts_a_fresh_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bug: a stage re-sending an earlier checkpoint's tensors (its outbox never emptied), which rank 0 would write
    into the next file."""
    sent: list[Tensor] = []
    monkeypatch.setattr(checkpointer_module.dist, "send", lambda tensor, dst: sent.append(tensor))
    checkpointer = StreamedCheckpointer()
    save = checkpointer.begin()
    save.outbox.describe({"w": torch.ones(2)})
    io = (None, lambda: pytest.fail("only rank 0 writes"))
    checkpointer.finish({}, ("unused", None), False, torch.device("cpu"), io)  # type: ignore[arg-type]
    assert len(sent) == 1 and checkpointer.current is not save
    checkpointer.finish({}, ("unused", None), False, torch.device("cpu"), io)  # type: ignore[arg-type]
    assert len(sent) == 1


def test_begin_drops_an_unfinished_save() -> None:
    """Bug: tensors described for a save that never finished (an exception between Lightning's calls) sent with
    the next one."""
    checkpointer = StreamedCheckpointer()
    checkpointer.current.outbox.describe({"w": torch.ones(1)})
    assert checkpointer.begin().outbox.tensors == []


def test_rank_zero_with_nothing_to_receive_saves_plainly() -> None:
    """Bug: rank 0 streaming (and waiting for senders) when no other stage holds a part of the model."""
    writes: list[str] = []
    checkpointer = StreamedCheckpointer()
    module = nn.Linear(2, 2)
    state = checkpointer.model_state(module, None, whole_on_rank_zero=True, during_run=False, rank_zero=True)
    assert state.keys() == module.state_dict().keys()
    io = (None, lambda: writes.append("plain"))
    checkpointer.finish({"state_dict": state}, ("x.ckpt", None), True, torch.device("cpu"), io)  # type: ignore[arg-type]
    assert writes == ["plain"]


def test_no_whole_model_to_save_from_meta_blocks() -> None:
    """Bug: a module whose blocks are on the meta device saved as if whole (a file of empty tensors)."""
    module = nn.Linear(2, 2, device="meta")
    with pytest.raises(RuntimeError, match="no whole model to save"):
        StreamedCheckpointer().model_state(module, None, whole_on_rank_zero=False, during_run=False, rank_zero=True)


def test_an_optimizer_over_another_modules_parameters_is_refused_with_the_fix() -> None:
    """Bug: after `fit`, `validate(other_module)` and then a save failed with a bare `KeyError` (a parameter's id)."""
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    layout: Any = object()  # any layout: the check comes before it is read
    with pytest.raises(RuntimeError, match="Save the checkpoint before running another module"):
        StreamedCheckpointer().optimizer_state(optimizer, nn.Linear(2, 2), layout)


def test_optimizer_state_unwraps_lightnings_optimizer() -> None:
    """Bug: Lightning's optimizer wrapper saved instead of the optimizer's own state."""
    optimizer = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)

    class Wrapper:
        _optimizer = optimizer

    state = StreamedCheckpointer().optimizer_state(Wrapper(), None, None)  # type: ignore[arg-type]
    assert state == optimizer.state_dict()


# ---------------------------------------------------------------------------------------------------- placement
class FakeMesh:
    def get_group(self, name: str) -> str:
        return f"{name}-group"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
        self.head = nn.Linear(4, 1)


@pytest.mark.parametrize(("rank", "stage", "replica", "blocks"), [(1, 0, 1, [0, 1]), (2, 1, 0, [2, 3])])
def test_partition_gives_each_rank_its_stage_and_replica(
    rank: int, stage: int, replica: int, blocks: list[int]
) -> None:
    """Bug: rank ``r`` placed on stage ``r % D`` instead of ``r // D`` (the replicas of a stage would differ)."""
    placement = StagePlacement(HybridPipelineConfig(pipeline_stages=2, micro_batches=2))
    layout, bodies = placement.partition(Net(), "body", FakeMesh(), rank=rank, world=4)  # type: ignore[arg-type]
    assert (layout.stage, layout.replica, layout.replicas) == (stage, replica, 2)
    assert layout.data_group == "data_parallel-group" and layout.local_blocks == blocks
    assert [[int(name) for name, _ in body.named_children()] for body in bodies] == [blocks]


def test_too_few_blocks_for_the_chunks_is_refused() -> None:
    """Bug: an interleaved schedule cutting 4 blocks into 2 x 4 = 8 chunks (empty chunks, a hang at run time)."""
    config = HybridPipelineConfig(pipeline_stages=2, micro_batches=4, schedule="interleaved_1f1b", virtual_stages=4)
    with pytest.raises(ValueError, match="8 chunks, but it has 4 blocks"):
        StagePlacement(config).partition(Net(), "body", FakeMesh(), rank=0, world=2)  # type: ignore[arg-type]


def test_cpu_keeps_meta_blocks_and_is_removed_after() -> None:
    """Bug: Lightning's teardown ``module.cpu()`` failing on the other stages' meta blocks, or the shadow left on."""
    module = Net()
    module.body[3].to("meta")
    with cpu_keeps_meta(module):
        module.cpu()
    assert module.body[3].weight.is_meta and not module.body[0].weight.is_meta
    assert "cpu" not in vars(module)


# ---------------------------------------------------------------------------------------------------- collectives
def test_values_reduce_over_the_data_group_unless_named() -> None:
    """Bug: ``self.log(sync_dist=True)`` reducing over the world, counting each replica once per stage."""

    class FakeLayout:
        data_group = "data"

    assert data_group_or(None, FakeLayout()) == "data"  # type: ignore[arg-type]
    assert data_group_or("mine", FakeLayout()) == "mine"  # type: ignore[arg-type]
    assert data_group_or(None, None) is None
    assert vote(False, require_all=True, world_size=4, device=torch.device("cpu")) is False  # no process group


def test_metric_groups_are_bound_and_given_back() -> None:
    """Bug: a torchmetrics metric left synchronising over the data group after teardown (a destroyed group)."""
    torchmetrics = pytest.importorskip("torchmetrics")
    module, metric = nn.Module(), torchmetrics.MeanMetric()
    module.metric = metric
    own = metric.process_group
    groups = MetricGroups()
    groups.bind(module, "data")
    assert metric.process_group == "data"
    groups.restore()
    assert metric.process_group is own


def test_stages_with_different_targets_are_named_by_replica(mocker: Any) -> None:
    """Bug: a loader split over every process trains stage 0's inputs against another sample's targets, silently."""

    class FakeLayout:
        stages, replicas = 2, 2  # rank r is stage r // 2 of replica r % 2

    digests = [7, 9, 7, 8]  # replica 0 (ranks 0 and 2) agrees, replica 1 (ranks 1 and 3) does not
    mocker.patch.object(collectives.dist, "is_initialized", return_value=True)
    mocker.patch.object(collectives.dist, "get_world_size", return_value=4)

    def gather(out: list[Tensor], mine: Tensor) -> None:
        for tensor, digest in zip(out, digests, strict=True):
            tensor.fill_(digest)

    mocker.patch.object(collectives.dist, "all_gather", side_effect=gather)
    cpu = torch.device("cpu")
    with pytest.raises(RuntimeError) as error:
        check_same_targets(torch.tensor([1]), FakeLayout(), cpu, "step 3")  # type: ignore[arg-type]
    message = str(error.value)
    assert "at step 3, rank 1 (stage 0 of replica 1) and rank 3 (stage 1) hold different targets" in message
    assert "num_replicas=2, rank=trainer.global_rank % 2" in message and "not the 4 processes" in message
    digests[3] = 9
    check_same_targets(torch.tensor([1]), FakeLayout(), cpu, "step 3")  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.bfloat16, torch.bool])
def test_target_digest_tells_equal_targets_from_different_ones(dtype: torch.dtype) -> None:
    """Bug: a digest that ignores order, shape or dtype lets two stages on different samples pass as equal."""
    target = torch.tensor([[0, 1], [1, 1]]).to(dtype)
    assert target_digest(target) == target_digest(target.clone().t().contiguous().t())  # same values, other strides
    assert target_digest(target) != target_digest(target.flip(0))
    assert target_digest(target) != target_digest(target.reshape(4))
    assert target_digest(target) != target_digest(target.to(torch.float64))
