"""The clock-table model of the schedules: literal tables, the bubble formulas, and the checks of the options.

What torch actually runs is checked against :func:`rank_order` in ``tests/pipeline/test_runner.py`` (the runner
records every forward and backward pass torch's schedule calls, on real processes).
"""

from __future__ import annotations

import pytest

from lightning_dp_strategies.pipeline import (
    LOOPED,
    SCHEDULES,
    SPLIT_BACKWARD,
    check_schedule,
    chunk_ranks,
    clock_table,
    gpipe_bubble,
    rank_order,
    schedule_bubble,
    schedule_micro_batches,
    stage_order,
    table_bubble,
    table_in_flight,
)
from lightning_dp_strategies.strategies.hybrid_pipeline.config import HybridPipelineConfig


def render(table: list[list[str]]) -> list[str]:
    return [" ".join(a or ".." for a in row) for row in table]


def test_gpipe_table_two_stages_four_micro_batches() -> None:
    assert render(clock_table("gpipe", 2, 4)) == [
        "F0 F1 F2 F3 .. .. .. B0 B0 B1 B1 B2 B2 B3 B3",
        ".. F0 F1 F2 F3 B0 B0 B1 B1 B2 B2 B3 B3 .. ..",
    ]


def test_1f1b_table_two_stages_four_micro_batches() -> None:
    assert render(clock_table("1f1b", 2, 4)) == [
        "F0 F1 .. .. B0 B0 F2 B1 B1 F3 B2 B2 .. B3 B3",
        ".. F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3 .. ..",
    ]


def test_zbv_table_fills_the_bubble_with_weight_passes() -> None:
    # rank 0 runs chunks 0 and 3 (the V), rank 1 chunks 1 and 2; W passes fill what would be idle
    assert render(clock_table("zbv", 2, 4)) == [
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 0I2 0W2 0I3 0W3 ..",
        ".. 1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 1I3 1W2 2W3 1W3",
    ]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_rank_runs_each_pass_of_each_of_its_chunks_once(schedule: str) -> None:
    stages, micro = 2, 4
    for rank, row in enumerate(clock_table(schedule, stages, micro)):
        started = [a for i, a in enumerate(row) if a and (i == 0 or row[i - 1] != a)]
        chunks = [c for c, r in enumerate(chunk_ranks(schedule, stages, 2 if schedule in (*LOOPED, "zbv") else 1))]
        mine = [c for c in chunks if chunk_ranks(schedule, stages, len(chunks) // stages)[c] == rank]
        prefix = (lambda c: str(c)) if len(chunks) > stages else (lambda c: "")
        backward = ["I", "W"] if schedule in SPLIT_BACKWARD else ["B"]
        expected = [f"{prefix(c)}{k}{m}" for c in mine for k in ["F", *backward] for m in range(micro)]
        assert sorted(started) == sorted(expected), schedule


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("micro", [1, 2, 4, 8])
def test_ideal_bubble_is_the_gpipe_formula(schedule: str, stages: int, micro: int) -> None:
    assert table_bubble(clock_table(schedule, stages, micro)) == pytest.approx(gpipe_bubble(stages, micro))


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "looped_bfs"])
@pytest.mark.parametrize(("stages", "micro"), [(2, 2), (2, 4), (2, 8), (4, 4), (4, 8)])
def test_interleaved_bubble_is_the_formula_with_v_chunks(schedule: str, stages: int, micro: int) -> None:
    # (S - 1) / (V M + S - 1): V chunks per rank cut the fill and drain V times finer
    assert schedule_bubble(schedule, stages, micro) == pytest.approx((stages - 1) / (2 * micro + stages - 1))


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv"])
@pytest.mark.parametrize(("stages", "micro"), [(2, 2), (2, 4), (2, 8), (4, 4), (4, 8)])
def test_every_virtual_schedule_has_a_smaller_bubble_than_1f1b(schedule: str, stages: int, micro: int) -> None:
    assert schedule_bubble(schedule, stages, micro) < schedule_bubble("1f1b", stages, micro)
    if schedule in SPLIT_BACKWARD and micro >= 2 * stages:
        assert schedule_bubble(schedule, stages, micro) < schedule_bubble("interleaved_1f1b", stages, micro)


def test_activations_held_gpipe_all_micro_batches_1f1b_at_most_stages_minus_index() -> None:
    assert table_in_flight(clock_table("gpipe", 2, 8)) == [8, 8]
    assert table_in_flight(clock_table("1f1b", 2, 8)) == [2, 1]
    assert table_in_flight(clock_table("1f1b", 4, 8)) == [4, 3, 2, 1]
    # chunks held at once (each half a stage): looped BFS holds every micro-batch of both, interleaved 1F1B a few
    assert table_in_flight(clock_table("looped_bfs", 2, 8)) == [16, 16]
    assert table_in_flight(clock_table("interleaved_1f1b", 2, 8)) == [5, 3]


def test_one_chunk_orders_are_1f1b_and_gpipe() -> None:
    assert rank_order("1f1b", 2, 4, 1) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    assert rank_order("1f1b", 2, 1, 0) == stage_order("gpipe", 2, 1, 0)  # M < S runs as GPipe


def test_chunk_placement_loops_or_forms_a_v() -> None:
    assert chunk_ranks("interleaved_1f1b", 3, 2) == [0, 1, 2, 0, 1, 2]
    assert chunk_ranks("zbv", 3, 2) == [0, 1, 2, 2, 1, 0]


def test_unknown_schedule_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"\['gpipe', '1f1b', 'interleaved_1f1b'"):
        stage_order("zero-bubble", 2, 4, 0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"schedule": "1f1b", "virtual_stages": 2}, r"virtual_stages=1, or a schedule with several chunks per rank"),
        ({"schedule": "gpipe", "virtual_stages": 3}, r"\['interleaved_1f1b', 'looped_bfs', 'interleaved_zb', 'zbv'\]"),
        ({"schedule": "interleaved_1f1b", "virtual_stages": 1}, r"virtual_stages >= 2, or schedule='1f1b'"),
        ({"schedule": "zbv", "virtual_stages": 3}, r"use virtual_stages=2, or one of \['interleaved_1f1b'"),
        ({"schedule": "interleaved_zb", "micro_batches": 5}, r"micro_batches in \[1, 2, 3, 4, 6, 8\]"),
        ({"schedule": "looped_bfs", "virtual_stages": 0}, r"`virtual_stages` must be an integer >= 1"),
        ({"schedule": "zbv", "balance": [1, 2]}, r"each of the 4 stages"),
    ],
)
def test_options_a_schedule_cannot_honour_are_refused_when_the_strategy_is_built(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        HybridPipelineConfig(**kwargs)


def test_micro_batch_counts_the_interleaved_schedules_run() -> None:
    assert [m for m in range(1, 13) if schedule_micro_batches("interleaved_1f1b", 4, m)] == [
        1,
        2,
        3,
        4,
        5,
        6,
        7,
        8,
        10,
        12,
    ]
    assert all(schedule_micro_batches("looped_bfs", 4, m) for m in range(1, 13))
    check_schedule("zbv", 2, 1, 2)  # any count
