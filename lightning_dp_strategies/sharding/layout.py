"""Which rank steps which elements: each bucket cut into one chunk per rank, and each parameter into its pieces.

The gradient buckets are flat buffers of parameters back to back (:mod:`lightning_dp_strategies.bucketing`). The
ring's reduce-scatter leaves rank ``r`` with chunk ``(r + 1) % N`` of every bucket reduced
(:mod:`lightning_dp_strategies.comm.shards`), so that chunk is what rank ``r`` steps: the pieces of the parameters
that fall inside it. A parameter on a chunk boundary has pieces on two (or more) ranks::

    bucket 0 (w0: 8 elements, b0: 2), 2 ranks:   [ w0 w0 w0 w0 w0 | w0 w0 w0 b0 b0 ]
                                                   chunk 0: rank 1   chunk 1: rank 0
    rank 1 steps w0[0:5]; rank 0 steps w0[5:8] and b0[0:2]

The layout depends only on the buckets' parameters and the world size, so every rank computes every rank's pieces
(what a checkpoint needs to put a parameter's state back together) without communicating.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch.nn import Parameter

from lightning_dp_strategies.comm.shards import chunk_range, owned_chunk

__all__ = ["Piece", "ShardLayout"]


@dataclass(frozen=True)
class Piece:
    """Elements ``start:stop`` of the flattened parameter ``param`` (its position in :attr:`ShardLayout.params`),
    stepped by ``rank``; they sit at ``offset`` in bucket ``bucket``'s buffer."""

    param: int
    rank: int
    start: int
    stop: int
    bucket: int
    offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


class ShardLayout:
    """Every rank's pieces of every bucketed parameter.

    Args:
        buckets: per bucket, its parameters in buffer order (``[bucket.params for bucket in buckets.buckets]``).
        world_size: ranks the buckets are reduce-scattered over.

    Examples:
        >>> import torch
        >>> w, b = Parameter(torch.zeros(2, 4)), Parameter(torch.zeros(2))
        >>> layout = ShardLayout([[w, b]], world_size=2)  # 10 elements: chunk 0 = [0:5], chunk 1 = [5:10]
        >>> [(p.param, p.start, p.stop) for p in layout.pieces_of_rank(1)]  # rank 1 owns chunk 0
        [(0, 0, 5)]
        >>> [(p.param, p.start, p.stop) for p in layout.pieces_of_rank(0)]
        [(0, 5, 8), (1, 0, 2)]
        >>> layout.owned_fraction(0), layout.owned_fraction(1)
        (0.5, 0.5)
    """

    def __init__(self, buckets: Sequence[Sequence[Parameter]], world_size: int) -> None:
        self.world_size = world_size
        self.params: list[Parameter] = [p for params in buckets for p in params]
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.bucket_params: list[list[int]] = []
        self.bucket_numel: list[int] = []
        self.pieces: list[Piece] = []
        first = 0
        for b, params in enumerate(buckets):
            members = list(range(first, first + len(params)))
            first += len(params)
            self.bucket_params.append(members)
            self.bucket_numel.append(sum(self.params[i].numel() for i in members))
            self.pieces += self._cut(b, members)
        self._by_param: dict[int, list[Piece]] = {}
        self._by_rank: dict[int, list[Piece]] = {}
        for piece in self.pieces:
            self._by_param.setdefault(piece.param, []).append(piece)
            self._by_rank.setdefault(piece.rank, []).append(piece)

    def _cut(self, bucket: int, members: list[int]) -> list[Piece]:
        """The pieces of bucket ``bucket``, by rank then by position."""
        numel = sum(self.params[i].numel() for i in members)
        pieces = []
        for rank in range(self.world_size):
            lo, hi = self.chunk(bucket, rank, numel)
            offset = 0
            for i in members:
                size = self.params[i].numel()
                start, stop = max(lo, offset), min(hi, offset + size)
                if start < stop:
                    pieces.append(Piece(i, rank, start - offset, stop - offset, bucket, start))
                offset += size
        return pieces

    def chunk(self, bucket: int, rank: int, numel: int | None = None) -> tuple[int, int]:
        """``(start, stop)`` in bucket ``bucket``'s buffer of the chunk ``rank`` owns."""
        numel = self.bucket_numel[bucket] if numel is None else numel
        return chunk_range(numel, self.world_size, owned_chunk(rank, self.world_size))

    def pieces_of_rank(self, rank: int) -> list[Piece]:
        """The pieces ``rank`` steps, bucket by bucket in buffer order."""
        return self._by_rank.get(rank, [])

    def pieces_of_param(self, param: int) -> list[Piece]:
        """The pieces of parameter ``param`` in element order (each on the rank that steps it)."""
        return sorted(self._by_param.get(param, []), key=lambda piece: piece.start)

    def owned_fraction(self, rank: int) -> float:
        """The fraction of all bucketed elements ``rank`` steps."""
        total = sum(self.bucket_numel)
        return sum(p.numel for p in self.pieces_of_rank(rank)) / total if total else 0.0
