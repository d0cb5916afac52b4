"""The arithmetic the runtime and the cost model share, in pure Python: bucket boundaries and ring traffic.

:func:`~lightning_dp_strategies.bucketing.assign_buckets` cuts real parameters into buckets with
:func:`bucket_boundaries`, and :func:`~lightning_dp_strategies.plan.bucket_count` counts the buckets of parameter sizes
with it, so the prediction and the run agree by construction. Both the reducers' byte counters and the cost model
use :func:`ring_bytes_per_rank`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

__all__ = ["MiB", "bucket_boundaries", "check_caps", "divisors", "ring_bytes_per_rank"]

MiB = 1024 * 1024


def check_caps(bucket_cap_mb: float, first_bucket_cap_mb: float) -> None:
    """Raise ``ValueError`` unless both caps are > 0 MiB."""
    if bucket_cap_mb <= 0 or first_bucket_cap_mb <= 0:
        raise ValueError(
            f"bucket caps must be > 0 MiB: got bucket_cap_mb={bucket_cap_mb} and "
            f"first_bucket_cap_mb={first_bucket_cap_mb}."
        )


def bucket_boundaries(
    sizes: Sequence[tuple[Hashable, int]], bucket_cap_mb: float = 25.0, first_bucket_cap_mb: float = 1.0
) -> list[list[int]]:
    """Group tensor indices into buckets, in reverse order, one kind (dtype and device) per bucket.

    ``sizes[i]`` is ``(kind, nbytes)`` of tensor ``i``. The first bucket of each kind takes tensors until it holds
    ``first_bucket_cap_mb`` (the tensor that reaches the cap included, as torch DDP's first bucket does), so it is
    never left nearly empty by a large tensor that follows a few small ones: its reduction starts early in backward.
    The tensors after it go into as many buckets as ``bucket_cap_mb`` needs (each closed before it would exceed the
    cap, a single tensor larger than the cap alone), but cut evenly: the largest bucket is as small as that count
    allows. Filling each bucket to the cap would leave the last one a remainder, and the one before it, nearly the
    whole gradient on a model a little over one cap, ready only at the end of backward, with the link idle while it
    fills. Buckets are ordered by the position of their first tensor in reverse order.

    Examples:
        >>> bucket_boundaries([("f32", 400), ("f32", 1_200_000), ("f32", 40), ("f32", 1_200_000)], 2, 1)
        [[3], [2, 1, 0]]
        >>> bucket_boundaries([("f32", 400), ("f32", 2_400_000), ("f32", 1_000)], 25, 1)  # the first bucket: 2 tensors
        [[2, 1], [0]]
        >>> bucket_boundaries([("f32", 1_100_000)] + [("f32", 400_000)] * 6, 2, 1)  # 2.4 MB after the first: 2 x 1.2
        [[6, 5, 4], [3, 2, 1], [0]]
    """
    check_caps(bucket_cap_mb, first_bucket_cap_mb)
    order: dict[Hashable, list[int]] = {}  # each kind's tensors, in reverse order
    for index in reversed(range(len(sizes))):
        order.setdefault(sizes[index][0], []).append(index)
    closed: list[list[int]] = []
    for indices in order.values():
        first, size = 0, 0
        while first < len(indices) and size < first_bucket_cap_mb * MiB:  # up to the tensor that reaches the cap
            size += sizes[indices[first]][1]
            first += 1
        closed.append(indices[:first])
        rest = indices[first:]
        closed.extend(_even_cut(rest, [sizes[i][1] for i in rest], int(bucket_cap_mb * MiB)))
    return sorted((members for members in closed if members), key=lambda members: len(sizes) - 1 - members[0])


def _greedy_cut(indices: list[int], nbytes: list[int], limit: int) -> list[list[int]]:
    """``indices`` in order, a bucket closed before it would exceed ``limit`` bytes (a larger tensor alone)."""
    buckets: list[list[int]] = []
    members: list[int] = []
    size = 0
    for index, n in zip(indices, nbytes, strict=True):
        if members and size + n > limit:
            buckets.append(members)
            members, size = [], 0
        members.append(index)
        size += n
    return [*buckets, members] if members else buckets


def _even_cut(indices: list[int], nbytes: list[int], cap: int) -> list[list[int]]:
    """As many buckets as :func:`_greedy_cut` at ``cap`` makes, cut at the smallest limit that needs no more.

    The count falls as the limit grows, so the smallest such limit is found by bisection; at it no bucket is larger
    than necessary for that count (a tensor larger than ``cap`` still alone).
    """
    count = len(_greedy_cut(indices, nbytes, cap))
    if count >= len(indices):  # one tensor a bucket (or none)
        return [[index] for index in indices]
    low, high = 0, cap  # a limit of 0 bytes puts every tensor alone: too many buckets; `cap` makes `count`
    while high - low > 1:
        middle = (low + high) // 2
        if len(_greedy_cut(indices, nbytes, middle)) <= count:
            high = middle
        else:
            low = middle
    return _greedy_cut(indices, nbytes, high)


def ring_bytes_per_rank(nbytes: float, world_size: int) -> float:
    """The bytes each rank sends in a bandwidth-optimal all-reduce of ``nbytes``: ``2 (N - 1) / N`` of them.

    Examples:
        >>> ring_bytes_per_rank(1000, 4), ring_bytes_per_rank(1000, 1)
        (1500.0, 0.0)
    """
    return 2 * (world_size - 1) * nbytes / world_size if world_size > 1 and nbytes else 0.0


def divisors(n: int, up_to: int | None = None) -> list[int]:
    """The divisors of ``n`` up to ``up_to`` (default ``n``), ascending: the sizes an even split can take.

    Examples:
        >>> divisors(12), divisors(12, up_to=5)
        ([1, 2, 3, 4, 6, 12], [1, 2, 3, 4])
    """
    return [d for d in range(1, (n if up_to is None else up_to) + 1) if n % d == 0]
