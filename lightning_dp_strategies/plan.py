"""A cost model: per-step communication time and pipeline bubble of each strategy at any world size, before renting it.

Every message costs a latency ``alpha`` (seconds) plus its bytes over a bandwidth ``beta`` (bytes/s): a :class:`Link`.
For a workload (gradient bytes, batch, activations) and a world size, :func:`predict` counts what the busiest rank
sends per optimizer step and prices it on the link::

    ring_allreduce    per bucket 2(N-1) ring steps; each rank sends 2(N-1)/N of the gradient bytes
                      t = buckets * 2(N-1) * alpha + 2(N-1)/N * gradient_bytes / beta
    scatter_gather    all traffic goes through the root device (one process, N devices):
                      root bytes = (N-1) * (param_bytes + grad_bytes) + batch * (in + out bytes/sample) * (N-1)/N
                      t = 4(N-1) * alpha + root bytes / beta     (replicate, scatter, gather, reduce: N-1 each)
    hybrid_pipeline   S stages x D = N/S replicas, M micro-batches; bubble = (S-1)/(M+S-1)
                      P2P: an interior stage sends M activations forward and M gradients backward (one of each at
                      the ends): min(S-1, 2) * M messages, min(S-1, 2) * batch * activation bytes/sample;
                      plus a ring all-reduce over D replicas of the stage's gradient bytes, gradient_bytes / S

The ring's gradient reduction may hide behind backward: given ``Workload.backward_seconds``, the exposed time is
``max(0, comm - backward_seconds)``, otherwise all of it. Nothing else is assumed to overlap (this package's
``hybrid_pipeline`` averages gradients after its schedule ends). Contention, congestion and hierarchy (NVLink inside a
node, a slower network between nodes) are not modelled: fit one :class:`Link` per level and plan with the slowest.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_dp_strategies._text import text_table
from lightning_dp_strategies.sizing import MiB, bucket_boundaries, check_caps, divisors, ring_bytes_per_rank

__all__ = [
    "COST_MODELS",
    "HYBRID_PIPELINE",
    "RING_ALLREDUCE",
    "SCATTER_GATHER",
    "STRATEGIES",
    "CostModel",
    "Link",
    "Prediction",
    "Workload",
    "bucket_count",
    "cost_model_of",
    "format_table",
    "plan",
    "predict",
]

_ALIASES = {"dp": "scatter_gather"}


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


def _ring(nbytes: float, world: int, buckets: int) -> tuple[float, int]:
    """(bytes sent per rank, latency terms) of ring all-reducing ``nbytes`` in ``buckets`` buckets over ``world``."""
    if world == 1 or nbytes == 0:
        return 0.0, 0
    return ring_bytes_per_rank(nbytes, world), buckets * 2 * (world - 1)


Formula = Callable[["Workload", int, "Link", int, int, tuple[float, float]], tuple[float, int, float, float, float]]
"""``(workload, world_size, link, stages, micro_batches, (bucket_cap_mb, first_bucket_cap_mb))`` -> ``(bytes per rank,
messages per rank, comm seconds, exposed seconds, bubble)``."""


@dataclass(frozen=True)
class CostModel:
    """A strategy's per-step communication formula (see the module docstring); a strategy class carries its own as
    ``cost_model``, so a subclass registered under another name is planned like its base.

    Examples:
        >>> RING_ALLREDUCE.name, HYBRID_PIPELINE.pipelined
        ('ring_allreduce', True)
    """

    name: str
    formula: Formula = field(repr=False)
    pipelined: bool = False
    """Whether ``stages`` and ``micro_batches`` apply."""


def _ring_formula(
    w: Workload, n: int, link: Link, stages: int, micro_batches: int, caps: tuple[float, float]
) -> tuple[float, int, float, float, float]:
    nbytes, messages = _ring(w.gradient_bytes, n, bucket_count(w.tensor_bytes or w.gradient_bytes, *caps))
    comm = link.seconds(messages, nbytes)
    return nbytes, messages, comm, max(0.0, comm - (w.backward_seconds or 0.0)), 0.0


def _scatter_gather_formula(
    w: Workload, n: int, link: Link, stages: int, micro_batches: int, caps: tuple[float, float]
) -> tuple[float, int, float, float, float]:
    replicated = w.gradient_bytes if w.parameter_bytes is None else w.parameter_bytes
    batch_bytes = w.batch_size * (w.input_bytes_per_sample + w.output_bytes_per_sample)
    nbytes, messages = (n - 1) * (replicated + w.gradient_bytes) + batch_bytes * (n - 1) / n, 4 * (n - 1)
    comm = link.seconds(messages, nbytes)
    return nbytes, messages, comm, comm, 0.0


def _pipeline_formula(
    w: Workload, n: int, link: Link, stages: int, micro_batches: int, caps: tuple[float, float]
) -> tuple[float, int, float, float, float]:
    hops, stage_bytes = min(stages - 1, 2), w.gradient_bytes / stages
    ring_bytes, ring_messages = _ring(stage_bytes, n // stages, bucket_count(math.ceil(stage_bytes), *caps))
    nbytes = hops * w.batch_size * w.activation_bytes_per_sample + ring_bytes
    messages = hops * micro_batches + ring_messages
    comm = link.seconds(messages, nbytes)
    return nbytes, messages, comm, comm, (stages - 1) / (micro_batches + stages - 1)


RING_ALLREDUCE = CostModel("ring_allreduce", _ring_formula)
SCATTER_GATHER = CostModel("scatter_gather", _scatter_gather_formula)
HYBRID_PIPELINE = CostModel("hybrid_pipeline", _pipeline_formula, pipelined=True)
COST_MODELS: dict[str, CostModel] = {m.name: m for m in (RING_ALLREDUCE, SCATTER_GATHER, HYBRID_PIPELINE)}
"""The built-in strategies' cost models by name (``"dp"`` is accepted for ``"scatter_gather"``)."""
STRATEGIES = tuple(COST_MODELS)
"""Strategy names :func:`predict` knows without a class."""


def cost_model_of(strategy: str | CostModel | type | object) -> CostModel:
    """The cost model of a built-in strategy name, a :class:`CostModel`, or a strategy (class) with a ``cost_model``.

    Examples:
        >>> cost_model_of("dp").name
        'scatter_gather'
        >>> class MyRing:  # e.g. a subclass of RingAllReduceStrategy, which carries RING_ALLREDUCE
        ...     cost_model = RING_ALLREDUCE
        >>> cost_model_of(MyRing).name
        'ring_allreduce'
    """
    if isinstance(strategy, CostModel):
        return strategy
    if isinstance(strategy, str):
        name = _ALIASES.get(strategy, strategy)
        if name in COST_MODELS:
            return COST_MODELS[name]
        raise ValueError(
            f"Unknown strategy {strategy!r}: choose one of {', '.join(STRATEGIES)} (or 'dp'), or pass a strategy "
            "class that has a `cost_model` (every strategy of this package and its subclasses do)."
        )
    model = getattr(strategy, "cost_model", None)
    if isinstance(model, CostModel):
        return model
    raise ValueError(f"{strategy!r} has no `cost_model`: give its class a `cost_model = plan.CostModel(...)`.")


def predict(
    strategy: str | CostModel | type,
    workload: Workload,
    world_size: int,
    link: Link,
    stages: int = 1,
    micro_batches: int = 1,
    bucket_cap_mb: float = 25.0,
    first_bucket_cap_mb: float = 1.0,
) -> Prediction:
    """Predict one strategy's per-step communication at ``world_size`` devices (formulas in the module docstring).

    Args:
        strategy: ``"ring_allreduce"``, ``"scatter_gather"`` (or ``"dp"``), ``"hybrid_pipeline"``, a strategy class
            with a ``cost_model`` (yours, if it subclasses one of this package's), or a :class:`CostModel`.
        workload: what a step moves.
        world_size: devices in all (``hybrid_pipeline``: ``stages x`` data-parallel replicas).
        link: latency and bandwidth of one device's link.
        stages: pipeline stages (``hybrid_pipeline`` only; must divide ``world_size``).
        micro_batches: micro-batches per step (``hybrid_pipeline`` only).
        bucket_cap_mb: gradient bucket cap in MiB, as the strategies take it.
        first_bucket_cap_mb: the first bucket's cap in MiB.

    Examples:
        >>> work = Workload(gradient_bytes=100 * MiB, batch_size=32, activation_bytes_per_sample=64 * 1024)
        >>> p = predict("hybrid_pipeline", work, 8, Link(1e-5, 1e10), stages=4, micro_batches=8)
        >>> p.bubble_fraction, p.messages_per_rank, round(p.comm_seconds * 1e3, 2)
        (0.2727272727272727, 20, 3.24)
    """
    model = cost_model_of(strategy)
    label = strategy if isinstance(strategy, str) else getattr(strategy, "__name__", model.name)
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1 (the number of devices), got {world_size!r}.")
    if stages < 1 or micro_batches < 1:
        raise ValueError(f"stages and micro_batches must be >= 1, got {stages} and {micro_batches}.")
    if not model.pipelined and (stages, micro_batches) != (1, 1):
        raise ValueError(
            f"stages and micro_batches apply to pipelined strategies such as 'hybrid_pipeline' only; leave them at 1 "
            f"for {label!r}."
        )
    if world_size % stages:
        raise ValueError(
            f"stages={stages} does not divide world_size={world_size}: the pipeline is replicated world_size/stages "
            f"times, so pick stages from {divisors(world_size)[:12]} or a world size that is a multiple of {stages}."
        )
    caps = (bucket_cap_mb, first_bucket_cap_mb)
    nbytes, messages, comm, exposed, bubble = model.formula(workload, world_size, link, stages, micro_batches, caps)
    name = model.name if isinstance(strategy, str) else label
    return Prediction(name, world_size, stages, micro_batches, nbytes, messages, comm, exposed, bubble)


def plan(
    workload: Workload,
    link: Link,
    world_sizes: Sequence[int] = (8, 64, 512),
    strategies: Sequence[str | CostModel | type] = STRATEGIES,
    stages: int = 4,
    micro_batches: int = 16,
    bucket_cap_mb: float = 25.0,
    first_bucket_cap_mb: float = 1.0,
) -> list[Prediction]:
    """Predict every strategy at every world size: the table to read before renting 512 devices.

    ``stages`` and ``micro_batches`` apply to ``hybrid_pipeline``; the bucket caps (MiB) to the gradient buckets of
    ``ring_allreduce`` and ``hybrid_pipeline``.

    Examples:
        >>> rows = plan(Workload(gradient_bytes=400 * MiB), Link(1e-5, 1e10), world_sizes=(8, 512))
        >>> [(p.strategy, p.world_size) for p in rows][:3]
        [('ring_allreduce', 8), ('scatter_gather', 8), ('hybrid_pipeline', 8)]
    """
    predictions = []
    for world in world_sizes:
        for strategy in strategies:
            s, m = (stages, micro_batches) if cost_model_of(strategy).pipelined else (1, 1)
            predictions.append(predict(strategy, workload, world, link, s, m, bucket_cap_mb, first_bucket_cap_mb))
    return predictions


def format_table(predictions: Iterable[Prediction]) -> str:
    """A fixed-width text table of :meth:`Prediction.as_row` rows.

    Examples:
        >>> print(format_table(plan(Workload(gradient_bytes=MiB), Link(1e-5, 1e9), (2, 4), ['ring_allreduce'])))
        strategy        world  S x D  M  MB/rank  msgs/rank  comm_ms  exposed_ms  bubble
        ring_allreduce      2  1 x 2  1    1.049          2    1.069       1.069     0.0
        ring_allreduce      4  1 x 4  1    1.573          6    1.633       1.633     0.0
    """
    rows = [{k: str(v) for k, v in p.as_row().items()} for p in predictions]
    if not rows:
        return ""
    return text_table(list(rows[0]), [list(r.values()) for r in rows])
