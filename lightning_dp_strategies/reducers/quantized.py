"""``"int8"`` / ``"int4"``: a bucket's values sent as 8 or 4 bits with a scale a block (lossy), its flags exact."""

from __future__ import annotations

import time

import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_dp_strategies.comm.ops import divide_
from lightning_dp_strategies.comm.quantized import QUANTIZED_BITS, quantized_all_reduce
from lightning_dp_strategies.reducers.base import ReducerBase
from lightning_dp_strategies.reducers.bucket import GradBucket, completed

__all__ = ["QuantizedReducer"]


class QuantizedReducer(ReducerBase):
    """Reduce a bucket with :func:`~lightning_dp_strategies.comm.quantized.quantized_all_reduce`: each value crosses
    the wire twice as ``bits`` bits, with one fp32 scale a ``block`` of values, and is summed in fp32; the presence
    flags at the bucket's end are reduced exactly beside them. About a quarter (8 bits) or an eighth (4 bits) of the
    fp32 ring's bytes; every rank gets the same values, each within half a block scale, twice, of the exact result.

    It runs on the caller's thread (a synchronous reduction): meant for what crosses a slow link rarely, such as
    local SGD's averaged parameter change (``LocalSGDStrategy(reducer="int4")``), more than for every gradient.

    Examples:
        >>> QuantizedReducer(4)
        QuantizedReducer(bits=4, block=128)
        >>> import torch
        >>> bucket = GradBucket(torch.tensor([127.0, -63.0, 1.0]), num_flags=1)
        >>> QuantizedReducer(8)(bucket).wait().tolist()  # one process
        [127.0, -63.0, 1.0]
    """

    def __init__(self, bits: int = 8, block: int = 128) -> None:
        if bits not in QUANTIZED_BITS:
            raise ValueError(f"QuantizedReducer sends 8 or 4 bits a value, got bits={bits!r}.")
        if block < 1:
            raise ValueError(f"QuantizedReducer's `block` is a number of values (>= 1), got {block!r}.")
        self.bits, self.block = bits, block

    def __repr__(self) -> str:
        return f"QuantizedReducer(bits={self.bits}, block={self.block})"

    def __call__(self, bucket: GradBucket) -> Future[Tensor]:
        world, average = bucket.world_size, bucket.op == "avg"
        if world == 1:
            return completed(bucket.buffer)
        values = bucket.buffer[: bucket.buffer.numel() - bucket.num_flags]
        quantized_all_reduce(values, self.bits, average, bucket.group, self.block, bucket.counter)
        if bucket.num_flags:
            start, flags = time.perf_counter(), bucket.flags
            dist.all_reduce(flags, group=bucket.group)
            if average:
                divide_(flags, world)
            bucket.counter.bytes_sent += 2 * (world - 1) * flags.numel() * flags.element_size() // world
            bucket.counter.seconds += time.perf_counter() - start
        return completed(bucket.buffer)
