"""A link between two processes: a latency per message and a bandwidth, fitted from measurements."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Link"]


@dataclass(frozen=True)
class Link:
    """A point-to-point link: ``seconds = messages * latency_s + bytes / bandwidth_bytes_per_s``.

    A link is, by default, what :func:`~lightning_dp_strategies.comm.probe.probe_link` measures on the live job: the
    ring's own throughput, its fp32 adds and socket copies included. ``wire_only=True`` marks a data-sheet figure
    instead (:meth:`nominal`: ``Link.nominal(125e6)`` for 1 GbE): the wire alone, to which the step model adds the
    local work the probe would have included, priced with :class:`~lightning_dp_strategies.plan.CpuCosts` (see
    :mod:`lightning_dp_strategies.plan.step`).

    Examples:
        >>> link = Link(latency_s=1e-5, bandwidth_bytes_per_s=1e9)
        >>> round(link.seconds(messages=2, nbytes=1e6), 6)
        0.00102
        >>> Link.nominal(125e6).wire_only  # 1 GbE as the data sheet says
        True
    """

    latency_s: float
    bandwidth_bytes_per_s: float
    wire_only: bool = False
    """The wire alone (a nominal bandwidth), not a probe's fit: the step model adds the ring's local work."""

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_per_s > 0 or math.isinf(self.bandwidth_bytes_per_s):
            raise ValueError(
                f"Link bandwidth must be a positive, finite number of bytes per second, got "
                f"{self.bandwidth_bytes_per_s!r}: e.g. 25e9 for 200 Gb/s, or fit one with Link.fit(measurements)."
            )
        if not self.latency_s >= 0:
            raise ValueError(f"Link latency must be >= 0 seconds per message, got {self.latency_s!r}.")

    @classmethod
    def nominal(cls, bandwidth_bytes_per_s: float, latency_s: float = 5e-5) -> Link:
        """A link from its nominal figures (``wire_only=True``): ``125e6`` bytes/s for 1 GbE, ``1.25e9`` for 10 GbE."""
        return cls(latency_s, bandwidth_bytes_per_s, wire_only=True)

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
