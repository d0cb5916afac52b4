"""What a failed collective most likely means, logged at once on the rank that sees it."""

from __future__ import annotations

import logging

__all__ = ["PEER_FAILURE_HINT", "PeerLostError", "announce_failure"]


PEER_FAILURE_HINT = (
    "Another rank most likely died or stopped responding (a crash, an out-of-memory kill, a lost node) or the "
    "collective timed out (the strategy's `timeout`). Look for the first error in the other ranks' logs; checkpoints "
    "already written are complete, so resume from the last one with `trainer.fit(..., ckpt_path='last')`."
)
"""What a failed collective most likely means, and what to do; appended to the strategies' errors."""


class PeerLostError(RuntimeError):
    """A wait for a collective gave up because a peer is known to be gone (a fault-tolerant strategy's membership
    said so) rather than because the collective itself failed."""


_log = logging.getLogger("lightning_dp_strategies")


def announce_failure(message: str) -> str:
    """Log ``message`` on this rank at once, and return it for the exception that carries it.

    The exception may never be printed: Lightning's launcher kills every rank within seconds of one rank dying, and
    the strategy's teardown runs before the traceback is shown."""
    _log.error(message)
    return message
