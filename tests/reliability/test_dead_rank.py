"""A rank SIGKILLed mid-run never hangs the others: they exit non-zero, in bounded time, saying what happened.

Each case runs ``dead_rank_scenario`` (2 processes, popen launcher, collective ``timeout`` of 30 s) and kills one rank
at the start of step 4. The bound asserted is that timeout plus start-up slack, and the survivors must name the
failure; afterwards no process of the run is left, and ``last.ckpt`` (written after every step) loads.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import REPO_ROOT, free_port

TIMEOUT_S = 30.0
STARTUP_SLACK_S = 150.0  # interpreter and Lightning start-up of two processes on a loaded 2-core machine


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (zombies waiting to be reaped count as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def _run(args: list[str], tmp_path: Path, bound: float) -> tuple[str, int]:
    """Run ``dead_rank_scenario`` with ``args``: its output and rank 0's exit status; fails if a rank still runs after
    ``bound`` seconds, or 10 s after rank 0 ended."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MASTER_PORT": str(free_port())}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "tests.reliability.dead_rank_scenario", *args]
    # not run_commands: it kills the process group when the command ends, which would hide a rank left running
    proc = subprocess.Popen(
        cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        # EOF on the pipe: every rank (they all inherit it) has exited
        output, _ = proc.communicate(timeout=bound)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        output, _ = proc.communicate()
        pytest.fail(f"a rank of the run was still running after {bound} s:\n{output[-4000:]}")
    pids = {int(p.name.split("rank")[1]): int(p.read_text()) for p in tmp_path.glob("pid-rank*")}
    assert sorted(pids) == [0, 1], f"both ranks should have started training:\n{output[-4000:]}"
    deadline = time.monotonic() + 10
    while any(_running(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [r for r, pid in pids.items() if _running(pid)], "a rank of the run is still running"
    return output, proc.returncode


@pytest.mark.timeout(TIMEOUT_S + STARTUP_SLACK_S + 60)
@pytest.mark.parametrize(
    ("strategy", "victim"),
    [("ring_allreduce", 1), ("ring_allreduce", 0), ("hybrid_pipeline", 1)],
    ids=["ring-kill-rank1", "ring-kill-rank0", "hybrid-kill-stage1"],
)
def test_survivors_exit_nonzero_in_bounded_time_and_the_checkpoint_loads(
    strategy: str, victim: int, tmp_path: Path
) -> None:
    args = [strategy, str(victim), str(tmp_path), str(TIMEOUT_S)]
    output, code = _run(args, tmp_path, TIMEOUT_S + STARTUP_SLACK_S)
    assert code != 0, f"rank 0 exited 0 although rank {victim} died:\n{output[-4000:]}"
    survivor = 1 - victim
    assert "Another rank most likely died" in output, f"rank {survivor} did not say what happened:\n{output[-4000:]}"
    checkpoint = torch.load(tmp_path / "last.ckpt", map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] >= 3 and "state_dict" in checkpoint


HANG_TIMEOUT_S = 15.0  # also how long rank 0 waits for rank 1 to start (the rendezvous)


@pytest.mark.timeout(HANG_TIMEOUT_S + STARTUP_SLACK_S + 60)
def test_a_silent_rank_fails_the_others_within_the_timeout_and_is_stopped(tmp_path: Path) -> None:
    """Rank 1 stops answering (alive) at the start of step 5 under ``local_sgd``, which averages after that step on
    a group of its own: rank 0 fails once the timeout runs out on that group (not torch's 30 minutes for a new
    group), and stops rank 1, which would never time out itself."""
    args = ["local_sgd", "1", str(tmp_path), str(HANG_TIMEOUT_S), "hang"]
    output, code = _run(args, tmp_path, HANG_TIMEOUT_S + STARTUP_SLACK_S)
    assert code != 0, f"rank 0 exited 0 although rank 1 went silent:\n{output[-4000:]}"
    assert f"Timed out waiting {HANG_TIMEOUT_S * 1000:.0f}ms" in output, f"rank 0 did not time out:\n{output[-4000:]}"
    assert "Averaging over 2 ranks failed on rank 0" in output and "Another rank most likely died" in output
    checkpoint = torch.load(tmp_path / "last.ckpt", map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] >= 3
