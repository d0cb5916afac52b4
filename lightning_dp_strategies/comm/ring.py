"""Ring reduce-scatter, all-gather and all-reduce built on ``torch.distributed`` point-to-point operations.

The tensor is cut into N chunks (sizes differ by at most one element, so no padding is needed). With ranks on a ring,
rank r sends to r+1 and receives from r-1:

    reduce-scatter, step s = 0..N-2: send chunk (r - s) % N, receive chunk (r - s - 1) % N and add it in.
        After N-1 steps rank r holds the fully reduced chunk (r + 1) % N.
    all-gather,     step s = 0..N-2: send chunk (r + 1 - s) % N, receive chunk (r - s) % N in place.

    N = 3, chunks a b c; "a0" is rank 0's contribution to chunk a, "a*" the reduced chunk.

              rank 0          rank 1          rank 2
    start     a0 b0 c0        a1 b1 c1        a2 b2 c2
    RS s=0    0->1: a0        1->2: b1        2->0: c2
    RS s=1    0->1: c0+c2     1->2: a0+a1     2->0: b1+b2      now 0 owns b*, 1 owns c*, 2 owns a*
    AG s=0    0->1: b*        1->2: c*        2->0: a*
    AG s=1    0->1: a*        1->2: b*        2->0: c*         everyone holds a* b* c*

Each rank sends 2(N-1) chunks, i.e. 2(N-1)/N of the tensor's bytes give or take a chunk's rounding (under N
elements), whatever N is: the bandwidth-optimal cost. :func:`reference_all_reduce` (the backend's own all-reduce) is
the test oracle.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dp_strategies.comm.groups import new_group
from lightning_dp_strategies.comm.ops import (
    CommCounter,
    ReduceOpLike,
    divide as divide,  # importable from here before comm.ops existed
    divide_,
    is_average,
)
from lightning_dp_strategies.comm.streamed import streamed_ring_all_reduce

__all__ = [
    "new_duplex_group",
    "reference_all_reduce",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_reduce_scatter",
    "ring_workspace_numel",
]


def _ring_neighbours(group: dist.ProcessGroup | None) -> tuple[int, int, int, int]:
    """(this rank's index in the group, group size, global rank of the next, global rank of the previous)."""
    size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    if group is not None and group is not dist.GroupMember.WORLD:
        nxt, prv = dist.get_global_rank(group, nxt), dist.get_global_rank(group, prv)
    return rank, size, nxt, prv


def _post(ops: list[dist.P2POp], group: dist.ProcessGroup | None) -> list[dist.Work]:
    """Start point-to-point ``ops``; one handle per op, in order, except NCCL's single coalesced handle.

    NCCL needs them in one grouped call (``batch_isend_irecv``), or two ranks that both send first deadlock. Gloo's
    sends and receives are independent, and posting them one by one (receives first) is measurably faster there.
    """
    if dist.get_backend(group) != "gloo":
        return dist.batch_isend_irecv(ops)
    works: dict[int, dist.Work] = {}
    for i in sorted(range(len(ops)), key=lambda i: ops[i].op is not dist.irecv):  # receives first
        op = ops[i]
        works[i] = op.op(op.tensor, op.peer, op.group, op.tag)
    return [works[i] for i in range(len(ops))]


def _exchange(
    send: Tensor, recv: Tensor, nxt: int, prv: int, group: dist.ProcessGroup | None, counter: CommCounter | None
) -> None:
    """Send ``send`` to the next rank while receiving ``recv`` from the previous one; empty chunks are skipped."""
    ops = []
    if send.numel():
        ops.append(dist.P2POp(dist.isend, send, nxt, group))
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, prv, group))
    if not ops:
        return
    for work in _post(ops, group):
        work.wait()
    if counter is not None and send.numel():
        counter.bytes_sent += send.numel() * send.element_size()
        counter.messages += 1


PIPELINE_PIECE_BYTES = 4 * 1024 * 1024
"""Chunks move in pieces of about this size, so adding piece k overlaps receiving k+1 (gloo, 2 processes: smaller
pieces cost more in per-message hand-offs than they win below ~8 MiB chunks)."""
MAX_PIECES = 8


def _piece_count(chunk_numel: int, element_size: int) -> int:
    return max(1, min(MAX_PIECES, chunk_numel * element_size // PIPELINE_PIECE_BYTES))


def _pieces(chunk: Tensor) -> int:
    return _piece_count(chunk.numel(), chunk.element_size())


def _exchange_and_add(
    send: Tensor,
    target: Tensor,
    scratch: Tensor,
    nxt: int,
    prv: int,
    group: dist.ProcessGroup | None,
    counter: CommCounter | None,
) -> None:
    """Send ``send`` to the next rank; receive the previous rank's matching chunk and add it into ``target``.

    Both chunks move in the same number of pieces (the count depends only on sizes every rank knows), all posted in
    at once (see :func:`_post`). Where the backend gives one handle per operation (gloo), each received piece is added
    while later pieces are still in flight.
    """
    pieces = max(_pieces(send), _pieces(target))
    sends = [p for p in send.tensor_split(pieces) if p.numel()]
    incoming = scratch[: target.numel()]
    recv_pairs = [(r, t) for r, t in zip(incoming.tensor_split(pieces), target.tensor_split(pieces), strict=True)]
    recv_pairs = [(r, t) for r, t in recv_pairs if r.numel()]
    ops = [dist.P2POp(dist.isend, p, nxt, group, tag=i) for i, p in enumerate(sends)]
    ops += [dist.P2POp(dist.irecv, r, prv, group, tag=i) for i, (r, _) in enumerate(recv_pairs)]
    if not ops:
        return
    works = _post(ops, group)
    if len(works) == len(ops):
        for work, (received, into) in zip(works[len(sends) :], recv_pairs, strict=True):
            work.wait()
            into.add_(received)
        for work in works[: len(sends)]:
            work.wait()
    else:  # a coalesced handle (NCCL): everything completes together
        for work in works:
            work.wait()
        target.add_(incoming)
    if counter is not None and sends:
        counter.bytes_sent += send.numel() * send.element_size()
        counter.messages += len(sends)


def ring_reduce_scatter(
    chunks: list[Tensor],
    group: dist.ProcessGroup | None = None,
    counter: CommCounter | None = None,
    workspace: Tensor | None = None,
) -> int:
    """Sum ``chunks`` (one contiguous tensor per rank, same sizes on every rank) around the ring, in place.

    Returns the index of the chunk this rank now holds fully summed: ``(rank + 1) % world_size``.

    Examples:
        >>> # on rank 0 of an initialised 2-process group (rank 1 passes the same tensor)
        >>> chunks = list(torch.arange(4.0).tensor_split(2))  # doctest: +SKIP
        >>> ring_reduce_scatter(chunks)  # doctest: +SKIP
        1
        >>> chunks[1]  # doctest: +SKIP
        tensor([4., 6.])
    """
    rank, size, nxt, prv = _ring_neighbours(group)
    if len(chunks) != size:
        raise ValueError(f"ring_reduce_scatter needs one chunk per rank: got {len(chunks)} for {size} ranks.")
    largest = max(c.numel() for c in chunks)
    if workspace is not None and workspace.numel() >= largest and workspace.dtype == chunks[0].dtype:
        scratch = workspace.view(-1)[:largest]
    else:
        scratch = torch.empty(largest, dtype=chunks[0].dtype, device=chunks[0].device)
    for step in range(size - 1):
        send, target = chunks[(rank - step) % size], chunks[(rank - step - 1) % size]
        _exchange_and_add(send, target, scratch, nxt, prv, group, counter)
    return (rank + 1) % size


def ring_all_gather(
    chunks: list[Tensor], group: dist.ProcessGroup | None = None, counter: CommCounter | None = None
) -> None:
    """Circulate each rank's owned chunk (index ``(rank + 1) % world_size``) so every rank holds all of them.

    Examples:
        >>> # on every rank of an initialised 2-process group: reduce-scatter then all-gather is an all-reduce (sum)
        >>> flat = torch.arange(4.0)  # doctest: +SKIP
        >>> chunks = list(flat.tensor_split(2))  # views of flat  # doctest: +SKIP
        >>> owned = ring_reduce_scatter(chunks)  # doctest: +SKIP
        >>> ring_all_gather(chunks)  # doctest: +SKIP
        >>> flat  # doctest: +SKIP
        tensor([0., 2., 4., 6.])
    """
    rank, size, nxt, prv = _ring_neighbours(group)
    if len(chunks) != size:
        raise ValueError(f"ring_all_gather needs one chunk per rank: got {len(chunks)} for {size} ranks.")
    for step in range(size - 1):
        _exchange(chunks[(rank + 1 - step) % size], chunks[(rank - step) % size], nxt, prv, group, counter)


def ring_workspace_numel(numel: int, world_size: int) -> int:
    """Elements of scratch :func:`ring_all_reduce` needs for a tensor of ``numel`` elements over ``world_size`` ranks.

    Pass a buffer at least this long as ``workspace`` to reuse it across calls (a fresh one per call costs page
    faults on large tensors). It is two chunks' worth on gloo, where reduce-scatter steps are received double-buffered.

    Examples:
        >>> ring_workspace_numel(1000, 4), ring_workspace_numel(1000, 2), ring_workspace_numel(1000, 1)
        (514, 507, 0)
    """
    if world_size <= 1 or numel == 0:
        return 0
    largest = -(-numel // world_size)
    return min(2, world_size - 1) * (largest + MAX_PIECES - 1)  # pieces * ceil(largest / pieces), for any piece count


def _streamed_ring_all_reduce(
    flat: Tensor,
    average: bool,
    group: dist.ProcessGroup | None,
    counter: CommCounter | None,
    workspace: Tensor | None,
    duplex: dist.ProcessGroup | None = None,
) -> None:
    """The ring as one stream of messages (gloo), moved to :mod:`lightning_dp_strategies.comm.streamed`.

    The piece count is worked out here, from this module's :data:`PIPELINE_PIECE_BYTES`: chunk 0 is the largest, so
    it is the same on every rank.
    """
    largest = -(-flat.numel() // dist.get_world_size(group))
    pieces = _piece_count(largest, flat.element_size())
    streamed_ring_all_reduce(flat, average, group, counter, workspace, duplex, pieces)


def new_duplex_group(ranks: list[int] | None = None, backend: str | None = None) -> dist.ProcessGroup | None:
    """The second group :func:`ring_all_reduce` can take as ``duplex`` over ``ranks`` (``None``: the world), or
    ``None`` where the ring would not use one (not two ranks, or not gloo).

    It is a ``dist.new_group`` call: make it on every rank of the world, in the same order as the other groups, with
    the same ``ranks`` and ``backend`` (``None``: the default group's) as the group it pairs with. A rank outside
    ``ranks`` gets torch's placeholder back, as from ``dist.new_group``.

    Examples:
        >>> new_duplex_group([0, 1, 2], backend="gloo") is None  # three ranks: each neighbour has its connection
        True
        >>> duplex = new_duplex_group()  # doctest: +SKIP
        >>> ring_all_reduce(grad, "avg", duplex=duplex)  # doctest: +SKIP
    """
    size = len(ranks) if ranks is not None else dist.get_world_size()
    if size != 2 or (backend if backend is not None else dist.get_backend()) != "gloo":
        return None
    return new_group(ranks, backend)


def _check_duplex(group: dist.ProcessGroup | None, duplex: object) -> None:
    """A clear error, on every rank, unless ``duplex`` is a group over ``group``'s ranks in the same order."""
    base = group if group is not None else dist.group.WORLD
    if duplex is base:
        return  # harmless: everything goes over the one group
    fix = "pass dist.new_group(ranks) with the ranks of `group`, in the same order, created on every rank"
    if not isinstance(duplex, dist.ProcessGroup):
        raise ValueError(f"ring_all_reduce(duplex=...) got {duplex!r}, not a group this rank belongs to: {fix}.")
    assert base is not None
    mine, theirs = dist.get_process_group_ranks(base), dist.get_process_group_ranks(duplex)
    if mine != theirs:
        raise ValueError(f"ring_all_reduce(duplex=...) spans ranks {theirs}, but `group` spans {mine}: {fix}.")


def ring_all_reduce(
    tensor: Tensor,
    op: ReduceOpLike = "avg",
    group: dist.ProcessGroup | None = None,
    counter: CommCounter | None = None,
    workspace: Tensor | None = None,
    duplex: dist.ProcessGroup | None = None,
) -> Tensor:
    """Reduce ``tensor`` across the ranks of ``group`` in place: ring reduce-scatter, then ring all-gather.

    Args:
        tensor: any shape, length and device; floating dtypes for ``"avg"``. Every rank passes the same shape/dtype.
        op: ``"sum"`` or ``"avg"`` (also ``dist.ReduceOp.SUM`` / ``dist.ReduceOp.AVG``). The average divides the
            summed chunk once, after the reduce-scatter.
        group: the process group (a sub-group works: each rank exchanges with its ring neighbours inside it);
            ``None`` is the world.
        counter: optional :class:`CommCounter` that receives the bytes and messages this rank sent.
        workspace: optional scratch buffer of the tensor's dtype and device, at least
            :func:`ring_workspace_numel` elements, reused instead of allocating one per call (large fresh buffers
            cost page faults).
        duplex: optional second process group over the same ranks, in the same order (``dist.new_group`` with
            ``group``'s ranks). Gloo carries both directions between two ranks over one TCP connection, served by one
            I/O thread per process; in a two-rank ring the next and the previous rank are the same peer, so the
            ring's sends and receives share it. With ``duplex``, rank 1 sends over it and rank 0 receives over it:
            each direction gets its own connection. Used by gloo at two ranks only: with more ranks each neighbour
            already has its own connection, and NCCL manages its own channels. :func:`new_duplex_group` makes one
            where it is used; the ring reducer makes one in its setup step (see ``docs/benchmarks.md`` for what it
            gains).

    Returns:
        ``tensor``, now holding the reduction.

    Examples:
        >>> # on every rank of an initialised process group
        >>> grad = torch.full((10,), float(dist.get_rank()))  # doctest: +SKIP
        >>> ring_all_reduce(grad, op="avg")                     # doctest: +SKIP
    """
    average = is_average(op)
    if average and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(f"ring_all_reduce(op='avg') needs a floating tensor, got {tensor.dtype}; use op='sum'.")
    size = dist.get_world_size(group)
    if duplex is not None:
        _check_duplex(group, duplex)
    start = time.perf_counter()
    if size > 1 and tensor.numel() > 0:
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
        if dist.get_backend(group) == "gloo":
            _streamed_ring_all_reduce(flat, average, group, counter, workspace, duplex)
        else:  # NCCL: one grouped exchange per step (see _post)
            chunks = list(flat.tensor_split(size))
            owned = ring_reduce_scatter(chunks, group, counter, workspace)
            if average:
                divide_(chunks[owned], size)
            ring_all_gather(chunks, group, counter)
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view_as(tensor))
    if counter is not None:
        counter.operations += 1
        counter.seconds += time.perf_counter() - start
    return tensor


def reference_all_reduce(tensor: Tensor, op: ReduceOpLike = "avg", group: dist.ProcessGroup | None = None) -> Tensor:
    """The naive oracle: the backend's own ``all_reduce`` (sum), divided by the group size for an average.

    Examples:
        >>> # on every rank of an initialised 2-process group
        >>> grad = torch.full((3,), float(dist.get_rank()))  # doctest: +SKIP
        >>> reference_all_reduce(grad, op="avg")  # doctest: +SKIP
        tensor([0.5000, 0.5000, 0.5000])
    """
    average = is_average(op)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    if average:
        tensor.div_(dist.get_world_size(group))
    return tensor
