"""How a comparison starts a strategy's processes: forked from the fork server, each rank as torchrun would start it,
with the same results as fresh interpreters; a failed rank ends its row, a hung row is killed with everything it
started."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import tests.helpers.crashing_strategy  # noqa: F401  (registers the failing strategies in this process too)
from lightning_dp_strategies.compare import DemoConfig, compare, launch, runner
from lightning_dp_strategies.compare.launch import Session, torchrun_ranks
from lightning_dp_strategies.compare.runner import RunResult
from lightning_dp_strategies.compare.task import make_task

SMALL = DemoConfig(steps=4, model_size="small")
TOLERANCE = 1e-6  # the same arithmetic in a forked and in a fresh process; one thread in each


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _none_running(folder: Path) -> list[int]:
    pids = [int(p.name) for p in folder.iterdir()]
    assert pids, "the strategy never ran"
    for _ in range(50):  # SIGKILL is delivered at once; the kernel may take a moment to tear a process down
        if not any(_running(pid) for pid in pids):
            return pids
        time.sleep(0.1)
    raise AssertionError(f"still running after their row ended: {[pid for pid in pids if _running(pid)]}")


@pytest.mark.timeout(200)
def test_forked_ranks_train_as_fresh_interpreters_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    single, forked = compare(
        ["single", "ring_allreduce"], SMALL, 2, tmp_path / "a", progress=lambda m: None, accelerator="cpu"
    )
    monkeypatch.setattr(runner, "fork_server_available", lambda accelerator: False)
    (fresh,) = compare(["ring_allreduce"], SMALL, 2, tmp_path / "b", progress=lambda m: None, accelerator="cpu")
    assert (single.status, forked.status, fresh.status) == ("ok", "ok", "ok"), (forked.error, fresh.error)
    assert forked.processes == fresh.processes == 2 and len(forked.peak_mb_by_rank) == 2, "both ranks reported"
    assert len(forked.loss_curve) == len(fresh.loss_curve) == SMALL.steps
    assert forked.loss_curve == pytest.approx(fresh.loss_curve, abs=TOLERANCE)
    assert forked.final_loss == pytest.approx(fresh.final_loss, abs=TOLERANCE)
    assert forked.comm_mb_per_step == pytest.approx(fresh.comm_mb_per_step)  # the same buckets, the same bytes
    assert forked.max_param_diff is not None and forked.max_param_diff <= 1e-5  # at parity with the baseline


@pytest.mark.timeout(200)
def test_a_fresh_launch_keeps_its_ranks_until_all_have_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning's launcher starts rank 1 in rank 0's session, which the row kills once rank 0 has ended: rank 1's
    results must be on disk by then, also where it reaches the end of its script 2 s after rank 0."""
    monkeypatch.setattr(runner, "fork_server_available", lambda accelerator: False)
    imports = ["tests.helpers.crashing_strategy"]
    (row,) = compare(
        ["rank1_slow_to_report"], SMALL, 2, tmp_path, extra_imports=imports, progress=lambda m: None, accelerator="cpu"
    )
    assert row.status == "ok", row.error
    assert row.processes == 2 and len(row.peak_mb_by_rank) == 2, "both ranks reported"


@pytest.mark.timeout(200)
def test_a_launcher_that_starts_its_own_ranks_reports_each_of_them(tmp_path: Path) -> None:
    """``spawn`` and ``fork`` launches train in processes the launcher starts from the worker: each of those reports
    its steps, losses and memory (the worker that called ``fit`` trained nothing)."""
    rows = compare(
        ["ddp_spawn", "ring_allreduce_notebook"], SMALL, 2, tmp_path, progress=lambda m: None, accelerator="cpu"
    )
    for row in rows:
        assert row.status == "ok", row.error
        assert row.processes == 2 and len(row.peak_mb_by_rank) == 2, f"{row.strategy}: both ranks reported"
        assert len(row.loss_curve) == len(row.step_times_ms) == SMALL.steps and row.step_ms is not None, row.strategy
        assert row.comm_mb_per_step is not None or row.strategy == "ddp_spawn", "the ring counts what it sends"


def test_a_row_missing_a_rank_report_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The processes ended well but one of the two never reported: the row is not summarised from the other."""
    import json

    report = dict(step_ms=[5.0], losses=[1.0], comm_bytes=[], pipeline_bytes=[], exposed_ms=[], bubbles=[], peak_mb=1.0)

    def rank0_only(name: str, session: Session, log: Path, progress: object) -> int:
        (session.work / f"{name}.rank0.json").write_text(json.dumps(report))
        return 0

    monkeypatch.setattr(runner, "launch", rank0_only)
    session = Session(make_task(demo=SMALL), tmp_path / "task.pkl", 2, tmp_path, tmp_path)
    row = runner.run_one("ring_allreduce", session)
    assert (row.status, row.error) == ("failed", f"1 of 2 processes reported (see {tmp_path.name}/ring_allreduce.log)")


def test_only_a_script_launch_gets_its_ranks_from_the_comparison() -> None:
    assert torchrun_ranks("rank1_crashes_at_setup", 2) == 2  # a DDPStrategy: popen by default
    assert torchrun_ranks("ddp_spawn", 2) == 1  # Lightning spawns its ranks itself
    assert torchrun_ranks("ring_allreduce_notebook", 3) == 1
    assert torchrun_ranks("hybrid_pipeline", 4) == 4


def _failing_row(name: str, timeout: float, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> RunResult:
    """``name``'s row of a comparison, each of its processes recording its id in ``tmp_path / "pids"``."""
    monkeypatch.setenv("LDPS_TEST_PID_DIR", str(tmp_path / "pids"))
    (tmp_path / "pids").mkdir()
    imports = ["tests.helpers.crashing_strategy"]
    (row,) = compare([name], SMALL, 2, tmp_path / "out", timeout, imports, progress=lambda m: None, accelerator="cpu")
    return row


@pytest.mark.timeout(200)
def test_a_failed_rank_ends_its_row_and_the_rank_waiting_for_it_is_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The row's timeout (an hour) is far past the test's (200 s): only the grace after rank 1's failure ends it."""
    monkeypatch.setattr(launch, "FAILED_RANK_GRACE", 1.0)
    row = _failing_row("rank1_crashes_at_setup", 3600, tmp_path, monkeypatch)
    assert row.status == "failed" and row.error == "RuntimeError: rank 1 fails at setup"
    assert len(_none_running(tmp_path / "pids")) == 2


@pytest.mark.timeout(200)
@pytest.mark.parametrize("slow_join", [None, "3"], ids=["prompt", "launcher-slow-to-look"])
def test_a_rank_a_fork_launcher_started_fails_the_row_with_its_own_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slow_join: str | None
) -> None:
    """A ``ValueError`` after steps were trained is a failure, not a refusal of the configuration (``n/a``), also
    where the rank that raised it is not the process that called ``fit``, and where the launching process looks at
    its ranks only after rank 0 has failed too, on losing rank 1 (torch then names rank 0)."""
    if slow_join is not None:
        monkeypatch.setenv("LDPS_TEST_SLOW_JOIN", slow_join)
    row = _failing_row("rank1_refuses_step_3_notebook", 120, tmp_path, monkeypatch)
    assert (row.status, row.error) == ("failed", "ValueError: rank 1 refuses its third step")


@pytest.mark.timeout(120)
def test_a_row_past_its_timeout_is_killed_with_what_it_started(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    row = _failing_row("hangs_at_setup", 8, tmp_path, monkeypatch)
    assert row.status == "timeout" and "no result within 8 s" in (row.error or "")
    assert len(_none_running(tmp_path / "pids")) == 2  # the rank and the process it started


def _row_reason(folder: Path, reports: dict[int, object], aged: tuple[int, ...] = ()) -> tuple[str, str]:
    """The failed row's status and reason from these ranks' error reports (a dict is written as JSON, a string as
    it is); the ranks in ``aged`` get one and the same old modification time."""
    import json
    import os

    for rank, report in reports.items():
        path = folder / f"x.rank{rank}.error.json"
        path.write_text(report if isinstance(report, str) else json.dumps(report))
        if rank in aged:
            os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    (folder / "x.log").write_text("")
    return runner._failure("x", folder, folder / "x.log", 1, 10.0)


def test_the_row_says_why_the_first_rank_failed(tmp_path: Path) -> None:
    """Rank 1 failed first; rank 0 then failed on losing it: the row gives rank 1's reason."""
    first = {"type": "RuntimeError", "message": "rank 1 fails at setup", "steps_done": 0}
    then = {"type": "RuntimeError", "message": "Connection closed by peer", "steps_done": 0}
    assert _row_reason(tmp_path, {1: first, 0: then}, aged=(1,)) == ("failed", "RuntimeError: rank 1 fails at setup")


def test_the_time_a_rank_failed_decides_where_the_files_were_written_in_one_tick(tmp_path: Path) -> None:
    """A file's modification time comes from the kernel's coarse clock: rank 0's report, written on losing rank 1,
    may carry the same instant as rank 1's. The time each rank recorded decides, not the rank order."""
    first = {"type": "ValueError", "message": "rank 1 refuses", "steps_done": 2, "failed_at": 100.001}
    then = {"type": "RuntimeError", "message": "Connection closed by peer", "steps_done": 2, "failed_at": 100.002}
    assert _row_reason(tmp_path, {1: first, 0: then}, aged=(0, 1)) == ("failed", "ValueError: rank 1 refuses")


def test_a_report_cut_off_by_a_kill_is_passed_over(tmp_path: Path) -> None:
    report = {"type": "ValueError", "message": "rank 1 refuses", "steps_done": 2, "failed_at": 100.0}
    cut = '{"type": "RuntimeError", "mess'
    assert _row_reason(tmp_path, {0: cut, 1: report}) == ("failed", "ValueError: rank 1 refuses")


def test_only_cpu_runs_on_linux_are_forked() -> None:
    """A CUDA run starts fresh processes (a process that forked after CUDA's driver loaded cannot use CUDA)."""
    import sys

    from lightning_dp_strategies.compare.forks import fork_server_available

    assert not fork_server_available("cuda")
    assert fork_server_available("cpu") == sys.platform.startswith("linux")


@pytest.mark.timeout(120)
def test_a_forked_rank_exits_with_the_status_the_interpreter_would_give(tmp_path: Path) -> None:
    """``sys.exit()`` is success, ``sys.exit(3)`` is 3, ``sys.exit("message")`` prints it and is 1; a rank imports
    from the folder it was asked for in, not the one the server started in; once they have ended and its idle time
    has passed, the server ends by itself."""
    import os

    from lightning_dp_strategies.compare.forks import ForkServer, RankRequest

    here = os.getcwd()  # the repository: where ``tests`` imports from
    os.chdir(tmp_path)  # the server starts elsewhere; the ranks are asked for here, and import as if started here
    try:
        server = ForkServer(idle=3.0)  # longer than any pause between the requests below
    finally:
        os.chdir(here)
    try:
        pids = {}
        for case, value in [("none", None), ("three", "3"), ("message", "cannot go on")]:
            env = {k: v for k, v in os.environ.items() if k != "LDPS_TEST_EXIT"}
            env.update({"LDPS_TEST_EXIT_AT_IMPORT": "1"}, **({} if value is None else {"LDPS_TEST_EXIT": value}))
            log = tmp_path / f"{case}.log"
            request = RankRequest(
                "x", "-", 1, str(tmp_path), str(log), ["tests.helpers.exits_at_import"], env, os.getcwd()
            )
            pids[case] = server.start(request)
        for _ in range(600):
            codes = {case: server.exit_code(pid) for case, pid in pids.items()}
            if None not in codes.values():
                break
            time.sleep(0.1)
        assert server._proc.wait(timeout=60) == 0  # idle: no request and no live rank for 3 s
        assert not server.running()
    finally:
        server.close()
    assert codes == {"none": 0, "three": 3, "message": 1}
    assert "cannot go on" in (tmp_path / "message.log").read_text()


def test_comparisons_in_one_process_share_a_fork_server_until_it_ends_idles_or_the_package_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lightning_dp_strategies.compare import forks

    class Server:
        """Stands in for :class:`ForkServer` (no process): running until ``ended``, used at ``last_used``."""

        def __init__(self) -> None:
            self.idle, self.last_used, self.ended, self.closed = 300.0, time.monotonic(), False, False
            self.source_stamp = forks.package_stamp()

        def running(self) -> bool:
            return not self.ended

        def close(self) -> None:
            self.closed = True

    monkeypatch.setattr(forks, "ForkServer", Server)
    monkeypatch.setattr(forks, "_shared", [])
    first = forks.shared_fork_server()
    assert forks.shared_fork_server() is first
    first.ended = True  # type: ignore[attr-defined]
    second = forks.shared_fork_server()
    assert second is not first and first.closed  # type: ignore[attr-defined]
    second.last_used -= 151  # idle for over half its time: it could end while asked
    third = forks.shared_fork_server()
    assert third is not second and second.closed  # type: ignore[attr-defined]
    assert forks.shared_fork_server() is third
    files, latest = forks.package_stamp()
    monkeypatch.setattr(forks, "package_stamp", lambda: (files, latest + 1))  # a source file edited since
    fourth = forks.shared_fork_server()
    assert fourth is not third and third.closed  # type: ignore[attr-defined]
    assert forks.shared_fork_server() is fourth


def _traceback_of(error: Exception, cause: Exception | None = None) -> str:
    import traceback

    try:
        try:
            raise cause or KeyError("unused")
        except Exception as raised:
            raise error from (raised if cause is not None else None)
    except Exception:
        return traceback.format_exc()


def test_a_ranks_traceback_text_gives_its_last_exception_and_a_message_holding_a_traceback_stays_whole() -> None:
    """How a spawn- or fork-launched rank's failure reaches its row: ``ProcessRaisedException``'s text."""
    from lightning_dp_strategies.compare.worker import _raised

    launched = "\n\n-- Process 1 terminated with the following error:\n"
    assert _raised(launched + _traceback_of(ValueError("rank 1 refuses"))) == ("ValueError", "rank 1 refuses")
    assert _raised(_traceback_of(ValueError("outer"), cause=TypeError("cause"))) == ("ValueError", "outer")
    assert _raised(_traceback_of(ValueError("    indented\n    lines"))) == ("ValueError", "    indented\n    lines")
    inner = _traceback_of(RuntimeError("inner"))
    kind, message = _raised(_traceback_of(RuntimeError("rank 0 lost rank 1:\n" + inner)))
    assert kind == "RuntimeError" and message == "rank 0 lost rank 1:\n" + inner.rstrip()
