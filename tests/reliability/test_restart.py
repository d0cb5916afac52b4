"""A worker SIGKILLed once under ``torchrun --max-restarts 1`` (c10d rendezvous): the restarted job resumes from the
last complete checkpoint and ends with the parameters of an uninterrupted run.

Each case runs ``restart_scenario`` under ``torchrun --nnodes 1 --nproc-per-node 2`` on loopback. Before the
strategies made their process groups under a key prefix of their own attempt, the restarted workers read the dead
workers' addresses from torchrun's store and failed to connect (``Connection refused``), as Lightning's ``ddp`` still
does. Checkpoints fall on epoch boundaries, so the resumed run retrains the lost part of the epoch exactly.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import free_port, run_commands
from tests.reliability.restart_scenario import reference_state

TOLERANCE = 1e-6


def torchrun(strategy: str, outdir: Path, kill: str, victim: int) -> list[str]:
    """The torchrun command of one case: 2 workers, one restart allowed, c10d rendezvous on a free loopback port."""
    return [
        *(sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2"),
        *("--max-restarts", "1", "--monitor-interval", "0.2"),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"),
        *("-m", "tests.reliability.restart_scenario", strategy, str(outdir), kill, str(victim)),
    ]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("strategy", "kill", "victim"),
    [
        ("ring_allreduce", "mid_epoch", 1),
        ("hybrid_pipeline", "during_save", 1),
        ("fabric_ring_allreduce", "mid_epoch", 0),
    ],
    ids=["ring-kill-rank1-mid-epoch", "hybrid-kill-stage1-during-save", "fabric-ring-kill-rank0-mid-epoch"],
)
def test_a_restarted_job_resumes_and_ends_as_the_uninterrupted_run(
    strategy: str, kill: str, victim: int, tmp_path: Path
) -> None:
    output = run_commands([torchrun(strategy, tmp_path, kill, victim)], timeout=150)[0]
    assert (tmp_path / "killed").exists(), f"no worker killed itself:\n{output[-4000:]}"
    assert output.count("kills itself") == 1, output[-4000:]
    restarts = re.findall(r"rank \d finished \(restart (\d+)\)", output)  # the workers' lines may interleave
    assert restarts == ["1", "1"], f"both workers should finish after one restart:\n{output[-4000:]}"
    resumed = "resumed from last.ckpt at epoch 1" if strategy.startswith("fabric") else "Restored all states"
    assert resumed in output, f"the restarted job did not resume from epoch 1's checkpoint:\n{output[-4000:]}"
    final = torch.load(tmp_path / "final.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    expected = reference_state()
    assert sorted(final) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(final[name], value, rtol=TOLERANCE, atol=TOLERANCE, msg=name)
