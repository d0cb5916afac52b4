"""The streamed ring all-reduce (the gloo path of :func:`~lightning_dp_strategies.comm.ring.ring_all_reduce`).

The chunks move as in :func:`~lightning_dp_strategies.comm.ring.ring_reduce_scatter` then
:func:`~lightning_dp_strategies.comm.ring.ring_all_gather`, but as one stream of messages: each send is issued the
moment its data is ready, and no step waits for the whole previous one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dp_strategies.comm.ops import CommCounter, divide_

__all__ = ["streamed_ring_all_gather", "streamed_ring_all_reduce"]


def _duplex_sides(
    pg: dist.ProcessGroup, duplex: dist.ProcessGroup | None
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(the group this rank sends over, the group it receives over).

    At two ranks with ``duplex``, rank 1 sends over ``duplex`` and rank 0 receives over it, so each direction has its
    own connection; otherwise both are ``pg``.
    """
    two = duplex is not None and pg.size() == 2
    send_pg = duplex if two and pg.rank() == 1 else pg
    recv_pg = duplex if two and pg.rank() == 0 else pg
    assert send_pg is not None and recv_pg is not None
    return send_pg, recv_pg


def _scratch(flat: Tensor, slots: int, pieces: int, stride: int, workspace: Tensor | None) -> Tensor:
    """The ``(slots, pieces, stride)`` receive buffer: a view of ``workspace`` where it fits, else a fresh one."""
    needed = slots * pieces * stride
    if workspace is not None and workspace.numel() >= needed and workspace.dtype == flat.dtype:
        return workspace.view(-1)[:needed].view(slots, pieces, stride)
    return torch.empty(slots, pieces, stride, dtype=flat.dtype, device=flat.device)


class _StreamedRing:
    """The state of one streamed all-reduce of ``flat`` (or of one of its halves: the reduce-scatter alone where
    :meth:`start` is told ``gather=False``, the all-gather alone where :meth:`start` is not called): its pieces, the
    receive scratch, the messages in flight, what this rank sent.

    Tags keep the messages apart: reduce-scatter step s piece k is ``s * P + k``, all-gather step s is
    ``(N - 1 + s) * P + k``. Reduce-scatter receives are double-buffered in the scratch (step s in slot ``s % 2``).
    """

    def __init__(
        self, flat: Tensor, group: dist.ProcessGroup | None, duplex: dist.ProcessGroup | None, pieces: int
    ) -> None:
        pg = group if group is not None else dist.group.WORLD
        assert pg is not None
        self.size, self.rank = pg.size(), pg.rank()
        # group ranks: ProcessGroup.send/recv address peers by them
        self.nxt, self.prv = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        self.send_pg, self.recv_pg = _duplex_sides(pg, duplex)
        self.sent = CommCounter()
        """The bytes and messages :meth:`send` sent (:meth:`finish` adds them to the caller's counter)."""
        self.steps = self.size - 1
        self.pieces = pieces
        chunks = flat.tensor_split(self.size)
        self.split = [c.tensor_split(pieces) for c in chunks]
        self.stride = -(-chunks[0].numel() // pieces)  # scratch row per piece: re-posting row k never touches k+1
        self.slots = min(2, self.steps)
        self.scratch = flat.new_empty(0, 0, 0)
        """The reduce-scatter's receive buffer, ``(slots, pieces, stride)``, made by :meth:`start`."""
        self.gather = True
        """Whether the reduced chunks go on into the all-gather (else each rank keeps only its own)."""
        self.sends: list[dist.Work] = []
        self.incoming: list[list[tuple[dist.Work | None, Tensor]]] = [[] for _ in range(self.steps)]
        self.gathered: list[list[dist.Work | None]] = [[] for _ in range(self.steps)]
        self.gather_early = self.size > 2 or self.send_pg is not self.recv_pg  # see streamed_ring_all_reduce

    def send(self, piece: Tensor, tag: int) -> None:
        """Send ``piece`` to the next rank (empty pieces are skipped) and count it."""
        if piece.numel():
            self.sends.append(self.send_pg.send([piece], self.nxt, tag))
            self.sent.bytes_sent += piece.numel() * piece.element_size()
            self.sent.messages += 1

    def recv(self, piece: Tensor, tag: int) -> dist.Work | None:
        """Post a receive into ``piece`` from the previous rank; ``None`` for an empty piece."""
        return self.recv_pg.recv([piece], self.prv, tag) if piece.numel() else None

    def post_reduce_scatter(self, step: int, k: int) -> None:
        """Post the receive of piece ``k`` of reduce-scatter ``step`` into its scratch row."""
        into = self.scratch[step % 2, k, : self.split[(self.rank - step - 1) % self.size][k].numel()]
        self.incoming[step].append((self.recv(into, step * self.pieces + k), into))

    def post_all_gather(self, k: int) -> None:
        """Post piece ``k``'s all-gather receives: step s brings piece k of chunk ``(rank - s) % N``, in place."""
        for s in range(self.steps):
            chunk = self.split[(self.rank - s) % self.size]
            self.gathered[s].append(self.recv(chunk[k], (self.steps + s) * self.pieces + k))

    def start(self, flat: Tensor, workspace: Tensor | None, gather: bool) -> None:
        """Start the reduce-scatter of ``flat`` (and the all-gather after it, if ``gather``): make the receive scratch
        (a view of ``workspace`` where it fits), post the first reduce-scatter receives (and the all-gather's, if
        early), then send this rank's chunk."""
        self.scratch = _scratch(flat, self.slots, self.pieces, self.stride, workspace)
        self.gather = gather
        for s in range(self.slots):
            for k in range(self.pieces):
                self.post_reduce_scatter(s, k)
        if self.gather and self.gather_early:
            for k in range(self.pieces):
                self.post_all_gather(k)
        for k, piece in enumerate(self.split[self.rank]):
            self.send(piece, k)

    def reduce_scatter(self, average: bool) -> None:
        """Add each received piece in and pass it on; fully reduced pieces go straight on into the all-gather."""
        for step in range(self.steps):
            target = self.split[(self.rank - step - 1) % self.size]
            for k in range(self.pieces):
                work, received = self.incoming[step][k]
                if work is not None:
                    work.wait()
                    target[k].add_(received)
                if step + 2 < self.steps:  # row k of this slot is free again
                    self.post_reduce_scatter(step + 2, k)
                if step + 1 < self.steps:
                    self.send(target[k], (step + 1) * self.pieces + k)
                else:
                    self.reduced(target[k], k, average)

    def reduced(self, piece: Tensor, k: int, average: bool) -> None:
        """Piece ``k`` of this rank's chunk is fully reduced: average it if asked, and send it into the all-gather."""
        if average:
            divide_(piece, self.size)
        if not self.gather:
            return
        self.send(piece, self.steps * self.pieces + k)
        if not self.gather_early:
            self.post_all_gather(k)

    def all_gather(self) -> None:
        """Wait for each gathered piece (it lands in place) and pass it on while steps remain."""
        for step in range(self.steps):
            for k, work in enumerate(self.gathered[step]):
                if work is not None:
                    work.wait()
                if step + 1 < self.steps:
                    chunk = self.split[(self.rank - step) % self.size]
                    self.send(chunk[k], (self.steps + step + 1) * self.pieces + k)

    def finish(self, counter: CommCounter | None) -> None:
        """Wait for every send still in flight, then add what this rank sent to ``counter`` (if any)."""
        for work in self.sends:
            work.wait()
        if counter is not None:
            counter.add(self.sent)


def streamed_ring_all_reduce(
    flat: Tensor,
    average: bool,
    group: dist.ProcessGroup | None,
    counter: CommCounter | None,
    workspace: Tensor | None,
    duplex: dist.ProcessGroup | None,
    pieces: int,
    gather: bool = True,
) -> None:
    """The ring as one stream of messages (gloo): each send issued the moment its data is ready.

    The same chunks move as in ``ring_reduce_scatter`` then ``ring_all_gather``, but no step waits for the whole
    previous one: piece k of reduce-scatter step s+1 leaves as soon as piece k of step s is added in, and the reduced
    pieces go straight on into the all-gather. Tags keep the messages apart: reduce-scatter step s piece k is
    ``s * P + k``, all-gather step s is ``(N - 1 + s) * P + k``. Reduce-scatter receives are posted up front,
    double-buffered in the scratch (step s in slot ``s % 2``).

    With ``duplex`` at two ranks, rank 1's messages to rank 0 go over ``duplex`` and rank 0's to rank 1 over
    ``group`` (see ``ring_all_reduce``).

    When are the all-gather receives posted? Gloo writes a send in the calling thread when the peer's receive is
    already posted, and leaves it to its I/O thread otherwise. Where this rank's sends and receives travel over
    different connections (more than two ranks, or two with ``duplex``), they are posted up front, with the first
    reduce-scatter receives: the peer then writes its reduced pieces straight from its own thread. Over one
    connection (two ranks, no ``duplex``) piece k's are posted once this rank has reduced its own piece k: posted up
    front, the peer's synchronous writes would compete with this rank's reads on the same socket, in series with its
    additions (the measurements behind both choices are in ``docs/benchmarks.md``). Either way they land in place: a
    chunk's reduced copy can only arrive after this rank's contribution to it has been received downstream.

    Args:
        flat: the contiguous 1-D tensor to reduce in place; the same length on every rank.
        average: divide the reduced chunk by the group size (else a sum).
        group: the process group; ``None`` is the world.
        counter: optional counter of the bytes and messages this rank sends.
        workspace: optional scratch of ``flat``'s dtype, used where it holds two chunks' worth of pieces.
        duplex: optional second group over the same ranks (used at two ranks only).
        pieces: how many pieces each chunk moves in; the same on every rank.
        gather: ``False`` stops after the reduce-scatter: this rank's chunk of ``flat``
            (``flat.tensor_split(N)[(rank + 1) % N]``) holds the reduction, the other chunks partial sums.

    Examples:
        >>> # on every rank of an initialised gloo group
        >>> flat = torch.full((10,), float(dist.get_rank()))  # doctest: +SKIP
        >>> streamed_ring_all_reduce(flat, False, None, None, None, None, pieces=1)  # doctest: +SKIP
        >>> # the reduce-scatter half alone, on 2 ranks: each keeps its own reduced chunk
        >>> flat = torch.full((4,), float(dist.get_rank() + 1))  # doctest: +SKIP
        >>> streamed_ring_all_reduce(flat, False, None, None, None, None, pieces=1, gather=False)  # doctest: +SKIP
        >>> flat.tensor_split(2)[(dist.get_rank() + 1) % 2]  # doctest: +SKIP
        tensor([3., 3.])
    """
    ring = _StreamedRing(flat, group, duplex, pieces)
    ring.start(flat, workspace, gather)
    ring.reduce_scatter(average)
    if gather:
        ring.all_gather()
    ring.finish(counter)


def streamed_ring_all_gather(
    flat: Tensor,
    group: dist.ProcessGroup | None,
    counter: CommCounter | None,
    duplex: dist.ProcessGroup | None,
    pieces: int,
) -> None:
    """The all-gather half of :func:`streamed_ring_all_reduce`: each rank's chunk ``(rank + 1) % N`` of ``flat``
    travels round the ring in place, so that every rank ends with every rank's chunk."""
    ring = _StreamedRing(flat, group, duplex, pieces)
    for k in range(ring.pieces):
        ring.post_all_gather(k)
    for k, piece in enumerate(ring.split[(ring.rank + 1) % ring.size]):
        ring.send(piece, ring.steps * ring.pieces + k)
    ring.all_gather()
    ring.finish(counter)
