"""Collectives on ``torch.distributed`` point-to-point operations; knows nothing of Lightning.

- :mod:`.ops`: the reduction names, the counter of bytes and messages, averaging that is exact and fast.
- :mod:`.ring`: ring reduce-scatter, all-gather and all-reduce, and the reference all-reduce they are tested against.
"""

from lightning_dp_strategies.comm import ops, ring
from lightning_dp_strategies.comm.ops import CommCounter as CommCounter
from lightning_dp_strategies.comm.ops import ReduceOpLike as ReduceOpLike
from lightning_dp_strategies.comm.ops import divide as divide
from lightning_dp_strategies.comm.ops import divide_ as divide_
from lightning_dp_strategies.comm.ops import is_average as is_average
from lightning_dp_strategies.comm.ring import new_duplex_group as new_duplex_group
from lightning_dp_strategies.comm.ring import reference_all_reduce as reference_all_reduce
from lightning_dp_strategies.comm.ring import ring_all_gather as ring_all_gather
from lightning_dp_strategies.comm.ring import ring_all_reduce as ring_all_reduce
from lightning_dp_strategies.comm.ring import ring_reduce_scatter as ring_reduce_scatter
from lightning_dp_strategies.comm.ring import ring_workspace_numel as ring_workspace_numel

__all__ = [*ops.__all__, *ring.__all__]
