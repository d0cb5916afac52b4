"""The failure injector: what fires where and when, with harmless kill and sleep."""

from __future__ import annotations

import math

import pytest

from lightning_dp_strategies.core.failures import Failure, FailureInjector


def recording() -> tuple[FailureInjector, list[object]]:
    calls: list[object] = []
    return FailureInjector(kill=lambda: calls.append("kill"), sleep=calls.append), calls


def test_a_failure_fires_only_on_its_rank_at_its_step() -> None:
    injector, calls = recording()
    injector.fail(rank=1, step=2, kind="kill")
    for rank in range(3):
        for step in range(4):
            injector.step(rank, step)
    assert calls == ["kill"]
    assert injector.fired == [Failure(1, 2, "kill")]


def test_a_hang_sleeps_for_its_duration_forever_by_default() -> None:
    injector, calls = recording()
    injector.fail(0, 1, "hang").fail(0, 2, "hang", hang_s=3.0)
    for step in range(3):
        injector.step(0, step)
    assert calls == [math.inf, 3.0]


def test_the_default_sleep_returns_after_a_finite_hang() -> None:
    injector = FailureInjector().fail(0, 0, "hang", hang_s=0.01)
    injector.step(0, 0)
    assert [f.kind for f in injector.fired] == ["hang"]


def test_a_cut_names_the_simulated_clusters_command() -> None:
    injector, _ = recording()
    injector.fail(2, 5, "cut")
    injector.step(2, 4)
    with pytest.raises(NotImplementedError, match=r"benchmarks/netsim.py link NODE down"):
        injector.step(2, 5)


@pytest.mark.parametrize(("rank", "step", "kind"), [(0, 0, "crash"), (-1, 0, "kill"), (0, -2, "hang")])
def test_a_wrong_plan_is_refused(rank: int, step: int, kind: str) -> None:
    with pytest.raises(ValueError, match=r"`kind` must be one of|must be at least 0"):
        FailureInjector().fail(rank, step, kind)  # type: ignore[arg-type]
