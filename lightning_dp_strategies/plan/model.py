"""The cost model's inputs and output: a :class:`Link`, a :class:`Workload` and a :class:`Prediction`."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_dp_strategies.plan.sizing import MiB, bucket_boundaries, check_caps

__all__ = ["Link", "Prediction", "Workload", "bucket_count"]


@dataclass(frozen=True)
class Link:
    """A point-to-point link: ``seconds = messages * latency_s + bytes / bandwidth_bytes_per_s``.

    Examples:
        >>> link = Link(latency_s=1e-5, bandwidth_bytes_per_s=1e9)
        >>> round(link.seconds(messages=2, nbytes=1e6), 6)
        0.00102
    """

    latency_s: float
    bandwidth_bytes_per_s: float

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_per_s > 0 or math.isinf(self.bandwidth_bytes_per_s):
            raise ValueError(
                f"Link bandwidth must be a positive, finite number of bytes per second, got "
                f"{self.bandwidth_bytes_per_s!r}: e.g. 25e9 for 200 Gb/s, or fit one with Link.fit(measurements)."
            )
        if not self.latency_s >= 0:
            raise ValueError(f"Link latency must be >= 0 seconds per message, got {self.latency_s!r}.")

    def seconds(self, messages: float, nbytes: float) -> float:
        """Time to send ``messages`` messages carrying ``nbytes`` bytes in all, one after the other."""
        return messages * self.latency_s + nbytes / self.bandwidth_bytes_per_s

    @classmethod
    def fit(cls, samples: Iterable[tuple[float, float, float]]) -> Link:
        """Fit ``seconds = latency * messages + bytes / bandwidth`` to ``(messages, bytes, seconds)`` measurements.

        Least squares of the *relative* error (each sample weighted by ``1 / seconds**2``), so 64 KiB and 64 MiB
        measurements count alike. A negative latency fit (noise on tiny latencies) is clamped to 0 and the bandwidth
        refitted alone.

        Examples:
            >>> true = Link(latency_s=2e-5, bandwidth_bytes_per_s=5e8)
            >>> samples = [(m, b, true.seconds(m, b)) for m, b in [(2, 1e4), (2, 1e6), (4, 1e5), (8, 1e8)]]
            >>> fitted = Link.fit(samples)
            >>> round(fitted.latency_s, 9), round(fitted.bandwidth_bytes_per_s)
            (2e-05, 500000000)
        """
        rows = [(float(m), float(b), float(t)) for m, b, t in samples]
        if len(rows) < 2 or any(t <= 0 or b < 0 or m < 0 for m, b, t in rows):
            raise ValueError(f"Link.fit needs two or more (messages, bytes, seconds > 0) samples, got {rows!r}.")
        xy = [(m / t, b / t) for m, b, t in rows]  # relative residuals: x * latency + y / bandwidth - 1
        sxx, sxy, syy = (sum(x * x for x, _ in xy), sum(x * y for x, y in xy), sum(y * y for _, y in xy))
        sx, sy, det = sum(x for x, _ in xy), sum(y for _, y in xy), sxx * syy - sxy * sxy
        latency = (sx * syy - sy * sxy) / det if det > 1e-9 * sxx * syy else -1.0
        inverse_bandwidth = (sy * sxx - sx * sxy) / det if latency >= 0 else -1.0
        if latency < 0 or inverse_bandwidth <= 0:  # latency below the noise: fit the bandwidth alone
            latency, inverse_bandwidth = 0.0, sy / syy if syy > 0 else 0.0
        if inverse_bandwidth <= 0:
            raise ValueError("Link.fit found no bandwidth term: measure sizes large enough that bytes cost time.")
        return cls(latency_s=latency, bandwidth_bytes_per_s=1.0 / inverse_bandwidth)


@dataclass(frozen=True)
class Workload:
    """What one optimizer step moves. Byte counts are per model (all stages together), sizes per sample.

    Args:
        gradient_bytes: bytes of all trainable parameters' gradients (``numel * element_size`` summed).
        batch_size: samples per step on one replica (for ``scatter_gather``: the whole batch split over devices).
        parameter_bytes: bytes of the parameters ``scatter_gather`` replicates; defaults to ``gradient_bytes``.
        input_bytes_per_sample: bytes of one sample's inputs (``scatter_gather`` scatters them).
        output_bytes_per_sample: bytes of one sample's outputs (``scatter_gather`` gathers them).
        activation_bytes_per_sample: bytes of one sample's activation at a pipeline stage boundary.
        backward_seconds: backward time per step; ring gradient reduction up to this long is hidden behind it.
        tensor_bytes: optional per-parameter gradient bytes in registration order; then buckets are counted as
            :func:`lightning_dp_strategies.bucketing.assign_buckets` forms them (else ``gradient_bytes`` is cut
            into full buckets).

    Examples:
        >>> from lightning_dp_strategies.plan import predict
        >>> work = Workload(gradient_bytes=4 * 25_000_000, batch_size=32)  # 25 M fp32 parameters
        >>> predict("ring_allreduce", work, 8, Link(1e-5, 1e10)).bytes_per_rank / 1e6  # 2(N-1)/N of 100 MB
        175.0
    """

    gradient_bytes: int
    batch_size: int = 32
    parameter_bytes: int | None = None
    input_bytes_per_sample: int = 0
    output_bytes_per_sample: int = 0
    activation_bytes_per_sample: int = 0
    backward_seconds: float | None = None
    tensor_bytes: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        counts = [self.gradient_bytes, self.parameter_bytes or 0, self.input_bytes_per_sample]
        counts += [self.output_bytes_per_sample, self.activation_bytes_per_sample, *self.tensor_bytes]
        if min(counts) < 0 or self.batch_size < 1:
            raise ValueError(f"Workload byte counts must be >= 0 and batch_size >= 1, got {self!r}.")
        if self.tensor_bytes and sum(self.tensor_bytes) != self.gradient_bytes:
            raise ValueError(
                f"tensor_bytes sum to {sum(self.tensor_bytes)} but gradient_bytes is {self.gradient_bytes}: "
                "use Workload.from_module(module) to take both from the module."
            )

    @classmethod
    def from_module(cls, module: Any, **kwargs: Any) -> Workload:
        """A workload whose gradient bytes (and buckets) are ``module``'s trainable parameters'.

        Examples:
            >>> import torch
            >>> Workload.from_module(torch.nn.Linear(1000, 10), batch_size=64).gradient_bytes
            40040
        """
        sizes = tuple(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
        return cls(gradient_bytes=sum(sizes), tensor_bytes=sizes, **kwargs)


def bucket_count(
    gradient_bytes: int | Sequence[int], bucket_cap_mb: float = 25.0, first_bucket_cap_mb: float = 1.0
) -> int:
    """Number of gradient buckets: a first one of ``first_bucket_cap_mb`` MiB, then ``bucket_cap_mb`` MiB each.

    Given per-parameter sizes, the buckets are formed as ``assign_buckets`` does (reverse order, a bucket closed
    before it would exceed its cap, an oversized tensor alone); given a total, it is cut into full buckets.

    Examples:
        >>> bucket_count(100 * MiB), bucket_count([2 * MiB, 512 * 1024, 512 * 1024]), bucket_count(0)
        (5, 2, 0)
    """
    check_caps(bucket_cap_mb, first_bucket_cap_mb)
    if isinstance(gradient_bytes, int):
        rest = max(0, gradient_bytes - first_bucket_cap_mb * MiB)
        return (gradient_bytes > 0) + math.ceil(rest / (bucket_cap_mb * MiB))
    return len(bucket_boundaries([(None, n) for n in gradient_bytes], bucket_cap_mb, first_bucket_cap_mb))


@dataclass(frozen=True)
class Prediction:
    """Predicted per-step communication of one strategy at one world size (the busiest rank's figures).

    Examples:
        >>> from lightning_dp_strategies.plan import MiB, predict
        >>> p = predict("ring_allreduce", Workload(gradient_bytes=8 * MiB), 4, Link(0.0, 1e9))
        >>> p.bytes_per_rank == 2 * 3 / 4 * 8 * MiB, p.messages_per_rank, p.as_row()["comm_ms"]
        (True, 12, 12.583)
    """

    strategy: str
    world_size: int
    stages: int
    micro_batches: int
    bytes_per_rank: float
    """Bytes the busiest rank sends (``scatter_gather``: the root sends and receives) per step."""
    messages_per_rank: int
    """Latency terms on that rank: sequential ring steps, P2P transfers, or root transfers."""
    comm_seconds: float
    exposed_seconds: float
    """Of ``comm_seconds``, what is not hidden behind backward (see ``Workload.backward_seconds``)."""
    bubble_fraction: float

    def as_row(self) -> dict[str, Any]:
        """The figures rounded for a table: S x D stages x replicas, M micro-batches, MB (10^6 bytes), milliseconds."""
        return {
            "strategy": self.strategy,
            "world": self.world_size,
            "S x D": f"{self.stages} x {self.world_size // self.stages}",
            "M": self.micro_batches,
            "MB/rank": round(self.bytes_per_rank / 1e6, 3),
            "msgs/rank": self.messages_per_rank,
            "comm_ms": round(self.comm_seconds * 1e3, 3),
            "exposed_ms": round(self.exposed_seconds * 1e3, 3),
            "bubble": round(self.bubble_fraction, 3),
        }
