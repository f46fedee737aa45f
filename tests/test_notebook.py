"""docs/tour.ipynb runs from top to bottom, every cell, on a fresh kernel of this interpreter.

The kernel is this interpreter (a kernelspec written to a temporary folder, so no user-level
``python3`` kernelspec can pick another Python), with the CUDA simulator on unless the caller
chose otherwise; the notebook is committed without outputs, so it cannot rot unseen.
"""

import json
import os
import pathlib
import sys
import time

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402
from jupyter_client.manager import KernelManager  # noqa: E402

TOUR = pathlib.Path(__file__).resolve().parent.parent / "docs" / "tour.ipynb"


def _kernel_manager(tmp_path) -> KernelManager:
    spec_dir = tmp_path / "kernels" / "napkin-tour"
    spec_dir.mkdir(parents=True)
    env = {"NUMBA_ENABLE_CUDASIM": os.environ.get("NUMBA_ENABLE_CUDASIM", "1"), "MPLBACKEND": "Agg"}
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "napkin_cat tour", "language": "python", "env": env}))
    ksm = KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")], ensure_native_kernel=False)
    return KernelManager(kernel_name="napkin-tour", kernel_spec_manager=ksm)


def test_tour_notebook_is_committed_without_outputs():
    nb = nbformat.read(TOUR, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]


@pytest.mark.slow   # about 17 s: a Jupyter kernel, the tour and a simulated kernel; .ci/run runs the slow tier
def test_tour_notebook_runs_without_errors(tmp_path):
    nb = nbformat.read(TOUR, as_version=4)
    client = nbclient.NotebookClient(nb, km=_kernel_manager(tmp_path), timeout=300, allow_errors=False,
                                     resources={"metadata": {"path": str(tmp_path)}})
    start = time.perf_counter()
    client.execute()
    seconds = time.perf_counter() - start
    outputs = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    shown = [out.get("data", {}) for out in outputs if out.output_type == "execute_result"]
    assert any("image/svg+xml" in data for data in shown)                     # the diagram's picture
    html = [data["text/html"] for data in shown if "text/html" in data]
    assert any("napkin-report" in h for h in html)                            # the equivalence report
    assert any("napkin-derivation" in h and "<svg" in h for h in html)        # one picture per step
    assert any("napkin-final-form" in h for h in html)                        # the final form's table
    assert seconds < 120, f"the tour took {seconds:.0f} s"
