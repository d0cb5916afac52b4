"""Two-level all-reduce for ranks on several nodes: inside each node, then across nodes between equal shards.

With ``n`` nodes of ``L`` processes each, a flat ring over all ``n L`` ranks sends ``2(nL-1)/(nL)`` of the tensor over
every link of the ring, and ``n`` of those links cross between nodes: each node sends almost twice the tensor over its
slow link. The two-level reduction sends only shards over it::

    1. reduce-scatter inside the node      each local rank l holds shard l of its node's sum     (fast link)
    2. all-reduce shard l across nodes     between the ranks with the same local rank l          (slow link)
    3. all-gather inside the node          every rank holds the whole reduced tensor             (fast link)

    2 nodes x 2 processes, tensor = shards a b:

    node 0: rank 0 [a0 b0]  rank 1 [a1 b1]       node 1: rank 2 [a2 b2]  rank 3 [a3 b3]
    1.      rank 0 b0+b1    rank 1 a0+a1                 rank 2 b2+b3    rank 3 a2+a3
    2.      rank 0 <-> rank 2: b*                        rank 1 <-> rank 3: a*
    3.      every rank a* b*

A rank sends ``2(L-1)/L`` of the tensor inside its node and ``2(n-1)/n`` of one shard (``1/L`` of the tensor) across
nodes, so a node sends ``2(n-1)/n`` of the tensor over its slow link in all: at 2 nodes x 2 processes, 1x the tensor
instead of the flat ring's 1.5x. Ranks are numbered node by node, as torchrun and Lightning number them
(``rank = node * L + local_rank``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor

from lightning_dp_strategies.comm.groups import new_group
from lightning_dp_strategies.comm.ops import CommCounter, ReduceOpLike, divide_, is_average
from lightning_dp_strategies.comm.ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter

__all__ = [
    "AcrossNodes",
    "NodeLayout",
    "TwoLevelGroups",
    "gather_in_node",
    "new_two_level_groups",
    "reduce_across_nodes",
    "reduce_in_node",
    "ring_across",
    "two_level_all_reduce",
]


@dataclass(frozen=True)
class NodeLayout:
    """Ranks ``ranks`` (global, ascending) on ``nodes`` nodes of ``per_node`` consecutive ranks each.

    Examples:
        >>> layout = NodeLayout(nodes=2, per_node=2)
        >>> layout.node_groups(), layout.shard_groups()
        ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
        >>> NodeLayout(nodes=2, per_node=2, ranks=(4, 5, 6, 7)).shard_groups()
        [[4, 6], [5, 7]]
        >>> NodeLayout(nodes=2, per_node=3, ranks=(0, 1, 2, 3))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: A layout of 2 nodes x 3 processes needs 6 ranks, got 4: ...
    """

    nodes: int
    per_node: int
    ranks: tuple[int, ...] = ()
    """The global ranks in order (default: ``0 .. nodes * per_node - 1``)."""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.per_node < 1:
            raise ValueError(f"A node layout needs nodes >= 1 and per_node >= 1, got {self.nodes} x {self.per_node}.")
        if not self.ranks:
            object.__setattr__(self, "ranks", tuple(range(self.nodes * self.per_node)))
        if len(self.ranks) != self.nodes * self.per_node:
            raise ValueError(
                f"A layout of {self.nodes} nodes x {self.per_node} processes needs {self.nodes * self.per_node} ranks, "
                f"got {len(self.ranks)}: every node must run the same number of processes."
            )

    def node_groups(self) -> list[list[int]]:
        """The ranks of each node, node by node."""
        return [list(self.ranks[n * self.per_node : (n + 1) * self.per_node]) for n in range(self.nodes)]

    def shard_groups(self) -> list[list[int]]:
        """For each local rank, the ranks that hold that shard on every node."""
        return [list(self.ranks[local :: self.per_node]) for local in range(self.per_node)]


@dataclass(frozen=True)
class TwoLevelGroups:
    """The groups of a layout, every node's and every shard's (torch's placeholder where this rank is not a member),
    and this rank's among them: its node's (``intra``), a second one over the same ranks for the all-gather
    (``gather``, so that a bucket's all-gather and the next bucket's reduce-scatter may run at the same time without
    mixing their messages), and its shard's across nodes (``inter``)."""

    layout: NodeLayout
    made: list[dist.ProcessGroup]
    intra: dist.ProcessGroup | None
    gather: dist.ProcessGroup | None
    inter: dist.ProcessGroup | None
    inters: list[dist.ProcessGroup]
    """Every shard's group, in ``layout.shard_groups()`` order (a reducer across nodes sets itself up on each)."""


def new_two_level_groups(layout: NodeLayout, backend: str | None = None) -> TwoLevelGroups:
    """Make every node's two groups and every shard's group. Collective over the world: call it on every rank (also
    ranks outside ``layout.ranks``), in the same order, as for any ``dist.new_group``."""
    rank = dist.get_rank()

    def mine(groups: list[dist.ProcessGroup], members: list[list[int]]) -> dist.ProcessGroup | None:
        return next((g for g, r in zip(groups, members, strict=True) if rank in r), None)

    nodes = [new_group(ranks, backend) for ranks in layout.node_groups()]
    gathers = [new_group(ranks, backend) for ranks in layout.node_groups()]
    shards = [new_group(ranks, backend) for ranks in layout.shard_groups()]
    return TwoLevelGroups(
        layout,
        [*nodes, *gathers, *shards],
        mine(nodes, layout.node_groups()),
        mine(gathers, layout.node_groups()),
        mine(shards, layout.shard_groups()),
        shards,
    )


AcrossNodes = Callable[[Tensor, "dist.ProcessGroup | None", CommCounter], None]
"""``across(shard, inter_group, counter)``: sum ``shard`` in place over the ranks of ``inter_group``."""


def ring_across(shard: Tensor, group: dist.ProcessGroup | None, counter: CommCounter) -> None:
    """The default hop across nodes: a ring all-reduce (sum) of the shard."""
    ring_all_reduce(shard, "sum", group, counter)


def reduce_in_node(chunks: list[Tensor], groups: TwoLevelGroups, counter: CommCounter) -> int:
    """Phase 1: a ring reduce-scatter of ``chunks`` (one per process of the node) inside the node; returns the index
    of the chunk this rank now holds summed over its node."""
    return ring_reduce_scatter(chunks, groups.intra, counter) if groups.layout.per_node > 1 else 0


def reduce_across_nodes(shard: Tensor, groups: TwoLevelGroups, counter: CommCounter, across: AcrossNodes) -> None:
    """Phase 2: ``shard`` summed over the ranks that hold it on every node; counted as sent across nodes."""
    if groups.layout.nodes > 1:
        sent = CommCounter()
        across(shard, groups.inter, sent)
        counter.add(CommCounter(sent.bytes_sent, sent.messages, 0, sent.seconds, inter_node_bytes=sent.bytes_sent))


def gather_in_node(chunks: list[Tensor], groups: TwoLevelGroups, counter: CommCounter) -> None:
    """Phase 3: a ring all-gather of the node's summed chunks, over the node's second group."""
    if groups.layout.per_node > 1:
        ring_all_gather(chunks, groups.gather, counter)


def two_level_all_reduce(
    tensor: Tensor,
    op: ReduceOpLike,
    groups: TwoLevelGroups,
    counter: CommCounter | None = None,
    across: AcrossNodes = ring_across,
) -> Tensor:
    """Reduce ``tensor`` in place over ``groups.layout``'s ranks: a ring reduce-scatter inside the node, this rank's
    shard summed across nodes (``across``: a ring all-reduce, or a compressing reducer), a ring all-gather inside
    the node.

    Args:
        tensor: a contiguous tensor of the same shape and dtype on every rank.
        op: ``"sum"`` or ``"avg"`` (the average divides once, at the end).
        groups: from :func:`new_two_level_groups`.
        counter: receives everything this rank sent, what it sent across nodes also in ``inter_node_bytes``.
        across: sums a shard over the ranks that hold it on every node.

    Returns:
        ``tensor``, now holding the reduction.
    """
    counter = counter if counter is not None else CommCounter()
    chunks = list(tensor.view(-1).tensor_split(groups.layout.per_node))
    owned = reduce_in_node(chunks, groups, counter)
    reduce_across_nodes(chunks[owned], groups, counter, across)
    gather_in_node(chunks, groups, counter)
    counter.operations += 1
    if is_average(op):
        divide_(tensor, groups.layout.nodes * groups.layout.per_node)
    return tensor
