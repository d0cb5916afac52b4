"""``calibrate_cpu``: what it times, and how it sums the runs up."""

from __future__ import annotations

import threading
import time
import types

import pytest

import lightning_dp_strategies.reducers.calibrate as calibrate_module
from lightning_dp_strategies.reducers import calibrate_cpu


def test_a_run_that_lost_its_core_for_a_while_counts_in_the_figure(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where processes share a core, some runs wait a scheduler turn: the figure is the mean over the stretch (what a
    step sees), not the median of single runs (the work priced at a whole core). A fake clock stands in for time."""
    now = [0.0]
    durations = iter([5.0, 1.0, 1.0, 10.0])  # the untimed first run, then three timed ones, the last descheduled

    def work() -> None:
        now[0] += next(durations)

    monkeypatch.setattr(calibrate_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    assert calibrate_module._seconds(work, repeats=3) == pytest.approx(4.0)


def test_runs_go_on_until_the_stretch_is_long_enough(monkeypatch: pytest.MonkeyPatch) -> None:
    """Processes that calibrate together time each operation for the same stretch, not the same count of runs (a
    count would let a process that got the core early move on to the next operation while the others are still on
    this one). A fake clock stands in for time."""
    now = [0.0]
    runs = [0]

    def work() -> None:
        runs[0] += 1
        now[0] += 0.25

    monkeypatch.setattr(calibrate_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    assert calibrate_module._seconds(work, repeats=2, seconds=1.0) == pytest.approx(0.25)
    assert runs[0] == 1 + 4  # the untimed run, then four to fill the second


def test_the_costs_come_out_positive_and_powersgd_is_timed_on_a_bucket_of_matrices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[tuple[tuple[int, int], int]] = []
    original = calibrate_module._powersgd_seconds

    def spy(rank: int, shape: tuple[int, int], count: int, repeats: int, seconds: float) -> float:
        seen.append((shape, count))
        return original(rank, shape, count, repeats, seconds)

    monkeypatch.setattr(calibrate_module, "_powersgd_seconds", spy)
    costs = calibrate_cpu(nbytes=1 << 20, matrix=(128, 256), repeats=2, seconds=0.0)
    assert min(costs.add, costs.add_low, costs.cast, costs.powersgd) > 0 and costs.powersgd_rank == 4
    assert seen == [((128, 256), 8)]  # 1 MiB of fp32 holds eight 128 x 256 matrices


def test_overlap_is_what_a_second_thread_adds_to_the_throughput() -> None:
    """A second thread that runs beside the first doubles the runs a second (overlap 1: the reduction's thread gets a
    core of its own); one that must take turns with it adds nothing (overlap 0: processes outnumber the cores)."""
    nap = lambda: time.sleep(0.004)  # noqa: E731  (sleeping threads do not contend)
    assert calibrate_module._overlap(3, 0.1, (nap, nap)) > 0.7
    turns = threading.Lock()

    def take_turns() -> None:
        with turns:
            time.sleep(0.004)

    assert calibrate_module._overlap(3, 0.1, (take_turns, take_turns)) < 0.3
