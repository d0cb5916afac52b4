"""The pipeline schedules' ideal bubble and activation memory against the micro-batch count, at S = 2 and S = 4.

Nothing is timed: every point comes from the package's pure clock-table model
(``lightning_dp_strategies.pipeline.clock_table``: one tick per forward, input-gradient or weight-gradient pass, two
per full backward), the same model the tests hold torch's schedules to. Top: the bubble, the idle fraction of the
step (``schedule_bubble``). Bottom: the activations the busiest rank holds at most (``table_in_flight``), in
micro-batches of a whole stage (a chunk of a schedule with ``V`` chunks per rank counts ``1/V``). Counts a schedule
does not run (the interleaved schedules take ``M`` in rounds of ``S``) are left out.

Usage::

    python benchmarks/plot_pipeline_bubble.py [--output docs/figures/pipeline_bubble.png] [--max-micro 16]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _results import save_figure

from lightning_dp_strategies.pipeline import (
    SCHEDULES,
    clock_table,
    default_virtual_stages,
    schedule_bubble,
    schedule_micro_batches,
    table_in_flight,
)

ROOT = Path(__file__).resolve().parents[1]

# schedules whose curves coincide with a later one's (gpipe's bubble is 1f1b's, interleaved_1f1b's is looped_bfs's)
# are drawn wide and pale underneath
WIDE = {"gpipe", "interleaved_1f1b"}
STYLE = {
    "gpipe": ("tab:gray", "o", "-"),
    "1f1b": ("tab:blue", "s", "--"),
    "interleaved_1f1b": ("tab:orange", "^", "-"),
    "looped_bfs": ("tab:brown", "v", ":"),
    "interleaved_zb": ("tab:green", "D", "-"),
    "zbv": ("tab:red", "P", "--"),
}


def curves(stages: int, max_micro: int) -> dict[str, list[tuple[int, float, float]]]:
    """``schedule -> [(M, bubble, stages' worth of activations held by the busiest rank)]``."""
    out: dict[str, list[tuple[int, float, float]]] = {}
    for schedule in SCHEDULES:
        virtual = default_virtual_stages(schedule)
        points = []
        for micro in range(1, max_micro + 1):
            if not schedule_micro_batches(schedule, stages, micro):
                continue
            table = clock_table(schedule, stages, micro)
            points.append((micro, schedule_bubble(schedule, stages, micro), max(table_in_flight(table)) / virtual))
        out[schedule] = points
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "figures" / "pipeline_bubble.png")
    parser.add_argument("--max-micro", type=int, default=16, help="largest micro-batch count M")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4], help="pipeline stages S, one column each")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = len(args.stages)
    fig, axes = plt.subplots(2, columns, figsize=(5.2 * columns, 7.0), sharex=True, squeeze=False)
    for column, stages in enumerate(args.stages):
        top, bottom = axes[0][column], axes[1][column]
        for schedule, points in curves(stages, args.max_micro).items():
            color, marker, line = STYLE.get(schedule, ("black", "x", "-"))
            ms = [m for m, _, _ in points]
            style = {"color": color, "marker": marker, "linestyle": line, "label": schedule}
            if schedule in WIDE:
                style.update(linewidth=6, alpha=0.4, markersize=10)
            top.plot(ms, [b for _, b, _ in points], **style)
            bottom.plot(ms, [h for _, _, h in points], **style)
            print(f"S={stages} {schedule:>16}: " + ", ".join(f"M={m} {b:.3f}/{h:g}" for m, b, h in points))
        top.set_title(f"S = {stages} stages")
        top.set_ylabel("ideal bubble (idle fraction of the step)")
        top.set_ylim(0, None)
        top.grid(alpha=0.3)
        bottom.set_ylabel("activations held, busiest rank\n(micro-batches of one stage)")
        bottom.set_xlabel("micro-batches per step, M")
        bottom.set_ylim(0, None)
        bottom.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Pipeline schedules in the clock-table model (one tick per F, I or W; B = I + W)", fontsize=11)
    save_figure(fig, args.output)


if __name__ == "__main__":
    main()
