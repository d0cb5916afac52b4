"""Measure a link on the live process group: a short ring exchange at a few sizes, fitted to a latency and a bandwidth.

Every rank of the group sends ``nbytes`` to the next rank while it receives as many from the previous one (the
pattern of one ring step), a few times at each size; the slowest rank's median time of each size, the same on every
rank, is fitted with :meth:`~lightning_dp_strategies.plan.Link.fit`. Between nodes, give it a group of one rank a
node (each node's link then carries one stream each way, as a flat ring's does); inside a node, the node's ranks.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from lightning_dp_strategies.plan import Link

__all__ = ["PROBE_SIZES", "probe_link"]

PROBE_SIZES = (256 * 1024, 4 * 1024 * 1024, 16 * 1024 * 1024)
"""Bytes per message of the default probe: about half a second over 1 GbE, and large enough that a shaped link's
burst allowance does not pass for bandwidth."""


def _exchange_seconds(nbytes: int, group: dist.ProcessGroup | None, nxt: int, prv: int) -> float:
    send = torch.zeros(max(1, nbytes // 4))
    recv = torch.empty_like(send)
    start = time.perf_counter()
    works = [dist.irecv(recv, prv, group=group), dist.isend(send, nxt, group=group)]
    for work in works:
        if work is not None:  # None: this rank is outside the group, which probe_link refuses before
            work.wait()
    return time.perf_counter() - start


def probe_link(group: dist.ProcessGroup | None = None, sizes: Sequence[int] = PROBE_SIZES, repeats: int = 3) -> Link:
    """The :class:`~lightning_dp_strategies.plan.Link` between neighbouring ranks of ``group`` (default: the world).

    Collective: call it on every rank of ``group``. Every rank returns the same link. With one rank there is nothing
    to measure: ``ValueError``.

    Examples:
        >>> import torch.distributed as dist
        >>> link = probe_link(dist.new_group([0, 1]))  # doctest: +SKIP
        >>> link.bandwidth_bytes_per_s / 1e6  # doctest: +SKIP
        118.7
    """
    size = dist.get_world_size(group)
    if size < 2:
        raise ValueError("probe_link needs a group of two or more ranks: there is no link to measure in one.")
    rank = dist.get_rank(group)
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    if group is not None and group is not dist.GroupMember.WORLD:
        nxt, prv = dist.get_global_rank(group, nxt), dist.get_global_rank(group, prv)
    _exchange_seconds(min(sizes), group, nxt, prv)  # connect first: the first message pays the handshake
    medians = [statistics.median(_exchange_seconds(n, group, nxt, prv) for _ in range(repeats)) for n in sizes]
    slowest = torch.tensor(medians, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return Link.fit([(1, 4 * max(1, n // 4), t) for n, t in zip(sizes, slowest.tolist(), strict=True)])
