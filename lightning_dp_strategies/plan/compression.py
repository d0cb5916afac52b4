"""When gradient compression pays: the link time of the bytes it removes against the compute it adds, per step.

An extension of :mod:`lightning_dp_strategies.plan` for ``ring_allreduce`` with a compression wrapper or a torch
DDP communication hook. With the same alpha-beta :class:`~lightning_dp_strategies.plan.Link`, ``G`` the gradient
bytes, ``P`` the compressed payload (:func:`payload_bytes`), ``B`` buckets, ``k`` dependent reductions per bucket
(1 for a cast, 2 for this package's ``PowerSGD``, 3 for torch's ``powerSGD_hook``) and ``c`` the compression's
extra compute per step (measure it: ``benchmarks/bench_ring_allreduce.py --part c`` does)::

    plain       t0 = B * 2(N-1) * alpha      + 2(N-1)/N * G / beta
    compressed  t1 = B * k * 2(N-1) * alpha  + 2(N-1)/N * P / beta  + c
    pays when   t1 < t0, i.e. beta < beta* = 2(N-1)/N * (G - P) / (c + (k-1) * B * 2(N-1) * alpha)

Nothing is assumed to overlap: communication hidden behind backward gains nothing from compression, so overlap only
lowers the break-even bandwidth ``beta*``, and compute that runs beside backward on a core of its own costs less.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_dp_strategies.plan.model import Link, bucket_count
from lightning_dp_strategies.plan.sizing import ring_bytes_per_rank

__all__ = ["METHODS", "CompressionVerdict", "compression_pays", "payload_bytes"]

METHODS = ("none", "fp16", "bf16", "powersgd")
"""What :func:`payload_bytes` knows: no compression, a 2-byte cast, PowerSGD of a given rank."""


def payload_bytes(
    shapes: Sequence[Sequence[int]],
    method: str,
    rank: int = 4,
    min_compression: float = 2.0,
    element_size: int = 4,
) -> int:
    """Bytes one rank's gradients put on the wire per all-reduce round trip after compression (before the ring's
    2(N-1)/N factor): the whole gradient for ``"none"``, half of it from fp32 for ``"fp16"`` / ``"bf16"``, and for
    ``"powersgd"`` ``r(n + m)`` elements per ``n x m`` matrix it compresses (first dimension by the rest, where
    ``n m >= min_compression * r(n + m)``, as this package's ``PowerSGD`` decides; torch's hook asks for ``>``)
    plus the rest uncompressed.

    Examples:
        >>> shapes = [(1536, 1536), (1536,), (10, 1536), (10,)]  # two Linear layers
        >>> payload_bytes(shapes, "none"), payload_bytes(shapes, "fp16")
        (9504808, 4752404)
        >>> payload_bytes(shapes, "powersgd", rank=4) == 4 * (4 * (1536 + 1536) + 1536 + 4 * (10 + 1536) + 10)
        True
    """
    if method not in METHODS:
        raise ValueError(f"Unknown compression {method!r}: choose one of {', '.join(METHODS)}.")
    total = 0
    for shape in shapes:
        numel = math.prod(shape)
        if method in ("fp16", "bf16"):
            total += numel * 2
            continue
        n, m = (shape[0], numel // shape[0]) if len(shape) >= 2 and shape[0] else (0, 0)
        if method == "powersgd" and len(shape) >= 2 and n * m >= min_compression * rank * (n + m):
            total += rank * (n + m) * element_size
        else:
            total += numel * element_size
    return total


@dataclass(frozen=True)
class CompressionVerdict:
    """Predicted per-step time of the gradient reduction with and without compression (the busiest rank's).

    Examples:
        >>> verdict = CompressionVerdict(8, plain_seconds=0.20, compressed_seconds=0.05, saved_seconds=0.15,
        ...                              break_even_bytes_per_s=4e9)
        >>> verdict.pays
        True
    """

    world_size: int
    plain_seconds: float
    """``t0``: ring all-reduce of the uncompressed gradients."""
    compressed_seconds: float
    """``t1``: of the payload, in ``k`` dependent rounds per bucket, plus the compression's compute."""
    saved_seconds: float
    """``t0 - t1``: positive when compression pays."""
    break_even_bytes_per_s: float
    """``beta*``: compression pays on links slower than this (``inf``: at any bandwidth)."""

    @property
    def pays(self) -> bool:
        """Whether compression makes the step faster on this link."""
        return self.saved_seconds > 0


def compression_pays(
    shapes: Sequence[Sequence[int]],
    world_size: int,
    link: Link,
    method: str,
    compute_seconds: float,
    rounds: int = 1,
    rank: int = 4,
    bucket_cap_mb: float = 25.0,
    first_bucket_cap_mb: float = 1.0,
) -> CompressionVerdict:
    """Whether ``method`` makes one step's gradient reduction faster at ``world_size`` ranks on ``link`` (formula in
    the module docstring).

    Args:
        shapes: the trainable parameters' shapes in registration order (``[p.shape for p in model.parameters()]``),
            fp32.
        world_size: ranks averaging the gradients.
        link: latency and bandwidth of one rank's link.
        method: one of :data:`METHODS`.
        compute_seconds: the compression's extra local work per step (casts, factor products, orthogonalisation).
        rounds: dependent reductions per bucket: 1 for a cast, 2 for ``PowerSGD``, 3 for torch's ``powerSGD_hook``.
        rank: PowerSGD's approximation rank.
        bucket_cap_mb: gradient bucket cap in MiB, as the strategies take it.
        first_bucket_cap_mb: the first bucket's cap in MiB.

    Examples:
        >>> shapes = [(4096, 4096)] * 8  # 537 MB of fp32 gradients
        >>> slow, fast = Link(1e-5, 1.25e9), Link(1e-5, 25e9)  # 10 and 200 Gbit/s
        >>> v = compression_pays(shapes, 8, slow, "powersgd", compute_seconds=0.05, rounds=2)
        >>> v.pays, round(v.saved_seconds, 3), round(v.break_even_bytes_per_s / 1e9, 1)
        (True, 0.699, 18.3)
        >>> compression_pays(shapes, 8, fast, "powersgd", compute_seconds=0.05, rounds=2).pays
        False
    """
    if world_size < 1 or rounds < 1 or compute_seconds < 0:
        raise ValueError(
            f"world_size and rounds must be >= 1 and compute_seconds >= 0, got {world_size}, {rounds} and "
            f"{compute_seconds}."
        )
    sizes = [math.prod(s) * 4 for s in shapes]
    gradient, payload = sum(sizes), payload_bytes(shapes, method, rank)
    buckets = bucket_count(sizes, bucket_cap_mb, first_bucket_cap_mb) if world_size > 1 else 0
    steps = buckets * 2 * (world_size - 1)
    plain = link.seconds(steps, ring_bytes_per_rank(gradient, world_size))
    compressed = link.seconds(steps * rounds, ring_bytes_per_rank(payload, world_size)) + compute_seconds
    removed = ring_bytes_per_rank(gradient - payload, world_size)
    cost = compute_seconds + (rounds - 1) * steps * link.latency_s
    break_even = math.inf if cost <= 0 and removed > 0 else (removed / cost if cost > 0 else 0.0)
    return CompressionVerdict(world_size, plain, compressed, plain - compressed, break_even)
