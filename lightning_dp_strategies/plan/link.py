"""A link between two processes: a latency per message and a bandwidth, fitted from measurements."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Link"]


@dataclass(frozen=True)
class Link:
    """A point-to-point link: ``seconds = messages * latency_s + bytes / bandwidth_bytes_per_s``.

    Examples:
        >>> link = Link(latency_s=1e-5, bandwidth_bytes_per_s=1e9)
        >>> round(link.seconds(messages=2, nbytes=1e6), 6)
        0.00102
    """

    latency_s: float
    bandwidth_bytes_per_s: float

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_per_s > 0 or math.isinf(self.bandwidth_bytes_per_s):
            raise ValueError(
                f"Link bandwidth must be a positive, finite number of bytes per second, got "
                f"{self.bandwidth_bytes_per_s!r}: e.g. 25e9 for 200 Gb/s, or fit one with Link.fit(measurements)."
            )
        if not self.latency_s >= 0:
            raise ValueError(f"Link latency must be >= 0 seconds per message, got {self.latency_s!r}.")

    def seconds(self, messages: float, nbytes: float) -> float:
        """Time to send ``messages`` messages carrying ``nbytes`` bytes in all, one after the other."""
        return messages * self.latency_s + nbytes / self.bandwidth_bytes_per_s

    @classmethod
    def fit(cls, samples: Iterable[tuple[float, float, float]]) -> Link:
        """Fit ``seconds = latency * messages + bytes / bandwidth`` to ``(messages, bytes, seconds)`` measurements.

        Least squares of the *relative* error (each sample weighted by ``1 / seconds**2``), so 64 KiB and 64 MiB
        measurements count alike. A negative latency fit (noise on tiny latencies) is clamped to 0 and the bandwidth
        refitted alone.

        Examples:
            >>> true = Link(latency_s=2e-5, bandwidth_bytes_per_s=5e8)
            >>> samples = [(m, b, true.seconds(m, b)) for m, b in [(2, 1e4), (2, 1e6), (4, 1e5), (8, 1e8)]]
            >>> fitted = Link.fit(samples)
            >>> round(fitted.latency_s, 9), round(fitted.bandwidth_bytes_per_s)
            (2e-05, 500000000)
        """
        rows = [(float(m), float(b), float(t)) for m, b, t in samples]
        if len(rows) < 2 or any(t <= 0 or b < 0 or m < 0 for m, b, t in rows):
            raise ValueError(f"Link.fit needs two or more (messages, bytes, seconds > 0) samples, got {rows!r}.")
        xy = [(m / t, b / t) for m, b, t in rows]  # relative residuals: x * latency + y / bandwidth - 1
        sxx, sxy, syy = (sum(x * x for x, _ in xy), sum(x * y for x, y in xy), sum(y * y for _, y in xy))
        sx, sy, det = sum(x for x, _ in xy), sum(y for _, y in xy), sxx * syy - sxy * sxy
        latency = (sx * syy - sy * sxy) / det if det > 1e-9 * sxx * syy else -1.0
        inverse_bandwidth = (sy * sxx - sx * sxy) / det if latency >= 0 else -1.0
        if latency < 0 or inverse_bandwidth <= 0:  # latency below the noise: fit the bandwidth alone
            latency, inverse_bandwidth = 0.0, sy / syy if syy > 0 else 0.0
        if inverse_bandwidth <= 0:
            raise ValueError("Link.fit found no bandwidth term: measure sizes large enough that bytes cost time.")
        return cls(latency_s=latency, bandwidth_bytes_per_s=1.0 / inverse_bandwidth)
