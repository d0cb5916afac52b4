"""Communication statistics of the gradient buckets: bytes, messages, buckets and waits."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_dp_strategies.comm.ops import CommCounter, Counts

__all__ = ["COUNTER_FIELDS", "CommStats"]

COUNTER_FIELDS: dict[str, str] = {
    "bytes_sent": "bytes_sent",
    "inter_node_bytes": "inter_node_bytes_sent",
    "messages": "messages",
    "operations": "ring_operations",
    "seconds": "comm_seconds",
}
"""Each field of :class:`~lightning_dp_strategies.comm.CommCounter` (what a collective counts) and the field of
:class:`CommStats` that totals it; :meth:`CommStats.add_counter` adds one to the other by this table."""


@dataclass
class CommStats(Counts):
    """Counts of gradient communication; :class:`GradientBuckets` keeps running totals, strategies per-step deltas.

    The fields a collective counts are :class:`~lightning_dp_strategies.comm.CommCounter`'s, named here as
    :data:`COUNTER_FIELDS` says; the others count what only the buckets (or the pipeline) see. They add, subtract,
    copy and flatten field by field (:class:`~lightning_dp_strategies.comm.ops.Counts`).

    Examples:
        >>> before = CommStats(bytes_sent=1000, synced_backwards=2)
        >>> step = CommStats(bytes_sent=1600, synced_backwards=3) - before
        >>> step.bytes_sent, step.synced_backwards, step.as_dict("comm/")["comm/bytes_sent"]
        (600, 1, 600.0)
        >>> synced = CommStats.from_counter(CommCounter(bytes_sent=40, operations=1, seconds=0.5), exposed=True)
        >>> synced.bytes_sent, synced.ring_operations, synced.comm_seconds, synced.exposed_seconds
        (40, 1, 0.5, 0.5)
    """

    bytes_sent: int = 0
    """Bytes this rank sent for gradient reduction."""
    inter_node_bytes_sent: int = 0
    """Of ``bytes_sent``, the bytes sent to ranks on other nodes (counted by the two-level reduction only; the rest
    stayed inside the node)."""
    messages: int = 0
    """Point-to-point messages this rank sent."""
    ring_operations: int = 0
    """Bucket reductions (one all-reduce each)."""
    overlapped_buckets: int = 0
    """Buckets whose reduction started while backward was still running."""
    comm_seconds: float = 0.0
    """Seconds the communication thread spent reducing buckets (overlapped with backward or not)."""
    exposed_seconds: float = 0.0
    """Seconds the training loop waited for communication after backward had finished."""
    synced_backwards: int = 0
    """Backward passes whose gradients were reduced."""
    skipped_backwards: int = 0
    """Backward passes that did not communicate (gradient accumulation, ``no_sync``)."""
    pipeline_bytes_sent: int = 0
    """Bytes this rank sent to neighbouring pipeline stages: activations forward, their gradients backward
    (``hybrid_pipeline`` only)."""
    pipeline_bytes_received: int = 0
    """Bytes this rank received from neighbouring pipeline stages (``hybrid_pipeline`` only)."""

    @classmethod
    def from_counter(cls, counter: CommCounter, exposed: bool = False) -> CommStats:
        """What ``counter`` saw, as statistics; ``exposed``: the training loop waited for all of it (outside
        backward, as a synchronisation of local SGD is)."""
        stats = cls()
        stats.add_counter(counter)
        if exposed:
            stats.exposed_seconds = counter.seconds
        return stats

    def add_counter(self, counter: CommCounter) -> None:
        """Add what a collective's ``counter`` saw to these totals (by :data:`COUNTER_FIELDS`)."""
        for source, target in COUNTER_FIELDS.items():
            setattr(self, target, getattr(self, target) + getattr(counter, source))
