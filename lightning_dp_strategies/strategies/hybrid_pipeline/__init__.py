"""``hybrid_pipeline``: pipeline stages across ranks x data-parallel replicas of the pipeline.

- :mod:`.strategy`: the Lightning strategy, its lifecycle and orchestration;
- :mod:`.layout`: the mesh and what each rank owns;
- :mod:`.opt_in`: what a LightningModule adds to be pipelined, and how a batch splits into inputs and target.

The schedules, partition, micro-batching and whole-model state merging it uses need no Lightning and live in
:mod:`lightning_dp_strategies.pipeline`.
"""

from lightning_dp_strategies.strategies.hybrid_pipeline.strategy import HybridPipelineStrategy, PipelineStats

__all__ = ["HybridPipelineStrategy", "PipelineStats"]
