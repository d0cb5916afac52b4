"""Pipeline parallelism on plain ``torch.distributed``: partition, micro-batching, schedules, measurement.

Nothing here imports Lightning; :class:`~lightning_dp_strategies.strategies.HybridPipelineStrategy` puts it
together with the data-parallel gradient buckets.

- :mod:`.partition`: cut a sequence of blocks into contiguous stages (explicit balance, by parameters, by time).
- :mod:`.microbatch`: how a batch is cut into equal micro-batches, and the checks before training.
- :mod:`.schedule`: GPipe, 1F1B, and the interleaved and zero-bubble schedules with several chunks per rank: a pure
  clock-table model of each and the glue to ``torch.distributed.pipelining``.
- :mod:`.orders`: the schedules by name: the checks, which rank runs which chunk, each rank's order of actions.
- :mod:`.clock`: the clock-table model of the schedules: one step tick by tick, its bubble and activations held.
- :mod:`.runner`: one rank's side of a pipeline step, with the measured bubble.
- :mod:`.memory`: activation memory measured with saved-tensor hooks (any device).
- :func:`clip_grad_norm_across` (from :mod:`~lightning_dp_strategies.comm.clipping`): gradient clipping by the global
  norm across stages.
- :mod:`.layout`: where a rank sits in the stages x replicas mesh, what it owns, and its stage's blocks.
- :mod:`.state`: optimizer state of the stages <-> one state dict of the whole model.
- :mod:`.checkpoint`: the whole model's checkpoint from the stages' parts, and each stage's part of one.
- :mod:`.activations`: what travels between blocks and stages (a tensor or a tuple of tensors), and the fake-tensor
  check of a body.
- :mod:`.materialize`: deferred initialization, each stage allocating and initializing only its own blocks.
- :mod:`.placement`: which rank holds which blocks with storage; blocks sent to the ranks that need them, and back to
  rank 0 after a run.
- :mod:`.streamed`: a whole-model checkpoint written by one rank while the others send their tensors one at a time.
"""

from lightning_dp_strategies.comm.clipping import clip_grad_norm_across
from lightning_dp_strategies.pipeline.clock import (
    clock_table,
    gpipe_bubble,
    schedule_bubble,
    table_bubble,
    table_in_flight,
)
from lightning_dp_strategies.pipeline.materialize import has_meta, materialize
from lightning_dp_strategies.pipeline.memory import ActivationMeter
from lightning_dp_strategies.pipeline.microbatch import check_micro_batches, effective_micro_batches
from lightning_dp_strategies.pipeline.orders import (
    LOOPED,
    SCHEDULES,
    SPLIT_BACKWARD,
    V_SHAPED,
    check_schedule,
    chunk_ranks,
    default_virtual_stages,
    effective_schedule,
    rank_order,
    schedule_micro_batches,
    stage_order,
)
from lightning_dp_strategies.pipeline.partition import (
    balance_by_parameters,
    balance_by_time,
    balance_costs,
    check_balance,
    stage_ranges,
)
from lightning_dp_strategies.pipeline.runner import LossFn, PipelineRunner, StepResult, StepStats
from lightning_dp_strategies.pipeline.schedule import make_schedule
from lightning_dp_strategies.pipeline.state import (
    full_group_names,
    keep_owned_parameters,
    merge_optimizer_states,
    name_optimizer_state,
    select_optimizer_state,
)

__all__ = [
    "LOOPED",
    "SCHEDULES",
    "SPLIT_BACKWARD",
    "V_SHAPED",
    "ActivationMeter",
    "LossFn",
    "PipelineRunner",
    "StepResult",
    "StepStats",
    "balance_by_parameters",
    "balance_by_time",
    "balance_costs",
    "check_balance",
    "check_micro_batches",
    "check_schedule",
    "chunk_ranks",
    "clip_grad_norm_across",
    "clock_table",
    "default_virtual_stages",
    "effective_micro_batches",
    "effective_schedule",
    "full_group_names",
    "gpipe_bubble",
    "has_meta",
    "keep_owned_parameters",
    "make_schedule",
    "materialize",
    "merge_optimizer_states",
    "name_optimizer_state",
    "rank_order",
    "schedule_bubble",
    "schedule_micro_batches",
    "select_optimizer_state",
    "stage_order",
    "stage_ranges",
    "table_bubble",
    "table_in_flight",
]
