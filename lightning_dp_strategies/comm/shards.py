"""The ring's two halves on their own: reduce-scatter a flat tensor so that each rank owns one reduced chunk, and
all-gather the owned chunks back into every rank's copy.

Chunk ``i`` of an ``n``-element tensor over ``N`` ranks is ``flat.tensor_split(N)[i]`` (sizes differ by at most one
element); after the reduce-scatter rank ``r`` owns chunk ``(r + 1) % N``, the one the ring leaves fully reduced there
(see :mod:`lightning_dp_strategies.comm.ring`)::

    reduce-scatter            all-gather
    a0 b0 | a1 b1    ──▶      .. b* | a* ..    ──▶      a* b* | a* b*
    (rank 0 | rank 1)         (each owns one chunk)     (every rank holds every chunk)

Sharded optimizer state (ZeRO) is built on this pair: between the halves a rank steps only the parameters of its chunk.
"""

from __future__ import annotations

import time

import torch.distributed as dist
from torch import Tensor

from lightning_dp_strategies.comm.ops import CommCounter, divide_
from lightning_dp_strategies.comm.ring import _piece_count, ring_all_gather, ring_reduce_scatter
from lightning_dp_strategies.comm.streamed import streamed_ring_all_gather, streamed_ring_all_reduce

__all__ = ["chunk_range", "owned_chunk", "ring_all_gather_flat", "ring_reduce_scatter_flat"]


def owned_chunk(rank: int, world_size: int) -> int:
    """The chunk rank ``rank`` owns after the ring's reduce-scatter.

    Examples:
        >>> [owned_chunk(r, 3) for r in range(3)]
        [1, 2, 0]
    """
    return (rank + 1) % world_size


def chunk_range(numel: int, world_size: int, index: int) -> tuple[int, int]:
    """``(start, stop)`` of chunk ``index`` of ``numel`` elements cut in ``world_size`` (as ``Tensor.tensor_split``).

    Examples:
        >>> [chunk_range(10, 3, i) for i in range(3)]
        [(0, 4), (4, 7), (7, 10)]
    """
    base, extra = divmod(numel, world_size)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def _pieces(flat: Tensor, size: int) -> int:
    return _piece_count(-(-flat.numel() // size), flat.element_size())


def ring_reduce_scatter_flat(
    flat: Tensor,
    average: bool,
    group: dist.ProcessGroup | None = None,
    counter: CommCounter | None = None,
    workspace: Tensor | None = None,
    duplex: dist.ProcessGroup | None = None,
) -> tuple[int, int]:
    """Reduce-scatter the contiguous 1-D ``flat`` in place over ``group``; returns the ``(start, stop)`` of the
    chunk this rank now holds reduced (summed, or averaged with ``average``). The rest of ``flat`` holds partial sums.

    Args:
        flat: the same length on every rank.
        average: divide the owned chunk by the group size.
        group: the process group (``None``: the world).
        counter: receives the bytes and messages sent.
        workspace: optional scratch (see :func:`~lightning_dp_strategies.comm.ring_workspace_numel`).
        duplex: optional second group over the same ranks, used by gloo at two ranks (see ``ring_all_reduce``).

    Examples:
        >>> # on every rank of an initialised 2-process group
        >>> flat = torch.full((4,), float(dist.get_rank() + 1))  # doctest: +SKIP
        >>> start, stop = ring_reduce_scatter_flat(flat, average=False)  # doctest: +SKIP
        >>> flat[start:stop]  # doctest: +SKIP
        tensor([3., 3.])
    """
    size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    owned = chunk_range(flat.numel(), size, owned_chunk(rank, size))
    if size == 1 or flat.numel() == 0:
        return owned
    started = time.perf_counter()
    if dist.get_backend(group) == "gloo":
        pieces = _pieces(flat, size)
        streamed_ring_all_reduce(flat, average, group, counter, workspace, duplex, pieces, gather=False)
    else:
        chunks = list(flat.tensor_split(size))
        ring_reduce_scatter(chunks, group, counter, workspace)
        if average:
            divide_(flat[owned[0] : owned[1]], size)
    if counter is not None:
        counter.operations += 1
        counter.seconds += time.perf_counter() - started
    return owned


def ring_all_gather_flat(
    flat: Tensor,
    group: dist.ProcessGroup | None = None,
    counter: CommCounter | None = None,
    duplex: dist.ProcessGroup | None = None,
) -> None:
    """Every rank's owned chunk of the contiguous 1-D ``flat`` (see :func:`owned_chunk`) sent round the ring, in
    place: afterwards ``flat`` is the same on every rank.

    Examples:
        >>> # on every rank of an initialised 2-process group: each fills the chunk it owns
        >>> flat = torch.zeros(4)  # doctest: +SKIP
        >>> start, stop = chunk_range(4, 2, owned_chunk(dist.get_rank(), 2))  # doctest: +SKIP
        >>> flat[start:stop] = dist.get_rank() + 1  # doctest: +SKIP
        >>> ring_all_gather_flat(flat)  # doctest: +SKIP
        >>> flat  # doctest: +SKIP
        tensor([2., 2., 1., 1.])
    """
    size = dist.get_world_size(group)
    if size == 1 or flat.numel() == 0:
        return
    started = time.perf_counter()
    if dist.get_backend(group) == "gloo":
        streamed_ring_all_gather(flat, group, counter, duplex, _pieces(flat, size))
    else:
        ring_all_gather(list(flat.tensor_split(size)), group, counter)
    if counter is not None:
        counter.operations += 1
        counter.seconds += time.perf_counter() - started
