"""benchmarks/render_docs.py: the measured numbers of the pages are rendered from the stored results and checked.

A value marker (``<!-- value:NAME/KEY -->TEXT<!-- /value:NAME/KEY -->``) takes its text from the function
``doc_values.VALUES[NAME][KEY]`` of ``benchmarks/results/NAME.json``; ``--check`` fails where a page says something
else, and both modes fail on a marker that names nothing.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import doc_values  # noqa: E402
import render_docs  # noqa: E402

RATIO = "<!-- value:demo/ratio -->{}<!-- /value:demo/ratio -->"


@pytest.fixture
def demo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A results folder holding ``demo.json`` and one value of it, ``demo/ratio``; the page to write goes beside it."""
    results = tmp_path / "results"
    results.mkdir()
    (results / "demo.json").write_text(json.dumps({"step_ms": {"ours": 4.0, "theirs": 10.0}}))
    monkeypatch.setattr(render_docs, "RESULTS", results)
    values = {"demo": {"ratio": lambda d: f"{d['step_ms']['ours'] / d['step_ms']['theirs']:.2f}x"}}
    monkeypatch.setattr(render_docs, "VALUES", values)
    return tmp_path / "page.md"


def test_a_value_marker_is_rendered_from_its_result_file(demo: Path) -> None:
    demo.write_text(f"# Page\n\nOurs took {RATIO.format('0.50x')} of their step.\n")
    assert render_docs.render_page(demo, check=False)
    assert demo.read_text() == f"# Page\n\nOurs took {RATIO.format('0.40x')} of their step.\n"
    assert render_docs.render_page(demo, check=True)  # and then the page is up to date


def test_check_fails_naming_the_page_and_the_marker_where_a_value_differs(
    demo: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    text = f"Ours took {RATIO.format('0.50x')} of their step.\n"
    demo.write_text(text)
    assert not render_docs.render_page(demo, check=True)
    said = capsys.readouterr().err
    assert f"{demo}: <!-- value:demo/ratio --> says '0.50x', the stored results give '0.40x'" in said
    assert demo.read_text() == text  # --check writes nothing
    monkeypatch.setattr(sys, "argv", ["render_docs.py", "--check", "--page", str(demo)])
    with pytest.raises(SystemExit) as exit_:
        render_docs.main()
    assert exit_.value.code == 1


@pytest.mark.parametrize("check", [True, False], ids=["check", "render"])
@pytest.mark.parametrize(
    ("marker", "reason"),
    [
        ("<!-- value:demo/nope -->1<!-- /value:demo/nope -->", "has no value 'nope' for demo.json (it has: ratio)"),
        (
            "<!-- value:other/ratio -->1<!-- /value:other/ratio -->",
            "has no value 'ratio' for other.json (it has: none)",
        ),
        ("<!-- value:demo/ratio -->1 without its closing marker", "opens no value marker"),
        ("<!-- value:demo -->1<!-- /value:demo -->", "opens no value marker"),
    ],
    ids=["unknown key", "unknown file", "never closed", "no key"],
)
def test_a_marker_that_names_no_value_fails_both_modes(
    demo: Path, capsys: pytest.CaptureFixture[str], check: bool, marker: str, reason: str
) -> None:
    text = f"It took {marker} of the step.\n"
    demo.write_text(text)
    assert not render_docs.render_page(demo, check=check)
    said = capsys.readouterr().err
    assert str(demo) in said and reason in said
    assert demo.read_text() == text


def test_a_value_whose_file_is_missing_or_lacks_the_field_fails(
    demo: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    demo.write_text(f"It took {RATIO.format('0.40x')} of the step.\n")
    (render_docs.RESULTS / "demo.json").write_text(json.dumps({"step_ms": {"ours": 4.0}}))
    assert not render_docs.render_page(demo, check=True)
    assert "demo.json lacks what 'ratio' reads (KeyError: 'theirs')" in capsys.readouterr().err
    (render_docs.RESULTS / "demo.json").unlink()
    assert not render_docs.render_page(demo, check=True)
    assert "no stored result demo.json" in capsys.readouterr().err


def test_an_inline_value_may_not_start_a_line(demo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    demo.write_text(f"Ours took\n{RATIO.format('0.40x')} of their step.\n")  # Markdown would cut the paragraph
    assert not render_docs.render_page(demo, check=True)
    assert "starts a line" in capsys.readouterr().err


def test_a_block_value_is_rendered_between_markers_on_their_own_lines(
    demo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    render_docs.VALUES["demo"]["table"] = lambda d: "\n| ours | theirs |\n| --- | --- |\n| 4 | 10 |\n"
    demo.write_text("Before.\n\n<!-- value:demo/table -->\n| ours | theirs |\n| --- | --- |\n| 4 | 9 |\n"
                    "<!-- /value:demo/table -->\n\nAfter.\n")  # fmt: skip
    assert not render_docs.render_page(demo, check=True)
    assert "line 3 says '| 4 | 9 |', the stored results give '| 4 | 10 |'" in capsys.readouterr().err
    assert render_docs.render_page(demo, check=False)
    assert "| 4 | 10 |\n<!-- /value:demo/table -->\n\nAfter." in demo.read_text()


def test_a_stored_function_reads_its_number_from_the_json() -> None:
    cluster = doc_values.load("cluster")
    assert doc_values.CLUSTER["two_level_1gbit_2x2"](cluster) == "0.75x"
    changed = copy.deepcopy(cluster)
    cell = next(c for c in changed["cells"] if (c["link"], c["nodes"], c["per_node"]) == ("1gbit", 2, 2))
    cell["step_ms"]["two_level"] = cell["step_ms"]["ring"] / 2
    assert doc_values.CLUSTER["two_level_1gbit_2x2"](changed) == "0.50x"


def test_a_phrase_follows_the_stored_number_and_a_run_that_does_not_show_it_fails() -> None:
    restart = doc_values.load("restart")
    assert doc_values.RESTART["restarted_equal"](restart) == "bitwise equal to"
    changed = copy.deepcopy(restart)
    next(r for r in changed["runs"] if r["killed"])["max_param_diff"] = 3e-8
    assert doc_values.RESTART["restarted_equal"](changed) == "within 3.0e-8 of"
    rode = next(r for r in changed["runs"] if r["run"].startswith("link down") and not r["resumed_from_checkpoint"])
    rode["worker_restart_counts"] = [1, 0]  # not a ride-through: the page must not quote it as one
    with pytest.raises(ValueError, match="did not ride the outage through"):
        doc_values.RESTART["outage_rode_through"](changed)


def test_every_stored_value_is_quoted_by_a_page() -> None:
    marked = {
        (m.group("name"), m.group("key"))
        for page in render_docs.PAGES
        for m in render_docs.VALUE.finditer(page.read_text())
    }
    defined = {(name, key) for name, keys in doc_values.VALUES.items() for key in keys}
    assert defined - marked == set(), "values in benchmarks/doc_values.py no page quotes: remove them"
    assert marked - defined == set()


def test_the_pages_are_what_the_stored_results_give(capsys: pytest.CaptureFixture[str]) -> None:
    stale = [page for page in render_docs.PAGES if not render_docs.render_page(page, check=True)]
    assert stale == [], capsys.readouterr().err + "\nrender them with python benchmarks/render_docs.py"


COMPARE_RUNS = ["compare", "compare_user"]
"""The README's two `lightning-dp-strategies compare` tables: the built-in demo and docs/examples' user model."""


def _readme_value(name: str, key: str, text: str | None = None) -> str:
    text = (render_docs.ROOT / "README.md").read_text() if text is None else text
    found = [m.group("body") for m in render_docs.VALUE.finditer(text) if (m["name"], m["key"]) == (name, key)]
    assert len(found) == 1, f"README.md should hold one value:{name}/{key} marker, holds {len(found)}"
    return found[0]


@pytest.mark.parametrize("name", COMPARE_RUNS)
def test_the_readme_compare_table_is_the_package_formatter_on_the_stored_run(name: str) -> None:
    from lightning_dp_strategies.compare.report import format_table
    from lightning_dp_strategies.compare.runner import RunResult

    data = doc_values.load(name)
    printed = format_table([RunResult(**row) for row in data["results"]])
    assert _readme_value(name, "table") == f"\n```\n{printed}\n```\n"
    setting = _readme_value(name, "setting")
    assert f"torch {data['machine']['torch']}" in setting and f"{data['machine']['cpu_count']}-core" in setting
    assert data["command"] in _readme_value(name, "stored_by")
    stored = (render_docs.RESULTS / f"{name}.json").read_text()
    assert "/tmp" not in stored and str(render_docs.ROOT) not in stored, "machine paths in the stored run"


@pytest.mark.parametrize("name", COMPARE_RUNS)
def test_check_fails_where_the_readme_compare_table_and_the_stored_run_differ(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    readme = (render_docs.ROOT / "README.md").read_text()
    block = _readme_value(name, "table", readme)
    line = next(line for line in block.splitlines() if line.startswith("ring_allreduce "))
    samples = line.split()[3]  # samples/s
    tampered = line.replace(f" {samples} ", f" {int(samples) + 1} ", 1)
    page = tmp_path / "README.md"
    page.write_text(readme.replace(block, block.replace(line, tampered)))
    assert not render_docs.render_page(page, check=True)
    said = capsys.readouterr().err
    assert f"<!-- value:{name}/table --> line" in said and f"says {render_docs._clip(tampered)}" in said

    page.write_text(readme)  # the page as it is, against a stored run whose number moved
    data = json.loads((render_docs.RESULTS / f"{name}.json").read_text())
    ring = next(row for row in data["results"] if row["strategy"] == "ring_allreduce")
    ring["samples_per_second"] *= 1.5
    results = tmp_path / "results"
    results.mkdir()
    for stored in render_docs.RESULTS.glob("*.json"):  # every other marker of the page stays up to date
        (results / stored.name).write_bytes(stored.read_bytes())
    monkeypatch.setattr(render_docs, "RESULTS", results)
    assert render_docs.render_page(page, check=True), capsys.readouterr().err
    (results / f"{name}.json").write_text(json.dumps(data))
    assert not render_docs.render_page(page, check=True)
    said = capsys.readouterr().err
    assert f"<!-- value:{name}/table --> line" in said and "ring_allreduce" in said


@pytest.mark.parametrize(
    ("command", "shown"),
    [
        ("python b.py --json out.json --merge", "python b.py --merge --json benchmarks/results/demo.json"),
        (
            "python b.py --json out.json && python b.py --x 2 --add-to out.json --json out.json",
            "python b.py --json out.json && python b.py --x 2 --add-to out.json --json benchmarks/results/demo.json",
        ),
        (  # a figure written outside the repository is dropped; one written into it is kept
            "python b.py --figure /tmp/f.png --json /tmp/o.json --figure docs/figures/f.png",
            "python b.py --figure docs/figures/f.png --json benchmarks/results/demo.json",
        ),
    ],
)
def test_the_command_line_keeps_every_step_of_a_chain_and_names_the_stored_file_once(
    demo: Path, command: str, shown: str
) -> None:
    """The renderer replaces the last step's ``--json`` with the stored file; an earlier step's output is its input.
    A ``--figure`` written outside the repository is not part of what a clone reruns."""
    (render_docs.RESULTS / "demo.json").write_text(json.dumps({"command": command, "machine": {"cpu_count": 2}}))
    assert f"*Command:* `{shown}`." in render_docs.render("demo")


@pytest.mark.parametrize(("cpu", "shown"), [("AMD EPYC", "; AMD EPYC; 2 CPU cores;"), (None, "; 2 CPU cores;")])
def test_the_machine_line_names_the_processor_where_the_run_recorded_it(
    demo: Path, cpu: str | None, shown: str
) -> None:
    """A time ratio depends on the processor's speed against the link: the machine line says which one ran."""
    machine = {"platform": "Linux", "cpu_count": 2, **({"cpu": cpu} if cpu else {})}
    (render_docs.RESULTS / "demo.json").write_text(json.dumps({"command": "python b.py", "machine": machine}))
    assert f"*Machine:* Linux{shown}" in render_docs.render("demo")


def test_the_compute_share_is_local_sgds_median_step_over_ddps_step() -> None:
    """The share of ddp's time a mode that sends nothing would take, from the cell the page names."""
    cell = {"variants": {"local_sgd": {"median_step_s": 0.5}, "ddp": {"seconds_per_step": 2.0}}}
    other = {"variants": {"local_sgd": {"median_step_s": 0.5}, "ddp": {"seconds_per_step": 1.0}}}
    data = {"cells": [{"link": "1gbit", "nodes": 2, **other}, {"link": "200mbit", "nodes": 2, **cell}]}
    assert doc_values.VALUES["lm"]["compute_share_200mbit_2"](data) == "0.25"


def test_the_first_to_ddps_loss_is_named_per_seed_and_a_seed_nobody_reached_is_said() -> None:
    """``lm_seeds/first``: one name when one variant was first on every seed, else each with its seeds; a variant
    that never reached the target is never first."""
    first = doc_values.VALUES["lm_seeds"]["first"]

    def cell(seed: int, a: float | None, b: float | None) -> dict[str, object]:
        rows = {"ddp": {"ratio_to_ddp": 1.0}, "a": {"ratio_to_ddp": a}, "b": {"ratio_to_ddp": b}}
        return {"seed": seed, "variants": rows}

    assert first({"cells": [cell(0, 0.3, 0.4), cell(1, 0.5, None)]}) == "`a` on every seed"
    cells = [cell(0, 0.3, 0.4), cell(1, 0.5, 0.2), cell(2, None, None), cell(3, 0.1, 0.9)]
    assert first({"cells": cells}) == "`a` on seeds 0, 3, `b` on seed 1, none on seed 2"
