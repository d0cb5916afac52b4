"""Predict a strategy's step at a world size (:func:`predict`), or every strategy at several (:func:`plan`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lightning_dp_strategies.plan.auto import AutoChoice, choose
from lightning_dp_strategies.plan.cluster import Topology
from lightning_dp_strategies.plan.formulas import COST_MODELS, STRATEGIES, CostModel
from lightning_dp_strategies.plan.model import Link, Prediction, Workload
from lightning_dp_strategies.plan.sizing import divisors
from lightning_dp_strategies.plan.step import Reduction, StepTimes, buckets_step, buckets_traffic, ring_buckets

__all__ = ["cost_model_of", "name_strategy", "plan", "predict"]


_ALIASES = {"dp": "scatter_gather"}
_NAMED: dict[str, Callable[[], object]] = {}
"""The names registered with Lightning's strategy registries, each with a function that makes the strategy it stands
for (filled by :func:`name_strategy` as the package registers its names on import)."""


def name_strategy(name: str, make: Callable[[], object]) -> None:
    """Let :func:`cost_model_of` price ``name`` as the strategy ``make()`` returns (its ``cost_model``). The package
    calls it for every name it registers with Lightning, the Trainer's and Fabric's; a later call replaces the
    function (the two registries' same-named strategies carry the same cost model)."""
    _NAMED[name] = make


def cost_model_of(strategy: str | CostModel | type | object) -> CostModel:
    """The cost model of a strategy name (a built-in one, or any name the package registers with Lightning, as
    ``Trainer(strategy=...)`` takes it), a :class:`CostModel`, or a strategy (class) with a ``cost_model``.

    Examples:
        >>> from lightning_dp_strategies.plan import RING_ALLREDUCE
        >>> cost_model_of("dp").name
        'scatter_gather'
        >>> import lightning_dp_strategies  # registers the names: "streaming_diloco" is LocalSGDStrategy's
        >>> cost_model_of("streaming_diloco").name
        "local_sgd(sync_every='auto', fragments=4, delay=1, outer_precision='int4')"
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
        if name in _NAMED:
            return cost_model_of(_NAMED[name]())
        raise ValueError(
            f"Unknown strategy {strategy!r}: choose one of {', '.join(STRATEGIES)} (or 'dp'), a name the package "
            f"registers with Lightning ({', '.join(sorted(_NAMED)) or 'none registered: import the package'}), or "
            "pass a strategy class that has a `cost_model` (every strategy of this package and its subclasses do)."
        )
    model = getattr(strategy, "cost_model", None)
    if isinstance(model, CostModel):
        return model
    raise ValueError(f"{strategy!r} has no `cost_model`: give its class a `cost_model = plan.CostModel(...)`.")


def predict(
    strategy: str | CostModel | type | object,
    workload: Workload,
    world_size: int,
    link: Link,
    stages: int = 1,
    micro_batches: int = 1,
    bucket_cap_mb: float = 25.0,
    first_bucket_cap_mb: float = 1.0,
    reduction: Reduction | None = None,
) -> Prediction:
    """Predict one strategy's per-step communication at ``world_size`` devices (formulas in the module docstring),
    and its whole step when the workload has a ``compute_seconds`` (:mod:`lightning_dp_strategies.plan.step`).

    Args:
        strategy: ``"ring_allreduce"``, ``"scatter_gather"`` (or ``"dp"``), ``"hybrid_pipeline"``, a strategy class
            with a ``cost_model`` (yours, if it subclasses one of this package's), a strategy instance (a
            ``LocalSGDStrategy`` carries the model of its own period, fragments, delay and outer precision, and
            names the row after them), or a :class:`CostModel`.
        workload: what a step moves.
        world_size: devices in all (``hybrid_pipeline``: ``stages x`` data-parallel replicas).
        link: latency and bandwidth of one device's link.
        stages: pipeline stages (``hybrid_pipeline`` only; must divide ``world_size``).
        micro_batches: micro-batches per step (``hybrid_pipeline`` only).
        bucket_cap_mb: gradient bucket cap in MiB, as the strategies take it.
        first_bucket_cap_mb: the first bucket's cap in MiB.
        reduction: how the ring's buckets are reduced (compression, one or two levels): by default the strategy's
            own (``two_level=True``, ``reducer=bf16_compress("ring")``, ``PowerSGD(...)``; named in the row), the
            plain flat ring, or with ``reducer="auto"`` the reduction it would choose (named in the row). The row's
            bytes, steps and times are that reduction's; with a ``compute_seconds``, its times are those of the step
            it predicts (``step_seconds`` = compute + exposed, plus any CPU the reduction takes from backward).

    Examples:
        >>> from lightning_dp_strategies.plan import MiB
        >>> work = Workload(gradient_bytes=100 * MiB, batch_size=32, activation_bytes_per_sample=64 * 1024)
        >>> p = predict("hybrid_pipeline", work, 8, Link(1e-5, 1e10), stages=4, micro_batches=8)
        >>> p.bubble_fraction, p.messages_per_rank, round(p.comm_seconds * 1e3, 2)
        (0.2727272727272727, 20, 3.24)
    """
    model = cost_model_of(strategy)
    label = strategy if isinstance(strategy, str) else getattr(strategy, "__name__", model.name)
    _check(model, label, world_size, stages, micro_batches, reduction)
    caps = (bucket_cap_mb, first_bucket_cap_mb)
    nbytes, messages, comm, exposed, bubble = model.formula(workload, world_size, link, stages, micro_batches, caps)
    builtin = isinstance(strategy, str) and _ALIASES.get(strategy, strategy) in COST_MODELS
    name = model.name if builtin else label  # a registered name as written
    topology = _topology(workload, world_size, link)
    if reduction is None and model.reduction is not None:  # the strategy's own: named in the row
        reduction, name = model.reduction, f"{name}: {model.reduction.label}"
    if model.auto is not None and reduction is None:  # reducer="auto": the reduction it would choose
        reduction = _auto_reduction(model.auto, workload, topology, caps, label)
        name = f"{name}: {reduction.label}"
    compute = workload.compute_seconds
    step = None if compute is None else compute + exposed
    if model.bucketed and (reduction not in (None, Reduction()) or compute is not None):  # the step model's figures
        nbytes, messages, times = _reduced(workload, topology, reduction or Reduction(), caps)
        comm, exposed = times.comm_seconds, times.exposed_seconds
        step = None if compute is None else times.step_seconds
    return Prediction(name, world_size, stages, micro_batches, nbytes, messages, comm, exposed, bubble, step)


def _reduced(
    work: Workload, topology: Topology, how: Reduction, caps: tuple[float, float]
) -> tuple[float, int, StepTimes]:
    """``(bytes, ring steps, the step)`` of a rank reducing ``work``'s buckets as ``how`` says: the bytes and steps
    as the reducers count them, the step the bucket flow shop's (with no compute, all communication exposed)."""
    buckets = ring_buckets(work.tensor_bytes or (work.gradient_bytes,), work.shapes, caps)
    nbytes, steps = buckets_traffic(buckets, topology, how)
    compute = work.compute_seconds or 0.0
    backward = min(work.backward_seconds or 0.0, compute)
    return nbytes, steps, buckets_step(buckets, compute, backward, topology, how, work.cpu)


def _check(
    model: CostModel, label: str, world_size: int, stages: int, micro_batches: int, reduction: Reduction | None
) -> None:
    """A clear error for arguments :func:`predict` cannot price."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1 (the number of devices), got {world_size!r}.")
    if stages < 1 or micro_batches < 1:
        raise ValueError(f"stages and micro_batches must be >= 1, got {stages} and {micro_batches}.")
    if not model.pipelined and (stages, micro_batches) != (1, 1):
        raise ValueError(
            f"stages and micro_batches apply to pipelined strategies such as 'hybrid_pipeline' only; leave them at 1 "
            f"for {label!r}."
        )
    if reduction is not None and not model.bucketed:
        raise ValueError(f"`reduction` applies to bucketed strategies such as 'ring_allreduce', not {model.name!r}.")
    if model.reducer is not None and reduction is None:
        raise ValueError(
            f"{label!r} reduces its buckets with {model.reducer}, which its cost model does not price: pass the "
            "reduction to price as `reduction=plan.Reduction(...)`, e.g. Reduction('bf16') for a bf16 compression or "
            "Reduction('powersgd', rank=4)."
        )
    if world_size % stages:
        raise ValueError(
            f"stages={stages} does not divide world_size={world_size}: the pipeline is replicated world_size/stages "
            f"times, so pick stages from {divisors(world_size)[:12]} or a world size that is a multiple of {stages}."
        )


def _topology(work: Workload, world_size: int, link: Link) -> Topology:
    """The workload's topology (one node of ``world_size`` processes on ``link`` without one), checked."""
    topology = work.topology or Topology(nodes=1, per_node=world_size, inter=link)
    if topology.world_size != world_size:
        raise ValueError(
            f"The workload's topology has {topology.nodes} x {topology.per_node} = {topology.world_size} processes "
            f"but world_size is {world_size}: predict at world_size={topology.world_size} or change the topology."
        )
    return topology


def _auto_reduction(
    choice: AutoChoice, work: Workload, topology: Topology, caps: tuple[float, float], label: str
) -> Reduction:
    """The reduction ``reducer="auto"`` would choose for ``work``: the candidate whose predicted step is the
    shortest (:func:`~lightning_dp_strategies.plan.auto.choose`, as the reducer chooses at run time)."""
    if work.compute_seconds is None:
        raise ValueError(
            f"{label!r} chooses its reduction by the step it predicts for each candidate: give the workload a "
            "`compute_seconds` (plan.measure_compute), or pass `reduction=plan.Reduction(...)` to price one."
        )
    candidates = choice.candidates(topology.nodes, topology.per_node)
    buckets = ring_buckets(work.tensor_bytes or (work.gradient_bytes,), work.shapes, caps)
    chosen, _ = choose(candidates, buckets, work.compute_seconds, work.backward_seconds or 0.0, topology, work.cpu)
    return candidates[chosen]


def plan(
    workload: Workload,
    link: Link,
    world_sizes: Sequence[int] = (8, 64, 512),
    strategies: Sequence[str | CostModel | type | object] = STRATEGIES,
    stages: int = 4,
    micro_batches: int = 16,
    bucket_cap_mb: float = 25.0,
    first_bucket_cap_mb: float = 1.0,
) -> list[Prediction]:
    """Predict every strategy at every world size: the table to read before renting 512 devices.

    ``stages`` and ``micro_batches`` apply to ``hybrid_pipeline``; the bucket caps (MiB) to the gradient buckets of
    ``ring_allreduce`` and ``hybrid_pipeline``.

    Examples:
        >>> from lightning_dp_strategies.plan import MiB
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
