"""``hybrid_pipeline``: pipeline stages across ranks x data-parallel replicas of the pipeline.

- :mod:`.strategy`: the Lightning strategy, its lifecycle (setup and teardown) over the collaborators below;
- :mod:`.config`: its options, validated;
- :mod:`.refusals`: what it refuses to run, each with the fix in its message;
- :mod:`.placement`: stage placement (partition, balance, the owned blocks, the return to rank 0);
- :mod:`.driver`: the step driver (the schedule, pending gradients, the overlapped data-parallel reduction);
- :mod:`.steps`: Lightning's step hooks (``training_step``, ``backward``, evaluation) over the driver, its
  collectives (over the data-parallel group or every rank) and clipping by the norm over every stage;
- :mod:`.checkpointer`: the whole-model checkpoint, streamed between an explicit begin and finish;
- :mod:`.collectives`: the groups and votes those collectives use, and the metrics' groups;
- :mod:`.opt_in`: what a LightningModule adds to be pipelined, and how a batch splits into inputs and target;
- :mod:`.summary`: Lightning's model summary of the pipelined module (whole-model counts, this stage's share).

The layout (mesh, ownership, the stage's blocks), schedules, partition, micro-batching and the whole-model checkpoint
need no Lightning and live in :mod:`lightning_dp_strategies.pipeline`.
"""

from lightning_dp_strategies.pipeline.runner import PipelineStats
from lightning_dp_strategies.strategies.hybrid_pipeline.config import HybridPipelineConfig
from lightning_dp_strategies.strategies.hybrid_pipeline.strategy import HybridPipelineStrategy

__all__ = ["HybridPipelineConfig", "HybridPipelineStrategy", "PipelineStats"]
