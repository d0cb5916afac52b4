"""The one spawn helper for multi-process tests: gloo on loopback, a free port per call, a hard timeout."""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

REPO_ROOT = Path(__file__).resolve().parents[2]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _port_block() -> range:
    """The ports this pytest worker hands out: below the kernel's ephemeral range, one block per xdist worker."""
    low, high = 10000, _ephemeral_low()
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0) % workers
    size = (high - low) // workers
    return range(low + worker * size, low + (worker + 1) * size)


_next_port: list[int] = []


def free_port() -> int:
    """A TCP port on loopback that nothing uses right now, and that nothing else in the suite will be handed.

    A port from ``bind(0)`` comes from the kernel's ephemeral range, which every outgoing connection and every gloo
    listener draws from too: between this call and the rank that binds it, another test's connection could take it
    (seen as a rank timing out while connecting to its own store). Ports here come from below that range, from a
    block of its own for each pytest-xdist worker, in turn; one still in use (or in TIME_WAIT) is passed over.
    """
    block = _port_block()
    if not _next_port:
        _next_port.append(block.start + (os.getpid() * 7919) % len(block))
    for _ in range(len(block)):
        port = _next_port[0]
        _next_port[0] = block.start + (port + 1 - block.start) % len(block)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port in {block.start}-{block.stop - 1} on 127.0.0.1")


# Modules the fork server imports once; every rank forked from it starts with them loaded (importing torch and
# Lightning costs seconds per process, which used to dominate the multi-process tests).
# the package root is lazy: name Lightning and the strategy packages, so forked ranks skip their imports
_PRELOAD = [
    "torch",
    "torch.distributed",
    "lightning",
    "lightning_dp_strategies.strategies",
    "lightning_dp_strategies.fabric",
    "tests.helpers.distributed",
]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    env: dict[str, str],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    errors: Any,
) -> None:
    # a forked rank inherits the fork server's environment (the test session's when the server started): the
    # caller's current one replaces it, as a spawned process would have it
    os.environ.clear()
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    gc.freeze()  # what exists now (the imported modules) is left out of the collection after the body: it stays fast
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    except BaseException:
        errors.put((rank, _RENDEZVOUS, traceback.format_exc()))
        raise
    try:
        try:
            fn(rank, world_size, *args)
        finally:
            # what the body left in reference cycles (a DDP holds its group) is freed while the interpreter is
            # whole: a group whose last reference goes at interpreter exit can abort the process then
            gc.collect()
            dist.destroy_process_group()
    except BaseException:
        errors.put((rank, _BODY, traceback.format_exc()))
        raise


def duplex_ranks(buckets: Any) -> list[int] | None:
    """The ranks of the second connection the buckets' ring reducer made in its setup step, or ``None``."""
    lookup = getattr(getattr(buckets, "reducer", None), "duplex_group", None)
    duplex = lookup(buckets.group) if callable(lookup) else None
    return dist.get_process_group_ranks(duplex) if duplex is not None else None


@contextmanager
def point_to_point_log() -> Iterator[list[tuple[str, dist.ProcessGroup, int]]]:
    """Within the block, every ``ProcessGroup.send``/``recv`` call of this process is logged as ``(name, group, tag)``,
    in call order."""
    calls: list[tuple[str, dist.ProcessGroup, int]] = []
    originals = {name: getattr(dist.ProcessGroup, name) for name in ("send", "recv")}
    descriptors = {name: vars(dist.ProcessGroup)[name] for name in originals}  # what the class holds, restored as is

    def spy(name: str) -> Callable[..., Any]:
        def call(self: dist.ProcessGroup, tensors: Any, peer: int, tag: int) -> Any:
            calls.append((name, self, tag))
            return originals[name](self, tensors, peer, tag)

        return call

    try:
        for name in originals:
            setattr(dist.ProcessGroup, name, spy(name))
        yield calls
    finally:
        for name, descriptor in descriptors.items():
            setattr(dist.ProcessGroup, name, descriptor)


_RENDEZVOUS, _BODY = "joining the process group", "running the test body"
_RENDEZVOUS_ATTEMPTS = 3


def _spawn(
    fn: Callable[..., Any], world_size: int, args: tuple[Any, ...], timeout: float
) -> tuple[list[Any], list[int], list[tuple[int, str, str]]]:
    """One try of :func:`run_distributed`: the processes, the ranks that hung, and each failure reported."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # no effect once the server runs: it started with the same list
    errors = ctx.SimpleQueue()
    port = free_port()
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, port, env, fn, args, errors), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    return procs, hung, failures


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes joined in one gloo group.

    ``fn`` must be importable (a module-level function). The ranks are forked from a fork server that has torch and
    the package imported already (``multiprocessing``'s ``forkserver``: a clean single-threaded process, never the
    test process itself), and get the caller's environment. Raises with the failing rank's traceback; kills every
    rank and fails if they do not all finish within ``timeout`` seconds, so a deadlocked collective never hangs the
    suite. When the only failures are ranks that could not join the group (another process on loopback took or
    closed the port between :func:`free_port` and the rendezvous), the whole group is started again on a fresh
    port, up to three tries in all; a failure inside ``fn`` is never retried.
    """
    for attempt in range(_RENDEZVOUS_ATTEMPTS):
        procs, hung, failures = _spawn(fn, world_size, args, timeout)
        rendezvous_only = bool(failures) and not hung and all(where == _RENDEZVOUS for _, where, _ in failures)
        if not (rendezvous_only and attempt + 1 < _RENDEZVOUS_ATTEMPTS):
            break
    if failures:
        rank, where, tb = failures[0]
        raise AssertionError(f"rank {rank} failed ({where}):\n{tb}")
    if hung:
        raise TimeoutError(f"ranks {hung} did not finish within {timeout} s (a collective hung?)")
    failed = [(rank, p.exitcode) for rank, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        raise AssertionError(f"ranks exited abnormally: {failed}")


def _child_env(env: dict[str, str] | None) -> dict[str, str]:
    """The environment a command or rank starts with: this process's, unbuffered output, then ``env``, with the
    repository first on ``PYTHONPATH``."""
    full = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), full.get("PYTHONPATH", "")]))
    return full


def run_commands(
    commands: Sequence[Sequence[str]], timeout: float = 240.0, env: dict[str, str] | None = None
) -> list[str]:
    """Run several commands together from the repository root, each in its own session, under one deadline.

    On timeout every process group is killed and a ``TimeoutError`` carries their output; a non-zero exit status
    raises ``AssertionError`` with the output. Returns each command's combined stdout/stderr.
    """
    full_env = _child_env(env)
    full_env.setdefault("MASTER_PORT", str(free_port()))
    procs = [
        subprocess.Popen(
            list(cmd),
            cwd=REPO_ROOT,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for cmd in commands
    ]
    deadline = time.monotonic() + timeout
    outputs: list[str] = []
    timed_out = False
    try:
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, 9)
                out, _ = proc.communicate()
            outputs.append(out)
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, 9)  # reap any rank a launcher left behind
            except ProcessLookupError:
                pass
            if proc.poll() is None:
                proc.wait()
    joined = "\n".join(f"--- {' '.join(c)}\n{o[-6000:]}" for c, o in zip(commands, outputs, strict=False))
    if timed_out:
        raise TimeoutError(f"did not finish within {timeout} s; output:\n{joined}")
    if any(proc.returncode != 0 for proc in procs):
        raise AssertionError(f"exit statuses {[p.returncode for p in procs]}; output:\n{joined}")
    return outputs


def run_script(argv: Sequence[str], timeout: float = 240.0, env: dict[str, str] | None = None) -> str:
    """Run ``python argv...`` (a script, ``-m module`` or ``-c code``) from the repository root, as the interpreter
    would: ``__main__``, ``sys.argv`` and ``sys.path[0]`` set the same way, the caller's environment (with the
    repository on ``PYTHONPATH``), output unbuffered into one log, its own session (so that a Trainer's launcher
    starts further ranks as it does from a shell). The call returns when those ranks have ended too, as a shell's
    job does; at the deadline they are killed with the script.

    The process is forked from the fork server of :func:`run_distributed` instead of started fresh: torch and
    Lightning are imported already, which saves each call the seconds a new interpreter spends importing them. The
    processes a launcher starts from it are fresh interpreters, as under a shell. A new interpreter runs it instead
    (:func:`run_commands`) when ``env`` sets a variable that must act before the server's imports
    (``PYTHONHASHSEED``, ``OMP_NUM_THREADS``: :data:`_READ_AT_START`). A non-zero exit status raises
    ``AssertionError`` and the deadline ``TimeoutError``, each with the output; returns the output.
    """
    if _read_at_start(env):
        return run_commands([[sys.executable, *argv]], timeout=timeout, env=env)[0]
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    full_env = _child_env(env)
    full_env.setdefault("MASTER_PORT", str(free_port()))
    with tempfile.TemporaryDirectory(prefix="script-") as folder:
        log = os.path.join(folder, "output.log")
        process = ctx.Process(target=_as_main, args=(list(argv), full_env, log, True))
        process.start()
        assert process.pid is not None
        deadline = time.monotonic() + timeout
        left: list[str] = []  # what the script started and was still running at the deadline after it ended
        try:
            process.join(timeout)
            timed_out = process.is_alive()
            if not timed_out and process.exitcode == 0:  # the ranks it started finish after it, as under a shell
                left = _outlived(process.pid, deadline)
                timed_out = bool(left)
        finally:  # also when the test is interrupted (pytest-timeout)
            try:
                os.killpg(process.pid, 9)  # the script on the deadline, and any rank a launcher left behind
            except ProcessLookupError:
                pass
            if process.is_alive():  # killed before it made its session
                process.kill()
            process.join()
        output = Path(log).read_text(errors="replace") if os.path.exists(log) else ""
    shown = f"--- python {' '.join(argv)}\n{output[-6000:]}"
    if timed_out:
        still = f" (the script ended; still running: {'; '.join(left)})" if left else ""
        raise TimeoutError(f"did not finish within {timeout} s{still}; output:\n{shown}")
    if process.exitcode != 0:
        raise AssertionError(f"exit statuses [{process.exitcode}]; output:\n{shown}")  # as run_commands says
    return output


def _outlived(session: int, deadline: float) -> list[str]:
    """Wait until no live process is left in ``session`` (a launcher's ranks, which outlive the script's own process
    by the moment each needs to write its last results). Returns those still running at the deadline, each as its
    pid and command line; empty once none is left. Reads ``/proc``: where there is none, returns at once."""
    while members := _session_members(session):
        if time.monotonic() >= deadline:
            return [f"{pid} {_command_line(pid)}" for pid in members]
        time.sleep(0.05)
    return []


def _session_members(session: int) -> list[int]:
    """The live (not zombie) processes of ``session``, from ``/proc/PID/stat``."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _ppid, _group, sid = stat.read_text().rsplit(")", 1)[1].split()[:4]
        except (OSError, ValueError):  # gone meanwhile
            continue
        if int(sid) == session and state != "Z":
            members.append(int(stat.parent.name))
    return members


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "(ended)"


_READ_AT_START = (
    *("PYTHON", "OMP_", "KMP_", "GOMP_", "MKL_", "ATEN_CPU_CAPABILITY", "ONEDNN_", "DNNL_"),
    "LDPS_SIMULATE_NOTEBOOK",  # the scenarios' own: sets sys.ps1, which Lightning reads when it is imported
)
"""Prefixes of the variables read when the interpreter, OpenMP, MKL, ATen or Lightning start (in the fork server,
before the call): a forked process would ignore them."""
_READ_AFTER_START = ("PYTHONPATH", "PYTHONUNBUFFERED")
"""The ``PYTHON*`` variables a forked process honours (:func:`_as_main` applies them)."""


def _read_at_start(env: dict[str, str] | None) -> list[str]:
    """The variables of ``env`` that a process forked from the fork server would ignore (:data:`_READ_AT_START`)."""
    return [k for k in env or {} if k.startswith(_READ_AT_START) and k not in _READ_AFTER_START]


def _as_main(argv: list[str], env: dict[str, str], log: str, own_session: bool = False) -> None:
    """``python argv...`` in this (forked) process: output to ``log``, then the script, ``-m`` module or ``-c``
    code run as ``__main__``, with ``env`` as the environment and the repository root as the working directory."""
    import runpy

    if own_session:
        os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # as PYTHONUNBUFFERED does
    os.environ.clear()
    os.environ.update(env)
    os.chdir(REPO_ROOT)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[:0] = extra  # as the interpreter puts them: after the script's folder, inserted below
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path.insert(0, "")
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exit_:
        if exit_.code not in (None, 0):
            raise
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def run_ranks(
    module: str,
    argv: Sequence[str],
    world_size: int,
    timeout: float = 240.0,
    env: dict[str, str] | None = None,
    grace: float = 30.0,
    per_node: int | None = None,
) -> str:
    """Run ``python -m module argv...`` as ``world_size`` ranks started the way ``torchrun`` starts them.

    ``per_node`` numbers the ranks as on several nodes of that many processes (``NODE_RANK``, ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE`` as torchrun sets them on each node); all of them still run on this machine, over loopback.

    Each rank gets ``LOCAL_RANK``, ``RANK``, ``WORLD_SIZE`` and the main address, so Lightning's launcher starts no
    processes of its own (``creates_processes_externally``). The ranks are forked from the fork server of
    :func:`run_distributed`, which has torch and Lightning imported already; a Trainer script launched this way skips
    the seconds each of Lightning's spawned ranks spends importing them. When a rank fails, the others get
    ``grace`` seconds to fail too (a refusal is raised on every rank) before they are killed. Returns the ranks'
    combined output; raises ``AssertionError`` (with it) on a failed rank and ``TimeoutError`` on the deadline. An
    ``env`` that sets a variable only a process's start reads (:data:`_READ_AT_START`) is refused: a forked rank
    would ignore it.
    """
    started = _read_at_start(env)
    if started:
        raise ValueError(
            f"run_ranks forks its ranks from the fork server, which started without {started}: they would not take "
            "effect. Start new interpreters instead: run_script (a script whose launcher starts the other ranks), or "
            "torchrun through run_commands."
        )
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    base = _child_env(env)
    if world_size > 1:
        base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world_size), NODE_RANK="0")
        base["LOCAL_WORLD_SIZE"] = str(per_node or world_size)
    logs = []
    procs = []
    with tempfile.TemporaryDirectory(prefix="ranks-") as folder:
        for rank in range(world_size):
            rank_env = dict(base)
            if world_size > 1:
                local, node = (rank % per_node, rank // per_node) if per_node else (rank, 0)
                rank_env.update(LOCAL_RANK=str(local), RANK=str(rank), NODE_RANK=str(node))
            logs.append(os.path.join(folder, f"rank{rank}.log"))
            # not daemonic, as under torchrun: a rank may start processes of its own (DataLoader workers)
            procs.append(ctx.Process(target=_as_main, args=(["-m", module, *argv], rank_env, logs[-1])))
        failed = False
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout
            while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
                if not failed and any(p.exitcode not in (None, 0) for p in procs):
                    failed, deadline = True, min(deadline, time.monotonic() + grace)
                time.sleep(0.05)
        finally:  # also when the test is interrupted (pytest-timeout): no rank outlives the call
            hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
            for p in procs:
                if p.is_alive():
                    p.kill()
                if p.pid is not None:
                    p.join()
        outputs = [Path(log).read_text(errors="replace") if os.path.exists(log) else "" for log in logs]
    joined = "\n".join(f"--- rank {rank}\n{out[-6000:]}" for rank, out in enumerate(outputs))
    if hung and not failed:
        raise TimeoutError(f"did not finish within {timeout} s; output:\n{joined}")
    if any(p.exitcode != 0 for p in procs):
        raise AssertionError(f"exit statuses {[p.exitcode for p in procs]} (ranks {hung} killed); output:\n{joined}")
    return joined
