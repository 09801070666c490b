"""Every notebook under notebooks/ runs top to bottom in a real Jupyter kernel and
asserts its own result (an assert in its last cell)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import nbformat
import pytest
from jupyter_core.utils import ensure_event_loop
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


def test_there_is_a_notebook_per_entry_point():
    names = {p.name for p in NOTEBOOKS}
    assert {"spark_run.ipynb", "torch_estimator.ipynb", "keras_estimator.ipynb",
            "mlflow_tuning_journey.ipynb"} <= names


# make test runs one notebook (the shortest, an hvd_spark.run loop); make test-all runs all.
SMOKE = "spark_run"


@pytest.mark.parametrize("path", [
    pytest.param(p, marks=pytest.mark.smoke) if p.stem == SMOKE else p for p in NOTEBOOKS
], ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    try:
        NotebookClient(nb, timeout=600, kernel_name="python3",
                       resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        # nbclient runs on an event loop jupyter_core keeps open for the thread (with its
        # self-pipe sockets): close it; the next notebook gets a new one.
        ensure_event_loop().close()
        asyncio.set_event_loop(None)
    outputs = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert "Error" not in outputs or "assert" not in outputs
    last = nb.cells[-1]
    assert last.cell_type == "code" and last.get("outputs") is not None
    if "estimator" in path.stem:
        # The bars are drawn on the driver from the ranks' progress events (a text bar in
        # the cell's stderr where ipywidgets is missing); each epoch's line stays.
        streams = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", [])
                          if o.get("output_type") == "stream").replace("\r", "\n")
        assert re.search(r"^epoch 4/4: .*loss=", streams, re.M), \
            "the progress bar must reach the last epoch"
    if "progress" in path.stem:
        images = [o for c in nb.cells for o in c.get("outputs", [])
                  if "image/png" in o.get("data", {})]
        assert images, "the history plot must be drawn"
