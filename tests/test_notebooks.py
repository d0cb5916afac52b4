"""The notebooks run top to bottom in a real kernel (with fewer steps than their committed outputs)."""

from __future__ import annotations

import os
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
