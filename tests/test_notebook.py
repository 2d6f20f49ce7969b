"""The notebook runs top to bottom, as a user would run it, within a minute."""

import os
import time

import nbformat
from nbclient import NotebookClient

NB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks", "explore_plans.ipynb")


def test_explore_plans_notebook_executes():
    nb = nbformat.read(NB, as_version=4)
    t0 = time.perf_counter()
    NotebookClient(nb, timeout=60, kernel_name="python3").execute()
    assert time.perf_counter() - t0 < 60
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    table = nb.cells[2].outputs[-1]["data"]["text/plain"]
    assert "strategy" in table and ("ulysses" in table or "ring" in table)
    assert any("image/png" in o.get("data", {}) for o in outputs)
