"""The one spawn helper for multi-process tests: gloo on loopback, a free port per call, a hard timeout."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...], errors: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
        try:
            fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes joined in one gloo group.

    ``fn`` must be importable (a module-level function). Raises with the failing rank's traceback; kills every rank
    and fails if they do not all finish within ``timeout`` seconds, so a deadlocked collective never hangs the suite.
    """
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, port, fn, args, errors), daemon=True)
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
    if not errors.empty():
        rank, tb = errors.get()
        raise AssertionError(f"rank {rank} failed:\n{tb}")
    if hung:
        raise TimeoutError(f"ranks {hung} did not finish within {timeout} s (a collective hung?)")
    failed = [(rank, p.exitcode) for rank, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        raise AssertionError(f"ranks exited abnormally: {failed}")


def run_script(argv: Sequence[str], timeout: float = 240.0, env: dict[str, str] | None = None) -> str:
    """Run ``python argv...`` from the repository root in its own session; kill the whole group on timeout.

    Used for Trainer runs whose launcher starts further processes (Lightning's popen launcher re-runs the script).
    Returns the combined output; raises with it if the exit status is non-zero.
    """
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), full_env.get("PYTHONPATH", "")]))
    full_env.setdefault("MASTER_PORT", str(free_port()))
    proc = subprocess.Popen(
        [sys.executable, *argv],
        cwd=REPO_ROOT,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        raise TimeoutError(f"{argv} did not finish within {timeout} s; output:\n{out[-5000:]}") from None
    finally:
        try:
            os.killpg(proc.pid, 9)  # reap any rank the launcher left behind
        except ProcessLookupError:
            pass
    if proc.returncode != 0:
        raise AssertionError(f"{argv} exited with {proc.returncode}; output:\n{out[-8000:]}")
    return out
