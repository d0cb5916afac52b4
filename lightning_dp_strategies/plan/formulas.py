"""One per-step communication formula per strategy, each a :class:`CostModel` a strategy class carries."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from lightning_dp_strategies.plan.model import Link, Workload, bucket_count
from lightning_dp_strategies.plan.sizing import ring_bytes_per_rank

__all__ = [
    "COST_MODELS",
    "HYBRID_PIPELINE",
    "LOCAL_SGD",
    "RING_ALLREDUCE",
    "SCATTER_GATHER",
    "STRATEGIES",
    "CostModel",
    "Formula",
    "local_sgd_cost_model",
]


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
    bucketed: bool = False
    """Whether its step is the bucketed ring's (:func:`~lightning_dp_strategies.plan.step.ring_step`), so a
    ``reduction`` and a workload's ``topology`` apply."""


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


RING_ALLREDUCE = CostModel("ring_allreduce", _ring_formula, bucketed=True)


SCATTER_GATHER = CostModel("scatter_gather", _scatter_gather_formula)


HYBRID_PIPELINE = CostModel("hybrid_pipeline", _pipeline_formula, pipelined=True)


def local_sgd_cost_model(sync_every: int = 8) -> CostModel:
    """Local SGD synchronising every ``sync_every`` optimizer steps: one ring all-reduce of the parameters' change
    (one flat buffer), after the step so nothing hides it, priced per step as a ``1/sync_every`` share.

    Examples:
        >>> local_sgd_cost_model(16).name, LOCAL_SGD.pipelined
        ('local_sgd', False)
    """

    def formula(
        w: Workload, n: int, link: Link, stages: int, micro_batches: int, caps: tuple[float, float]
    ) -> tuple[float, int, float, float, float]:
        nbytes, messages = _ring(w.gradient_bytes, n, 1)
        comm = link.seconds(messages, nbytes) / sync_every
        return nbytes / sync_every, math.ceil(messages / sync_every), comm, comm, 0.0

    return CostModel("local_sgd", formula)


LOCAL_SGD = local_sgd_cost_model(8)
"""Local SGD at its default period (8 steps); a ``LocalSGDStrategy`` instance carries the model of its own
``sync_every``. Not in :data:`COST_MODELS`: its price depends on the period, so plan with a strategy instance or
:func:`local_sgd_cost_model`."""


COST_MODELS: dict[str, CostModel] = {m.name: m for m in (RING_ALLREDUCE, SCATTER_GATHER, HYBRID_PIPELINE)}
"""The built-in strategies' cost models by name (``"dp"`` is accepted for ``"scatter_gather"``)."""


STRATEGIES = tuple(COST_MODELS)
"""Strategy names :func:`predict` knows without a class."""
