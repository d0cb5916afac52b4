"""Gradient buckets: assignment (order, caps, first bucket, dtypes) and reduction on plain torch.distributed.

The oracle for every reduction is the per-rank gradients averaged by hand (each rank computes all ranks' gradients).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_dp_strategies.bucketing import GradientBuckets, MiB, assign_buckets
from lightning_dp_strategies.reducers import GradBucket, RingReducer, completed, setup_reducer
from tests.helpers.distributed import point_to_point_log, run_distributed

# numerically sensitive: CI runs this file again under other CPU kernel paths and thread counts
pytestmark = pytest.mark.numerics


def tensors(*numels: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [torch.empty(n, dtype=dtype) for n in numels]


def test_buckets_follow_reverse_registration_order() -> None:
    assert assign_buckets(tensors(1, 2, 3, 4)) == [[3, 2, 1, 0]]


def test_first_bucket_is_capped_smaller_then_bucket_cap() -> None:
    quarter = MiB // 4 // 4  # elements of 0.25 MiB in fp32
    # reverse order: 5 4 3 2 1 0; first cap 0.5 MiB holds two, later caps 1 MiB hold four
    assert assign_buckets(tensors(*[quarter] * 6), bucket_cap_mb=1, first_bucket_cap_mb=0.5) == [[5, 4], [3, 2, 1, 0]]
    sizes = [sum(quarter * 4 for _ in b) for b in assign_buckets(tensors(*[quarter] * 13), 1, 0.5)]
    assert sizes[0] <= MiB // 2 and all(s <= MiB for s in sizes), sizes


def test_a_tensor_larger_than_the_cap_gets_its_own_bucket_after_the_first() -> None:
    big = 2 * MiB // 4
    assert assign_buckets(tensors(10, big, big, 10), bucket_cap_mb=1, first_bucket_cap_mb=1) == [[3, 2], [1], [0]]


def test_the_first_bucket_takes_the_tensor_that_reaches_its_cap() -> None:
    """As torch DDP's first bucket: a few small tensors, then a large one, make one bucket that is ready early in
    backward, not a bucket of the small ones alone with the large one waiting for the next."""
    large = 2_400_000 // 4
    assert assign_buckets(tensors(1000, large, 100), bucket_cap_mb=25, first_bucket_cap_mb=1) == [[2, 1], [0]]


def test_the_buckets_after_the_first_are_cut_evenly() -> None:
    """As many buckets as the cap needs, but not filled to it in turn: on a gradient a little over one cap, filling
    would make one bucket of nearly everything, ready only at the end of backward, and a sliver after it."""
    tenth = MiB // 10 // 4  # elements of 0.1 MiB in fp32
    buckets = assign_buckets(tensors(*[tenth] * 11, 2 * MiB // 4), bucket_cap_mb=1, first_bucket_cap_mb=1)
    assert buckets == [[11], [10, 9, 8, 7, 6, 5], [4, 3, 2, 1, 0]]  # filling: [10 .. 1], [0]


def _filled(sizes: list[int], cap: int) -> list[list[int]]:
    """The buckets after the first as filling each to the cap cuts them (in order, a larger tensor alone)."""
    out: list[list[int]] = [[]]
    for n in sizes:
        if out[-1] and sum(out[-1]) + n > cap:
            out.append([])
        out[-1].append(n)
    return out if out[-1] else []


def test_the_even_cut_keeps_the_count_and_the_cap_and_minimises_the_largest_bucket() -> None:
    import itertools
    import random

    from lightning_dp_strategies.plan import bucket_boundaries

    rng = random.Random(0)
    for _ in range(300):
        sizes = [rng.choice([4, 400, 40_000, 300_000, 700_000, 1_200_000]) for _ in range(rng.randint(1, 9))]
        cap = rng.choice([1.0, 2.0])
        rest = sizes[::-1][1:] if sizes[-1] >= MiB else None  # one tensor reaches the first cap of 1 MiB
        if rest is None:
            continue
        buckets = bucket_boundaries([(None, n) for n in sizes], cap, 1)
        later = [[sizes[i] for i in b] for b in buckets[1:]]
        assert [i for b in buckets for i in b] == list(reversed(range(len(sizes))))
        assert len(later) == len(_filled(rest, int(cap * MiB))), (sizes, cap)
        assert all(sum(b) <= cap * MiB or len(b) == 1 for b in later), (sizes, cap)
        best = (
            min(  # every cut of `rest` into that many contiguous buckets: the smallest largest bucket
                max(sum(rest[a:b]) for a, b in itertools.pairwise([0, *cuts, len(rest)]))
                for cuts in itertools.combinations(range(1, len(rest)), len(later) - 1)
            )
            if later
            else 0
        )
        assert max((sum(b) for b in later), default=0) == best, (sizes, cap)


def test_one_dtype_per_bucket() -> None:
    mixed = [*tensors(4, 4), *tensors(4, dtype=torch.float64), *tensors(4)]
    buckets = assign_buckets(mixed)
    assert sorted(buckets) == [[2], [3, 1, 0]]
    for bucket in buckets:
        assert len({mixed[i].dtype for i in bucket}) == 1
    assert buckets[0] == [3, 1, 0], "the bucket holding the last-registered parameter comes first"


@pytest.mark.parametrize("cap", [0, -1.0])
def test_bad_caps_are_rejected(cap: float) -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        assign_buckets(tensors(1), bucket_cap_mb=cap)


def test_no_trainable_parameter_is_an_error_that_names_the_fix() -> None:
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="Unfreeze at least one parameter"):
        GradientBuckets(frozen.named_parameters())


class Branchy(nn.Module):
    """Three blocks; ``use`` picks which run, so ranks can leave different parameters unused."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        # registered first, so it lands in the last bucket: an unused parameter in an early bucket would hold back
        # every later bucket until backward ends (buckets launch strictly in order)
        self.never = nn.Linear(6, 6)
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.frozen = nn.Linear(6, 6).requires_grad_(False)

    def forward(self, x: torch.Tensor, use: tuple[str, ...]) -> torch.Tensor:
        for name in use:
            x = getattr(self, name)(x).tanh()
        return self.frozen(x).sum()


def rank_grads(rank: int, use: tuple[str, ...]) -> dict[str, torch.Tensor]:
    model = Branchy()
    model(torch.randn(3, 6, generator=torch.Generator().manual_seed(rank)), use).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check_reduction(rank: int, world_size: int) -> None:
    uses = [("a", "b"), ("a",), ("b", "a")][:world_size]
    model = Branchy()
    reducer = RingReducer()
    setup_reducer(reducer, None)  # its setup step: a second group at two ranks (none at three), which it must use
    duplex = reducer.duplex_group(None)
    assert (duplex is not None) == (world_size == 2)
    # tiny caps: several buckets, so some launch while backward is still running
    buckets = GradientBuckets(
        model.named_parameters(), reducer=reducer, bucket_cap_mb=200 / MiB, first_bucket_cap_mb=100 / MiB
    )
    assert len(buckets.buckets) >= 3
    assert all("frozen" not in n for b in buckets.buckets for n in b.names), "frozen parameters are excluded"
    with point_to_point_log() as calls:
        _train_and_check(model, buckets, rank, world_size, uses)
    if duplex is not None:  # rank 1 sends over the second group, rank 0 receives over it
        assert {group for name, group, _ in calls if name == ("send" if rank == 1 else "recv")} == {duplex}
    _check_stats(buckets, rank, world_size)
    buckets.close()


def _train_and_check(
    model: nn.Module, buckets: GradientBuckets, rank: int, world_size: int, uses: list[tuple[str, ...]]
) -> None:
    for _step in range(2):
        for p in model.parameters():
            p.grad = None
        buckets.arm()
        model(torch.randn(3, 6, generator=torch.Generator().manual_seed(rank)), uses[rank]).backward()
        buckets.finish()
        oracle = [rank_grads(r, uses[r]) for r in range(world_size)]
        for name, param in model.named_parameters():
            present = [g[name] for g in oracle if name in g]
            if not present:
                assert param.grad is None, f"{name}: no rank used it, so .grad must stay None"
                continue
            expected = sum(present) / world_size
            torch.testing.assert_close(param.grad, expected, rtol=1e-6, atol=1e-7, msg=name)


def _check_stats(buckets: GradientBuckets, rank: int, world_size: int) -> None:
    stats = buckets.totals
    assert stats.synced_backwards == 2 and stats.ring_operations == 2 * len(buckets.buckets)
    if rank == 0:  # rank 0 uses every block but `never`: every bucket before the first holding `never` starts early
        first_blocked = next(i for i, b in enumerate(buckets.buckets) if any(n.startswith("never") for n in b.names))
        assert first_blocked > 0
        assert stats.overlapped_buckets == 2 * first_blocked, "buckets did not start during backward"
    # bytes: 2(N-1)/N of each bucket's buffer (gradients + one flag per parameter), within N elements per bucket
    buffer_bytes = sum(b.buffer.numel() * 4 for b in buckets.buckets)
    ideal = 2 * 2 * (world_size - 1) / world_size * buffer_bytes
    assert abs(stats.bytes_sent - ideal) < 2 * len(buckets.buckets) * world_size * 4, (stats.bytes_sent, ideal)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.timeout(120)
def test_buckets_average_like_the_oracle_with_rank_dependent_unused_parameters(world_size: int) -> None:
    run_distributed(_check_reduction, world_size)


def _check_accumulation_unfreeze_and_warning(rank: int, world_size: int) -> None:
    model = Branchy()
    model.b.requires_grad_(False)
    buckets = GradientBuckets(model.named_parameters())
    assert all(not n.startswith("b.") for b in buckets.buckets for n in b.names)
    x = torch.randn(2, 6, generator=torch.Generator().manual_seed(rank))
    # an accumulation step: no communication, gradients stay local
    buckets.sync_blocked = True
    buckets.skip()
    model(x, ("a",)).backward()
    assert buckets.totals.ring_operations == 0 and buckets.totals.skipped_backwards == 1
    local = model.a.weight.grad.clone()
    buckets.sync_blocked = False
    # unfreezing is noticed at the next arm(): `b` is bucketed and averaged
    model.b.requires_grad_(True)
    buckets.arm()
    model(x, ("a", "b")).backward()
    buckets.finish()
    assert model.b.weight.grad is not None and any("b.weight" in b.names for b in buckets.buckets)
    assert not torch.equal(model.a.weight.grad, 2 * local), "accumulated gradient was not averaged"
    # a backward pass that bypasses the strategy warns once instead of silently skipping the average
    with pytest.warns(UserWarning, match="not averaged across ranks"):
        model(x, ("a",)).backward()
    buckets.close()


@pytest.mark.timeout(120)
def test_accumulation_unfreezing_and_unsynchronised_backward_warning() -> None:
    run_distributed(_check_accumulation_unfreeze_and_warning, 2)


def test_grad_points_at_its_bucket_slot_as_soon_as_its_hook_fires() -> None:
    """Autograd's fresh gradient is dropped during backward, not at finish(): holding all of them until the end of
    backward made the allocator return their memory to the OS and the next backward page-fault on all of it."""
    model = Branchy()
    buckets = GradientBuckets(model.named_parameters(), bucket_cap_mb=200 / MiB)
    buckets.arm()
    model(torch.randn(2, 6), ("a", "b")).backward()
    for bucket in buckets.buckets:  # before finish(): every gradient that exists already lives in its bucket
        for slot, param in enumerate(bucket.params):
            if param.grad is not None:
                assert param.grad.data_ptr() == bucket.grad_view(slot).data_ptr(), bucket.names[slot]
    assert model.a.weight.grad is not None and model.never.weight.grad is None
    buckets.finish()
    buckets.close()


def test_a_deferred_backward_buckets_each_gradient_after_its_last_pass_with_what_accumulated_before() -> None:
    """A pipeline stage makes one gradient in several backward passes (micro-batches): under ``arm(deferred=True)`` a
    parameter is bucketed only from the pass after ``accept`` named it, ``take`` buckets gradients written without
    the accumulate-grad hook, a bucket launches as soon as it is complete, and ``base`` is added in."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    x1, x2 = torch.randn(4, 3), torch.randn(4, 3)
    reference = copy.deepcopy(model)
    for x in (x1, x2):
        reference(x).sum().backward()
    earlier = torch.full_like(model[0].weight, 0.5)  # accumulated on an earlier step, .grad cleared for the passes
    launched: list[int] = []

    def record(bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        launched.append(bucket.index)
        return completed(bucket.buffer)

    buckets = GradientBuckets(model.named_parameters(), reducer=record)
    buckets.arm(deferred=True, base={model[0].weight: earlier})
    model(x1).sum().backward()
    assert launched == [] and model[1].weight.grad is not None  # a first pass: more gradient is coming
    buckets.accept(model[1].parameters())
    model(x2).sum().backward()
    assert launched == [], "the first layer's gradients are not final yet"
    buckets.take(model[0].parameters())
    assert launched == [0]
    buckets.finish()
    for name, param in model.named_parameters():
        expected = reference.get_parameter(name).grad + (earlier if name == "0.weight" else 0)
        torch.testing.assert_close(param.grad, expected, rtol=1e-6, atol=1e-7, msg=name)
    assert buckets.totals.overlapped_buckets == 1
    buckets.close()


def _check_prescaled_buckets_and_gradients_already_in_place(rank: int, world_size: int) -> None:
    model = Branchy()
    handed: list[list[torch.Tensor]] = []
    ring = RingReducer()

    def record_then_ring(bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        assert bucket.op == "sum"
        handed.append([g.clone() for g in bucket.gradients()])
        return ring(bucket)

    buckets = GradientBuckets(model.named_parameters(), reducer=record_then_ring)
    x = [torch.randn(2, 6, generator=torch.Generator().manual_seed(10 * r)) for r in range(world_size)]
    y = [torch.randn(2, 6, generator=torch.Generator().manual_seed(10 * r + 1)) for r in range(world_size)]

    def oracle(*batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        reference = Branchy()
        for r in range(world_size):
            for batch in batches:
                reference(batch[r], ("a", "b")).backward()
        return {n: p.grad / world_size for n, p in reference.named_parameters() if p.grad is not None}

    buckets.arm()
    model(x[rank], ("a", "b")).backward()
    buckets.finish()
    local = Branchy()
    local(x[rank], ("a", "b")).backward()
    assert len(buckets.buckets) == len(handed) == 1
    for name, given in zip(buckets.buckets[0].names, handed[0], strict=True):  # this rank's gradient / world size
        grad = local.get_parameter(name).grad
        expected = torch.zeros_like(given) if grad is None else grad / world_size
        torch.testing.assert_close(given, expected, msg=name)
    # zero_grad(set_to_none=False), then a no-sync backward and a synced one: .grad is the bucket slot throughout,
    # so it is divided in place rather than copied; the result is the average of both batches' gradients
    for param in model.parameters():
        if param.grad is not None:
            param.grad.zero_()
    buckets.sync_blocked = True
    buckets.skip()
    model(x[rank], ("a", "b")).backward()
    buckets.sync_blocked = False
    buckets.arm()
    model(y[rank], ("a", "b")).backward()
    buckets.finish()
    for name, expected in oracle(x, y).items():
        torch.testing.assert_close(model.get_parameter(name).grad, expected, rtol=1e-6, atol=1e-7, msg=name)
    buckets.close()


@pytest.mark.timeout(120)
def test_buckets_arrive_divided_and_gradients_already_in_the_bucket_are_divided_in_place() -> None:
    run_distributed(_check_prescaled_buckets_and_gradients_already_in_place, 2)


def test_custom_reducer_receives_every_bucket_in_order() -> None:
    seen: list[GradBucket] = []

    def record(bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        seen.append(bucket)
        return completed(bucket.buffer)

    model = Branchy()
    buckets = GradientBuckets(model.named_parameters(), reducer=record, bucket_cap_mb=200 / MiB)
    buckets.arm()
    model(torch.randn(2, 6), ("a", "b")).backward()
    buckets.finish()
    assert [s.index for s in seen] == list(range(len(buckets.buckets)))
    for bucket, given in zip(buckets.buckets, seen, strict=True):
        assert given.buffer is bucket.buffer and given.op == "sum", "gradients arrive divided, to be summed"
        assert given.shapes == [p.shape for p in bucket.params] and given.num_flags == len(bucket.params)
        assert [g.data_ptr() for g in given.gradients()] == [
            bucket.grad_view(i).data_ptr() for i in range(len(bucket.params))
        ]
    buckets.close()


def test_a_failed_reduction_is_logged_when_it_is_raised(caplog: pytest.LogCaptureFixture) -> None:
    """The launcher may kill this rank before the exception is printed, so the explanation is logged as it is raised."""

    def broken(bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_exception(RuntimeError("Connection reset by peer"))
        return future

    model = Branchy()
    buckets = GradientBuckets(model.named_parameters(), reducer=broken)
    buckets.arm()
    model(torch.randn(2, 6), ("a", "b")).backward()
    with caplog.at_level("ERROR", logger="lightning_dp_strategies"), pytest.raises(RuntimeError) as raised:
        buckets.finish()
    assert "Another rank most likely died" in str(raised.value)
    assert [r.getMessage() for r in caplog.records if r.name == "lightning_dp_strategies"] == [str(raised.value)]
    buckets.close()


def _check_grads_as_bucket_views(rank: int, world_size: int) -> None:
    model = Branchy()
    buckets = GradientBuckets(model.named_parameters())
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(rank))
    oracle = sum(rank_grads(r, ("a",))["a.weight"] for r in range(world_size)) / world_size

    def synced_backward() -> None:
        buckets.arm()
        model(x, ("a",)).backward()
        buckets.finish()

    synced_backward()
    torch.testing.assert_close(model.a.weight.grad, oracle)
    workspaces = dict(buckets.reducer._workspaces)  # type: ignore[union-attr]
    assert len(workspaces) == 1, "the default RingReducer keeps one scratch workspace per dtype and device"
    synced_backward()  # not zeroed: gradients accumulate, as in single-device training
    torch.testing.assert_close(model.a.weight.grad, 2 * oracle)
    assert buckets.reducer._workspaces == workspaces, "the workspace was reallocated"  # type: ignore[union-attr]
    torch.optim.SGD(model.parameters(), lr=0.1).zero_grad(set_to_none=False)
    assert model.b.weight.grad is None, "never used anywhere: stays None even after zero_grad(set_to_none=False)"
    synced_backward()
    torch.testing.assert_close(model.a.weight.grad, oracle)
    buckets.close()


@pytest.mark.timeout(120)
def test_gradients_accumulate_across_synchronised_steps_and_zero_in_place() -> None:
    run_distributed(_check_grads_as_bucket_views, 2)
