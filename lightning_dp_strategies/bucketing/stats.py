"""Communication statistics of the gradient buckets: bytes, messages, buckets and waits."""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["CommStats"]


@dataclass
class CommStats:
    """Counts of gradient communication; :class:`GradientBuckets` keeps running totals, strategies per-step deltas.

    Examples:
        >>> before = CommStats(bytes_sent=1000, synced_backwards=2)
        >>> step = CommStats(bytes_sent=1600, synced_backwards=3) - before
        >>> step.bytes_sent, step.synced_backwards, step.as_dict("comm/")["comm/bytes_sent"]
        (600, 1, 600.0)
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

    def __add__(self, other: CommStats) -> CommStats:
        return CommStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def __sub__(self, other: CommStats) -> CommStats:
        return CommStats(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def copy(self) -> CommStats:
        """An independent snapshot."""
        return CommStats(**{f.name: getattr(self, f.name) for f in fields(self)})

    def as_dict(self, prefix: str = "") -> dict[str, float]:
        """The fields as a flat ``{prefix + name: value}`` dictionary, e.g. for a logger."""
        return {prefix + f.name: float(getattr(self, f.name)) for f in fields(self)}
