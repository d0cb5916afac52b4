"""Failures on demand for tests: kill, hang or cut a chosen rank at a chosen step (as torchft's ``EventInjector``).

Training code calls :meth:`FailureInjector.step` once a step; the injector does nothing unless a failure was planned
for that rank and step::

    injector = FailureInjector().fail(rank=1, step=20, kind="kill")
    for step in range(steps):
        injector.step(rank, step)
        ...
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["Failure", "FailureInjector", "FailureKind"]

FailureKind = Literal["kill", "hang", "cut"]
KINDS: tuple[FailureKind, ...] = ("kill", "hang", "cut")


@dataclass(frozen=True)
class Failure:
    """One planned failure: ``rank`` fails at ``step`` in the way ``kind`` says.

    ``"kill"`` ends the process at once (SIGKILL: no cleanup, its sockets closed by the kernel), ``"hang"`` sleeps in
    the step for ``hang_s`` seconds (forever by default) while the process stays alive, ``"cut"`` loses the node's
    link, which only the simulated cluster can do.
    """

    rank: int
    step: int
    kind: FailureKind = "kill"
    hang_s: float = math.inf


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _sleep(seconds: float) -> None:
    while seconds > 0:  # time.sleep rejects infinity
        chunk = min(seconds, 3600.0)
        time.sleep(chunk)
        seconds -= chunk


@dataclass
class FailureInjector:
    """The planned failures, and those that fired in this process.

    ``kill`` and ``sleep`` are what a kill and a hang call (SIGKILL of this process, ``time.sleep``); tests of the
    injector itself pass harmless ones.

    Examples:
        >>> calls = []
        >>> injector = FailureInjector(kill=lambda: calls.append("kill"), sleep=calls.append)
        >>> injector = injector.fail(rank=1, step=2).fail(rank=0, step=3, kind="hang", hang_s=5.0)
        >>> for step in range(4):
        ...     injector.step(rank=1, step=step)
        >>> calls, [f.step for f in injector.fired]
        (['kill'], [2])
    """

    failures: list[Failure] = field(default_factory=list)
    fired: list[Failure] = field(default_factory=list)
    kill: Callable[[], None] = _kill_self
    sleep: Callable[[float], None] = _sleep

    def fail(self, rank: int, step: int, kind: FailureKind = "kill", hang_s: float = math.inf) -> FailureInjector:
        """Plan a failure of ``rank`` at ``step``; returns the injector, so plans chain.

        Raises:
            ValueError: if ``kind`` is not one of ``"kill"``, ``"hang"``, ``"cut"``, or ``rank``/``step`` is negative.
        """
        if kind not in KINDS:
            raise ValueError(f"`kind` must be one of {', '.join(map(repr, KINDS))}, got {kind!r}.")
        if rank < 0 or step < 0:
            raise ValueError(f"`rank` and `step` must be at least 0, got rank={rank}, step={step}.")
        self.failures.append(Failure(rank, step, kind, hang_s))
        return self

    def step(self, rank: int, step: int) -> None:
        """Fire the failures planned for ``rank`` at ``step``, in the order they were planned.

        Raises:
            NotImplementedError: for a ``"cut"``: one process cannot cut its own link.
        """
        for failure in self.failures:
            if failure.rank != rank or failure.step != step:
                continue
            self.fired.append(failure)
            if failure.kind == "kill":
                self.kill()
            elif failure.kind == "hang":
                self.sleep(failure.hang_s)
            else:
                raise NotImplementedError(
                    f"A 'cut' of rank {rank}'s link cannot be injected from inside the process: on the simulated "
                    "cluster run `benchmarks/netsim.py link NODE down` (and `link NODE up` to restore it), or inject "
                    "'hang', which peers see the same way (their collectives time out)."
                )
