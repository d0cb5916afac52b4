"""A comparison's worker processes, forked from one process that has torch and Lightning imported already.

Importing torch and Lightning takes seconds of CPU in every fresh interpreter, and a comparison starts one for every
rank of every strategy. :class:`ForkServer` starts one interpreter (``python -m lightning_dp_strategies.compare.forks``)
that imports them and computes nothing (no thread pool exists when it forks), then forks each rank from it on request:

    parent ──request (JSON line)──▶ fork server ──fork──▶ rank: new session, its own environment, cwd and log
           ◀──"started PID", "exited PID CODE"──

A forked rank starts a new session (the parent kills its whole process group on a timeout), takes the parent's
environment and working folder as they are at the request (``PYTHONPATH`` entries added since the server started
are put on ``sys.path``), writes its output to the row's log, imports the comparison's extra modules and runs
:func:`~lightning_dp_strategies.compare.worker.run_worker`, as ``python -m lightning_dp_strategies compare --worker``
would. The server ends when the parent closes its input, or once it has had no request and no live rank for
:data:`IDLE_SECONDS`. :func:`shared_fork_server` keeps one server for all of a process's comparisons (a second
``compare`` in a notebook forks its ranks at once); it is replaced when it has ended, has been idle for half that
time, or when a source file of this package has changed since it started (its ranks would run the old code).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import selectors
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["IDLE_SECONDS", "ForkServer", "RankRequest", "fork_server_available", "shared_fork_server"]

_PRELOAD = ("torch", "torch.distributed", "lightning", "lightning_dp_strategies.compare.worker")

IDLE_SECONDS = 300.0
"""How long a fork server waits with no request and no live rank before it ends."""


def fork_server_available(accelerator: str = "cpu") -> bool:
    """Whether a comparison's ranks are forked here: on Linux, for CPU runs. Elsewhere each strategy starts in a fresh
    interpreter: macOS's system libraries are not safe to fork once loaded, and a CUDA run keeps the path it has
    always been tested on."""
    return sys.platform.startswith("linux") and accelerator == "cpu"


@dataclass
class RankRequest:
    """One rank of one strategy's run: what :func:`~lightning_dp_strategies.compare.worker.run_worker` is given, the
    extra modules to import first, and the process's environment, working folder and log."""

    name: str
    task: str
    devices: int
    output: str
    log: str
    imports: list[str]
    env: dict[str, str]
    cwd: str


class ForkServer:
    """The parent's side: start the server, ask it for ranks, read how they ended.

    ``start`` returns the forked rank's process id; ``exit_code`` is ``None`` until the server has reaped it, then
    its exit status (minus the signal's number for a rank killed by one).
    """

    def __init__(self, idle: float = IDLE_SECONDS) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.idle = idle
        self.source_stamp = package_stamp()
        """:func:`package_stamp` when the server started: the package code its ranks run."""
        self.last_used = time.monotonic()
        """When a rank was last asked for or reported ended (the server counts its idle time from the same events)."""
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "lightning_dp_strategies.compare.forks", "--idle", str(idle)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            start_new_session=True,  # a Ctrl-C in the parent's terminal reaches the parent, which closes it
        )
        self._lock = threading.Condition()
        self._started: list[int] = []
        self._exits: dict[int, int] = {}
        self._reader = threading.Thread(target=self._read, name="fork-server-replies", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            kind, *values = line.split()
            with self._lock:
                self.last_used = time.monotonic()
                if kind == "started":
                    self._started.append(int(values[0]))
                    self._exits.pop(int(values[0]), None)  # an earlier rank's status under a process id now reused
                elif kind == "exited":
                    self._exits[int(values[0])] = int(values[1])
                self._lock.notify_all()
        with self._lock:
            self._lock.notify_all()

    def start(self, request: RankRequest, timeout: float = 120.0) -> int:
        """Fork one rank; its process id. ``RuntimeError`` when the server is gone or does not answer."""
        assert self._proc.stdin is not None
        with self._lock:
            self.last_used = time.monotonic()
            try:
                self._proc.stdin.write(json.dumps(asdict(request)) + "\n")
                self._proc.stdin.flush()
            except (BrokenPipeError, OSError) as err:
                raise RuntimeError(f"the comparison's fork server is gone: {err}") from err
            self._lock.wait_for(lambda: self._started or self._proc.poll() is not None, timeout)
            if not self._started:
                state = "exited" if self._proc.poll() is not None else f"did not answer in {timeout:.0f} s"
                raise RuntimeError(f"the comparison's fork server {state}")
            return self._started.pop(0)

    def running(self) -> bool:
        """Whether the server process is still there to fork ranks."""
        return self._proc.poll() is None

    def exit_code(self, pid: int) -> int | None:
        """The rank's exit status once the server has reaped it, else ``None``."""
        with self._lock:
            return self._exits.get(pid)

    def close(self) -> None:
        """End the server (its ranks have ended or been killed by then)."""
        if self._proc.stdin is not None:
            try:
                self._proc.stdin.close()
            except OSError:
                pass
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def package_stamp() -> tuple[int, float]:
    """The number of this package's source files and their latest modification time."""
    times = [path.stat().st_mtime for path in Path(__file__).parents[1].rglob("*.py")]
    return len(times), max(times, default=0.0)


_shared: list[ForkServer] = []


def shared_fork_server() -> ForkServer:
    """This process's fork server, started on first use and kept for its later comparisons; a new one where it has
    ended, has been idle for more than half its :attr:`~ForkServer.idle` time (it could end while asked), or where
    the package's source changed since it started."""
    server = _shared[0] if _shared else None
    if (
        server is not None
        and server.running()
        and time.monotonic() - server.last_used < server.idle / 2
        and server.source_stamp == package_stamp()
    ):
        return server
    if _shared:
        _shared.pop().close()
    _shared.append(ForkServer())
    return _shared[0]


# ---------------------------------------------------------------------------------------------- the server's side
_cwd_leads_path = False
"""Whether ``python -m`` put the server's working folder first on ``sys.path`` (it does not under ``-P``)."""


def _run_rank(request: RankRequest) -> int:
    """In the forked rank: become the process the request describes, run the worker; its exit status."""
    os.setsid()
    log = os.open(request.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(devnull)
    os.chdir(request.cwd)
    if _cwd_leads_path:  # the request's folder takes the server's place, as in a fresh ``python -m`` started there
        sys.path[0] = request.cwd
    os.environ.clear()
    os.environ.update(request.env)
    added = [p for p in request.env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[1:1] = added
    sys.argv = [str(Path(__file__).parents[1] / "__main__.py"), "compare", "--worker", request.name]
    for module in request.imports:
        try:
            importlib.import_module(module)
        except ImportError as err:
            print(f"--import {module}: {err}", file=sys.stderr)
            return 2
    from lightning_dp_strategies.compare.worker import run_worker

    run_worker(request.name, Path(request.task), request.devices, Path(request.output))
    return 0


def _fork(request: RankRequest) -> int:
    """Fork a rank for ``request``; in the parent its process id (the child never returns)."""
    sys.stdout.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        code = _run_rank(request)
    except SystemExit as err:  # as the interpreter would exit: None is success, a message is printed and fails
        code = 0 if err.code is None else err.code if isinstance(err.code, int) else 1
        if not isinstance(err.code, int | None):
            print(err.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _reap(out: list[str]) -> None:
    """Every ended rank, as ``exited PID CODE`` lines."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        out.append(f"exited {pid} {os.waitstatus_to_exitcode(status)}\n")


def main(idle: float = IDLE_SECONDS) -> None:
    """The server: import, then fork a rank per request line until the input ends or ``idle`` seconds pass with no
    request and no live rank."""
    global _cwd_leads_path
    _cwd_leads_path = bool(sys.path) and sys.path[0] == os.getcwd()
    for module in _PRELOAD:
        importlib.import_module(module)
    selector = selectors.DefaultSelector()
    selector.register(sys.stdin.fileno(), selectors.EVENT_READ)
    pending, open_input, live, last = b"", True, 0, time.monotonic()
    while open_input and (live or time.monotonic() - last < idle):
        replies: list[str] = []
        if selector.select(timeout=0.05):
            chunk = os.read(sys.stdin.fileno(), 65536)
            open_input = bool(chunk)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                replies.append(f"started {_fork(RankRequest(**json.loads(line)))}\n")
                live += 1
        _reap(replies)
        live -= sum(reply.startswith("exited") for reply in replies)
        if replies:
            last = time.monotonic()
        sys.stdout.write("".join(replies))
        sys.stdout.flush()


if __name__ == "__main__":
    main(float(sys.argv[sys.argv.index("--idle") + 1]) if "--idle" in sys.argv else IDLE_SECONDS)
