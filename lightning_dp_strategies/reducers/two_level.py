"""The two-level reducer: each bucket reduced inside the node, across nodes, inside the node again.

See :mod:`lightning_dp_strategies.comm.two_level` for the algorithm and what it saves on the link between nodes. The
hop across nodes goes through another reducer (``inter_node``: the ring by default), so a compression wrapper such as
``bf16_compress("ring")`` compresses exactly the traffic that crosses the slow link.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_dp_strategies.comm import CommCounter
from lightning_dp_strategies.comm.two_level import (
    NodeLayout,
    TwoLevelGroups,
    new_two_level_groups,
    two_level_all_reduce,
)
from lightning_dp_strategies.reducers.base import GradBucket, Reducer, close_reducer, setup_reducer
from lightning_dp_strategies.reducers.builtin import resolve_reducer
from lightning_dp_strategies.reducers.thread import CommThread

__all__ = ["TwoLevelReducer"]


class TwoLevelReducer:
    """Reduce each bucket over ``per_node`` consecutive ranks a node, then across nodes, then inside the node.

    Args:
        per_node: processes on every node (ranks are numbered node by node, as torchrun numbers them).
        inter_node: the reducer of the hop across nodes: a name (``"ring"``, the default, or ``"native"``) or a
            reducer such as ``bf16_compress("ring")``. It sums one shard (``1/per_node`` of the bucket) over the ranks
            that hold it, one per node.

    Its :meth:`setup` makes every node's group and every shard's group (collective over the world, as every
    reducer's setup). What a bucket sent across nodes is counted in its counter's ``inter_node_bytes``.

    Examples:
        >>> import torch
        >>> reducer = TwoLevelReducer(per_node=2)
        >>> reducer(GradBucket(torch.ones(4))).wait()  # one process (no setup): nothing to exchange
        tensor([1., 1., 1., 1.])
        >>> reducer.close()
    """

    def __init__(self, per_node: int, inter_node: str | Reducer | None = None) -> None:
        if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1:
            raise ValueError(f"`per_node` must be the number of processes on each node (>= 1), got {per_node!r}.")
        self.per_node = per_node
        self.inter_node = resolve_reducer(inter_node)
        self._groups: dict[object, TwoLevelGroups] = {}  # the group a bucket names -> its two levels
        self._made: list[dist.ProcessGroup] = []
        self._thread = CommThread("ldps-two-level")

    def setup(self, group: dist.ProcessGroup | None, ranks: Sequence[int], backend: str | None = None) -> None:
        """Make the node and shard groups over ``ranks``, and the inter-node reducer's own groups, on every rank."""
        if len(ranks) % self.per_node:
            raise ValueError(
                f"{len(ranks)} ranks do not split into nodes of {self.per_node} processes: every node must run the "
                "same number of processes (torchrun --nproc-per-node, Trainer(devices=...))."
            )
        layout = NodeLayout(len(ranks) // self.per_node, self.per_node, tuple(ranks))
        groups = new_two_level_groups(layout, backend)
        self._made += groups.all()
        for shard_group, shard_ranks in zip(groups.shards, layout.shard_groups(), strict=True):
            setup_reducer(self.inter_node, shard_group, shard_ranks, backend)
        if dist.get_rank() in ranks:
            self._groups[group] = groups

    def __call__(self, bucket: GradBucket) -> Future[Tensor]:
        return self._thread.submit(functools.partial(self.reduce, bucket), bucket.buffer.device)

    def reduce(self, bucket: GradBucket) -> Tensor:
        """Reduce ``bucket`` now, in the calling thread; returns its buffer."""
        groups = self._groups.get(bucket.group)
        if groups is None or bucket.world_size == 1:
            return bucket.buffer
        across = functools.partial(self._across, bucket.index)
        return two_level_all_reduce(bucket.buffer, bucket.op, groups, bucket.counter, across)

    def _across(self, index: int, shard: Tensor, group: dist.ProcessGroup | None, counter: CommCounter) -> None:
        self.inter_node(GradBucket(shard, group=group, counter=counter, index=index, op="sum")).wait()

    def close(self) -> None:
        """Stop the thread, close the inter-node reducer and destroy the groups :meth:`setup` made."""
        self._thread.close()
        close_reducer(self.inter_node)
        if dist.is_available() and dist.is_initialized():
            for group in self._made:
                if isinstance(group, dist.ProcessGroup):
                    dist.destroy_process_group(group)
        self._made, self._groups = [], {}
