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
    Later buckets are closed before they would exceed ``bucket_cap_mb``; a single tensor larger than the cap gets a
    bucket of its own. Buckets are ordered by the position of their first tensor in reverse order.

    Examples:
        >>> bucket_boundaries([("f32", 400), ("f32", 1_200_000), ("f32", 40), ("f32", 1_200_000)], 2, 1)
        [[3], [2, 1, 0]]
        >>> bucket_boundaries([("f32", 400), ("f32", 2_400_000), ("f32", 1_000)], 25, 1)  # the first bucket: 2 tensors
        [[2, 1], [0]]
    """
    check_caps(bucket_cap_mb, first_bucket_cap_mb)
    open_buckets: dict[Hashable, tuple[list[int], int, bool]] = {}
    closed: list[list[int]] = []
    for index in reversed(range(len(sizes))):
        kind, nbytes = sizes[index]
        members, size, is_first = open_buckets.get(kind, ([], 0, True))
        if members and not is_first and size + nbytes > bucket_cap_mb * MiB:
            closed.append(members)
            members, size = [], 0
        members.append(index)
        size += nbytes
        if is_first and size >= first_bucket_cap_mb * MiB:  # the first bucket closes once it reaches its cap
            closed.append(members)
            members, size, is_first = [], 0, False
        open_buckets[kind] = (members, size, is_first)
    closed.extend(members for members, _, _ in open_buckets.values() if members)
    return sorted(closed, key=lambda members: len(sizes) - 1 - members[0])


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
