"""Every notebook in notebooks/ executes top to bottom on CPU (nbclient)."""
import os
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat", reason="install the 'notebooks' extra")
nbclient = pytest.importorskip("nbclient", reason="install the 'notebooks' extra")

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 3, NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path, monkeypatch):
    # The kernel is a fresh process: give it the simulated devices and pool size up front.
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    monkeypatch.setenv("PJRT_NPROC", "32")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    root = str(path.parents[1])
    monkeypatch.setenv("PYTHONPATH", root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
