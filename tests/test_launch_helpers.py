"""The test helpers that start ranks: the one that starts Trainer scripts the way ``torchrun`` does
(:func:`run_ranks`), what each rank sees, and that a hung or failed rank fails the test within its bounds instead of
hanging the suite; :func:`run_script`, which runs ``python ...`` forked from the fork server as the interpreter
would; and :func:`run_distributed`'s fresh start when no rank could join the group."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from pytest_mock import MockerFixture

from tests.helpers import distributed
from tests.helpers.distributed import REPO_ROOT, run_ranks, run_script


@pytest.mark.timeout(120)
def test_each_rank_gets_torchrun_variables_so_lightning_starts_no_processes(tmp_path: Path) -> None:
    output = run_ranks("tests.helpers.rank_probe", ["env", str(tmp_path)], 3, timeout=60)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert [(s["RANK"], s["LOCAL_RANK"], s["WORLD_SIZE"]) for s in seen] == [(str(r), str(r), "3") for r in range(3)]
    assert all(s["external"] for s in seen)  # Lightning's launcher leaves the process creation to us
    assert len({s["MASTER_PORT"] for s in seen}) == 1 and seen[0]["MASTER_ADDR"] == "127.0.0.1"
    assert all(s["argv"] == ["env", str(tmp_path)] and s["cwd"] == str(REPO_ROOT) for s in seen)
    assert all(s["from_worker"] == [[0, 1, 2]] for s in seen)  # a DataLoader worker process started in each rank
    assert all(f"probe rank {r} says hello" in output for r in range(3))  # each rank's output comes back


@pytest.mark.timeout(120)
def test_one_process_gets_no_distributed_variables(tmp_path: Path) -> None:
    run_ranks("tests.helpers.rank_probe", ["env", str(tmp_path)], 1, timeout=60)
    seen = json.loads((tmp_path / "rank0.json").read_text())
    assert seen["LOCAL_RANK"] is None and seen["WORLD_SIZE"] is None and not seen["external"]


@pytest.mark.timeout(120)
def test_a_hung_rank_times_out_and_is_killed(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within 5"):
        run_ranks("tests.helpers.rank_probe", ["hang", str(tmp_path)], 2, timeout=5)
    assert time.monotonic() - start < 60


@pytest.mark.timeout(120)
def test_a_failed_rank_fails_the_run_and_the_others_are_killed_after_the_grace(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(AssertionError) as failure:
        run_ranks("tests.helpers.rank_probe", ["fail", str(tmp_path)], 2, timeout=100, grace=2)
    assert time.monotonic() - start < 60  # the deadline was 100 s: the grace after the failure ended it
    message = str(failure.value)
    assert "RuntimeError: probe rank 1 refuses" in message and "ranks [0] killed" in message


SEEN = """
import json, os, sys
print("script says hello")
print("to stderr", file=sys.stderr)
seen = {"name": __name__, "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "var": os.environ.get("PROBE")}
seen["extra_on_path"] = os.path.join(os.environ["PROBE"], "lib") in sys.path
open(os.path.join(os.environ["PROBE"], "seen.json"), "w").write(json.dumps(seen))
sys.exit(int(sys.argv[-1]))
"""


@pytest.mark.timeout(120)
def test_a_script_runs_as_the_interpreter_would_run_it(tmp_path: Path) -> None:
    script = tmp_path / "probe_script.py"
    script.write_text(SEEN)
    env = {"PROBE": str(tmp_path), "PYTHONPATH": str(tmp_path / "lib")}
    output = run_script([str(script), "a", "0"], timeout=60, env=env)
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert "script says hello" in output and "to stderr" in output
    assert seen == {
        "name": "__main__",
        "argv": [str(script), "a", "0"],
        "path0": str(tmp_path),  # the script's folder, as `python script.py` puts it first
        "cwd": str(REPO_ROOT),
        "var": str(tmp_path),
        "extra_on_path": True,  # PYTHONPATH from `env`, which a forked process has to apply itself
    }
    run_script(["-c", SEEN, "b", "0"], timeout=60, env=env)
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["name"] == "__main__" and seen["argv"] == ["-c", "b", "0"]
    with pytest.raises(AssertionError, match=r"exit statuses \[3\]") as failure:
        run_script([str(script), "3"], timeout=60, env=env)
    assert "script says hello" in str(failure.value)


@pytest.mark.timeout(120)
def test_a_script_past_its_deadline_is_killed_with_the_processes_it_started(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within 5"):
        run_script(["-c", starts_a_sleeper(pid_file) + "; time.sleep(3600)"], timeout=5)
    assert time.monotonic() - start < 60
    assert_gone(int(pid_file.read_text()))


def starts_a_sleeper(pid_file: Path) -> str:
    """Code that starts a child process ``sleep 3600`` and writes its pid to ``pid_file``."""
    return (
        "import subprocess, time; "
        f"child = subprocess.Popen(['sleep', '3600']); open({str(pid_file)!r}, 'w').write(str(child.pid))"
    )


def assert_gone(child: int) -> None:
    """``child`` was killed: gone once its parent (init, after the kill) reaps it."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    pytest.fail(f"the script's own child {child} outlived the deadline")


@pytest.mark.timeout(120)
def test_a_script_returns_after_the_processes_it_started_have_ended(tmp_path: Path) -> None:
    """A launcher's ranks outlive the script's own process (rank 0) by the moment each takes to write its results:
    killing them when the script ends loses those results."""
    done = tmp_path / "child.done"
    child = f"import time; time.sleep(2); open({str(done)!r}, 'w').write('written')"
    code = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {child!r}])"
    run_script(["-c", code], timeout=60)
    assert done.exists() and done.read_text() == "written"


@pytest.mark.timeout(120)
def test_a_process_the_script_left_running_fails_the_run_at_the_deadline_and_is_killed(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    left = r"did not finish within 5 s \(the script ended; still running: \d+ sleep 3600\)"
    with pytest.raises(TimeoutError, match=left):
        run_script(["-c", starts_a_sleeper(pid_file)], timeout=5)
    assert_gone(int(pid_file.read_text()))


@pytest.mark.timeout(120)
def test_a_variable_read_at_interpreter_start_gets_a_new_interpreter() -> None:
    """``PYTHONHASHSEED=0`` turns hash randomization off, and ``OMP_NUM_THREADS`` sets torch's threads when OpenMP
    starts, which only a new interpreter can show."""
    code = "import sys; print('randomized', sys.flags.hash_randomization)"
    assert "randomized 0" in run_script(["-c", code], timeout=60, env={"PYTHONHASHSEED": "0"})
    code = "import torch; print('threads', torch.get_num_threads())"
    assert "threads 1" in run_script(["-c", code], timeout=60, env={"OMP_NUM_THREADS": "1"})  # the fork: all cores
    with pytest.raises(ValueError, match="OMP_NUM_THREADS"):  # forked ranks could not honour it: refused
        run_ranks("tests.helpers.rank_probe", ["env", "."], 2, timeout=60, env={"OMP_NUM_THREADS": "1"})


def _joined(rank: int, world_size: int) -> None:
    """A test body that only needs the group it was handed."""
    assert dist.get_world_size() == world_size


@pytest.mark.timeout(120)
def test_a_group_whose_ranks_all_failed_to_join_is_started_again(mocker: MockerFixture) -> None:
    """The first start is refused at the rendezvous (faked); the next starts are real, and may themselves be refused
    on a busy loopback, which the helper's own tries absorb."""
    real = distributed._spawn
    refused = [(0, distributed._RENDEZVOUS, "RuntimeError: Gloo connectFullMesh failed")] * 2

    def refused_first(*args: Any) -> Any:
        return ([], [], refused) if spawn.call_count == 1 else real(*args)

    spawn = mocker.patch.object(distributed, "_spawn", side_effect=refused_first)
    distributed.run_distributed(_joined, 2)
    assert spawn.call_count >= 2


@pytest.mark.timeout(60)
def test_a_failure_in_the_test_body_is_not_retried(mocker: MockerFixture) -> None:
    body = [(1, distributed._BODY, "AssertionError: wrong gradient")]
    spawn = mocker.patch.object(distributed, "_spawn", return_value=([], [], body))
    with pytest.raises(AssertionError, match="rank 1 failed \\(running the test body\\)"):
        distributed.run_distributed(_joined, 2)
    assert spawn.call_count == 1


@pytest.mark.timeout(60)
def test_a_group_that_never_joins_fails_after_three_tries(mocker: MockerFixture) -> None:
    refused = [(0, distributed._RENDEZVOUS, "RuntimeError: Gloo connectFullMesh failed")]
    spawn = mocker.patch.object(distributed, "_spawn", return_value=([], [], refused))
    with pytest.raises(AssertionError, match="joining the process group"):
        distributed.run_distributed(_joined, 2)
    assert spawn.call_count == 3
