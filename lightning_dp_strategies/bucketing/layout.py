"""Which parameters share a bucket: reverse registration order, one dtype and device each, capped in size.

The algorithm, :func:`bucket_boundaries`, works on ``(kind, nbytes)`` pairs in pure Python and lives in the cost
model's :mod:`~lightning_dp_strategies.plan.sizing` (the bottom layer, which counts buckets with it and may import
nothing above it); it is exported here beside :func:`assign_buckets`, its use on real parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from lightning_dp_strategies.plan.sizing import bucket_boundaries

__all__ = ["assign_buckets", "bucket_boundaries"]


def assign_buckets(
    params: Sequence[Tensor], bucket_cap_mb: float = 25.0, first_bucket_cap_mb: float = 1.0
) -> list[list[int]]:
    """Group parameter indices into buckets, in reverse registration order, one dtype and device per bucket.

    The first bucket of each dtype and device takes tensors until it reaches ``first_bucket_cap_mb``; the rest go into
    as many buckets as ``bucket_cap_mb`` needs, cut evenly (no bucket larger than the cap, nor than that count
    requires); a single tensor larger than the cap gets a bucket of its own (see :func:`bucket_boundaries`). Buckets
    are ordered by the position of their first parameter in reverse order, the order their gradients become ready.

    Examples:
        >>> import torch
        >>> sizes = [torch.empty(n) for n in (100, 300_000, 10, 300_000)]  # 4 bytes each element
        >>> assign_buckets(sizes, bucket_cap_mb=2, first_bucket_cap_mb=1)
        [[3], [2, 1, 0]]
    """
    sizes = [((t.dtype, t.device), t.numel() * t.element_size()) for t in params]
    return bucket_boundaries(sizes, bucket_cap_mb, first_bucket_cap_mb)
