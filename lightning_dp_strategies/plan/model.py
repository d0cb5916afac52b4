"""The cost model's input and output: a :class:`Workload` and a :class:`Prediction` (:class:`Link` re-exported)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_dp_strategies.plan.cluster import CpuCosts, Topology
from lightning_dp_strategies.plan.link import Link
from lightning_dp_strategies.plan.sizing import MiB, bucket_boundaries, check_caps

__all__ = ["Link", "Prediction", "Workload", "bucket_count"]


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
        compute_seconds: one rank's measured step without communication (forward, backward and optimizer at the
            per-rank batch; :func:`~lightning_dp_strategies.plan.measure_compute` measures it). Given, a prediction
            has a ``step_seconds``.
        shapes: the trainable parameters' shapes in registration order (what PowerSGD factors).
        topology: nodes, processes a node and their links; ``None``: one node whose processes share ``predict``'s
            link.
        cpu: seconds per byte of reducing and compressing on this machine
            (:func:`~lightning_dp_strategies.reducers.calibrate_cpu`); ``None``: the wire alone.

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
    compute_seconds: float | None = None
    shapes: tuple[tuple[int, ...], ...] = field(default=(), repr=False)
    topology: Topology | None = None
    cpu: CpuCosts | None = None

    def __post_init__(self) -> None:
        counts = [self.gradient_bytes, self.parameter_bytes or 0, self.input_bytes_per_sample]
        counts += [self.output_bytes_per_sample, self.activation_bytes_per_sample, *self.tensor_bytes]
        times = [t for t in (self.backward_seconds, self.compute_seconds) if t is not None]
        if min(counts) < 0 or self.batch_size < 1 or min(times, default=0.0) < 0:
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
        trainable = [p for p in module.parameters() if p.requires_grad]
        sizes = tuple(p.numel() * p.element_size() for p in trainable)
        shapes = tuple(tuple(p.shape) for p in trainable)
        return cls(gradient_bytes=sum(sizes), tensor_bytes=sizes, shapes=shapes, **kwargs)


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
    step_seconds: float | None = None
    """One optimizer step: ``Workload.compute_seconds`` plus the exposed communication (``None`` without it). For
    the ring, with a ``compute_seconds`` or under a ``reduction`` (given, the strategy's own, or ``reducer="auto"``'s
    choice), every figure is the step model's for that reduction: its bytes and ring steps as the reducers count
    them, ``comm_seconds`` and ``exposed_seconds`` those of this step (the buckets handed over as backward makes
    them); otherwise they are the plain ring's formula, which hides communication behind all of backward."""

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
            **({} if self.step_seconds is None else {"step_ms": round(self.step_seconds * 1e3, 3)}),
        }
