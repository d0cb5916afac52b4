"""What the collectives share: the reduction names they accept, the counter of what a rank sent, exact averaging."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
from torch import Tensor
from typing_extensions import Self

__all__ = ["CommCounter", "ReduceOpLike", "divide", "divide_", "is_average"]

ReduceOpLike = dist.ReduceOp.RedOpType | str
_AVERAGE_NAMES = {"avg", "mean", "average"}
_SUM_NAMES = {"sum"}


@dataclass
class Counts:
    """A dataclass of numeric counts that add up field by field: the base of :class:`CommCounter` and of
    :class:`~lightning_dp_strategies.bucketing.CommStats`.

    Examples:
        >>> total = CommCounter(bytes_sent=400, messages=2)
        >>> step = total.copy()
        >>> total.add(CommCounter(bytes_sent=100, messages=1))
        >>> (total - step).bytes_sent, (total + step).messages, step.as_dict("comm/")["comm/bytes_sent"]
        (100, 5, 400.0)
    """

    def reset(self) -> None:
        """Zero every field."""
        for f in fields(self):
            setattr(self, f.name, f.default)

    def add(self, other: Self) -> None:
        """Add ``other``'s counts to these, in place."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def __add__(self, other: Self) -> Self:
        return type(self)(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def __sub__(self, other: Self) -> Self:
        return type(self)(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def copy(self) -> Self:
        """An independent snapshot."""
        return type(self)(**{f.name: getattr(self, f.name) for f in fields(self)})

    def as_dict(self, prefix: str = "") -> dict[str, float]:
        """The fields as a flat ``{prefix + name: value}`` dictionary, e.g. for a logger."""
        return {prefix + f.name: float(getattr(self, f.name)) for f in fields(self)}


@dataclass
class CommCounter(Counts):
    """What this rank sent: bytes, point-to-point messages, collective operations and seconds spent in them.

    Examples:
        >>> total = CommCounter(bytes_sent=400, messages=2, operations=1)
        >>> total.add(CommCounter(bytes_sent=100, messages=1))
        >>> total.bytes_sent, total.messages, total.operations
        (500, 3, 1)
    """

    bytes_sent: int = 0
    """Bytes this rank sent."""
    messages: int = 0
    """Point-to-point messages this rank sent."""
    operations: int = 0
    """Collective operations (one all-reduce, reduce-scatter or all-gather each)."""
    seconds: float = 0.0
    """Seconds spent in them."""
    inter_node_bytes: int = 0
    """Of ``bytes_sent``, the bytes sent to another node (counted by the two-level all-reduce)."""


def is_average(op: ReduceOpLike) -> bool:
    """``True`` for an average, ``False`` for a sum; a clear error for anything else.

    Examples:
        >>> is_average("mean"), is_average(dist.ReduceOp.SUM)
        (True, False)
    """
    if isinstance(op, str):
        name = op.lower()
        if name in _AVERAGE_NAMES:
            return True
        if name in _SUM_NAMES:
            return False
    elif op == dist.ReduceOp.AVG:
        return True
    elif op == dist.ReduceOp.SUM:
        return False
    raise ValueError(f"Unsupported reduction {op!r}: use 'sum' or 'avg' (or dist.ReduceOp.SUM / dist.ReduceOp.AVG).")


def divide(tensor: Tensor, divisor: int, *, out: Tensor | None = None) -> Tensor:
    """``tensor / divisor`` (into ``out``, which may be ``tensor`` itself), bit for bit as ``torch.div``, but faster
    where that is exact.

    For a power-of-two ``divisor`` and a real floating tensor, multiplying by the reciprocal gives the same bits (both
    round the same exact quotient once) and is several times faster on CPU (``docs/benchmarks.md``).

    Examples:
        >>> divide(torch.tensor([3.0, 1.0]), 2), divide(torch.tensor([3.0, 1.0]), 3)
        (tensor([1.5000, 0.5000]), tensor([1.0000, 0.3333]))
    """
    if divisor > 0 and divisor & (divisor - 1) == 0 and tensor.is_floating_point():
        return torch.mul(tensor, 1.0 / divisor, out=out)
    return torch.div(tensor, divisor, out=out)


def divide_(tensor: Tensor, divisor: int) -> Tensor:
    """In-place :func:`divide`: ``tensor /= divisor``, the same bits as ``tensor.div_(divisor)``.

    Examples:
        >>> grad = torch.tensor([3.0, 1.0])
        >>> divide_(grad, 4) is grad, grad
        (True, tensor([0.7500, 0.2500]))
    """
    return divide(tensor, divisor, out=tensor)
