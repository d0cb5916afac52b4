"""Where a step runs: nodes and their links (:class:`Topology`), and what the CPU pays per byte (:class:`CpuCosts`)."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_dp_strategies.plan.link import Link

__all__ = ["CpuCosts", "Topology"]


@dataclass(frozen=True)
class Topology:
    """``nodes`` machines of ``per_node`` processes each: an ``inter`` link between nodes, an ``intra`` one inside.

    ``inter`` is one node's network link (its bandwidth is shared by every stream that crosses it at once); ``intra``
    is the link between two processes of one node (shared memory, NVLink, loopback), the ``inter`` link by default;
    ``flat`` is what a ring over every rank runs at (its slowest hop, with every rank in it), ``inter`` by default
    (``intra`` on one node). Measure them on the live job with
    :func:`~lightning_dp_strategies.comm.probe.probe_ring`, each with every rank busy as the reduction keeps them:
    every node's link at once, every node inside at once, the whole ring. A probe's ``busy`` (the share of the ring's
    time the process's CPU was busy) goes in ``inter_busy``, ``intra_busy``, ``flat_busy``: where the CPU sets the
    pace, the phases of a two-level reduction take turns on it instead of overlapping (0, the default: the wire alone
    sets it).

    Examples:
        >>> gbe = Link(latency_s=5e-5, bandwidth_bytes_per_s=1.25e8)
        >>> Topology(nodes=2, per_node=4, inter=gbe).world_size
        8
    """

    nodes: int
    per_node: int
    inter: Link
    intra: Link | None = None
    flat: Link | None = None
    inter_busy: float = 0.0
    intra_busy: float = 0.0
    flat_busy: float = 0.0

    def __post_init__(self) -> None:
        for name in ("nodes", "per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Topology `{name}` must be an integer >= 1, got {value!r}.")
        for name in ("inter_busy", "intra_busy", "flat_busy"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(
                    f"Topology `{name}` is a share of a ring's time in [0, 1], got {getattr(self, name)!r}."
                )

    @property
    def world_size(self) -> int:
        """Processes in all."""
        return self.nodes * self.per_node

    @property
    def intra_link(self) -> Link:
        """The link between two processes of one node (``inter`` when none was given)."""
        return self.intra if self.intra is not None else self.inter

    @property
    def flat_link(self) -> Link:
        """The link a ring over every rank runs at (``inter`` across nodes, ``intra_link`` on one, when not given)."""
        if self.flat is not None:
            return self.flat
        return self.inter if self.nodes > 1 else self.intra_link


@dataclass(frozen=True)
class CpuCosts:
    """Seconds per byte of the local work that gradient reduction adds to the ring's time, on one process.

    Measure them on the machine that trains (:func:`lightning_dp_strategies.reducers.calibrate_cpu` does, in a few
    seconds); the defaults are zero, which prices the ring alone. A link measured by
    :func:`~lightning_dp_strategies.comm.probe.probe_link` already holds the ring's fp32 adds, so the step model
    charges ``add`` there only as the baseline a 16-bit ring's adds are priced against (``add_low - add`` a byte
    summed); on a nominal link (``Link.nominal``) it also prices the ring's own fp32 adds and socket copies with
    ``add`` (see :mod:`lightning_dp_strategies.plan.step`).

    Args:
        add: summing a received fp32 chunk into the bucket, per fp32 byte.
        add_low: summing a received bf16/fp16 chunk, per 2-byte-element byte.
        cast: casting fp32 to 16 bits and back, per fp32 byte.
        powersgd: PowerSGD's local work (error feedback, the three factor products, orthogonalisation), per byte of
            the fp32 matrices it compresses, at rank ``powersgd_rank``.
        powersgd_rank: the rank ``powersgd`` was measured at.
        overlap: how much of that work runs beside the process's compute rather than taking turns with it: 1 where
            the process has a core to spare for its communication thread (the default), 0 where its threads share
            one (more processes than cores); measured as the second thread's gain in throughput.

    Examples:
        >>> CpuCosts(add=2e-10).add * 4e6  # summing 1 M fp32 values
        0.0008
    """

    add: float = 0.0
    add_low: float = 0.0
    cast: float = 0.0
    powersgd: float = 0.0
    powersgd_rank: int = 4
    overlap: float = 1.0

    def __post_init__(self) -> None:
        for name in ("add", "add_low", "cast", "powersgd"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"CpuCosts `{name}` must be >= 0 seconds per byte, got {value!r}.")
        if not 0 <= self.overlap <= 1:
            raise ValueError(f"CpuCosts `overlap` is a share in [0, 1], got {self.overlap!r}.")
