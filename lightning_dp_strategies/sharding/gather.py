"""After an optimizer step on the pieces: every bucket's chunks sent round the ring, so every rank holds every
parameter again.

Bucket by bucket, the main thread copies this rank's chunk of the parameters into a flat workspace, the reducer's
communication thread all-gathers it (:meth:`~lightning_dp_strategies.reducers.ScatterReducer.all_gather`), and the
main thread copies the gathered buffer back into the parameters, while the next bucket travels. Two workspaces the
size of the largest bucket alternate::

    main:  copy in 0 │ copy in 1 │ wait 0, copy out 0 │ copy in 2 │ wait 1, copy out 1 │ ...
    comm:            │ gather 0 ────────── │ gather 1 ─────────────│ gather 2 ──── ...
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_dp_strategies.comm import CommCounter
from lightning_dp_strategies.reducers.scatter import ScatterReducer
from lightning_dp_strategies.sharding.layout import ShardLayout

__all__ = ["ParameterGather"]


class ParameterGather:
    """All-gathers the buckets' parameters over ``group`` after this rank stepped its chunks.

    Args:
        layout: the shard layout.
        rank: this rank's index in ``group``.
        reducer: the buckets' reducer, whose thread runs the all-gathers.
        group: the group the buckets are reduced over.
    """

    def __init__(
        self, layout: ShardLayout, rank: int, reducer: ScatterReducer, group: dist.ProcessGroup | None
    ) -> None:
        self.layout, self.rank, self.reducer, self.group = layout, rank, reducer, group
        self._workspaces: list[Tensor] = []

    def _workspace(self, slot: int, like: Tensor, numel: int) -> Tensor:
        while len(self._workspaces) <= slot:
            self._workspaces.append(like.new_empty(0))
        workspace = self._workspaces[slot]
        if workspace.numel() < numel or workspace.dtype != like.dtype or workspace.device != like.device:
            largest = max(self.layout.bucket_numel)
            workspace = self._workspaces[slot] = torch.empty(largest, dtype=like.dtype, device=like.device)
        return workspace[:numel]

    def _copy_in(self, bucket: int, flat: Tensor) -> None:
        """This rank's chunk of bucket ``bucket``'s parameters into ``flat``."""
        lo, hi = self.layout.chunk(bucket, self.rank)
        offset = 0
        for index in self.layout.bucket_params[bucket]:
            param = self.layout.params[index]
            start, stop = max(lo, offset), min(hi, offset + param.numel())
            if start < stop:
                flat[start:stop].copy_(param.detach().view(-1)[start - offset : stop - offset])
            offset += param.numel()

    def _copy_out(self, bucket: int, flat: Tensor) -> None:
        """The gathered ``flat`` back into bucket ``bucket``'s parameters."""
        offset = 0
        for index in self.layout.bucket_params[bucket]:
            param = self.layout.params[index]
            param.detach().view(-1).copy_(flat[offset : offset + param.numel()])
            offset += param.numel()

    def gather(self, buckets: Sequence[int], counter: CommCounter) -> None:
        """All-gather the parameters of ``buckets`` (bucket indices), two in flight at most; returns when every
        parameter holds the stepped values of its owner."""
        if self.layout.world_size == 1:
            return
        in_flight: list[tuple[int, Tensor, Future[Tensor]]] = []
        for k, bucket in enumerate(buckets):
            if len(in_flight) == 2:
                self._finish(*in_flight.pop(0))
            like = self.layout.params[self.layout.bucket_params[bucket][0]]
            flat = self._workspace(k % 2, like, self.layout.bucket_numel[bucket])
            self._copy_in(bucket, flat)
            in_flight.append((bucket, flat, self.reducer.all_gather(flat, self.group, counter)))
        for pending in in_flight:
            self._finish(*pending)

    def _finish(self, bucket: int, flat: Tensor, future: Future[Tensor]) -> None:
        future.wait()
        self._copy_out(bucket, flat)

    def release(self) -> None:
        """Free the workspaces."""
        self._workspaces = []
