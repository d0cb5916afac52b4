"""Activation memory measured on any device: the bytes of tensors autograd saves for backward, at their peak.

``torch.cuda.max_memory_allocated`` exists only on CUDA; this meter works on the CPU too. Inside the context, every
tensor saved for backward is counted once per storage (a tensor saved by two operations costs its bytes once) until
autograd frees it; parameters (and tensors sharing their storage) are not activations and are not counted.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from types import TracebackType
from typing import Any

import torch
from torch import Tensor

__all__ = ["ActivationMeter"]


class _Saved:
    """What a pack hook returns: the tensor, and a release of its storage's count when autograd drops it."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, meter: ActivationMeter, tensor: Tensor, key: int | None) -> None:
        self.meter = meter
        self.tensor = tensor
        self.key = key

    def __del__(self) -> None:
        if self.key is not None:
            self.meter._release(self.key)


class ActivationMeter:
    """Track the live and peak bytes of activations saved for backward while the context is active.

    Args:
        exclude: tensors never counted (the parameters).

    Examples:
        >>> lin = torch.nn.Linear(1000, 1000)
        >>> with ActivationMeter(exclude=lin.parameters()) as meter:
        ...     loss = torch.tanh(lin(torch.randn(8, 1000))).sum()
        >>> meter.peak_bytes  # the input saved by the linear layer and the tanh output: 2 x 8 x 1000 x 4 bytes
        64000
        >>> loss.backward(); meter.live_bytes
        0
    """

    def __init__(self, exclude: Iterable[Tensor] = ()) -> None:
        # configuration
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        # runtime state
        self._counts: dict[int, tuple[int, int]] = {}  # storage pointer -> (bytes, references)
        self._lock = threading.Lock()
        self._hooks: Any = None
        # statistics
        self.live_bytes = 0
        self.peak_bytes = 0

    def _pack(self, tensor: Tensor) -> _Saved:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._excluded or storage.nbytes() == 0:
            return _Saved(self, tensor, None)
        with self._lock:
            nbytes, refs = self._counts.get(key, (storage.nbytes(), 0))
            if refs == 0:
                self.live_bytes += nbytes
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            self._counts[key] = (nbytes, refs + 1)
        return _Saved(self, tensor, key)

    @staticmethod
    def _unpack(saved: _Saved) -> Tensor:
        return saved.tensor

    def _release(self, key: int) -> None:
        with self._lock:
            nbytes, refs = self._counts[key]
            if refs == 1:
                del self._counts[key]
                self.live_bytes -= nbytes
            else:
                self._counts[key] = (nbytes, refs - 1)

    def __enter__(self) -> ActivationMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._hooks.__exit__(exc_type, exc, tb)
        self._hooks = None
