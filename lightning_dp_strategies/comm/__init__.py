"""Collectives on ``torch.distributed`` point-to-point operations; knows nothing of Lightning.

- :mod:`.ops`: the reduction names, the counter of bytes and messages, averaging that is exact and fast.
- :mod:`.ring`: ring reduce-scatter, all-gather and all-reduce, and the reference all-reduce they are tested against.
- :mod:`.streamed`: the ring all-reduce as one stream of messages, the path :func:`ring_all_reduce` takes on gloo.
- :mod:`.shards`: the ring's two halves on their own (each rank owns one reduced chunk in between), for sharded
  optimizer state.
- :mod:`.two_level`: the all-reduce for several nodes: inside each node, across nodes by shard, inside again.
- :mod:`.quantized`: a low-bit all-reduce (8 or 4 bits a value, a scale a block, summed in fp32) on any backend.
- :mod:`.clipping`: gradient clipping by the global 2-norm of gradients spread over ranks (pipeline stages, ZeRO).
- :mod:`.probe`: a link's latency and bandwidth, measured on the live process group.
- :mod:`.failures`: what a failed collective most likely means, logged on the rank that sees it.
- :mod:`.groups`: process groups that time out as the default group does (torch gives a new one 30 minutes).
"""

from lightning_dp_strategies.comm import clipping, ops, quantized, ring, shards
from lightning_dp_strategies.comm.clipping import clip_grad_norm_across as clip_grad_norm_across
from lightning_dp_strategies.comm.ops import (
    CommCounter as CommCounter,
    ReduceOpLike as ReduceOpLike,
    divide as divide,
    divide_ as divide_,
    is_average as is_average,
)
from lightning_dp_strategies.comm.quantized import (
    QUANTIZED_BITS as QUANTIZED_BITS,
    Quantized as Quantized,
    dequantize as dequantize,
    error_bound as error_bound,
    quantize as quantize,
    quantized_all_reduce as quantized_all_reduce,
)
from lightning_dp_strategies.comm.ring import (
    new_duplex_group as new_duplex_group,
    reference_all_reduce as reference_all_reduce,
    ring_all_gather as ring_all_gather,
    ring_all_reduce as ring_all_reduce,
    ring_reduce_scatter as ring_reduce_scatter,
    ring_workspace_numel as ring_workspace_numel,
)
from lightning_dp_strategies.comm.shards import (
    chunk_range as chunk_range,
    owned_chunk as owned_chunk,
    ring_all_gather_flat as ring_all_gather_flat,
    ring_reduce_scatter_flat as ring_reduce_scatter_flat,
)

__all__ = [*clipping.__all__, *ops.__all__, *quantized.__all__, *ring.__all__, *shards.__all__]
