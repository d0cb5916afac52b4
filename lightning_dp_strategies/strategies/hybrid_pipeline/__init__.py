"""``hybrid_pipeline``: pipeline stages across ranks x data-parallel replicas of the pipeline.

- :mod:`.strategy`: the Lightning strategy, its lifecycle and orchestration;
- :mod:`.config`: its options, validated;
- :mod:`.opt_in`: what a LightningModule adds to be pipelined, and how a batch splits into inputs and target;
- :mod:`.precision`: the view of Lightning's precision plugin that clips by the norm over every stage.
- :mod:`.summary`: Lightning's model summary of the pipelined module (whole-model counts, this stage's share).

The layout (mesh, ownership, the stage's blocks), schedules, partition, micro-batching and the whole-model checkpoint
need no Lightning and live in :mod:`lightning_dp_strategies.pipeline`.
"""

from lightning_dp_strategies.pipeline.runner import PipelineStats
from lightning_dp_strategies.strategies.hybrid_pipeline.config import HybridPipelineConfig
from lightning_dp_strategies.strategies.hybrid_pipeline.strategy import HybridPipelineStrategy

__all__ = ["HybridPipelineConfig", "HybridPipelineStrategy", "PipelineStats"]
