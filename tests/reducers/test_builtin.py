"""The reduction contract: every built-in reducer averages (and sums) a bucket like the backend's own all-reduce.

Oracle: ``reference_all_reduce`` (a plain ``dist.all_reduce``). Tolerance 1e-6 absolute on fp32 values of order 1:
the reducers differ from the oracle only in summation order.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_dp_strategies.comm import CommCounter, reference_all_reduce
from lightning_dp_strategies.reducers import (
    REDUCERS,
    GradBucket,
    NativeReducer,
    PerTensorReducer,
    RingReducer,
    bf16_compress,
    check_reducer,
    close_reducer,
    completed,
    fp16_compress,
    resolve_reducer,
    setup_reducer,
)
from tests.helpers.distributed import run_distributed

# numerically sensitive: CI runs this file again under other CPU kernel paths and thread counts
pytestmark = pytest.mark.numerics


SHAPES = [torch.Size([3, 5]), torch.Size([7]), torch.Size([2, 2, 2])]
NUMEL = 15 + 7 + 8


def _bucket_for(rank: int, op: str) -> GradBucket:
    generator = torch.Generator().manual_seed(100 + rank)
    buffer = torch.randn(NUMEL + len(SHAPES), generator=generator)
    buffer[NUMEL:] = torch.tensor([1.0, float(rank % 2), 0.0])  # presence flags
    return GradBucket(buffer, None, CommCounter(), index=0, shapes=list(SHAPES), num_flags=len(SHAPES), op=op)  # type: ignore[arg-type]


def _check_reducers_against_oracle(rank: int, world_size: int) -> None:
    # "auto" picks among these after setup (test_auto.py); "int8" / "int4" are lossy (test_quantized.py)
    for name in (n for n in REDUCERS if n not in ("auto", "int8", "int4")):
        for op in ("avg", "sum"):
            bucket = _bucket_for(rank, op)
            expected = reference_all_reduce(bucket.buffer.clone(), op)
            reducer = resolve_reducer(name)
            result = reducer(bucket).wait()
            assert result is bucket.buffer, f"{name}: the future's value is the reduced buffer itself"
            torch.testing.assert_close(bucket.buffer, expected, atol=1e-6, rtol=0, msg=f"{name} {op}")
            # every rank sends 2(N-1)/N of the payload (counted by the ring, the bandwidth-optimal estimate otherwise)
            nbytes = bucket.buffer.numel() * 4
            expected_bytes = 2 * (world_size - 1) * nbytes / world_size
            assert abs(bucket.counter.bytes_sent - expected_bytes) <= 3 * 4 * world_size * 2, (name, bucket.counter)
            assert bucket.counter.operations == (len(SHAPES) + 1 if name == "per_tensor" else 1), name
            close_reducer(reducer)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_built_in_reducers_match_the_oracle(world_size: int) -> None:
    run_distributed(_check_reducers_against_oracle, world_size)


def _check_ring_reducer_keeps_call_order(rank: int, world_size: int) -> None:
    """Many buckets in flight on the communication thread come back right and in order."""
    reducer = RingReducer()
    buckets = [GradBucket(torch.full((1000 + i,), float(rank + i)), index=i) for i in range(6)]
    futures = [reducer(b) for b in buckets]
    for i, future in enumerate(futures):
        future.wait()
        torch.testing.assert_close(buckets[i].buffer, torch.full((1000 + i,), (world_size - 1) / 2 + i))
    reducer.close()


@pytest.mark.timeout(120)
def test_ring_reducer_overlaps_buckets_in_launch_order() -> None:
    run_distributed(_check_ring_reducer_keeps_call_order, 2)


def _check_failure_reaches_the_waiter(rank: int, world_size: int) -> None:
    reducer = RingReducer()
    future = reducer(GradBucket(torch.ones(4), op="max"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="use 'sum' or 'avg'"):
        future.wait()
    reducer.close()


@pytest.mark.timeout(120)
def test_an_error_on_the_communication_thread_is_raised_by_wait() -> None:
    run_distributed(_check_failure_reaches_the_waiter, 2)


class _FailedWork:
    """What ``dist.all_reduce(..., async_op=True)`` returns when the collective fails (a peer died)."""

    def get_future(self) -> Future[list[Tensor]]:
        future: Future[list[Tensor]] = Future()
        future.set_exception(RuntimeError("Connection reset by peer"))
        return future


@pytest.mark.parametrize("which", ["native", "fp16_compress(failing)", "bf16_compress('native')", "the guide's"])
def test_a_failed_collective_fails_the_reducers_future_instead_of_completing_it(
    which: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``.then`` callback runs when the collective failed too; unless it reads the result, the chained future
    completes and the bucket keeps this rank's own gradient, silently. Each chain must raise at ``wait()``."""
    monkeypatch.setattr(dist, "all_reduce", lambda *args, **kwargs: _FailedWork())
    monkeypatch.setattr(GradBucket, "world_size", property(lambda self: 2))
    guide = _guide_reducer()
    guide.groups[None] = None  # the group made in setup; all_reduce is replaced
    reducers = {
        "native": NativeReducer(),
        "fp16_compress(failing)": fp16_compress(lambda bucket: _FailedWork().get_future()),
        "bf16_compress('native')": bf16_compress("native"),
        "the guide's": guide,
    }
    with pytest.raises(RuntimeError, match="Connection reset by peer"):
        reducers[which](GradBucket(torch.ones(4), op="avg")).wait()


def test_one_process_reducers_leave_the_buffer_alone() -> None:
    for reducer in (RingReducer(), NativeReducer(), PerTensorReducer()):
        bucket = GradBucket(torch.arange(5.0))
        assert torch.equal(reducer(bucket).wait(), torch.arange(5.0))
        assert bucket.counter.bytes_sent == 0


def test_unknown_names_and_non_callables_are_rejected_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"use one of \['ring', 'native', 'per_tensor', 'auto', 'int8', 'int4'\]"):
        resolve_reducer("nccl")
    with pytest.raises(TypeError, match="callable reducer\\(bucket\\)"):
        resolve_reducer(42)  # type: ignore[arg-type]
    custom = lambda bucket: completed(bucket.buffer)  # noqa: E731
    assert resolve_reducer(custom) is custom


def test_bucket_views_and_rebinding() -> None:
    bucket = GradBucket(torch.arange(8.0), shapes=[torch.Size([2, 3])], num_flags=2, index=4)
    (grad,) = bucket.gradients()
    grad.add_(1)
    assert bucket.buffer[:6].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], "gradients() are views of the buffer"
    assert bucket.flags.tolist() == [6.0, 7.0]
    other = bucket.with_buffer(torch.zeros(3), op="sum", keep_layout=False)
    assert other.counter is bucket.counter and other.index == 4 and other.op == "sum" and other.shapes == []


def _check_setup_step(rank: int, world_size: int) -> None:
    """Two groups of two, as hybrid_pipeline's stages: every rank sets the reducer up for both, in the same order."""
    from lightning_dp_strategies import bf16_compress
    from tests.helpers.distributed import point_to_point_log

    pairs = [[0, 1], [2, 3]]
    groups = [dist.new_group(ranks) for ranks in pairs]
    mine = rank // 2
    ring = RingReducer()
    for group, ranks in zip(groups, pairs, strict=True):
        setup_reducer(bf16_compress(ring), group, ranks)  # a wrapper hands the setup step to its inner reducer
    duplex = ring.duplex_group(groups[mine])
    assert duplex is not None and dist.get_process_group_ranks(duplex) == pairs[mine]
    assert ring.duplex_group(groups[1 - mine]) is None  # a group this rank is not in
    bucket = GradBucket(torch.full((6,), float(rank)), groups[mine], op="sum")
    with point_to_point_log() as calls:
        ring(bucket).wait()
    assert torch.equal(bucket.buffer, torch.full((6,), float(sum(pairs[mine]))))  # small integers: exact
    sender = pairs[mine][1]  # the pair's second rank sends over the second connection, the first receives over it
    assert {group for name, group, _ in calls if name == ("send" if rank == sender else "recv")} == {duplex}
    ring.close()
    assert ring.duplex_group(groups[mine]) is None  # destroyed with the reducer
    ring.close()  # twice: nothing more to do


@pytest.mark.timeout(120)
def test_the_ring_makes_its_second_connection_in_its_setup_step_per_group() -> None:
    run_distributed(_check_setup_step, 4)


def _guide_reducer() -> Any:
    """A new ``OwnGroupReducer`` of the extending guide (``docs/examples/own_group_reducer.py``)."""
    import sys

    from tests.helpers.distributed import REPO_ROOT

    sys.path.insert(0, str(REPO_ROOT / "docs" / "examples"))
    from own_group_reducer import OwnGroupReducer

    return OwnGroupReducer()


def _check_own_group_reducer(rank: int, world_size: int) -> None:
    reducer = _guide_reducer()
    pairs = [[0, 1], [1, 2]]
    groups = [dist.new_group(ranks) for ranks in pairs]  # the strategy's groups
    for group, ranks in zip(groups, pairs, strict=True):  # rank 0 is outside the second and still helps make it
        setup_reducer(reducer, group, ranks)
    assert len(reducer.groups) == (2 if rank == 1 else 1)
    if rank in (0, 1):
        bucket = GradBucket(torch.full((4,), float(rank + 1)), groups[0], op="avg")
        assert torch.equal(reducer(bucket).wait(), torch.full((4,), 1.5))  # (1 + 2) / 2: exact
    # new_group has no barrier of its own: rank 2, done with [1, 2] on its side, must not exit and close the connection
    # while rank 1 is still completing the same group's handshake
    dist.barrier()
    reducer.close()


@pytest.mark.timeout(120)
def test_the_guides_reducer_makes_its_own_groups_in_setup_on_every_rank() -> None:
    run_distributed(_check_own_group_reducer, 3)


def test_validating_the_reducer_option_builds_no_reducer(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_dp_strategies import HybridPipelineStrategy, RingAllReduceStrategy

    def refuse() -> RingReducer:
        raise AssertionError("a reducer was built while validating the option")

    monkeypatch.setitem(REDUCERS, "ring", refuse)
    RingAllReduceStrategy(reducer="ring")
    HybridPipelineStrategy(pipeline_stages=2, reducer="ring")
    check_reducer(None)
    with pytest.raises(ValueError, match="Unknown reducer 'tree'"):
        check_reducer("tree")


def test_a_duplex_group_handed_to_the_buckets_is_deprecated() -> None:
    from lightning_dp_strategies import GradientBuckets

    with pytest.warns(DeprecationWarning, match="setup_reducer"):
        GradientBuckets(torch.nn.Linear(2, 2).named_parameters(), duplex_group=object()).close()  # type: ignore[arg-type]
