"""The example notebooks (examples/*.ipynb) run top to bottom in a Jupyter kernel, and are stored
without outputs.

Each notebook runs on the CPU backend where no GPU is found (its GPU cells print that they were
skipped) and in full on a GPU. The kernel is the `python3` kernel of the interpreter running
pytest, started from examples/ (as Jupyter starts it) with the checkout on PYTHONPATH.
"""
import json
import os
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO / "examples").glob("*.ipynb"))
# Seconds a whole notebook may take on the CPU backend: 2-17 s each on a quiet 2-core machine, up to
# 8x that on a shared one (docs/notebooks.md). A notebook that outgrows this should get cheaper.
TIMEOUT_S = {"01_kernels_from_numpy": 120, "02_generate": 600, "03_paged_kv_cache": 120,
             "04_quantization": 400, "05_roofline": 120}


def test_every_notebook_has_a_timeout():
    assert {p.stem for p in NOTEBOOKS} == set(TIMEOUT_S)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_without_outputs(path):
    cells = json.loads(path.read_text())["cells"]
    dirty = [i for i, c in enumerate(cells)
             if c["cell_type"] == "code" and (c["outputs"] or c["execution_count"] is not None)]
    assert not dirty, f"{path.name}: cells {dirty} hold outputs; clear them before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_runs_top_to_bottom(path, monkeypatch):
    nbformat = pytest.importorskip("nbformat", reason="notebook runners are in the dev extra")
    nbclient = pytest.importorskip("nbclient", reason="notebook runners are in the dev extra")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    deadline = time.monotonic() + TIMEOUT_S[path.stem]
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}},
                                     timeout_func=lambda cell: max(1, int(deadline - time.monotonic())))
    client.execute()  # raises CellExecutionError (the cell and its traceback) when a cell raises
