"""The two-level reducer: each bucket reduced inside the node, across nodes, inside the node again.

See :mod:`lightning_dp_strategies.comm.two_level` for the algorithm and what it saves on the link between nodes. The
hop across nodes goes through another reducer (``inter_node``: the ring by default), so a compression wrapper such as
``bf16_compress("ring")`` compresses exactly the traffic that crosses the slow link.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_dp_strategies.comm import CommCounter, divide_
from lightning_dp_strategies.comm.two_level import (
    NodeLayout,
    TwoLevelGroups,
    gather_in_node,
    new_two_level_groups,
    reduce_across_nodes,
    reduce_in_node,
)
from lightning_dp_strategies.reducers.base import GradBucket, Reducer, ReducerBase, as_reducer, completed
from lightning_dp_strategies.reducers.builtin import resolve_reducer
from lightning_dp_strategies.reducers.thread import CommThread

__all__ = ["TwoLevelReducer"]


class TwoLevelReducer(ReducerBase):
    """Reduce each bucket over ``per_node`` consecutive ranks a node, then across nodes, then inside the node.

    A bucket is cut into pieces of at most ``piece_mb`` MiB, and the three phases run on three threads, one phase
    each, pieces in launch order on every thread: while piece ``k`` crosses the link between nodes, piece ``k+1`` is
    reduced inside the node and piece ``k-1`` gathered, so the slow link and the fast one are busy at the same time,
    also within one large bucket. Each phase has its own process group (the node's
    all-gather a second group over the node), so the order of messages on every group is the launch order on every
    rank, whatever the timing.

    Args:
        per_node: processes on every node (ranks are numbered node by node, as torchrun numbers them).
        inter_node: the reducer of the hop across nodes: a name (``"ring"``, the default, or ``"native"``) or a
            reducer such as ``bf16_compress("ring")``. It sums one shard (``1/per_node`` of the bucket) over the ranks
            that hold it, one per node.
        piece_mb: the largest piece of a bucket that goes through the phases at once, in MiB (default 4).

    Its :meth:`setup` makes the groups (collective over the world, as every reducer's setup). What a bucket sent
    across nodes is counted in its counter's ``inter_node_bytes``.

    Examples:
        >>> import torch
        >>> reducer = TwoLevelReducer(per_node=2)
        >>> reducer(GradBucket(torch.ones(4))).wait()  # one process (no setup): nothing to exchange
        tensor([1., 1., 1., 1.])
        >>> reducer.close()
    """

    def __init__(self, per_node: int, inter_node: str | Reducer | None = None, piece_mb: float = 4.0) -> None:
        if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1:
            raise ValueError(f"`per_node` must be the number of processes on each node (>= 1), got {per_node!r}.")
        if not piece_mb > 0:
            raise ValueError(f"`piece_mb` must be a positive number of MiB, got {piece_mb!r}.")
        self.per_node = per_node
        self.piece_mb = float(piece_mb)
        self.inter_node: ReducerBase = as_reducer(resolve_reducer(inter_node))
        self._groups: dict[object, TwoLevelGroups] = {}  # the group a bucket names -> its two levels
        self._made: list[dist.ProcessGroup] = []
        self._phases = [CommThread(f"ldps-two-level-{phase}") for phase in ("in", "across", "gather")]

    def setup(self, group: dist.ProcessGroup | None, ranks: Sequence[int], backend: str | None = None) -> None:
        """Make the node and shard groups over ``ranks``, and the inter-node reducer's own groups, on every rank."""
        if len(ranks) % self.per_node:
            raise ValueError(
                f"{len(ranks)} ranks do not split into nodes of {self.per_node} processes: every node must run the "
                "same number of processes (torchrun --nproc-per-node, Trainer(devices=...))."
            )
        layout = NodeLayout(len(ranks) // self.per_node, self.per_node, tuple(ranks))
        groups = new_two_level_groups(layout, backend)
        self._made += groups.made
        for shard_group, shard_ranks in zip(groups.inters, layout.shard_groups(), strict=True):
            self.inter_node.setup(shard_group, list(shard_ranks), backend)
        if dist.get_rank() in ranks:
            self._groups[group] = groups

    def __call__(self, bucket: GradBucket) -> Future[Tensor]:
        groups = self._groups.get(bucket.group)
        buffer = bucket.buffer
        if bucket.world_size == 1:
            return completed(buffer)
        if groups is None:
            raise RuntimeError(
                "TwoLevelReducer was handed a bucket over a process group it was not set up for: call "
                "`setup_reducer(reducer, group, ranks)` on every rank, for every group it will reduce over, first."
            )
        flat = buffer.view(-1)
        pieces = max(1, math.ceil(flat.numel() * flat.element_size() / (self.piece_mb * 2**20)))
        futures = [self._submit(bucket, piece, groups) for piece in flat.tensor_split(pieces)]

        def all_done(last: Future[Tensor]) -> Tensor:
            for future in futures:
                future.value()  # an earlier piece's error reaches the waiter
            bucket.counter.operations += 1
            return buffer

        return futures[-1].then(all_done)

    def _submit(self, bucket: GradBucket, piece: Tensor, groups: TwoLevelGroups) -> Future[Tensor]:
        """The three phases of one piece of a bucket, each on its phase's thread."""
        chunks = list(piece.tensor_split(groups.layout.per_node))
        counters = [CommCounter() for _ in self._phases]  # one per thread, added up by the last phase
        owned: list[int] = []

        def reduce_in() -> Tensor:
            owned.append(reduce_in_node(chunks, groups, counters[0]))
            return piece

        def across() -> Tensor:
            reduced.wait()
            hop = functools.partial(self._across, bucket.index)
            reduce_across_nodes(chunks[owned[0]], groups, counters[1], hop)
            return piece

        def gather() -> Tensor:
            crossed.wait()
            gather_in_node(chunks, groups, counters[2])
            for counter in counters:
                bucket.counter.add(counter)
            if bucket.op == "avg":
                divide_(piece, groups.layout.nodes * groups.layout.per_node)
            return piece

        device = piece.device
        reduced = self._phases[0].submit(reduce_in, device)
        crossed = self._phases[1].submit(across, device)
        return self._phases[2].submit(gather, device)

    def _across(self, index: int, shard: Tensor, group: dist.ProcessGroup | None, counter: CommCounter) -> None:
        self.inter_node(GradBucket(shard, group=group, counter=counter, index=index, op="sum")).wait()

    def close(self) -> None:
        """Stop the threads, close the inter-node reducer and destroy the groups :meth:`setup` made."""
        for thread in self._phases:
            thread.close()
        self.inter_node.close()
        if dist.is_available() and dist.is_initialized():
            for group in self._made:
                if isinstance(group, dist.ProcessGroup):
                    dist.destroy_process_group(group)
        self._made, self._groups = [], {}
