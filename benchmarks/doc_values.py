"""The numbers the pages' prose quotes from stored results: one named function of a result file for each.

A page marks every measured number it states, inline, with the result file and the name of a function here::

    two levels were <!-- value:cluster/two_level_1gbit_2x2 -->0.75x<!-- /value:cluster/two_level_1gbit_2x2 --> the
    flat ring's step

``python benchmarks/render_docs.py`` writes what ``VALUES["cluster"]["two_level_1gbit_2x2"]`` returns for
``benchmarks/results/cluster.json`` between the markers, and ``--check`` fails where the page says something else or
names a function that is not here. A function reads the stored JSON (it runs no benchmark; a few price the stored
measurements with the package's cost model, or print them with its formatter), and returns the number
formatted as the page prints it, or a short phrase where the number's words depend on it (``"equal"``, ``"lower"``),
or a whole block (a table, a log) that then sits between markers on lines of their own. Add a function here before
writing its marker.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import statistics
import textwrap
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"

Result = dict[str, Any]
Value = Callable[[Result], str]


def load(name: str) -> Result:
    """The stored result file ``benchmarks/results/NAME.json``."""
    data: Result = json.loads((RESULTS / f"{name}.json").read_text())
    return data


# ---- formatting: as the pages print numbers


def times(ratio: float) -> str:
    """A ratio as a factor: ``0.75x``."""
    return f"{ratio:.2f}x"


def sci(x: float) -> str:
    """A small difference in short scientific notation: ``3.7e-9``."""
    return re.sub(r"e([+-])0*(\d)", lambda m: "e" + ("-" if m[1] == "-" else "") + m[2], f"{x:.1e}")


def decimals2(x: float) -> str:
    """A ratio without its unit: ``0.93``."""
    return f"{x:.2f}"


def short(x: float, digits: int = 2) -> str:
    """A number with at most ``digits`` decimals and no trailing zeros: ``0``, ``0.13``."""
    return f"{x:.{digits}f}".rstrip("0").rstrip(".")


def span(values: Iterable[float], fmt: Callable[[float], str], sep: str = "-", unit: str = "") -> str:
    """The range of ``values`` as printed: ``1.14-1.19x``, or one figure where both ends print alike."""
    numbers = list(values)
    low, high = fmt(min(numbers)), fmt(max(numbers))
    return f"{low}{unit}" if low == high else f"{low}{sep}{high}{unit}"


def percent(text: str) -> int:
    """A table's ``-8%`` as an integer."""
    return int(text.rstrip("%"))


def rows(data: Result, table: int) -> list[dict[str, Any]]:
    """The rows of one of the file's tables, each by column name; a name's second column is ``"NAME #2"``."""
    t = data["tables"][table]
    columns: list[str] = []
    seen: dict[str, int] = {}
    for name in t["columns"]:
        seen[name] = seen.get(name, 0) + 1
        columns.append(name if seen[name] == 1 else f"{name} #{seen[name]}")
    return [dict(zip(columns, row, strict=True)) for row in t["rows"]]


def row(data: Result, table: int, **match: Any) -> dict[str, Any]:
    """The one row of a table whose columns hold ``match`` (``KeyError`` when none does)."""
    for r in rows(data, table):
        if all(r[column] == wanted for column, wanted in match.items()):
            return r
    raise KeyError(f"no row of table {table} with {match}")


LINKS = {"1gbit": "1 GbE", "10gbit": "10 GbE", "200mbit": "200 Mbit"}
VARIANTS = {"powersgd": "PowerSGD", "ring": "the flat ring", "two_level": "two levels"}


# ---- cluster.json: bench_cluster.py, every variant on the simulated 1 and 10 GbE cluster


def _cell(data: Result, link: str, nodes: int, per_node: int) -> dict[str, Any]:
    for cell in data["cells"]:
        if (cell["link"], cell["nodes"], cell["per_node"]) == (link, nodes, per_node):
            return dict(cell)
    raise KeyError(f"no cell {link} {nodes} x {per_node}")


def _step_ratio(data: Result, link: str, nodes: int, per_node: int, variant: str, against: str) -> float:
    steps = _cell(data, link, nodes, per_node)["step_ms"]
    return float(steps[variant] / steps[against])


def _link_ratios(data: Result, link: str, variant: str, against: str) -> list[float]:
    return [
        _step_ratio(data, link, c["nodes"], c["per_node"], variant, against) for c in data["cells"] if c["link"] == link
    ]


def _ring_vs_ddp(data: Result) -> str:
    def apart(processes: int) -> str:
        diff = max(c["max_param_diff_vs_ddp"]["ring"] for c in data["cells"] if c["nodes"] * c["per_node"] == processes)
        return "equal" if diff == 0 else f"{sci(diff)} apart"

    return f"{apart(2)} at 2 processes, {apart(4)} at 4"


def _model_errors(data: Result) -> list[tuple[int, dict[str, Any]]]:
    return [(percent(r["error"]), r) for r in rows(data, 1)]


def _model_within(data: Result) -> str:
    errors = [abs(e) for e, _ in _model_errors(data)]
    bound = 5 * math.ceil(max(errors) / 5)
    return f"within {bound}% on all {len(errors)} cells, within 15% on {sum(e <= 15 for e in errors)}"


def _model_worst_shared(data: Result) -> str:
    shared = [(e, r) for e, r in _model_errors(data) if r["nodes x procs"] in ("2 x 2", "4 x 1")]
    error, r = min(shared, key=lambda er: er[0])
    what = VARIANTS.get(r["variant"], f"`{r['variant']}`")
    return f"{-error}% ({what} on {r['nodes x procs']} over {LINKS[r['link']]})"


def _auto_vs_best(data: Result) -> list[float]:
    return [float(r["auto / best"]) for r in rows(data, 2)]


def _auto_log(data: Result) -> str:
    """The first auto launch of the 2 x 2 cell over 1 GbE, as ``AutoDecision.describe`` logs it (its first line wrapped
    once, its last at 116 characters)."""
    from lightning_dp_strategies.plan.auto import AutoChoice
    from lightning_dp_strategies.reducers.auto import repeat_hint

    cell = _cell(data, "1gbit", 2, 2)
    inputs, chosen = cell["auto_inputs"][0], cell["auto_chose"][0]
    lines = [
        f"reducer='auto' chose {chosen!r} for {cell['nodes']} node(s) x {cell['per_node']} process(es): compute "
        f"{inputs['compute_s'] * 1e3:.1f} ms a step ({inputs['backward_s'] * 1e3:.1f} ms backward),",
        f"link between nodes {inputs['inter_bytes_per_s'] / 1e6:.0f} MB/s, "
        f"inside a node {inputs['intra_bytes_per_s'] / 1e6:.0f} MB/s.",
    ]
    for label, ms in sorted(inputs["predicted_ms"].items(), key=lambda kv: kv[1]):
        lines.append(f"  {label:22s} {ms:9.1f} ms predicted" + (" <-" if label == chosen else ""))
    hint = repeat_hint(AutoChoice().candidates(cell["nodes"], cell["per_node"])[chosen])
    lines += textwrap.wrap(hint, 116)
    return "\n```text\n" + "\n".join(lines) + "\n```\n"


def _launch_spread(data: Result) -> str:
    spread = max(max(ms) / min(ms) - 1 for c in data["cells"] for ms in c["launches_ms"].values())
    return f"{spread * 100:.0f}%"


CLUSTER: dict[str, Value] = {
    "ring_vs_ddp": _ring_vs_ddp,
    "two_level_1gbit_2x2": lambda d: times(_step_ratio(d, "1gbit", 2, 2, "two_level", "ring")),
    "two_level_10gbit": lambda d: span(_link_ratios(d, "10gbit", "two_level", "ring"), decimals2, unit="x"),
    "powersgd_1gbit_2x1": lambda d: times(_step_ratio(d, "1gbit", 2, 1, "powersgd", "ddp")),
    "powersgd_1gbit_4_processes": lambda d: span(
        (_step_ratio(d, "1gbit", n, p, "powersgd", "ddp") for n, p in ((2, 2), (4, 1))), times
    ),
    "powersgd_10gbit": lambda d: span(_link_ratios(d, "10gbit", "powersgd", "ddp"), times, sep=" to "),
    "overlap": lambda d: span((c["inputs"]["overlap"] for c in d["cells"]), short, sep=" to "),
    "model_within": _model_within,
    "model_worst_shared": _model_worst_shared,
    "auto_vs_best": lambda d: span(_auto_vs_best(d), decimals2, sep=" to "),
    "auto_vs_best_x": lambda d: span(_auto_vs_best(d), times, sep=" to "),
    "auto_slower": lambda d: f"{max(0.0, max(_auto_vs_best(d)) - 1) * 100:.0f}%",
    "auto_log": _auto_log,
    "auto_2x2_first_launch": lambda d: f"{_cell(d, '1gbit', 2, 2)['launches_ms']['auto'][0]:.0f} ms",
    "auto_2x2": lambda d: f"{_cell(d, '1gbit', 2, 2)['step_ms']['auto']:.0f} ms",
    "powersgd_2x2": lambda d: f"{_cell(d, '1gbit', 2, 2)['step_ms']['powersgd']:.0f} ms",
    "launch_spread": _launch_spread,
}


# ---- zero.json: bench_zero.py, the sharded optimizer state against the unsharded ring


def _zero(data: Result, link: str, layout: str, variant: str = "zero") -> dict[str, Any]:
    return row(data, 0, link=link, layout=layout, variant=variant)


def _zero_step(data: Result, link: str, layout: str) -> float:
    return float(_zero(data, link, layout)["/ ring #2"])


def _zero_state_mb(data: Result, link: str, layout: str, variant: str = "zero") -> float:
    return float(_zero(data, link, layout, variant)["optimizer state MB / rank"])


def _zero_peak(data: Result, layout: str) -> int:
    """The sharded run's peak resident memory less the unsharded ring's, MB, on the 1 GbE cluster."""
    return int(_zero(data, "1gbit", layout)["- ring's"])


def _zero_peak_4(data: Result) -> str:
    change = _zero_peak(data, "4 x 1")
    return f"{abs(change)} MB {'lower' if change < 0 else 'higher'}"


ZERO_CELLS = (("loopback", "2 procs"), ("loopback", "4 procs"), ("1gbit", "2 x 1"), ("1gbit", "4 x 1"))

ZERO: dict[str, Value] = {
    "state_2": lambda d: row(d, 0, layout="2 procs", variant="zero")["/ ring"],
    "state_4": lambda d: row(d, 0, layout="4 procs", variant="zero")["/ ring"],
    "step_range": lambda d: span((_zero_step(d, *cell) for cell in ZERO_CELLS), times, sep=" to "),
    "step_loopback_2": lambda d: times(_zero_step(d, "loopback", "2 procs")),
    "step_loopback_4": lambda d: times(_zero_step(d, "loopback", "4 procs")),
    "step_1gbit_2": lambda d: times(_zero_step(d, "1gbit", "2 x 1")),
    "step_1gbit_4": lambda d: times(_zero_step(d, "1gbit", "4 x 1")),
    "state_mb": lambda d: f"{_zero_state_mb(d, '1gbit', '2 x 1', 'ring'):.1f} MB",
    "workspaces_mb": lambda d: f"{_zero(d, '1gbit', '2 x 1')['all-gather workspaces MB']} MB",
    "saved_2": lambda d: f"{_zero_state_mb(d, '1gbit', '2 x 1', 'ring') - _zero_state_mb(d, '1gbit', '2 x 1'):.1f} MB",
    "saved_4": lambda d: f"{_zero_state_mb(d, '1gbit', '4 x 1', 'ring') - _zero_state_mb(d, '1gbit', '4 x 1'):.1f} MB",
    "peak_2": lambda d: f"{_zero_peak(d, '2 x 1'):+d} MB",
    "peak_4": _zero_peak_4,
}


# ---- local_sgd.json: bench_local_sgd.py, time to ddp's held-out loss over 1 GbE


def _variants(data: Result, nodes: int) -> dict[str, dict[str, Any]]:
    for cell in data["cells"]:
        if cell["nodes"] == nodes:
            return dict(cell["variants"])
    raise KeyError(f"no cell of {nodes} nodes")


def _ratio(data: Result, nodes: int, variant: str) -> str:
    return f"{_variants(data, nodes)[variant]['ratio_to_ddp']:.2f}"


def _ms(data: Result, nodes: int, variant: str) -> float:
    return float(_variants(data, nodes)[variant]["seconds_per_step"] * 1e3)


def _local_sgd_table(data: Result) -> str:
    lines = [
        "| nodes | variant | ms/step | s to ddp's loss | / ddp | loss at ddp's samples | final loss |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for cell in sorted(data["cells"], key=lambda c: c["nodes"]):
        for name, v in cell["variants"].items():
            reached = v["seconds_to_target"] is not None
            seconds = f"{v['seconds_to_target']:.1f}" if reached else "not reached"
            ratio = f"{v['ratio_to_ddp']:.2f}" if reached else "-"
            if name == "local_sgd_8":  # the period the page's text follows
                name, seconds, ratio = f"**{name}**", f"**{seconds}**", f"**{ratio}**"
            ms = v["seconds_per_step"] * 1e3
            cells = [cell["nodes"], name, f"{ms:.0f}", seconds, ratio]
            cells += [f"{v['loss_at_ddp_samples']:.3f}", f"{v['final_loss']:.3f}"]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n" + "\n".join(lines) + "\n"


def _local_reached(data: Result) -> list[float]:
    return [
        v["ratio_to_ddp"]
        for cell in data["cells"]
        for name, v in cell["variants"].items()
        if name.startswith("local_sgd_") and v["seconds_to_target"] is not None
    ]


def _cheaper(data: Result, prefix: str) -> list[float]:
    return [
        _ms(data, cell["nodes"], "ddp") / _ms(data, cell["nodes"], name)
        for cell in data["cells"]
        for name in cell["variants"]
        if name.startswith(prefix)
    ]


def _outer_steps(data: Result) -> list[float]:
    return [
        cell["steps"] / int(name.removeprefix("diloco_"))
        for cell in data["cells"]
        for name in cell["variants"]
        if name.startswith("diloco_")
    ]


LOCAL_SGD: dict[str, Value] = {
    "table": _local_sgd_table,
    "local_sgd_8_2": lambda d: _ratio(d, 2, "local_sgd_8"),
    "local_sgd_8_4": lambda d: _ratio(d, 4, "local_sgd_8"),
    "diloco_16_2": lambda d: _ratio(d, 2, "diloco_16"),
    "diloco_16_4": lambda d: _ratio(d, 4, "diloco_16"),
    "local_reached": lambda d: span(_local_reached(d), decimals2),
    "ddp_step_2": lambda d: f"{_ms(d, 2, 'ddp'):.0f} ms",
    "ddp_step_4": lambda d: f"{_ms(d, 4, 'ddp') / 1e3:.1f} s",
    "local_sgd_8_step_2": lambda d: f"{_ms(d, 2, 'local_sgd_8'):.0f} ms",
    "loss_8_2": lambda d: (
        f"{_variants(d, 2)['local_sgd_8']['loss_at_ddp_samples']:.3f} against "
        f"{_variants(d, 2)['ddp']['loss_at_ddp_samples']:.3f}"
    ),
    "local_cheaper": lambda d: span(_cheaper(d, "local_sgd_"), lambda x: f"{x:.1f}", unit="x"),
    "powersgd_faster": lambda d: span(_cheaper(d, "powersgd"), lambda x: f"{x:.1f}", unit="x"),
    "outer_steps": lambda d: span(_outer_steps(d), lambda x: f"{x:.0f}"),
}


# ---- local_sgd_ft.json: bench_local_sgd.py, local SGD with and without fault_tolerant=True (Adam)


def _share(data: Result, variant: str) -> str:
    ratio = _variants(data, 2)[variant]["ratio_to_ddp"]
    return "not reached" if ratio is None else f"{ratio:.2f}"


def _period_s(data: Result, variant: str) -> float:
    """The median wall time of one period of 8 steps after the first (evaluated every 8 steps, at the
    synchronisations; the evaluations' own time left out)."""
    cell = next(c for c in data["cells"] if c["nodes"] == 2)
    seconds = [p["seconds"] for p in cell["curves"][variant][1:]]
    return float(statistics.median(b - a for a, b in itertools.pairwise(seconds)))


LOCAL_SGD_FT: dict[str, Value] = {
    "period": lambda d: f"{_period_s(d, 'local_sgd_8_ft'):.1f} s",
    "plain_period": lambda d: f"{_period_s(d, 'local_sgd_8'):.1f} s",
    "per_sync": lambda d: f"{_period_s(d, 'local_sgd_8_ft') - _period_s(d, 'local_sgd_8'):.1f} s",
    "share": lambda d: _share(d, "local_sgd_8_ft"),
    "plain_share": lambda d: _share(d, "local_sgd_8"),
}


# ---- planning.json: bench_planning.py, the step planned from a nominal link against the simulated cluster

PLANNING_ORDER = (("1gbit", 1), ("10gbit", 1), ("1gbit", 2), ("10gbit", 2))


def _planning_cells(data: Result) -> list[dict[str, Any]]:
    by_key = {(c["link"], c["per_node"]): c for c in data["cells"]}
    return [by_key[key] for key in PLANNING_ORDER]


def _error(x: float) -> str:
    return f"{x * 100:+.0f}%".replace("+", "")


def _planning_table(data: Result) -> str:
    lines = [
        "| link | nodes x processes | default ms | flat ms | default / flat | predicted ms (planning path) | error "
        "| predicted, compute measured with the cell's processes at once | error |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in _planning_cells(data):
        measured, predicted, error = c["measured_ms"], c["predicted_ms"], c["error"]
        cells = [LINKS[c["link"]], f"{c['nodes']} x {c['per_node']}", f"{measured['default']:.0f}"]
        cells += [f"{measured['flat']:.0f}", f"{c['ratio_default_flat']:.2f}"]
        cells += [f"{predicted['planned']:.0f}", _error(error["planned"])]
        cells += [f"{predicted['shared_cores']:.0f}", _error(error["shared_cores"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n" + "\n".join(lines) + "\n"


def _bandwidths(data: Result, link: str) -> str:
    mbs = [float(re.findall(r"([\d.]+) MB/s", c["bandwidth"])[0]) for c in data["cells"] if c["link"] == link]
    return span(mbs, lambda x: f"{x:.0f}", unit=" MB/s")


def _planning_errors(data: Result, per_node: int, prediction: str) -> list[float]:
    return [abs(c["error"][prediction]) * 100 for c in data["cells"] if c["per_node"] == per_node]


def _slow_launch(data: Result) -> str:
    cell = min(data["cells"], key=lambda c: c["ratio_default_flat"])
    which = "flat" if cell["ratio_default_flat"] < 1 else "default"
    launches = cell["launches_ms"][which]
    name = "the flat ring" if which == "flat" else "the default"
    return (
        f"{cell['ratio_default_flat']:.2f} from one slow launch of {name} "
        f"({max(launches):.0f} ms against {min(launches):.0f} ms)"
    )


PLANNING: dict[str, Value] = {
    "table": _planning_table,
    "bandwidth_1gbit": lambda d: _bandwidths(d, "1gbit"),
    "bandwidth_10gbit": lambda d: _bandwidths(d, "10gbit"),
    "planned_2x1": lambda d: f"{max(_planning_errors(d, 1, 'planned')):.0f}%",
    "planned_2x2": lambda d: span(_planning_errors(d, 2, "planned"), lambda x: f"{x:.0f}", unit="%"),
    "shared_cores_2x2": lambda d: f"{max(_planning_errors(d, 2, 'shared_cores')):.0f}%",
    "compute_4_processes": lambda d: f"{d['shared_cores']['4']['compute_s'] * 1e3:.0f} ms",
    "compute_local": lambda d: f"{d['local']['compute_s'] * 1e3:.0f} ms",
    "cpu_costs_shift": lambda d: span(
        (100 * (c["predicted_ms"]["planned"] / c["predicted_ms"]["wire"] - 1) for c in d["cells"]),
        lambda x: f"{x:.0f}",
        unit="%",
    ),
    "wire_ms": lambda d: (
        ", ".join(f"{c['predicted_ms']['wire']:.0f}" for c in _planning_cells(d)[:-1])
        + f" and {_planning_cells(d)[-1]['predicted_ms']['wire']:.0f} ms"
    ),
    "default_flat": lambda d: span((c["ratio_default_flat"] for c in d["cells"]), decimals2),
    "slow_launch": _slow_launch,
}


# ---- restart*.json: bench_restart.py, torchrun restarts on the simulated 2-node cluster


def _ddp_resumed(data: Result) -> str:
    """Lightning's ddp over this file's killed tries and restart_run2.json's (a try that never ran is not counted)."""
    tries = [
        r
        for d in (data, load("restart_run2"))
        for r in d["runs"]
        if r["strategy"] == "ddp" and r["run"] != "uninterrupted"
    ]
    ran = [r for r in tries if r["seconds"] > 0]
    return f"{sum(r['passed'] for r in ran)} of the {len(ran)}"


def _ddp_lost(data: Result) -> str:
    lost = [r for r in load("restart_run2")["runs"] if r["strategy"] == "ddp" and r["seconds"] > 0 and not r["passed"]]
    return f"{lost[0]['seconds']:.0f} s"


def _outage_restarted(data: Result) -> str:
    runs = [r for r in data["runs"] if r["run"].startswith("link down") and r["resumed_from_checkpoint"]]
    return f"{runs[0]['seconds']:.1f} s"


def _outage_rode_through(data: Result) -> str:
    """The outage run whose timeout outlasted the outage: its seconds, where no worker restarted."""
    run = next((r for r in data["runs"] if r["run"].startswith("link down") and not r["resumed_from_checkpoint"]), None)
    if run is None:
        raise ValueError("no outage run that rode through is stored: run bench_restart.py with --outage above 0")
    if any(run["worker_restart_counts"]) or not run["passed"]:
        raise ValueError(f"the run {run['run']!r} restarted or failed: it did not ride the outage through")
    return f"{run['seconds']:.1f} s"


def _restarted_equal(data: Result) -> str:
    """How far the killed and restarted jobs ended from the uninterrupted job's parameters, worst of them."""
    diffs = [r["max_param_diff"] for r in data["runs"] if r["killed"] and r["max_param_diff"] is not None]
    worst = max(diffs)
    return "bitwise equal to" if worst == 0 else f"within {sci(worst)} of"


RESTART: dict[str, Value] = {
    "ddp_resumed": _ddp_resumed,
    "ddp_lost": _ddp_lost,
    "outage_restarted": _outage_restarted,
    "outage_rode_through": _outage_rode_through,
    "restarted_equal": _restarted_equal,
}

RESTART_OUTAGE: dict[str, Value] = {"outage_restarted": _outage_restarted}


# ---- ring_allreduce_c.json: bench_ring_allreduce.py --part c, reducers and compression on loopback


def _compression_ms(data: Result, compression: str) -> str:
    """A compression's extra compute per step (``c``) as the cost-model table states it."""
    return f"{float(row(data, 1, compression=compression)['c ms']):.0f} ms"


def _reducer_step(data: Result, reducer: str) -> str:
    """A reducer's Trainer step in the first table."""
    return f"{float(row(data, 0, reducer=reducer)['ms/step']):.0f} ms"


RING_ALLREDUCE_C: dict[str, Value] = {
    "powersgd_compute": lambda d: _compression_ms(d, 'PowerSGD("ring", rank=4)'),
    "ring_step": lambda d: _reducer_step(d, '"ring"'),
}


# ---- survive.json: bench_survive.py, fault_tolerant=True on the simulated 3-node cluster


def _agents_exit(data: Result) -> str:
    join = next(r for r in data["runs"] if r["run"] == "join")
    agents = [rank["agent_exited_s"] for rank in join["ranks"].values() if rank["worker_exit"] == "0"]
    return f"{max([*agents, join['replacement']['agent_exited_s']]) - join['seconds']:.0f} s"


SURVIVE: dict[str, Value] = {"join_agents_exit": _agents_exit}


# ---- lm.json: bench_lm.py, the language model on the simulated cluster


def _lm_setting(data: Result, key: str) -> str:
    """One training setting every stored cell shares, as the page prints it (seconds without a trailing ``.0``)."""
    value = data["settings"][key]
    return f"{value:g}" if isinstance(value, float) else str(value)


def _plain_sooner(data: Result) -> str:
    """In how many stored cells ``streaming_diloco`` (plain averaging, its chosen period) reached ddp's loss before
    both variants with DiLoCo's outer Nesterov step (``diloco``, ``streaming_nesterov``); never reaching it is last."""

    def seconds(cell: Result, variant: str) -> float:
        reached = cell["variants"][variant]["seconds_to_target"]
        return math.inf if reached is None else float(reached)

    cells = [c for c in data["cells"] if c["target_loss"] is not None]
    sooner = sum(
        seconds(c, "streaming_diloco") < min(seconds(c, "diloco"), seconds(c, "streaming_nesterov")) for c in cells
    )
    return f"in all {len(cells)} cells" if sooner == len(cells) else f"in {sooner} of the {len(cells)} cells"


def _compute_share(data: Result, link: str, nodes: int) -> str:
    """The compute's share of ddp's step in the ``link`` x ``nodes`` cell (local SGD's median step, which sends
    nothing, over ddp's mean step): the share of ddp's time a mode takes that sends nothing and needs ddp's steps."""
    cell = next(c for c in data["cells"] if c["link"] == link and c["nodes"] == nodes)
    rows = cell["variants"]
    return f"{rows['local_sgd']['median_step_s'] / rows['ddp']['seconds_per_step']:.2f}"


LOCAL_VARIANTS = ("local_sgd", "diloco", "streaming_diloco", "streaming_diloco_int8", "streaming_nesterov")
"""The language model's variants a ``LocalSGDStrategy`` runs, which the cost model prices."""


def _lm_predictions(data: Result) -> str:
    """The cost model against the language model's local SGD runs: for each cell and variant, the period and delay
    it prices (for ``"auto"``, the ones it chooses itself), and the bytes a step and the step it predicts (the
    variant's ``cost_model`` at the measured link, without latency, with the variant's own median step as
    ``compute_seconds``) beside the measured ones."""
    from types import SimpleNamespace

    from bench_lm import lm_config, make_strategy
    from lightning.pytorch.strategies import StrategyRegistry
    from lm_task import parameter_count

    from lightning_dp_strategies import plan
    from lightning_dp_strategies.plan.formulas import local_sgd_schedule

    params = parameter_count(lm_config(SimpleNamespace(**data["settings"])))
    lines = [
        "| link | nodes | variant | H, K, delay, precision | MB/step predicted | measured | s/step predicted | "
        "measured | error |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for cell in data["cells"]:
        link = plan.Link(0.0, float(re.search(r"(\d+) MB/s", cell["bandwidth"])[1]) * 1e6)  # type: ignore[index]
        for name in (v for v in LOCAL_VARIANTS if v in cell["variants"]):
            run, strategy = cell["variants"][name], make_strategy(name)
            if isinstance(strategy, str):  # a registered name: the instance the Trainer makes of it
                strategy = StrategyRegistry.get(strategy)
            c = strategy.local_config
            work = plan.Workload(gradient_bytes=4 * params, compute_seconds=run["median_step_s"])
            p = plan.predict(strategy, work, cell["nodes"], link)
            period, delay = local_sgd_schedule(
                work, cell["nodes"], link, c.sync_every, c.fragments, c.delay, c.outer_precision
            )
            auto = " (auto)" if c.sync_every == "auto" else ""
            measured = run["seconds_per_step"]
            lines.append(
                f"| {cell['link']} | {cell['nodes']} | {name} | {period}{auto}, {c.fragments}, {delay}, "
                f"{c.outer_precision} | {p.bytes_per_rank / 1e6:.2f} | {run['sent_mb_per_step']:.2f} | "
                f"{p.step_seconds:.2f} | {measured:.2f} | {(p.step_seconds - measured) / measured * 100:+.0f}% |"
            )
    return "\n" + "\n".join(lines) + "\n"


LM: dict[str, Value] = {key: (lambda d, k=key: _lm_setting(d, k)) for key in ("lr", "warmup", "eval_seconds")}
LM["predictions"] = _lm_predictions
LM["plain_sooner"] = _plain_sooner
LM["compute_share_200mbit_2"] = lambda d: _compute_share(d, "200mbit", 2)


def _first_per_seed(data: Result) -> str:
    """Which variant reached its seed's ddp loss first (``lm_seeds.json``), over the seeds: "`NAME` on every seed",
    or each variant with the seeds it was first on.

    Examples:
        >>> cell = lambda seed, a, b: {"seed": seed, "variants": {"a": {"ratio_to_ddp": a}, "b": {"ratio_to_ddp": b}}}
        >>> _first_per_seed({"cells": [cell(0, 0.3, 0.4), cell(1, 0.5, None)]})
        '`a` on every seed'
        >>> _first_per_seed({"cells": [cell(0, 0.3, 0.4), cell(1, 0.5, 0.2), cell(2, None, None)]})
        '`a` on seed 0, `b` on seed 1, none on seed 2'
    """
    firsts: dict[str, list[int]] = {}
    for cell in data["cells"]:
        reached = {v: r["ratio_to_ddp"] for v, r in cell["variants"].items() if v != "ddp" and r["ratio_to_ddp"]}
        name = f"`{min(reached, key=reached.__getitem__)}`" if reached else "none"
        firsts.setdefault(name, []).append(cell["seed"])
    if len(firsts) == 1:
        return f"{next(iter(firsts))} on every seed"
    said = [f"{name} on seed{'s' * (len(seeds) > 1)} {', '.join(map(str, seeds))}" for name, seeds in firsts.items()]
    return ", ".join(said)


# ---- compare.json, compare_user.json: store_compare.py, the README's `lightning-dp-strategies compare` runs


def compare_printed(data: Result) -> str:
    """The table ``lightning-dp-strategies compare`` printed for the stored rows, by the package's own formatter (the
    rows that did not run and why included)."""
    from lightning_dp_strategies.compare.report import format_table
    from lightning_dp_strategies.compare.runner import RunResult

    return str(format_table([RunResult(**row) for row in data["results"]]))


def _compare_setting(data: Result) -> str:
    """Where and on what the comparison ran: the machine, the software and the workload."""
    m, config = data["machine"], data["config"]
    cores, usable, load = m["cpu_count"], m.get("cores_usable"), m.get("load_average_at_start")
    where = f"a {cores}-core {m['platform'].split('-')[0]} machine"
    where += f" ({usable} usable)" if usable not in (None, cores) else ""
    where += f", load average {load} at the start" if load is not None else ""
    software = f"Python {m['python']}, torch {m['torch']}, {m['cuda'] or 'no GPU'}"
    work = f"the demo's {config['model_size']} MLP, " if "model_size" in config else ""
    work += f"{config['steps']} steps" + (f" of {config['global_batch']} samples" if "global_batch" in config else "")
    return f"{where}; {software}; {work}, {data['devices']} devices per strategy"


COMPARE: dict[str, Value] = {
    "table": lambda d: f"\n```\n{compare_printed(d)}\n```\n",
    "setting": _compare_setting,
    "stored_by": lambda d: f"`{d['command']}`",
}


def _final_loss(strategy: str) -> Value:
    """A row's final loss as the comparison's table prints it."""
    return lambda d: next(f"{r['final_loss']:.2f}" for r in d["results"] if r["strategy"] == strategy)


COMPARE_STREAMING: dict[str, Value] = {
    **COMPARE,
    **{
        f"loss_{name}": _final_loss(name)
        for name in ("single", "local_sgd", "streaming_delay_1", "streaming_delay_0", "streaming_mixing_half")
    },
}


VALUES: dict[str, dict[str, Value]] = {
    "cluster": CLUSTER,
    "zero": ZERO,
    "local_sgd": LOCAL_SGD,
    "local_sgd_ft": LOCAL_SGD_FT,
    "planning": PLANNING,
    "restart": RESTART,
    "restart_outage": RESTART_OUTAGE,
    "ring_allreduce_c": RING_ALLREDUCE_C,
    "survive": SURVIVE,
    "lm": LM,
    "lm_seeds": {"first": _first_per_seed},
    "lm_amd": {"compute_share_200mbit_2": LM["compute_share_200mbit_2"], "predictions": _lm_predictions},
    "compare": COMPARE,
    "compare_user": COMPARE,
    "compare_streaming": COMPARE_STREAMING,
}
"""Every value a page may quote: ``VALUES[NAME][KEY]`` of ``benchmarks/results/NAME.json``."""
