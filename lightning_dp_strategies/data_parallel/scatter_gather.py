"""Scatter a batch into one chunk per replica, and gather the replicas' outputs back on one device."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from lightning_dp_strategies.data_parallel.devices import DeviceLike, as_devices
from lightning_dp_strategies.data_parallel.pytree import _children, _rebuild, _tensors

__all__ = ["gather", "scatter", "split_sizes"]

T = TypeVar("T")


# ---------------------------------------------------------------------------------------------------- scatter
def split_sizes(batch_size: int, num_devices: int) -> list[int]:
    """Sizes of the chunks: as even as possible, the first ``batch_size % n`` one larger, never an empty chunk.

    Examples:
        >>> split_sizes(10, 3)
        [4, 3, 3]
        >>> split_sizes(2, 4)  # a batch smaller than the number of devices uses fewer replicas
        [1, 1]
    """
    if batch_size < 0 or num_devices < 1:
        raise ValueError(f"Need batch_size >= 0 and num_devices >= 1, got {batch_size} and {num_devices}.")
    n = max(1, min(num_devices, batch_size))
    base, extra = divmod(batch_size, n)
    return [base + 1] * extra + [base] * (n - extra)


def _batch_size(inputs: Any, dim: int, name: str) -> int | None:
    first: tuple[str, int] | None = None
    for path, tensor in _tensors(inputs, name):
        if tensor.dim() == 0:
            continue  # a scalar has no batch dimension: it is copied to every replica
        if tensor.dim() <= dim:
            raise ValueError(
                f"Cannot split {path} (shape {tuple(tensor.shape)}) along dim {dim}: every tensor argument needs "
                f"the batch dimension {dim}. Pass per-batch constants as module buffers or attributes instead."
            )
        if first is None:
            first = (path, tensor.shape[dim])
        elif tensor.shape[dim] != first[1]:
            raise ValueError(
                f"Cannot split the batch: {path} has {tensor.shape[dim]} rows along dim {dim} but {first[0]} has "
                f"{first[1]}. Every tensor that is split must share the batch size; pass tensors shared by all "
                "samples as module buffers/attributes, or expand them to the batch size."
            )
    return None if first is None else first[1]


def scatter(inputs: T, devices: Sequence[DeviceLike], dim: int = 0, name: str = "inputs") -> list[T]:
    """Split ``inputs`` into one piece per replica, each moved to its device.

    Tensors are split along ``dim`` (which every non-scalar tensor must share in size) into chunks as even as
    :func:`split_sizes` makes them, recursing through tuples, lists, dicts, named tuples and dataclasses; 0-dim tensors
    and non-tensors are copied (by reference) to every replica. A batch smaller than ``len(devices)`` gives fewer
    pieces; inputs without a tensor to split give one piece.

    Args:
        inputs: any nesting of the containers above, e.g. ``(args, kwargs)`` of a forward call.
        devices: the replicas' devices, one type (see :func:`as_devices`).
        dim: the batch dimension.
        name: how error messages call ``inputs``.

    Examples:
        >>> pieces = scatter({"x": torch.arange(5), "tag": "a"}, ["cpu"] * 2)
        >>> [p["x"].tolist() for p in pieces], [p["tag"] for p in pieces]
        ([[0, 1, 2], [3, 4]], ['a', 'a'])
    """
    targets = as_devices(devices)
    batch = _batch_size(inputs, dim, name)
    sizes = split_sizes(batch or 0, len(targets))
    return [_take(inputs, i, sizes, dim, targets[i]) for i in range(len(sizes))]


def _take(obj: Any, index: int, sizes: list[int], dim: int, device: torch.device) -> Any:
    if isinstance(obj, Tensor):
        if obj.dim() == 0 or len(sizes) == 1:
            return obj.to(device)
        start = sum(sizes[:index])
        return obj.narrow(dim, start, sizes[index]).to(device, non_blocking=device.type == "cuda")
    children = _children(obj)
    if children is None:
        return obj
    return _rebuild(obj, [_take(child, index, sizes, dim, device) for _, child in children])


# ---------------------------------------------------------------------------------------------------- gather
def gather(outputs: Sequence[Any], device: DeviceLike, dim: int = 0) -> Any:
    """Merge the replicas' outputs on ``device``: tensors concatenated along ``dim``, containers recursively.

    Every replica must return the same structure. Non-tensor leaves equal in all replicas are kept once, otherwise
    returned as the list of per-replica values. 0-dim tensors (for example a loss computed inside ``forward``) are
    stacked into a vector with one value per replica, with a warning: their mean is not the batch mean when the split
    is uneven.

    Examples:
        >>> gather([(torch.zeros(2), "a"), (torch.ones(1), "a")], "cpu")
        (tensor([0., 0., 1.]), 'a')
    """
    if len(outputs) == 0:
        raise ValueError("Nothing to gather: `outputs` is empty.")
    return _merge(list(outputs), as_devices([device])[0], dim, "output")


def _merge(values: list[Any], device: torch.device, dim: int, path: str) -> Any:
    first = values[0]
    if isinstance(first, Tensor):
        if not all(isinstance(v, Tensor) for v in values):
            raise ValueError(
                f"{path} is a tensor in replica 0 but not in every replica; forward must return one structure."
            )
        moved = [v.to(device) for v in values]
        if all(v.dim() == 0 for v in moved):
            if len(moved) > 1:
                warnings.warn(
                    f"forward returned the 0-dim tensor {path} (a loss?); its {len(moved)} per-replica values were "
                    "stacked into a vector, whose mean is not the batch mean when the batch splits unevenly. Return "
                    "per-sample values (e.g. reduction='none') and reduce them in the step: that gives exactly the "
                    "single-device gradients.",
                    stacklevel=2,
                )
            return torch.stack(moved) if len(moved) > 1 else moved[0]
        return torch.cat(moved, dim) if len(moved) > 1 else moved[0]
    children = _children(first)
    if children is None:
        return first if _all_equal(values) else values
    keys = [key for key, _ in children]
    per_replica = [children]
    for i, other in enumerate(values[1:], start=1):
        other_children = _children(other) if type(other) is type(first) else None
        if other_children is None or [key for key, _ in other_children] != keys:
            found = [key for key, _ in other_children or []]
            raise ValueError(
                f"The replicas returned different structures at {path}: {type(first).__name__} with {keys} in "
                f"replica 0, {type(other).__name__} with {found} in replica {i}. forward must return the same "
                "structure for every chunk of the batch."
            )
        per_replica.append(other_children)
    merged = [
        _merge([child_list[j][1] for child_list in per_replica], device, dim, path + key) for j, key in enumerate(keys)
    ]
    return _rebuild(first, merged)


def _all_equal(values: list[Any]) -> bool:
    try:
        return all(v is values[0] or bool(v == values[0]) for v in values[1:])
    except Exception:  # an __eq__ that does not give a truth value
        return False
