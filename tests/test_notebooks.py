"""docs/notebooks/tour.ipynb runs from top to bottom in a local Jupyter kernel (nbclient, the ``python3`` kernel of
ipykernel, started with the interpreter running the tests), fails on any error, and every result shows itself as
HTML: the report's views in sandboxed frames, the other results as inline SVG."""

from __future__ import annotations

import sys
import time
from datetime import datetime
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient

TOUR = Path(__file__).resolve().parents[1] / "docs" / "notebooks" / "tour.ipynb"
CELL_TIMEOUT = 300  # seconds per cell (the slowest, loading smollm2 and causal tracing, take 15-20 s here)


def _html(cell) -> str:
    return "".join(o.get("data", {}).get("text/html", "") for o in cell.outputs
                   if o.output_type in ("execute_result", "display_data"))


def test_tour_is_committed_without_outputs():
    nb = nbformat.read(TOUR, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.outputs == [] and c.execution_count is None for c in code)
    assert nb.metadata.kernelspec.name == "python3"


@pytest.mark.slow
def test_tour_runs_and_every_result_draws_itself(tmp_path):
    # the python3 kernel is ipykernel's own, which jupyter_client starts with this interpreter (sys.executable)
    spec = KernelSpecManager().get_kernel_spec("python3")
    assert spec.argv[:3] == ["python", "-m", "ipykernel_launcher"], spec.argv
    nb = nbformat.read(TOUR, as_version=4)
    n = len(nb.cells)
    nb.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.executable)"))
    client = NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3", allow_errors=False,
                            resources={"metadata": {"path": str(tmp_path)}})
    t = time.perf_counter()
    client.execute()  # raises CellExecutionError on the first cell that fails
    seconds = time.perf_counter() - t
    assert nb.cells[-1].outputs[0]["text"].strip() == sys.executable
    code = [c for c in nb.cells[:n] if c.cell_type == "code"]
    assert not any(o.output_type == "error" for c in code for o in c.outputs)
    views = {c.source.splitlines()[-1].strip(): _html(c) for c in code}
    for last in ("dla", "view(explanations)", 'explanations["alti-logit"]', "trajectory", "view(maps)", "flow",
                 "report"):
        html = views[last]
        assert '<iframe id="lenscope-' in html and 'sandbox="allow-scripts"' in html, last
    key = {"dla": "components", "view(explanations)": "attribution", "trajectory": "trajectory",
           "view(maps)": "mixing", "flow": "flow"}
    for last, k in key.items():
        assert f"data-section=&quot;{k}&quot;" in views[last], (last, k)  # the section's card, in the srcdoc
    for last in ("patching", "tracing"):
        assert views[last].startswith('<div class="lenscope-plot"><svg'), last
    timed = []
    for c in code:
        ex = c.metadata.get("execution", {})
        if "iopub.execute_input" in ex and "shell.execute_reply" in ex:
            a, b = (datetime.fromisoformat(ex[k].replace("Z", "+00:00")) for k in ("iopub.execute_input",
                                                                                   "shell.execute_reply"))
            timed.append(((b - a).total_seconds(), c.source.splitlines()[-1].strip()))
    slowest = ", ".join(f"{last} {s:.1f} s" for s, last in sorted(timed, reverse=True)[:4])
    print(f"tour.ipynb ran in {seconds:.1f} s (slowest cells: {slowest})")
