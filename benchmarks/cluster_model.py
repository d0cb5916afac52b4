"""The step model against the simulated cluster: predictions from a cluster run's measured inputs, and its figure.

``bench_cluster.py`` stores, per cell (link x nodes x processes), the measured step of every variant and what the
model needs (``inputs``: one rank's compute and backward, the CPU's per-byte costs, the links between and inside
nodes). This module predicts each ring variant's step from those inputs with
:func:`lightning_dp_strategies.plan.ring_step`, tabulates prediction against measurement, and draws step time
against link bandwidth. Usage::

    python benchmarks/cluster_model.py benchmarks/results/cluster.json   # table, and docs/figures/network.png
    python benchmarks/cluster_model.py --guide   # the guide's decision table: benchmarks/results/network_guide.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FIGURE = ROOT / "docs" / "figures" / "network.png"

REDUCTIONS = {  # variant -> (compression, two levels)
    "ring": ("none", False),
    "two_level": ("none", True),
    "ring_bf16": ("bf16", False),
    "two_level_bf16": ("bf16", True),
    "powersgd": ("powersgd", False),
}
LABELS = {"flat plain": "ring", "two-level plain": "two_level", "flat bf16": "ring_bf16"}
LABELS |= {"two-level bf16": "two_level_bf16", "flat powersgd r4": "powersgd"}
"""``AutoReducer``'s candidate labels and the variant each is."""


def _shapes(settings: dict[str, Any]) -> list[tuple[int, ...]]:
    width, depth = settings["width"], settings["depth"]
    return [s for _ in range(depth) for s in ((width, width), (width,))] + [(10, width), (10,)]


def predict_ms(
    cell: dict[str, Any], settings: dict[str, Any], variant: str, inter_bytes_per_s: float | None = None
) -> float | None:
    """The predicted step (ms) of a ring ``variant`` in ``cell``, on its measured inputs (``None`` without them);
    ``inter_bytes_per_s`` replaces the measured bandwidth between nodes."""
    from lightning_dp_strategies.plan import CpuCosts, Link, Reduction, Topology, ring_step

    x = cell.get("inputs")
    if not x or variant not in REDUCTIONS:
        return None
    compression, two_level = REDUCTIONS[variant]
    inter = Link(x["inter_latency_s"], inter_bytes_per_s or x["inter_bytes_per_s"] or 1e12)
    intra = Link(x["intra_latency_s"], x["intra_bytes_per_s"]) if x["intra_bytes_per_s"] else None
    flat = Link(x["flat_latency_s"], x["flat_bytes_per_s"]) if x.get("flat_bytes_per_s") else None
    if flat is not None and inter_bytes_per_s:  # the flat ring's slowest hop crosses nodes: it scales with them
        flat = Link(flat.latency_s, flat.bandwidth_bytes_per_s * inter_bytes_per_s / x["inter_bytes_per_s"])
    busy = [x.get(k, 0.0) for k in ("inter_busy", "intra_busy", "flat_busy")]
    topology = Topology(cell["nodes"], cell["per_node"], inter, intra, flat, *busy)
    cpu = CpuCosts(x["add"], x["add_low"], x["cast"], x["powersgd"], powersgd_rank=4, overlap=x.get("overlap", 1.0))
    shapes = _shapes(settings)
    sizes = [4 * math.prod(s) for s in shapes]
    how = Reduction(compression, rank=4, two_level=two_level)
    caps = (settings.get("bucket_cap_mb", 25.0), 1.0)
    return 1e3 * ring_step(sizes, shapes, x["compute_s"], x["backward_s"], topology, how, cpu, caps).step_seconds


def prediction_rows(data: dict[str, Any]) -> list[list[Any]]:
    """Per cell and ring variant: measured ms, predicted ms, error; and ``auto``'s choice against the best fixed."""
    rows = []
    for cell in data["cells"]:
        where = [cell["link"], f"{cell['nodes']} x {cell['per_node']}"]
        for variant, measured in cell["step_ms"].items():
            predicted = predict_ms(cell, data["settings"], variant)
            if predicted is not None:
                rows.append([*where, variant, round(measured), round(predicted), f"{predicted / measured - 1:+.0%}"])
    return rows


def auto_rows(data: dict[str, Any]) -> list[list[Any]]:
    """Per cell: what ``auto`` chose, its step, the best fixed package variant's, and the ratio."""
    rows = []
    for cell in data["cells"]:
        steps = cell["step_ms"]
        if "auto" not in steps:
            continue
        fixed = {v: ms for v, ms in steps.items() if v in REDUCTIONS}
        best = min(fixed, key=fixed.__getitem__)
        chose = ", ".join(sorted({LABELS.get(c, c) for c in cell.get("auto_chose", [])}))
        where = [cell["link"], f"{cell['nodes']} x {cell['per_node']}"]
        rows.append(
            [*where, chose, round(steps["auto"]), best, round(fixed[best]), f"{steps['auto'] / fixed[best]:.2f}"]
        )
    return rows


def _measured_gbits(cell: dict[str, Any]) -> float:
    """The bandwidth between nodes the cell's probe measured, in Gbit/s (the nominal rate without a probe)."""
    inputs = cell.get("inputs") or {}
    measured = inputs.get("inter_bytes_per_s")
    return 8 * measured / 1e9 if measured else float(cell["link"].removesuffix("gbit"))


def draw(data: dict[str, Any], path: Path = FIGURE) -> None:
    """Step time against the bandwidth between nodes (as the probe measured it): one panel per layout, the model's
    lines (on the slowest link's measured inputs, the bandwidth varied) and the measured points of every link."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = sorted({(c["nodes"], c["per_node"]) for c in data["cells"]})
    width = 4.2 * len(layouts) + 2.6  # the panels and the legend beside them
    fig, axes = plt.subplots(1, len(layouts), figsize=(width, 3.8), sharey=True, squeeze=False)
    others = ("ddp", "torch_powersgd", "auto", "hybrid_pipeline")
    colors = dict(zip([*REDUCTIONS, *others], plt.cm.tab10.colors, strict=False))
    gbits = [0.25 * 1.25**k for k in range(30)]
    for ax, (nodes, per_node) in zip(axes[0], layouts, strict=True):
        cells = [c for c in data["cells"] if (c["nodes"], c["per_node"]) == (nodes, per_node)]
        base = min((c for c in cells if c.get("inputs")), key=_measured_gbits, default=None)
        shown = [v for v in REDUCTIONS if per_node > 1 or not v.startswith("two_level")]
        for variant in shown:
            if base is not None and variant in base["step_ms"]:
                line = [predict_ms(base, data["settings"], variant, g * 1e9 / 8) for g in gbits]
                ax.plot(gbits, line, color=colors[variant], lw=1.2, label=f"{variant}: model, measured")
        for cell in cells:
            for variant, ms in cell["step_ms"].items():
                if variant in shown or variant in others:
                    marker = "o" if variant in REDUCTIONS else "x"
                    ax.scatter([_measured_gbits(cell)], [ms], color=colors[variant], s=20, marker=marker)
        title = f"{nodes} nodes x {per_node} process{'es' if per_node > 1 else ''}"
        ax.set(xscale="log", yscale="log", title=title, xlabel="bandwidth between nodes, Gbit/s")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("step time, ms")
    lines = dict(pair for ax in axes[0] for pair in zip(*reversed(ax.get_legend_handles_labels()), strict=True))
    labels, handles = list(lines), list(lines.values())
    extra = [plt.Line2D([], [], color=colors[v], marker="x", ls="") for v in others]
    names = ["ddp, measured", "torch powerSGD_hook, measured", "reducer='auto', measured", "hybrid_pipeline, measured"]
    fig.legend([*handles, *extra], [*labels, *names], loc="center right", fontsize=8)
    fig.tight_layout(rect=(0, 0, 1 - 2.6 / width, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


GUIDE_MODELS = {  # name -> (parameters, weight matrix shape, compute seconds a step on one GPU)
    "25 M (ResNet-50 class)": (25_000_000, (512, 2048), 0.10),
    "350 M (BERT-large class)": (350_000_000, (1024, 4096), 0.35),
    "1.3 B (GPT-XL class)": (1_300_000_000, (2048, 8192), 1.00),
}
"""The guide's models: their size, a typical weight matrix (all of them, for PowerSGD) and an assumed step."""
GUIDE_LINKS = {"1 GbE": 1.25e8, "10 GbE": 1.25e9, "25 GbE": 3.125e9}
GUIDE_GPU_CPU = (2e-12, 2e-12, 2e-12, 2e-11)
"""Per-byte costs of add, bf16 add, cast and PowerSGD's work on a GPU (about 1 TB/s of memory bandwidth)."""
GUIDE_NODES = (2, 8)
GUIDE_PER_NODE = 8


def guide_rows() -> list[list[Any]]:
    """The decision table: per link, model and node count, every candidate's predicted step on GPU-class compute,
    8 GPUs a node joined by NVLink-class links; the fastest named, with its share of the step spent computing."""
    from lightning_dp_strategies.plan import CpuCosts, Link, Reduction, Topology, ring_step

    candidates = {
        "flat plain": Reduction(),
        "two-level plain": Reduction(two_level=True),
        "two-level bf16": Reduction("bf16", two_level=True),
        "flat powersgd r4": Reduction("powersgd", rank=4),
    }
    cpu = CpuCosts(*GUIDE_GPU_CPU, powersgd_rank=4)
    nvlink = Link(1e-5, 1.5e11)
    rows = []
    for link_name, bandwidth in GUIDE_LINKS.items():
        for model, (params, shape, compute) in GUIDE_MODELS.items():
            matrices = params // (shape[0] * shape[1])
            shapes = [shape] * matrices
            sizes = [4 * shape[0] * shape[1]] * matrices
            for nodes in GUIDE_NODES:
                topology = Topology(nodes, GUIDE_PER_NODE, Link(5e-5, bandwidth), nvlink)
                steps = {
                    label: ring_step(sizes, shapes, compute, compute * 2 / 3, topology, how, cpu).step_seconds
                    for label, how in candidates.items()
                }
                best = min(steps, key=steps.__getitem__)
                rows.append(
                    [link_name, model, f"{nodes} x {GUIDE_PER_NODE}"]
                    + [round(steps[c] * 1e3) for c in candidates]
                    + [best, f"{compute / steps[best]:.0%}"]
                )
    return rows


def write_guide(path: Path) -> None:
    """Store :func:`guide_rows` as a result file that ``render_docs.py`` renders into the guide page."""
    columns = ["link between nodes", "model", "nodes x GPUs"]
    columns += ["flat ring ms", "two-level ms", "two-level bf16 ms", "PowerSGD r4 ms", "fastest", "compute share"]
    notes = [
        "Predicted by `lightning_dp_strategies.plan.ring_step`, not measured: "
        + ", ".join(f"{m}: {c:.2f} s a step" for m, (_, _, c) in GUIDE_MODELS.items())
        + " of compute on one GPU (backward two thirds of it), fp32 gradients, 25 MiB buckets, 8 GPUs a node over "
        "150 GB/s links, 50 us latency between nodes, reductions on the GPU at about 1 TB/s.",
    ]
    table = {"title": "Predicted step on GPU-class compute", "columns": columns, "rows": guide_rows(), "notes": notes}
    data = {"benchmark": "network_guide", "command": "python benchmarks/cluster_model.py --guide", "tables": [table]}
    path.write_text(json.dumps({**data, "notes": [], "settings": {}}, indent=2) + "\n")
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, nargs="?", default=ROOT / "benchmarks" / "results" / "cluster.json")
    parser.add_argument("--figure", type=Path, default=FIGURE)
    parser.add_argument(
        "--guide",
        type=Path,
        nargs="?",
        const=ROOT / "benchmarks" / "results" / "network_guide.json",
        help="write the predicted guide table: to this path, to --json, or to benchmarks/results/network_guide.json",
    )
    parser.add_argument("--json", type=Path, help="with --guide: where the guide table goes")
    args = parser.parse_args()
    if args.guide is not None:
        return write_guide(args.json or args.guide)
    data = json.loads(args.results.read_text())
    for row in prediction_rows(data):
        print("  ".join(str(c) for c in row))
    for row in auto_rows(data):
        print("auto", "  ".join(str(c) for c in row))
    draw(data, args.figure)
    print(f"wrote {args.figure}")
    return None


if __name__ == "__main__":
    main()
