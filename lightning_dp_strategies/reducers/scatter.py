"""``ScatterReducer``: a bucket reduce-scattered instead of all-reduced, for sharded optimizer state (ZeRO).

After a bucket's reduction each rank holds the average of its own chunk of the gradients (see
:mod:`lightning_dp_strategies.comm.shards`) and every rank holds the summed presence flags; the rest of the buffer
holds partial sums and must not be read. The optimizer steps the owned chunks, and :meth:`ScatterReducer.all_gather`
sends the updated parameters back round the ring: the same bytes as an all-reduce of the gradients, in two halves.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_dp_strategies.comm import (
    CommCounter,
    is_average,
    ring_all_gather_flat,
    ring_reduce_scatter_flat,
    ring_workspace_numel,
)
from lightning_dp_strategies.plan.sizing import ring_bytes_per_rank
from lightning_dp_strategies.reducers.base import GradBucket
from lightning_dp_strategies.reducers.builtin import RingReducer

__all__ = ["ScatterReducer"]


class ScatterReducer(RingReducer):
    """Reduce-scatters each bucket's gradients and sums its presence flags, on the ring reducer's thread.

    Its :attr:`scatters` tells :class:`~lightning_dp_strategies.bucketing.GradientBuckets` that only this rank's
    chunk of the gradients is reduced, so it leaves ``.grad`` of the bucket's parameters unset after backward.

    Examples:
        >>> reducer = ScatterReducer()
        >>> reducer(GradBucket(torch.arange(5.0), num_flags=1)).wait()  # one process: nothing to exchange
        tensor([0., 1., 2., 3., 4.])
        >>> reducer.close()
    """

    @property
    def scatters(self) -> bool:
        """``True``: only this rank's chunk of the gradients is reduced."""
        return True

    def reduce(self, bucket: GradBucket) -> Tensor:
        """Reduce-scatter ``bucket`` now, in the calling thread; returns its buffer."""
        buffer = bucket.buffer
        if bucket.world_size == 1:
            return buffer
        grads = buffer[: buffer.numel() - bucket.num_flags]
        ring_reduce_scatter_flat(
            grads,
            is_average(bucket.op),
            bucket.group,
            bucket.counter,
            self._workspace(grads, bucket.world_size),
            self.duplex_group(bucket.group) if bucket.duplex is None else bucket.duplex,
        )
        if bucket.num_flags:
            flags = bucket.flags
            dist.all_reduce(flags, group=bucket.group)
            nbytes = flags.numel() * flags.element_size()
            bucket.counter.bytes_sent += int(ring_bytes_per_rank(nbytes, bucket.world_size))
        return buffer

    def _workspace(self, flat: Tensor, world_size: int) -> Tensor:
        needed = ring_workspace_numel(flat.numel(), world_size)
        key = (flat.dtype, flat.device)
        workspace = self._workspaces.get(key)
        if workspace is None or workspace.numel() < needed:
            workspace = self._workspaces[key] = torch.empty(needed, dtype=flat.dtype, device=flat.device)
        return workspace

    def all_gather(self, flat: Tensor, group: dist.ProcessGroup | None, counter: CommCounter) -> Future[Tensor]:
        """Queue the all-gather of ``flat`` (every rank's owned chunk to every rank) on the communication thread,
        after the reductions already queued; the future completes with ``flat``."""

        def gather() -> Tensor:
            ring_all_gather_flat(flat, group, counter, self.duplex_group(group))
            return flat

        return self._thread.submit(gather, flat.device)
