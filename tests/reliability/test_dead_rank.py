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


@pytest.mark.timeout(TIMEOUT_S + STARTUP_SLACK_S + 60)
@pytest.mark.parametrize(
    ("strategy", "victim"),
    [("ring_allreduce", 1), ("ring_allreduce", 0), ("hybrid_pipeline", 1)],
    ids=["ring-kill-rank1", "ring-kill-rank0", "hybrid-kill-stage1"],
)
def test_survivors_exit_nonzero_in_bounded_time_and_the_checkpoint_loads(
    strategy: str, victim: int, tmp_path: Path
) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MASTER_PORT": str(free_port())}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "tests.reliability.dead_rank_scenario", strategy, str(victim), str(tmp_path)]
    # not run_commands: it kills the process group when the command ends, which would hide a rank left running
    start = time.monotonic()
    proc = subprocess.Popen(
        [*cmd, str(TIMEOUT_S)],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        # EOF on the pipe: every rank (they all inherit it) has exited
        output, _ = proc.communicate(timeout=TIMEOUT_S + STARTUP_SLACK_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        output, _ = proc.communicate()
        pytest.fail(f"the surviving rank hung past the bound:\n{output[-4000:]}")
    elapsed = time.monotonic() - start
    pids = {int(p.name.split("rank")[1]): int(p.read_text()) for p in tmp_path.glob("pid-rank*")}
    assert sorted(pids) == [0, 1], f"both ranks should have started training:\n{output[-4000:]}"
    assert proc.returncode != 0, f"rank 0 exited 0 although rank {victim} died:\n{output[-4000:]}"
    deadline = time.monotonic() + 10
    while any(_running(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [r for r, pid in pids.items() if _running(pid)], "a rank of the run is still running"
    survivor = 1 - victim
    assert "Another rank most likely died" in output, f"rank {survivor} did not say what happened:\n{output[-4000:]}"
    checkpoint = torch.load(tmp_path / "last.ckpt", map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] >= 3 and "state_dict" in checkpoint
    assert elapsed < TIMEOUT_S + STARTUP_SLACK_S
