"""Streaming DiLoCo's parts: the model cut into fragments, their staggered turns, the thread that sends them, and
a fragment on its way.

A fragment is a run of consecutive parameters (in the module's order) of about ``1/K`` of the model's values. Each
fragment is synchronised every ``sync_every = H`` local steps, fragment ``p`` at the steps ``s`` with
``s ≡ (p + 1)·H // K (mod H)``, so a synchronisation sends ``1/K`` of the model every ``H/K`` steps instead of all of
it every ``H``::

    H = 8, K = 4      step  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16
    fragment 0                 s                       s
    fragment 1                             s                       s
    fragment 2                                   s                       s     (s: the fragment's outer gradient
    fragment 3                                               s                  leaves this step)

With ``delay = d > 0`` the outer gradient is averaged on :class:`OuterChannel`'s thread while the next ``d`` inner
steps run, and applied after the ``d``-th of them.
"""

from __future__ import annotations

import concurrent.futures
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from torch import Tensor

from lightning_dp_strategies.plan.streaming import BYTES_PER_VALUE, choose_period

__all__ = [
    "BYTES_PER_VALUE",
    "STREAMING_FRAGMENTS",
    "InFlight",
    "OuterChannel",
    "choose_period",
    "split_fragments",
    "turns",
]
# BYTES_PER_VALUE and choose_period live in the planning layer (``plan.streaming``), which prices streaming DiLoCo
# with them; they are named here too, where the algorithm uses them

T = TypeVar("T")

STREAMING_FRAGMENTS = 4
"""The fragments of the registered name ``"streaming_diloco"``."""


def split_fragments(tensors: Sequence[Tensor], fragments: int) -> list[list[int]]:
    """The indices of ``tensors`` cut into ``fragments`` runs of consecutive tensors with about equal numbers of
    values (a tensor is never split).

    Examples:
        >>> import torch
        >>> split_fragments([torch.empty(n) for n in (4, 4, 1, 3, 8)], 2)
        [[0, 1, 2], [3, 4]]
        >>> split_fragments([torch.empty(3)], 2)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: `fragments=2` cuts the trainable parameters into 2 runs, but the model trains 1 ...
    """
    if fragments > len(tensors):
        named = ""
        if fragments == STREAMING_FRAGMENTS:  # most likely the registered name's
            named = (
                f'; the name "streaming_diloco" stands for {fragments} fragments, so for this model pass '
                f'`strategy=LocalSGDStrategy(sync_every="auto", fragments={len(tensors)}, delay=1, '
                'outer_precision="int4")` (Fabric: `FabricLocalSGDStrategy`) in its place'
            )
        raise ValueError(
            f"`fragments={fragments}` cuts the trainable parameters into {fragments} runs, but the model trains "
            f"{len(tensors)} parameter tensor(s) and a tensor is never split. Pass `fragments` at most "
            f"{len(tensors)}{named}."
        )
    sizes = [t.numel() for t in tensors]
    total = max(sum(sizes), 1)
    ends = list(itertools.accumulate(sizes))  # values up to and including each tensor
    cuts = [0]
    for j in range(1, fragments):
        # the cut closest to j/K of the values, after the previous cut, leaving a tensor for every later fragment
        target = j * total / fragments
        best = min(range(1, len(sizes)), key=lambda c: abs(ends[c - 1] - target))
        cuts.append(min(max(best, cuts[-1] + 1), len(sizes) - (fragments - j)))
    cuts.append(len(sizes))
    return [list(range(a, b)) for a, b in itertools.pairwise(cuts)]


def turns(fragments: int, sync_every: int) -> list[int]:
    """The step of the period (``1 .. sync_every``) at which each fragment's outer gradient leaves.

    Examples:
        >>> turns(4, 8)
        [2, 4, 6, 8]
        >>> turns(1, 16)
        [16]
        >>> turns(3, 16)
        [5, 10, 16]
    """
    return [(p + 1) * sync_every // fragments for p in range(fragments)]


class OuterChannel:
    """One background thread that runs the outer gradients' reductions in the order they are submitted.

    Every collective of local SGD's averager goes through it once a delay is asked for, so a synchronous reduction
    (:meth:`run`) never overtakes one in flight, and the ranks issue them in the same order.

    Examples:
        >>> channel = OuterChannel()
        >>> future = channel.submit(lambda: 2 + 2)
        >>> future.result(), channel.run(lambda: 3)
        (4, 3)
        >>> channel.close()
    """

    def __init__(self) -> None:
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def submit(self, work: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Start ``work`` on the thread, after everything submitted before it."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="outer-gradient")
        return self._pool.submit(work)

    def run(self, work: Callable[[], T]) -> T:
        """Run ``work`` on the thread and wait for it."""
        return self.submit(work).result()

    def close(self) -> None:
        """Let the thread finish what it has, and stop it."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


@dataclass
class InFlight:
    """A fragment's outer gradient on its way: averaged on the channel's thread, applied at phase ``apply_at``."""

    fragment: int
    apply_at: int
    future: concurrent.futures.Future[list[Tensor]] | None = None
    averaged: list[Tensor] | None = None
    """The averaged change (and buffers), once received: what a checkpoint keeps."""
    work: Callable[[], list[Tensor]] | None = None
    """The reduction, until it is handed to the channel (held sends)."""

    def start(self, channel: OuterChannel) -> None:
        """Hand the reduction to ``channel`` (nothing if it was handed over already)."""
        if self.work is not None:
            self.future, self.work = channel.submit(self.work), None

    def result(self) -> list[Tensor]:
        if self.averaged is None:
            assert self.future is not None, "a held send must be released before its result is taken"
            self.averaged = self.future.result()
            self.future = None
        return self.averaged
