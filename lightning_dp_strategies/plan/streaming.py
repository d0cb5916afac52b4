"""What streaming DiLoCo's planning and its ``sync_every="auto"`` share: the bytes a value of the change takes on
the wire in each outer precision, and the choice of the period and the delay from a fragment's reduction time and
the inner step's compute."""

from __future__ import annotations

import math

__all__ = ["BYTES_PER_VALUE", "choose_period"]

BYTES_PER_VALUE = {"fp32": 4.0, "bf16": 2.0, "int8": 1 + 4 / 128, "int4": 0.5 + 4 / 128}
"""Bytes a value of the change takes on the wire in each outer precision (a 4-byte scale a block of 128 values)."""


def choose_period(fragments: int, delay: int, step_seconds: float, fragment_seconds: float) -> tuple[int, int]:
    """``(sync_every, delay)`` for ``sync_every="auto"``: the smallest period in which each fragment's reduction
    (``fragment_seconds``, measured or predicted) ends before the next fragment leaves, and a delay that covers it,
    given the inner steps' compute (``step_seconds``). With ``delay=0`` nothing hides the reduction: the period is long
    enough that it costs at most a tenth of the compute.

    The period is a multiple of ``fragments`` (evenly spaced turns) and longer than the delay.

    Examples:
        >>> choose_period(4, 1, step_seconds=0.3, fragment_seconds=0.05)  # one step hides a fragment
        (4, 1)
        >>> choose_period(4, 1, step_seconds=0.3, fragment_seconds=0.7)  # three steps do
        (12, 3)
        >>> choose_period(1, 0, step_seconds=0.3, fragment_seconds=0.7)  # exposed: at most a tenth of 24 steps
        (24, 0)
    """
    ratio = fragment_seconds / max(step_seconds, 1e-9)
    if delay == 0:
        steps = max(1, math.ceil(10 * ratio))
    else:
        steps = max(1, math.ceil(ratio))
        delay = max(delay, steps)
    period = max(fragments * steps, delay + 1)
    return fragments * math.ceil(period / fragments), delay
