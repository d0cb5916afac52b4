"""The clock-table model of the schedules: literal tables, the GPipe bubble formula, and torch's own order."""

from __future__ import annotations

import pytest

from lightning_dp_strategies.pipeline import clock_table, gpipe_bubble, stage_order, table_bubble, table_in_flight


def render(table: list[list[str]]) -> list[str]:
    return [" ".join(a or ".." for a in row) for row in table]


def test_gpipe_table_two_stages_four_micro_batches() -> None:
    assert render(clock_table("gpipe", 2, 4)) == [
        "F0 F1 F2 F3 .. .. B0 B1 B2 B3",
        ".. F0 F1 F2 F3 B0 B1 B2 B3 ..",
    ]


def test_1f1b_table_two_stages_four_micro_batches() -> None:
    assert render(clock_table("1f1b", 2, 4)) == [
        "F0 F1 .. B0 F2 B1 F3 B2 .. B3",
        ".. F0 B0 F1 B1 F2 B2 F3 B3 ..",
    ]


def test_every_stage_runs_each_forward_and_backward_once() -> None:
    for schedule in ("gpipe", "1f1b"):
        for row in clock_table(schedule, 3, 4):
            assert sorted(a for a in row if a) == sorted([f"F{m}" for m in range(4)] + [f"B{m}" for m in range(4)])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("micro", [1, 2, 4, 8])
def test_ideal_bubble_is_the_gpipe_formula(schedule: str, stages: int, micro: int) -> None:
    assert table_bubble(clock_table(schedule, stages, micro)) == pytest.approx(gpipe_bubble(stages, micro))


def test_activations_held_gpipe_all_micro_batches_1f1b_at_most_stages_minus_index() -> None:
    assert table_in_flight(clock_table("gpipe", 2, 8)) == [8, 8]
    assert table_in_flight(clock_table("1f1b", 2, 8)) == [2, 1]
    assert table_in_flight(clock_table("1f1b", 4, 8)) == [4, 3, 2, 1]


def test_unknown_schedule_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"\['gpipe', '1f1b'\]"):
        stage_order("zero-bubble", 2, 4, 0)
