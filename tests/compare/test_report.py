"""The comparison's table and figure: every strategy shown, rows that did not run marked, no labels overlapping."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from lightning_dp_strategies.compare.report import format_table, make_figure, write_figure
from lightning_dp_strategies.compare.runner import RunResult

pytest.importorskip("matplotlib")

from matplotlib.axes import Axes
from matplotlib.colors import to_hex
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.text import Annotation

CURVE = [2.3 * 0.93**step + 0.1 for step in range(20)]
TOLERANCE = 1e-6
ROWS = [
    RunResult(
        "single",
        1,
        1,
        step_ms=12.0,
        samples_per_second=5300.0,
        max_param_diff=0.0,
        loss_curve=CURVE,
        peak_mb_per_rank=210.4,
    ),
    RunResult(
        "ring_allreduce",
        2,
        2,
        step_ms=9.0,
        samples_per_second=7100.0,
        comm_mb_per_step=0.41,
        max_param_diff=3e-8,
        loss_curve=CURVE,
        peak_mb_per_rank=190.0,
    ),
    RunResult(
        "hybrid_pipeline",
        2,
        2,
        step_ms=11.0,
        samples_per_second=5800.0,
        comm_mb_per_step=0.0,
        pipeline_mb_per_step=0.26,
        max_param_diff=0.0,
        loss_curve=CURVE,
    ),
    RunResult("dp", 1, 2, step_ms=15.0, samples_per_second=4200.0, max_param_diff=2e-8, loss_curve=CURVE),
    RunResult("scatter_gather", 1, 2, status="n/a", error="the model holds a buffer that replicas cannot share"),
    RunResult("ddp", 2, 2, status="failed", error="exit 1: RuntimeError: boom"),
]
NAMES = [r.strategy for r in ROWS]
NOT_RUN = [(i, r.status) for i, r in enumerate(ROWS) if r.status != "ok"]


@pytest.fixture(scope="module")
def figure() -> Figure:
    return make_figure(ROWS, tolerance=TOLERANCE)


def bar_panels(figure: Figure) -> list[Axes]:
    return figure.axes[:3]  # step time, communication, parity


def texts_at(ax: Axes, slot: int) -> list[str]:
    """The texts drawn in a bar slot: an annotation is placed by the point it annotates, a text by its position."""
    x = [t.xy[0] if isinstance(t, Annotation) else t.get_position()[0] for t in ax.texts]
    return [t.get_text() for t, at in zip(ax.texts, x, strict=True) if t.get_visible() and abs(at - slot) < 0.5]


def test_every_bar_panel_lists_every_strategy_in_order(figure: Figure) -> None:
    for ax in bar_panels(figure):
        assert [label.get_text() for label in ax.get_xticklabels()] == NAMES, ax.get_title()
        assert ax.get_title() and ax.get_ylabel()


def test_rows_that_did_not_run_show_their_status_at_their_slot_in_every_bar_panel(figure: Figure) -> None:
    for ax in bar_panels(figure):
        for slot, status in NOT_RUN:
            assert status in texts_at(ax, slot), (ax.get_title(), NAMES[slot])


def test_hybrid_activation_traffic_is_a_visible_bar_with_a_legend(figure: Figure) -> None:
    comm = figure.axes[1]
    slot = NAMES.index("hybrid_pipeline")
    in_slot = [p for p in comm.patches if isinstance(p, Rectangle) and abs(p.get_x() + p.get_width() / 2 - slot) < 0.5]
    heights = [p.get_height() for p in in_slot]
    assert sum(heights) == pytest.approx(0.26)
    legend = comm.get_legend()
    assert legend is not None
    labels = " ".join(t.get_text() for t in legend.get_texts())
    assert "gradients" in labels and "activations" in labels
    assert "MB" in comm.get_ylabel()


def test_communication_labels_never_overlap(figure: Figure) -> None:
    comm = figure.axes[1]
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()  # type: ignore[attr-defined]
    boxes = [t.get_window_extent(renderer) for t in comm.texts if t.get_visible() and t.get_text()]
    legend = comm.get_legend()
    assert legend is not None
    boxes.append(legend.get_window_extent(renderer))
    assert len(boxes) >= len(ROWS)  # one label per slot (a value or why there is none), and the legend
    for a, b in itertools.combinations(boxes, 2):
        assert not a.overlaps(b), (a, b)


def test_parity_panel_is_log_scaled_with_the_tolerance_and_the_reference(figure: Figure) -> None:
    parity = figure.axes[2]
    assert parity.get_yscale() == "log"
    tolerance_lines = [line for line in parity.get_lines() if set(line.get_ydata()) == {TOLERANCE}]  # type: ignore[arg-type]
    assert len(tolerance_lines) == 1 and "tolerance" in str(tolerance_lines[0].get_label())
    assert "reference" in texts_at(parity, NAMES.index("single"))
    assert "0" in texts_at(parity, NAMES.index("hybrid_pipeline"))  # exactly zero, drawn on the floor
    bars = [p for p in parity.patches if isinstance(p, Rectangle)]
    tops = {round(p.get_x() + p.get_width() / 2): p.get_y() + p.get_height() for p in bars}
    assert tops[NAMES.index("ring_allreduce")] == pytest.approx(3e-8)


def test_loss_curves_can_be_told_apart_and_the_axes_say_what_they_show(figure: Figure) -> None:
    loss = figure.axes[3]
    lines = loss.get_lines()
    assert [line.get_label() for line in lines] == [r.strategy for r in ROWS if r.status == "ok"]
    styles = [(to_hex(line.get_color()), line.get_linestyle()) for line in lines]
    assert len({color for color, _ in styles}) == len({style for _, style in styles}) == len(lines)
    widths = [line.get_linewidth() for line in lines]
    assert widths == sorted(widths, reverse=True) and len(set(widths)) == len(lines)  # widest drawn first
    offsets = [line.get_markevery()[0] for line in lines]  # type: ignore[index]
    assert len(set(offsets)) == len(lines)  # markers at staggered steps
    assert "step" in loss.get_xlabel() and "loss" in loss.get_ylabel()
    legend = loss.get_legend()
    assert legend is not None
    notes = " ".join([legend.get_title().get_text(), loss.get_title()])
    assert "agree" in notes
    entries = [t.get_text() for t in legend.get_texts()]
    for slot, status in NOT_RUN:
        assert any(NAMES[slot] in entry and status in entry for entry in entries), entries


def test_write_figure_saves_a_png(tmp_path: Path) -> None:
    assert write_figure(ROWS, tmp_path / "comparison.png")
    assert (tmp_path / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table_shows_peak_memory_and_why_rows_did_not_run() -> None:
    lines = format_table(ROWS).splitlines()
    header = lines[0].split("  ")
    header = [cell.strip() for cell in header if cell.strip()]
    assert header[-2:] == ["peak MB/rank", "status"]
    assert lines[2].split()[-2:] == ["210", "ok"]
    assert lines[lines.index("why some rows did not run:") + 1 :] == [
        "  scatter_gather (n/a): the model holds a buffer that replicas cannot share",
        "  ddp (failed): exit 1: RuntimeError: boom",
    ]


def test_every_axis_label_and_title_lies_inside_the_figure(figure: Figure) -> None:
    """No label is cut at the figure's edge (the loss panel's long axis label was, before it wrapped).

    The figure is drawn first: until then a label's position is not laid out, and this test must not depend on
    another test having drawn the shared figure. An empty label draws nothing, so it cannot be cut.
    """
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()  # type: ignore[attr-defined]
    bounds = figure.bbox
    for ax in figure.axes:
        for text in (ax.xaxis.label, ax.yaxis.label, ax.title):
            if not text.get_text():
                continue
            box = text.get_window_extent(renderer)
            inside = bounds.x0 <= box.x0 and box.x1 <= bounds.x1 and bounds.y0 <= box.y0 and box.y1 <= bounds.y1
            assert inside, (text.get_text(), box, bounds)
