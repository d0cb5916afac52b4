"""The cost model: a strategy's per-step communication, exposed time and pipeline bubble at any world size.

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
    local_sgd         (a LocalSGDStrategy instance's own) every H steps, K fragments of the change in turns, each a
                      ring all-reduce of gradient_bytes / K at the outer precision's bytes a value; a share 1/H a step
                      t = K * (2(N-1) * alpha + 2(N-1)/N * gradient_bytes * bytes_a_value / 4 / K / beta) / H

The ring's gradient reduction may hide behind backward: given ``Workload.backward_seconds``, the exposed time is
``max(0, comm - backward_seconds)``, otherwise all of it. Given also a measured ``Workload.compute_seconds``, a
prediction has a ``step_seconds``: for the ring, a flow shop of its buckets through the reduction's phases (one or two
levels, a compression) on a :class:`Topology` of nodes and links, with the CPU's per-byte costs
(:mod:`lightning_dp_strategies.plan.step`); for the others, compute plus the exposed time. The pipeline's is priced
as fully exposed, an upper bound: ``hybrid_pipeline`` starts each stage's reduction inside the schedule, at that
stage's last backward, so part of it overlaps the drain. Local SGD's reduction is exposed without a delay; with a
delay of d steps only what outlasts d steps of ``compute_seconds`` is (``sync_every="auto"``: at the period the
strategy would choose from these predictions). Contention and congestion are not modelled; a node's link
is shared by the streams that cross it at once.

=====================  ===================================================================
module                 what it holds
=====================  ===================================================================
``plan.sizing``        bucket boundaries, ring bytes per rank, divisors
``plan.link``          :class:`Link`: latency and bandwidth, fitted, or nominal
``plan.cluster``       :class:`Topology` (nodes, processes a node, links), :class:`CpuCosts`
``plan.model``         :class:`Workload`, :class:`Prediction`
``plan.step``          :func:`ring_step`: the bucketed ring's step, :class:`Reduction`
``plan.measure``       :func:`measure_compute`: one rank's step without communication
``plan.formulas``      :class:`CostModel` and one formula per strategy
``plan.streaming``     streaming DiLoCo's bytes a value per outer precision, and its ``"auto"`` period's choice
``plan.auto``          ``reducer="auto"``'s candidates and choice, at run time and in :func:`predict`
``plan.predict``       :func:`predict`, :func:`plan`, :func:`cost_model_of`
``plan.compression``   :func:`compression_pays`: when a compressed reducer beats the plain one
``plan.tables``        :func:`format_table`, :func:`text_table`
=====================  ===================================================================
"""

from lightning_dp_strategies.plan.auto import AutoChoice
from lightning_dp_strategies.plan.cluster import CpuCosts, Topology
from lightning_dp_strategies.plan.compression import CompressionVerdict, compression_pays, payload_bytes
from lightning_dp_strategies.plan.formulas import (
    COST_MODELS,
    HYBRID_PIPELINE,
    RING_ALLREDUCE,
    SCATTER_GATHER,
    STRATEGIES,
    CostModel,
)
from lightning_dp_strategies.plan.link import Link
from lightning_dp_strategies.plan.measure import ComputeTimes, measure_compute
from lightning_dp_strategies.plan.model import Prediction, Workload, bucket_count
from lightning_dp_strategies.plan.predict import cost_model_of, plan, predict
from lightning_dp_strategies.plan.sizing import MiB, bucket_boundaries, divisors, ring_bytes_per_rank
from lightning_dp_strategies.plan.step import (
    COMPRESSIONS,
    Reduction,
    StepTimes,
    buckets_step,
    buckets_traffic,
    ring_buckets,
    ring_step,
)
from lightning_dp_strategies.plan.tables import format_table, text_table

__all__ = [
    "COMPRESSIONS",
    "COST_MODELS",
    "HYBRID_PIPELINE",
    "RING_ALLREDUCE",
    "SCATTER_GATHER",
    "STRATEGIES",
    "AutoChoice",
    "CompressionVerdict",
    "ComputeTimes",
    "CostModel",
    "CpuCosts",
    "Link",
    "MiB",
    "Prediction",
    "Reduction",
    "StepTimes",
    "Topology",
    "Workload",
    "bucket_boundaries",
    "bucket_count",
    "buckets_step",
    "buckets_traffic",
    "compression_pays",
    "cost_model_of",
    "divisors",
    "format_table",
    "measure_compute",
    "payload_bytes",
    "plan",
    "predict",
    "ring_buckets",
    "ring_bytes_per_rank",
    "ring_step",
    "text_table",
]
