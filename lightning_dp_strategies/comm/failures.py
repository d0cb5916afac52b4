"""What a failed collective most likely means, logged at once on the rank that sees it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist

__all__ = [
    "PEER_FAILURE_HINT",
    "PEER_FAILURE_MARKERS",
    "PeerFailure",
    "PeerLostError",
    "announce_failure",
    "detect",
    "guarded",
    "is_peer_failure",
    "wait_work",
]


PEER_FAILURE_HINT = (
    "Another rank most likely died or stopped responding (a crash, an out-of-memory kill, a lost node) or the "
    "collective timed out (the strategy's `timeout`), which is also what ranks given different numbers of training "
    "batches in an epoch end in. Look for the first error in the other ranks' logs; checkpoints already written are "
    "complete, so resume from the last one with `trainer.fit(..., ckpt_path='last')`."
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


PEER_FAILURE_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Timed out waiting",
    "Application timeout caused pair closure",  # gloo, on a rank whose peer's side of the pair timed out
    "Connect timeout",
    "wait timeout",
)
"""What gloo's and the store's errors say when a peer is gone or did not answer in time."""


@dataclass(frozen=True)
class PeerFailure:
    """A collective that raised because a peer is gone or did not answer within the group's timeout."""

    error: BaseException
    seconds: float
    """From the call to the raise."""

    @property
    def timed_out(self) -> bool:
        """Whether the collective waited the group's whole timeout (a hung peer, a cut link, a dead non-neighbour)."""
        return "timeout" in str(self.error).lower().replace("timed out", "timeout")


def is_peer_failure(error: BaseException) -> bool:
    """Whether ``error`` says that a peer is gone or silent, rather than that the call itself was wrong.

    Examples:
        >>> is_peer_failure(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:7052"))
        True
        >>> is_peer_failure(RuntimeError("Tensors must have the same shape"))
        False
    """
    if isinstance(error, PeerLostError) or (error.__cause__ is not None and is_peer_failure(error.__cause__)):
        return True
    return isinstance(error, dist.DistError) or (
        isinstance(error, RuntimeError) and any(marker in str(error) for marker in PEER_FAILURE_MARKERS)
    )


T = TypeVar("T")


def guarded(what: str, collective: Callable[..., T], *args: Any) -> T:
    """``collective(*args)``; a peer's failure in it is logged at once and raised as a ``RuntimeError`` that names
    ``what``, this rank and :data:`PEER_FAILURE_HINT` (the original error is its ``__cause__``, so
    :func:`is_peer_failure` still says yes); any other exception propagates as it is.

    Examples:
        >>> guarded("Adding", lambda a, b: a + b, 1, 2)
        3
        >>> def collective(): raise RuntimeError("Timed out waiting 2000ms for recv operation to complete")
        >>> guarded("Comparing the ranks' counts", collective)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        RuntimeError: Comparing the ranks' counts failed on rank 0: RuntimeError: Timed out waiting 2000ms ...
    """
    try:
        return collective(*args)
    except Exception as error:
        if not is_peer_failure(error):
            raise
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        message = f"{what} failed on rank {rank}: {type(error).__name__}: {error}\n{PEER_FAILURE_HINT}"
        raise RuntimeError(announce_failure(message)) from error


def detect(fn: Callable[[], object]) -> PeerFailure | None:
    """Run ``fn`` (collectives on a group with a short timeout); the peer failure it raised, or ``None``.

    Any other exception propagates. After a failure the tensors ``fn`` passed to the collective hold undefined values
    (a partial reduction): redo the work from a copy on the new group.

    Examples:
        >>> detect(lambda: None) is None
        True
        >>> def collective(): raise RuntimeError("Timed out waiting 2000ms for recv operation to complete")
        >>> failure = detect(collective)
        >>> failure.timed_out, failure.seconds < 1
        (True, True)
    """
    start = time.monotonic()
    try:
        fn()
    except Exception as error:
        if not is_peer_failure(error):
            raise
        return PeerFailure(error, time.monotonic() - start)
    return None


def wait_work(work: dist.Work | None, interrupt: Callable[[], str | None] | None, what: str) -> None:
    """Wait for ``work`` (a collective run on its group's threads); with ``interrupt``, polled, and given up with
    :class:`PeerLostError` naming ``what`` once it gives a reason (the collective is left to end with its group, no
    Python thread waits on it)."""
    assert work is not None
    while interrupt is not None and not work.is_completed():
        reason = interrupt()
        if reason is not None:
            raise PeerLostError(f"{what} was given up: {reason}.")
        time.sleep(0.001)
    work.wait()
