"""A low-bit all-reduce on any backend (gloo and CPU included): values sent as 8 or 4 bits with one scale a block,
summed in fp32.

Each rank owns one chunk of the flat tensor (as :func:`~lightning_dp_strategies.comm.shards.chunk_range` cuts it).
Every rank quantizes its contribution to each other rank's chunk and sends it to the chunk's owner; the owner
dequantizes them, sums them in fp32 with its own contribution (exact: it never leaves the rank), quantizes the reduced
chunk once more and all-gathers it; every rank then dequantizes the same bytes, so the result is the same on every
rank::

    quantize chunk j ──send──▶ rank j: dequantize, sum in fp32 ──▶ quantize ──all-gather──▶ every rank: dequantize

A value travels twice, each time as ``bits`` bits (plus one fp32 scale per ``block`` values): a rank sends
``2(N-1)/N`` of the tensor as the ring does, at ``bits/32`` of its fp32 bytes. Quantization is symmetric and
round-to-nearest per block: a value's error is at most half its block's scale (``max|x| / 127`` for 8 bits,
``max|x| / 7`` for 4), once for each contribution sent and once for the reduced chunk (:func:`error_bound`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dp_strategies.comm.ops import CommCounter
from lightning_dp_strategies.comm.shards import chunk_range

__all__ = ["QUANTIZED_BITS", "Quantized", "dequantize", "error_bound", "quantize", "quantized_all_reduce"]

QUANTIZED_BITS = (8, 4)
"""The widths :func:`quantize` sends a value in."""


@dataclass
class Quantized:
    """A flat tensor as ``bits``-bit integers (two to a byte at 4 bits) and one fp32 scale a block of ``block``.

    Examples:
        >>> q = quantize(torch.arange(10.0), bits=4, block=5)
        >>> q.data.numel(), q.scales.numel(), q.nbytes
        (5, 2, 13)
    """

    data: Tensor
    """``uint8``: one value a byte at 8 bits (offset by 128), two at 4 bits (offset by 8, low nibble first)."""
    scales: Tensor
    numel: int
    bits: int
    block: int

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: the integers and the scales."""
        return self.data.numel() + 4 * self.scales.numel()


def _qmax(bits: int) -> int:
    if bits not in QUANTIZED_BITS:
        raise ValueError(f"Quantized reduction sends 8 or 4 bits a value, got bits={bits!r}.")
    return (1 << (bits - 1)) - 1


def _block_scales(x: Tensor, qmax: int, block: int) -> Tensor:
    """Each block's largest magnitude over ``qmax``: the whole blocks as a view of ``x``, the short last one apart."""
    whole = x.numel() // block * block
    scales = torch.empty(-(-x.numel() // block), dtype=torch.float32, device=x.device)
    head = x[:whole].view(-1, block)
    if whole:
        torch.maximum(head.amax(dim=1), head.amin(dim=1).neg_(), out=scales[: whole // block])
    if whole < x.numel():
        scales[-1] = x[whole:].abs().max()
    return scales.div_(torch.full_like(scales, qmax))  # not by a scalar: CUDA multiplies by its reciprocal then


def _steps(x: Tensor, scales: Tensor, block: int) -> Tensor:
    """``x / scale`` rounded to the nearest integer (as floats; 0 where a block's scale is 0), in one new tensor."""
    whole = x.numel() // block * block
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    out = torch.empty(x.numel() + x.numel() % 2, dtype=torch.float32, device=x.device)  # room for a last nibble
    torch.div(x[:whole].view(-1, block), safe[: whole // block, None], out=out[:whole].view(-1, block))
    if whole < x.numel():
        torch.div(x[whole:], safe[-1], out=out[whole : x.numel()])
    out[x.numel() :] = 0.0
    return out.round_()


def quantize(x: Tensor, bits: int = 8, block: int = 128) -> Quantized:
    """``x`` (any shape, read flat) as ``bits``-bit integers with one scale a block of ``block`` values.

    Examples:
        >>> q = quantize(torch.tensor([127.0, -63.0, 0.5, -0.25]), bits=8, block=2)
        >>> [round(v, 5) for v in dequantize(q).tolist()]  # the second block's -0.25 moves to its nearest step
        [127.0, -63.0, 0.5, -0.25197]
        >>> quantize(torch.ones(100), bits=4, block=50).nbytes  # 50 bytes of nibbles, two scales
        58
    """
    qmax = _qmax(bits)
    flat = x.detach().reshape(-1).to(torch.float32)
    scales = _block_scales(flat, qmax, block)
    steps = _steps(flat, scales, block)
    if bits == 8:  # v + 128 as a byte is v's two's-complement byte with its top bit flipped
        data = steps[: flat.numel()].to(torch.int8).view(torch.uint8).bitwise_xor_(0x80)
    else:  # (v0 + 8) | (v1 + 8) << 4  ==  (v0 + 16 v1 + 8) + 128, and v0 + 16 v1 + 8 fits a signed byte
        pairs = steps.view(-1, 2)
        packed = torch.addcmul(pairs[:, 0], pairs[:, 1], steps.new_tensor(16.0)).add_(8)
        data = packed.to(torch.int8).view(torch.uint8).bitwise_xor_(0x80)
    return Quantized(data, scales, flat.numel(), bits, block)


def dequantize(q: Quantized) -> Tensor:
    """The fp32 values ``q`` stands for, flat.

    Examples:
        >>> dequantize(quantize(torch.tensor([7.0, -3.5, 0.0]), bits=4)).tolist()
        [7.0, -4.0, 0.0]
    """
    full = q.scales.numel() * q.block
    room = full if q.bits == 8 else max(full, 2 * q.data.numel())  # 4 bits: a last nibble past the blocks
    values = torch.empty(room, dtype=torch.float32, device=q.data.device)
    if q.bits == 8:
        values[: q.numel] = q.data
    else:
        pairs = values[: 2 * q.data.numel()].view(-1, 2)
        pairs[:, 0] = q.data & 0x0F
        pairs[:, 1] = q.data >> 4
    values[: q.numel].sub_(128 if q.bits == 8 else 8)
    values[q.numel : full] = 0.0
    return values[:full].view(-1, q.block).mul_(q.scales[:, None]).view(-1)[: q.numel]


def _half_scales(x: Tensor, qmax: int, block: int) -> Tensor:
    """Half of each value's block scale: the most round-to-nearest can move it."""
    return (_block_scales(x.reshape(-1).float(), qmax, block) / 2).repeat_interleave(block)[: x.numel()]


def error_bound(contributions: list[Tensor], bits: int = 8, block: int = 128) -> Tensor:
    """The largest error, per element, :func:`quantized_all_reduce` can make averaging ``contributions`` (one a
    rank, as many as ranks): half a block scale for each contribution sent to the chunk's owner (their sum over
    the number of ranks) and half the reduced chunk's, the blocks counted from each rank's chunk as the reduction
    cuts them.

    Examples:
        >>> round(float(error_bound([torch.full((4,), 127.0), torch.full((4,), -127.0)], bits=8, block=4).max()), 3)
        0.251
    """
    qmax, size = _qmax(bits), len(contributions)
    flat = [c.reshape(-1).float() for c in contributions]
    bound = torch.zeros_like(flat[0])
    for j in range(size):
        a, b = chunk_range(flat[0].numel(), size, j)
        sent = sum(_half_scales(c[a:b], qmax, block) for i, c in enumerate(flat) if i != j) / size
        largest = torch.stack([c[a:b] for c in flat]).mean(dim=0).abs() + sent
        bound[a:b] = sent + _half_scales(largest, qmax, block)
    return bound


def _wire_sizes(numel: int, bits: int, block: int) -> tuple[int, int]:
    """``(bytes of integers, scales)`` of :func:`quantize` of ``numel`` values."""
    return (numel if bits == 8 else -(-numel // 2)), -(-numel // block)


def _exchange(
    sends: dict[int, Quantized], mine: int, rank: int, size: int, group: dist.ProcessGroup | None
) -> list[Quantized]:
    """The other ranks' quantized contributions to this rank's chunk (``mine`` values), ``sends[j]`` sent to rank
    ``j``."""
    received, requests = [], []
    some = next(iter(sends.values()))
    n_data, n_scales = _wire_sizes(mine, some.bits, some.block)
    for step in range(1, size):
        dst, src = (rank + step) % size, (rank - step) % size
        out = sends[dst]
        data = torch.empty(n_data, dtype=torch.uint8, device=out.data.device)
        scales = torch.empty(n_scales, dtype=torch.float32, device=out.data.device)
        peer = dist.get_global_rank(group, dst) if group is not None else dst
        source = dist.get_global_rank(group, src) if group is not None else src
        requests += [dist.isend(out.data, peer, group), dist.isend(out.scales, peer, group)]
        requests += [dist.irecv(data, source, group), dist.irecv(scales, source, group)]
        received.append(Quantized(data, scales, mine, some.bits, some.block))
    for request in requests:
        if request is not None:
            request.wait()
    return received


def _gather(mine: Quantized, sizes: list[int], group: dist.ProcessGroup | None, size: int) -> list[Quantized]:
    """Every rank's quantized reduced chunk (all-gathered, padded to the largest)."""
    longest_data, longest_scales = _wire_sizes(max(sizes), mine.bits, mine.block)
    data = torch.zeros(longest_data, dtype=torch.uint8, device=mine.data.device)
    scales = torch.zeros(longest_scales, dtype=torch.float32, device=mine.data.device)
    data[: mine.data.numel()], scales[: mine.scales.numel()] = mine.data, mine.scales
    datas, scaless = [torch.empty_like(data) for _ in range(size)], [torch.empty_like(scales) for _ in range(size)]
    dist.all_gather(datas, data, group=group)
    dist.all_gather(scaless, scales, group=group)
    out = []
    for j, numel in enumerate(sizes):
        n_data, n_scales = _wire_sizes(numel, mine.bits, mine.block)
        out.append(Quantized(datas[j][:n_data], scaless[j][:n_scales], numel, mine.bits, mine.block))
    return out


def quantized_all_reduce(
    tensor: Tensor,
    bits: int = 8,
    average: bool = True,
    group: dist.ProcessGroup | None = None,
    block: int = 128,
    counter: CommCounter | None = None,
) -> Tensor:
    """Reduce the flat fp32 ``tensor`` in place over ``group``, its values sent as ``bits`` bits (see the module doc).

    The result is the same on every rank; its error against the exact sum or mean is at most :func:`error_bound`.
    ``counter`` counts the bytes this rank sends (integers and scales), the messages and one operation.

    Examples:
        >>> t = torch.tensor([127.0, -63.0, 2.0])
        >>> quantized_all_reduce(t, bits=8).tolist()  # one process: the values as 8 bits carry them
        [127.0, -63.0, 2.0]
    """
    _qmax(bits)
    start = time.perf_counter()
    size = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    flat = tensor.view(-1)
    if size == 1:
        flat.copy_(dequantize(quantize(flat, bits, block)))
        return tensor
    rank = dist.get_rank(group)
    ranges = [chunk_range(flat.numel(), size, j) for j in range(size)]
    sends = {j: quantize(flat[a:b], bits, block) for j, (a, b) in enumerate(ranges) if j != rank}
    a, b = ranges[rank]
    received = _exchange(sends, b - a, rank, size, group)
    reduced = flat[a:b].to(torch.float32, copy=True)  # this rank's own part, exact
    for q in received:
        reduced += dequantize(q)
    if average:
        reduced /= size
    gathered = _gather(quantize(reduced, bits, block), [b - a for a, b in ranges], group, size)
    for (a, b), q in zip(ranges, gathered, strict=True):
        flat[a:b] = dequantize(q)
    if counter is not None:
        sent = sum(q.nbytes for q in sends.values())
        counter.bytes_sent += sent + (size - 1) * gathered[rank].nbytes
        counter.messages += 4 * (size - 1)
        counter.operations += 1
        counter.seconds += time.perf_counter() - start
    return tensor
