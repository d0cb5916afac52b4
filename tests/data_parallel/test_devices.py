"""as_devices: bad device lists raise errors that name the fix, also through scatter."""

from __future__ import annotations

import pytest
import torch

from lightning_dp_strategies.data_parallel import as_devices, scatter

# numerically sensitive: CI runs this file again under other CPU kernel paths and thread counts
pytestmark = pytest.mark.numerics


@pytest.mark.parametrize(
    ("devices", "message"),
    [
        (["cpu", "cuda:0"], "mix the device types"),
        (["tpu:0", "tpu:1"], "Unknown device 'tpu:0'"),
        (["meta", "meta"], "'meta' is not supported"),
        ([], "non-empty list"),
    ],
)
def test_bad_devices_raise_errors_naming_the_fix(devices: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        as_devices(devices)
    with pytest.raises(ValueError, match=message):
        scatter(torch.zeros(4), devices)
