"""A reducer that makes the process group it needs in its setup step: a dedicated group per bucket group.

The strategies call ``setup(group, ranks, backend)`` on every rank, once per group they average over (a rank outside
``ranks`` too: ``dist.new_group`` is collective over the world), before the first bucket; ``close()`` at teardown.
Both are optional steps of ``ReducerBase``, overridden here. A hierarchical reducer would make its intra- and
inter-node groups here the same way.
"""

from collections.abc import Sequence

import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_dp_strategies import GradBucket, RingAllReduceStrategy
from lightning_dp_strategies.reducers import ReducerBase


class OwnGroupReducer(ReducerBase):
    """Sums each bucket with the backend's all-reduce over a group of its own, made in ``setup``."""

    def __init__(self) -> None:
        self.groups: dict[object, dist.ProcessGroup] = {}  # the strategy's group -> the one made for it

    def setup(self, group: dist.ProcessGroup | None, ranks: Sequence[int], backend: str | None = None) -> None:
        mine = dist.new_group(list(ranks), backend=backend)  # every rank calls this, member or not
        if dist.get_rank() in ranks:
            self.groups[group] = mine

    def __call__(self, bucket: GradBucket) -> Future[Tensor]:
        work = dist.all_reduce(bucket.buffer, group=self.groups[bucket.group], async_op=True)
        buffer, average, world = bucket.buffer, bucket.op == "avg", bucket.world_size

        def done(reduced: Future[list[Tensor]]) -> Tensor:
            reduced.value()  # raises if the all-reduce failed (a callback runs either way)
            return buffer.div_(world) if average else buffer

        return work.get_future().then(done)

    def close(self) -> None:
        for mine in self.groups.values():
            dist.destroy_process_group(mine)
        self.groups = {}


strategy = RingAllReduceStrategy(reducer=OwnGroupReducer())
