"""Starting one strategy's processes for a comparison and waiting for them: forked from the comparison's fork server
(:mod:`.forks`) where it runs, else a fresh ``python -m lightning_dp_strategies compare --worker`` process.

Forked, a strategy that Lightning would start by re-running the script on every rank (the ``popen`` launch of
``ddp`` and this package's strategies) gets all its ranks at once, each with the variables ``torchrun`` sets
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, the main address), so Lightning starts none of its own. Any other
strategy (the baseline, ``dp``, a ``spawn`` or ``fork`` launch) gets one process, and launches the rest itself as
it would anywhere.
"""

from __future__ import annotations

import inspect
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from lightning.fabric.plugins.environments.lightning import find_free_network_port
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry

from lightning_dp_strategies.compare.catalogue import BASELINE, processes_for
from lightning_dp_strategies.compare.forks import ForkServer, RankRequest
from lightning_dp_strategies.compare.task import Task

__all__ = ["FAILED_RANK_GRACE", "Session", "launch", "torchrun_ranks"]

FAILED_RANK_GRACE = 30.0
"""Seconds the other ranks get to end once one has failed (a refusal is raised on every rank) before they are
killed: a rank waiting in a collective for a dead peer would otherwise wait for the whole timeout."""


@dataclass
class Session:
    """What every strategy's run in one comparison shares: the task (and its pickle), the devices, where the workers
    write (``work``, deleted afterwards) and where the logs stay, the timeout, how progress is reported, and the fork
    server the processes come from (``None``: fresh interpreters)."""

    task: Task
    task_path: Path
    devices: int
    work: Path
    logs: Path
    timeout: float = 300.0
    extra_imports: list[str] = field(default_factory=list)
    progress: Callable[[str], None] = print
    progress_every: float = 10.0
    forks: ForkServer | None = None


def torchrun_ranks(name: str, devices: int) -> int:
    """How many processes a forked run of ``name`` starts itself: all its ranks where Lightning would re-run the script
    for them (the ``popen`` launch), else one.

    Examples:
        >>> [torchrun_ranks(name, 2) for name in ("single", "dp", "ring_allreduce", "ring_allreduce_spawn", "ddp")]
        [1, 1, 2, 1, 2]
    """
    processes = processes_for(name, devices)
    if name == BASELINE or processes == 1 or name not in StrategyRegistry:
        return 1
    entry = StrategyRegistry[name]
    if not (isinstance(entry["strategy"], type) and issubclass(entry["strategy"], ParallelStrategy)):
        return 1  # no launcher: one process, whatever the count of devices
    start = entry.get("init_params", {}).get("start_method")
    if start is None:
        default = inspect.signature(entry["strategy"]).parameters.get("start_method")
        start = "popen" if default is None or default.default is inspect.Parameter.empty else default.default
    return processes if start == "popen" else 1


def _requests(name: str, session: Session, log: Path) -> list[RankRequest]:
    ranks = torchrun_ranks(name, session.devices)
    base = dict(os.environ)
    if ranks > 1:
        port = str(find_free_network_port())
        base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=str(ranks), NODE_RANK="0")
        base["LOCAL_WORLD_SIZE"] = str(ranks)
    requests = []
    for rank in range(ranks):
        env = dict(base, LOCAL_RANK=str(rank), RANK=str(rank)) if ranks > 1 else base
        task, work, imports = str(session.task_path), str(session.work), list(session.extra_imports)
        request = RankRequest(name, task, session.devices, work, str(log), imports, env=env, cwd=os.getcwd())
        requests.append(request)
    return requests


def _kill_group(pid: int) -> None:
    for kill in (os.killpg, os.kill):  # the rank's session (the rank and what it started), then the rank itself
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def launch(name: str, session: Session, log: Path, report: Callable[[float], None]) -> int | None:
    """Run ``name``'s processes until they end: the exit status (the first failed rank's, else 0), ``None`` when they
    ran past the session's timeout. ``report`` is called about every ``progress_every`` seconds with the time so
    far; no process outlives the call."""
    start = time.perf_counter()
    forks = session.forks
    if forks is not None:
        log.write_text("")
        pids: list[int] = []
        try:
            pids += [forks.start(request) for request in _requests(name, session, log)]
        except RuntimeError as err:  # the server is gone: this row and the rest start fresh interpreters
            for pid in pids:
                _kill_group(pid)
            session.progress(f"        ({err}; starting fresh processes instead)")
            session.forks = forks = None
    if forks is not None:
        try:
            return _wait(lambda: [forks.exit_code(pid) for pid in pids], session, report, start)
        finally:
            for pid in pids:
                if forks.exit_code(pid) is None:
                    _kill_group(pid)
    cmd = [sys.executable, "-m", "lightning_dp_strategies", "compare", "--worker", name]
    cmd += ["--task", str(session.task_path), "--output", str(session.work), "--devices", str(session.devices)]
    for module in session.extra_imports:
        cmd += ["--import", module]
    with open(log, "w") as handle:
        proc = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return _wait(lambda: [proc.poll()], session, report, start)
        finally:
            _kill_group(proc.pid)  # no rank outlives its row


def _wait(
    codes: Callable[[], list[int | None]], session: Session, report: Callable[[float], None], start: float
) -> int | None:
    """Poll the processes' exit codes (``None``: running) until all have ended, or the timeout has passed, or a grace
    period after one failed; the first failed code, 0, or ``None`` for a timeout."""
    said, deadline = start, start + session.timeout
    while True:
        now = codes()
        failed = [code for code in now if code not in (None, 0)]
        if None not in now or time.perf_counter() >= deadline:
            return failed[0] if failed else (0 if None not in now else None)
        if failed:
            deadline = min(deadline, time.perf_counter() + FAILED_RANK_GRACE)
        time.sleep(0.05)
        if time.perf_counter() - said >= session.progress_every:
            said = time.perf_counter()
            report(said - start)
