"""examples/quickstart.ipynb: committed without outputs, and it runs from top to bottom in a fresh kernel (on sklearn's
digits, in seconds), in a temporary folder so nothing is written into the repository."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "quickstart.ipynb"


def test_the_notebook_is_committed_without_outputs():
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    code = [cell for cell in cells if cell["cell_type"] == "code"]
    assert code and all(cell["outputs"] == [] and cell["execution_count"] is None for cell in code)


@pytest.mark.slow
def test_the_notebook_runs_and_shows_the_comparison(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # a cell that raises fails the test with the cell and its traceback (nbclient's CellExecutionError)
    nbclient.NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": tmp_path}}
    ).execute()

    study = tmp_path / "quickstart-runs" / "study"
    assert sorted(p.name for p in study.iterdir() if p.is_dir()) == [
        f"{algorithm}-s{seed}" for algorithm in ("fedavg", "fedprox", "scaffold") for seed in (0, 1)
    ]
    assert (study / "comparison.png").is_file() and (study / "comparison.md").is_file()
    outputs = [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs]
    text = "".join(out.get("text", "") for out in outputs if out.output_type == "stream")
    for label in ("fedavg", "fedprox", "scaffold"):
        assert any(line.startswith(label) and "± " in line and "(2 seeds)" in line for line in text.splitlines())
    images = [out for out in outputs if "image/png" in out.get("data", {})]
    assert len(images) == 2  # the DataFrame's curves and compare's comparison.png
    tables = [out["data"]["text/html"] for out in outputs if "text/html" in out.get("data", {})]
    assert any("client_dist_acc" in table for table in tables)
    assert not (ROOT / "quickstart-runs").exists()  # the notebook wrote only where it ran
