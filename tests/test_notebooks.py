"""The notebooks run top to bottom in a real kernel (with fewer steps than their committed outputs)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


@pytest.mark.parametrize("name", ["compare_strategies.ipynb", "extend_a_strategy.ipynb", "fabric_ring_allreduce.ipynb"])
@pytest.mark.timeout(600)
def test_notebook_runs(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LDPS_NOTEBOOK_STEPS", "6")
    monkeypatch.setenv("LDPS_NOTEBOOK_MODEL_SIZE", "small")
    # the comparison notebook's two runs with the baseline and the pipeline only (the other strategies run in
    # test_compare*.py and test_docs.py)
    monkeypatch.setenv("LDPS_NOTEBOOK_STRATEGIES", "single,hybrid_pipeline")
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(NOTEBOOKS.parent), os.environ.get("PYTHONPATH")]))
    )
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    # a failing cell raises CellExecutionError with the cell's traceback
    NotebookClient(
        notebook, timeout=540, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
    ).execute()
    errors = [
        o for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"
    ]
    assert not errors


MACHINE_PATH = re.compile(r"(?<![\w.])(/(home|tmp|work|root|Users|opt|var|private)/|[A-Za-z]:\\)")


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.name)
def test_committed_outputs_show_no_machine_paths(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    texts = ["".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", "")) for o in outputs]
    leaks = [t for t in texts if MACHINE_PATH.search(t)]
    assert not leaks, f"{path.name} shows machine paths in its saved outputs: {leaks[0][:200]}"
