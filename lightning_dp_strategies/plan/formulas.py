"""One per-step communication formula per strategy, each a :class:`CostModel` a strategy class carries."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from lightning_dp_strategies.plan.auto import AutoChoice
from lightning_dp_strategies.plan.model import Link, Workload, bucket_count
from lightning_dp_strategies.plan.sizing import ring_bytes_per_rank
from lightning_dp_strategies.plan.step import Reduction
from lightning_dp_strategies.plan.streaming import BYTES_PER_VALUE, choose_period

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
    "local_sgd_schedule",
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
    reducer: str | None = None
    """A strategy instance's own reduction where the planner cannot price it (its reducer or hook, as written):
    :func:`~lightning_dp_strategies.plan.predict` asks for a ``reduction``."""
    reduction: Reduction | None = None
    """A strategy instance's own reduction where the planner prices it (two levels, a 16-bit cast, PowerSGD):
    :func:`~lightning_dp_strategies.plan.predict` prices it unless given another."""
    auto: AutoChoice | None = None
    """A strategy instance's ``reducer="auto"``: :func:`~lightning_dp_strategies.plan.predict` prices the reduction
    it would choose (:mod:`lightning_dp_strategies.plan.auto`)."""


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


def _fragment_reduction(w: Workload, n: int, link: Link, fragments: int, outer_precision: str) -> tuple[float, int]:
    """(bytes sent per rank, messages) of one fragment's ring all-reduce: ``1/fragments`` of the parameters' values
    (fp32, as ``gradient_bytes`` counts them) at the outer precision's bytes a value."""
    wire = w.gradient_bytes * BYTES_PER_VALUE[outer_precision] / BYTES_PER_VALUE["fp32"]
    return _ring(wire / fragments, n, 1)


def local_sgd_schedule(
    w: Workload,
    n: int,
    link: Link,
    sync_every: int | str = 8,
    fragments: int = 1,
    delay: int = 0,
    outer_precision: str = "fp32",
) -> tuple[int, int]:
    """``(sync_every, delay)`` as :func:`local_sgd_cost_model` prices them: the fixed period and delay, or for
    ``sync_every="auto"`` the ones :func:`~lightning_dp_strategies.plan.streaming.choose_period` picks from the
    predicted reduction of a fragment and the workload's ``compute_seconds`` (16 steps and the delay given, without
    ``compute_seconds``).

    Examples:
        >>> from lightning_dp_strategies.plan import Link, Workload
        >>> work, link = Workload(gradient_bytes=29_000_000, compute_seconds=0.6), Link(0.0, 25e6)  # 200 Mbit/s
        >>> local_sgd_schedule(work, 2, link, "auto", 4, 1, "int4")  # 0.04 s a fragment: one step hides it
        (4, 1)
    """
    if isinstance(sync_every, int):
        return sync_every, delay
    if w.compute_seconds is None:
        return 16, delay
    nbytes, messages = _fragment_reduction(w, n, link, fragments, outer_precision)
    return choose_period(fragments, delay, w.compute_seconds, link.seconds(messages, nbytes))


def local_sgd_cost_model(
    sync_every: int | str = 8, fragments: int = 1, delay: int = 0, outer_precision: str = "fp32"
) -> CostModel:
    """Local SGD and streaming DiLoCo: every ``sync_every`` optimizer steps each of ``fragments`` runs of the
    parameters (``1/fragments`` of their values each, fp32 values as ``gradient_bytes`` counts them) has its change
    averaged by one ring all-reduce, in ``outer_precision`` (:data:`~lightning_dp_strategies.plan.streaming.
    BYTES_PER_VALUE` bytes a value), the fragments in turns; priced per step as a period's share.

    The exposed time: with ``delay=0`` the whole reduction (the loop waits for it). With ``delay=d`` a fragment's
    reduction runs while the next ``d`` inner steps compute (the workload's ``compute_seconds``), and only what
    outlasts them is exposed; where the fragments' reductions together outlast the period's compute, the loop waits
    for that excess instead. Without ``compute_seconds`` nothing is counted as hidden. ``sync_every="auto"`` is priced
    at the period and delay the strategy would choose
    (:func:`~lightning_dp_strategies.plan.streaming.choose_period`) from the predicted reduction of a fragment and
    ``compute_seconds``; without ``compute_seconds``, at 16 steps (:func:`local_sgd_schedule`).

    Examples:
        >>> from lightning_dp_strategies.plan import Link, Workload
        >>> work, link = Workload(gradient_bytes=29_000_000, compute_seconds=0.6), Link(0.0, 25e6)  # 200 Mbit/s
        >>> plain = local_sgd_cost_model(16).formula(work, 2, link, 1, 1, (25.0, 1.0))
        >>> streamed = local_sgd_cost_model(16, 4, 1, "int4").formula(work, 2, link, 1, 1, (25.0, 1.0))
        >>> round(plain[0] / 1e6, 2), round(streamed[0] / 1e6, 2)  # MB a step: the int4 change is 0.13 of fp32's
        (1.81, 0.24)
        >>> round(plain[3], 2), streamed[3]  # seconds exposed a step: the loop waits; one step hides each fragment
        (0.07, 0.0)
        >>> local_sgd_cost_model(16).name, LOCAL_SGD.pipelined  # a plan's table names the options
        ('local_sgd(sync_every=16)', False)
        >>> local_sgd_cost_model("auto", 4, 1, "int4").name
        "local_sgd(sync_every='auto', fragments=4, delay=1, outer_precision='int4')"
    """

    def formula(
        w: Workload, n: int, link: Link, stages: int, micro_batches: int, caps: tuple[float, float]
    ) -> tuple[float, int, float, float, float]:
        nbytes, messages = _fragment_reduction(w, n, link, fragments, outer_precision)
        seconds, compute = link.seconds(messages, nbytes), w.compute_seconds
        period, hidden_by = local_sgd_schedule(w, n, link, sync_every, fragments, delay, outer_precision)
        comm = fragments * seconds / period
        if hidden_by == 0 or compute is None:
            exposed = comm
        else:  # each fragment's excess over its delay's compute, or the period's, whichever the loop waits longer for
            exposed = max(fragments * max(0.0, seconds - hidden_by * compute), fragments * seconds - period * compute)
            exposed = max(0.0, exposed) / period
        return fragments * nbytes / period, math.ceil(fragments * messages / period), comm, exposed, 0.0

    options = {"fragments": (fragments, 1), "delay": (delay, 0), "outer_precision": (outer_precision, "fp32")}
    shown = [f"sync_every={sync_every!r}", *(f"{k}={v!r}" for k, (v, plain) in options.items() if v != plain)]
    return CostModel(f"local_sgd({', '.join(shown)})", formula)


LOCAL_SGD = local_sgd_cost_model(8)
"""Local SGD at its default period (8 steps); a ``LocalSGDStrategy`` instance carries the model of its own
``sync_every``, ``fragments``, ``delay`` and ``outer_precision``. Not in :data:`COST_MODELS`: its price depends on
them, so plan with a strategy instance or :func:`local_sgd_cost_model`."""


COST_MODELS: dict[str, CostModel] = {m.name: m for m in (RING_ALLREDUCE, SCATTER_GATHER, HYBRID_PIPELINE)}
"""The built-in strategies' cost models by name (``"dp"`` is accepted for ``"scatter_gather"``)."""


STRATEGIES = tuple(COST_MODELS)
"""Strategy names :func:`predict` knows without a class."""
