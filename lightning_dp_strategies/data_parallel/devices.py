"""The devices replicas may run on: one type, CPU (logical replicas) or CUDA (one replica per GPU)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["as_devices"]

DeviceLike = torch.device | str | int
SUPPORTED_DEVICE_TYPES = ("cpu", "cuda")


def as_devices(devices: Sequence[DeviceLike]) -> list[torch.device]:
    """Normalise ``devices`` (``torch.device``, ``"cuda:1"``, or a CUDA index) and check they are one supported type.

    Examples:
        >>> as_devices(["cpu", torch.device("cpu")])
        [device(type='cpu'), device(type='cpu')]
    """
    if isinstance(devices, (str, int, torch.device)) or len(devices) == 0:
        raise ValueError(
            f"Expected a non-empty list of devices such as ['cuda:0', 'cuda:1'] or ['cpu'] * 3, got {devices!r}."
        )
    out: list[torch.device] = []
    for device in devices:
        try:
            out.append(torch.device("cuda", device) if isinstance(device, int) else torch.device(device))
        except (RuntimeError, TypeError) as err:
            raise ValueError(f"Unknown device {device!r}: use 'cpu', 'cuda:<index>' or a torch.device.") from err
    types = sorted({d.type for d in out})
    if len(types) > 1:
        raise ValueError(
            f"The devices {[str(d) for d in out]} mix the device types {types}: scatter/gather data parallelism needs "
            "devices of one type, e.g. ['cuda:0', 'cuda:1'] or ['cpu'] * 3 (logical CPU replicas)."
        )
    if types[0] not in SUPPORTED_DEVICE_TYPES:
        raise ValueError(
            f"Device type {types[0]!r} is not supported: replicas run on {list(SUPPORTED_DEVICE_TYPES)} devices. Use "
            "accelerator='cuda' (one replica per GPU) or accelerator='cpu' (logical replicas on the CPU)."
        )
    return out
