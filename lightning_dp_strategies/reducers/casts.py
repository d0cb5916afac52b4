"""Compression by casting: the bucket travels as fp16 or bf16 and is written back in its own dtype."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.futures import Future

from lightning_dp_strategies.reducers.base import GradBucket, Reducer, ReducerWrapper
from lightning_dp_strategies.reducers.builtin import resolve_reducer

__all__ = ["CastCompression", "bf16_compress", "fp16_compress"]


class CastCompression(ReducerWrapper):
    """Reduce a ``dtype`` copy of the bucket with ``inner``, then cast the result back into the bucket.

    For an average, every rank divides by N *before* the cast and the inner reducer sums, so fp16's range (max
    65504) only has to hold the average, not the sum of N gradients. Bytes sent shrink by the dtype's size ratio
    (half, from fp32 to fp16/bf16); the presence flags survive the cast (``1 / N`` stays positive). Its optional
    steps (setup, close, ...) are the inner reducer's (:class:`~lightning_dp_strategies.reducers.ReducerWrapper`).

    Args:
        inner: the reducer of the compressed bucket (a name such as ``"ring"`` or ``"native"``, or a reducer).
        dtype: the wire dtype, ``torch.float16`` or ``torch.bfloat16``.

    Examples:
        >>> bucket = GradBucket(torch.tensor([1.0, 2.0**-12, 3.0]))
        >>> bf16_compress("ring")(bucket).wait()  # one process: only the rounding of bf16 shows
        tensor([1.0000e+00, 2.4414e-04, 3.0000e+00])
    """

    def __init__(self, inner: str | Reducer | None = "ring", dtype: torch.dtype = torch.float16) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"CastCompression compresses to torch.float16 or torch.bfloat16, got {dtype}.")
        super().__init__(resolve_reducer(inner))
        self.dtype = dtype

    def __call__(self, bucket: GradBucket) -> Future[Tensor]:
        buffer = bucket.buffer
        if buffer.dtype == self.dtype:  # nothing to compress
            return self.inner(bucket)
        world = bucket.world_size
        if bucket.op == "avg" and world > 1:
            low = buffer.div(world).to(self.dtype)  # divide in full precision, then cast: no overflow in the sum
            op: Any = "sum"
        else:
            low, op = buffer.to(self.dtype), bucket.op
        inner = self.inner(bucket.with_buffer(low, op=op))

        def write_back(reduced: Future[Any]) -> Tensor:
            reduced.value()  # the inner reduction's error, if any, reaches the waiter
            buffer.copy_(low)
            return buffer

        return inner.then(write_back)


def fp16_compress(inner: str | Reducer | None = "ring") -> CastCompression:
    """``inner`` on an fp16 copy of every bucket (half the bytes), divided by N before the sum.

    Examples:
        >>> fp16_compress("native").dtype
        torch.float16
    """
    return CastCompression(inner, torch.float16)


def bf16_compress(inner: str | Reducer | None = "ring") -> CastCompression:
    """``inner`` on a bf16 copy of every bucket: half the bytes, fp32's range, 8 bits of mantissa.

    Examples:
        >>> bf16_compress().dtype
        torch.bfloat16
    """
    return CastCompression(inner, torch.bfloat16)
