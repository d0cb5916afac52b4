"""``calibrate_cpu``: what it times, and how it sums the runs up."""

from __future__ import annotations

import threading
import time
import types

import pytest
import torch

import lightning_dp_strategies.reducers.calibrate as calibrate_module
from lightning_dp_strategies.reducers import calibrate_cpu


def test_a_run_that_lost_its_core_for_a_while_counts_in_the_wall_mean(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where processes share a core, some runs wait a scheduler turn: ``_seconds`` is the mean over the stretch, not
    the median of single runs (the work priced at a whole core). A fake clock stands in for time."""
    now = [0.0]
    durations = iter([5.0, 1.0, 1.0, 10.0])  # the untimed first run, then three timed ones, the last descheduled

    def work() -> None:
        now[0] += next(durations)

    fake = types.SimpleNamespace(perf_counter=lambda: now[0], process_time=lambda: 0.0)
    monkeypatch.setattr(calibrate_module, "time", fake)
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

    fake = types.SimpleNamespace(perf_counter=lambda: now[0], process_time=lambda: 0.0)
    monkeypatch.setattr(calibrate_module, "time", fake)
    assert calibrate_module._seconds(work, repeats=2, seconds=1.0) == pytest.approx(0.25)
    assert runs[0] == 1 + 4  # the untimed run, then four to fill the second


def test_the_costs_come_out_positive_and_powersgd_is_timed_on_a_bucket_of_matrices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[tuple[tuple[int, int], int]] = []
    original = calibrate_module._PowerSGDWork

    class Spy(original):  # type: ignore[misc,valid-type]
        def __init__(self, rank: int, shape: tuple[int, int], count: int, device: torch.device) -> None:
            seen.append((shape, count))
            super().__init__(rank, shape, count, device)

    monkeypatch.setattr(calibrate_module, "_PowerSGDWork", Spy)
    costs = calibrate_cpu(nbytes=1 << 20, matrix=(128, 256), repeats=2, seconds=0.0, rounds=1)
    assert min(costs.add, costs.add_low, costs.cast, costs.powersgd) > 0 and costs.powersgd_rank == 4
    assert seen == [((128, 256), 8)]  # 1 MiB of fp32 holds eight 128 x 256 matrices


def test_a_figure_is_cpu_time_a_run_at_the_share_of_the_cores_the_process_got(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each operation's CPU time a run (the lower of its rounds), divided by the CPU the process got a wall second over
    the whole calibration: a stretch in which it lost its core (wall 30 s for 1 s of CPU, first round) prices no one
    operation, only the share. The overlap is the lowest of its rounds."""
    Stretch = calibrate_module._Stretch
    first = [Stretch(1, 30.0, 1.0)] + [Stretch(1, 2.0, 1.0)] * 4  # add (descheduled), add_low, cast, copy, powersgd
    second = [Stretch(1, 2.0, 1.0)] * 3 + [Stretch(1, 1.0, 0.5), Stretch(1, 3.0, 1.5)]
    stretches = iter(first + second)
    overlaps = iter([0.9, 0.2])
    monkeypatch.setattr(calibrate_module, "_stretch", lambda *_: next(stretches))
    monkeypatch.setattr(calibrate_module, "_overlap", lambda *_: next(overlaps))
    costs = calibrate_cpu(nbytes=1 << 20, matrix=(128, 256), rounds=2)
    share = (1.0 + 4 * 1.0 + 3 * 1.0 + 0.5 + 1.5) / (30.0 + 4 * 2.0 + 3 * 2.0 + 1.0 + 3.0)  # CPU a wall second: 0.2
    assert costs.add == pytest.approx(1.0 / share / (1 << 20))
    assert costs.cast == pytest.approx(1.0 / share / (1 << 20))
    powersgd_own = (1.0 - 0.5) / share  # the run less the bucket's copy, each the lower of its rounds
    assert costs.powersgd == pytest.approx(powersgd_own / (4 * 8 * 128 * 256))
    assert costs.overlap == 0.2


def test_overlap_is_what_a_second_thread_adds_to_the_throughput() -> None:
    """A second thread that runs beside the first doubles the runs a second (overlap 1: the reduction's thread gets a
    core of its own); one that must take turns with it adds nothing (overlap 0: processes outnumber the cores). Each
    case keeps the clearest of three measurements, so that a busy test machine that delays one stretch (a sleeper
    woken late) cannot decide it."""
    nap = lambda: time.sleep(0.004)  # noqa: E731  (sleeping threads do not contend)
    assert max(calibrate_module._overlap(3, 0.1, (nap, nap)) for _ in range(3)) > 0.7
    turns = threading.Lock()

    def take_turns() -> None:
        with turns:
            time.sleep(0.004)

    assert min(calibrate_module._overlap(3, 0.1, (take_turns, take_turns)) for _ in range(3)) < 0.3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_operations_run_there_and_are_timed_to_their_end() -> None:
    costs = calibrate_cpu(nbytes=8 << 20, matrix=(512, 512), seconds=0.05, device="cuda")
    on_cpu = calibrate_cpu(nbytes=8 << 20, matrix=(512, 512), seconds=0.05)
    assert min(costs.add, costs.add_low, costs.cast, costs.powersgd) > 0
    assert costs.add < on_cpu.add  # device memory's bandwidth, not the host's
    assert costs.overlap == 1.0  # the reduction's kernels are queued beside backward's, not on a core it needs
