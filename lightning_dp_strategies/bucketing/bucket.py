"""One gradient bucket: a flat buffer of gradients, one presence flag per parameter, and its readiness state."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.nn import Parameter

from lightning_dp_strategies.comm import CommCounter

__all__ = ["Bucket"]


@dataclass
class Bucket:
    """One flat buffer: the gradients of ``params`` back to back, then one presence flag per parameter.

    Examples:
        >>> bias, weight = Parameter(torch.zeros(3)), Parameter(torch.zeros(2, 3))
        >>> bucket = Bucket(0, [bias, weight], ["fc.bias", "fc.weight"], [0, 3], torch.zeros(3 + 6 + 2))
        >>> bucket.numel, tuple(bucket.grad_view(1).shape), bucket.flags.tolist()
        (9, (2, 3), [0.0, 0.0])
    """

    index: int
    params: list[Parameter]
    names: list[str]
    offsets: list[int]
    buffer: Tensor
    # runtime state of the current synchronised backward
    ready: list[bool] = field(default_factory=list)
    pending: int = 0
    future: torch.futures.Future[Any] | None = None
    counter: CommCounter = field(default_factory=CommCounter)

    @property
    def numel(self) -> int:
        """Gradient elements in the bucket (the flags excluded)."""
        return self.buffer.numel() - len(self.params)

    @property
    def flags(self) -> Tensor:
        """The presence flags: after reduction, > 0 where at least one rank had a gradient."""
        return self.buffer[self.numel :]

    def grad_view(self, slot: int) -> Tensor:
        """The buffer slice of parameter ``slot``, shaped like the parameter."""
        param = self.params[slot]
        start = self.offsets[slot]
        return self.buffer[start : start + param.numel()].view(param.shape)

    def reset(self) -> None:
        """Forget the readiness of the last backward."""
        self.ready = [False] * len(self.params)
        self.pending = len(self.params)
        self.future = None
        self.counter = CommCounter()
