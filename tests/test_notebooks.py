"""Every notebook in notebooks/ executes top to bottom on CPU (nbclient), and shows its plots.

A plotting cell is a code cell that draws with matplotlib (``plt.``); it must produce an
image/png output when executed with Jupyter's inline backend (no MPLBACKEND override), and
the committed notebook must store that output (so it renders on GitHub) and stay small.
"""
import os
import pathlib
import re

import pytest
from _compile_flags import TEXT as COMPILE_FLAGS

nbformat = pytest.importorskip("nbformat", reason="install the 'notebooks' extra")
nbclient = pytest.importorskip("nbclient", reason="install the 'notebooks' extra")

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
PLOTS = re.compile(r"\bplt\.")
MAX_BYTES = 300_000
# CI time: notebook 03 trains two S3 models for 400 steps each (most of its ~220 s run on a
# 2-core CPU). The test runs every cell with fewer steps: what it checks (no error, every
# plot drawn) does not depend on the step count; users and the committed outputs keep 400.
SHORTER = {"03_s3_state_tracking": ("STEPS, SEQ_LEN = 400, 16", "STEPS, SEQ_LEN = 40, 16")}


def _code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def _has_png(cell) -> bool:
    return any("image/png" in o.get("data", {}) for o in cell.get("outputs", []))


def _plotting_cells(nb):
    """Code cells that draw (not the import cell, which only configures matplotlib)."""
    return [c for c in _code_cells(nb) if PLOTS.search(c.source)
            and not c.source.lstrip().startswith("import os")]


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 3, NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_stores_outputs_and_is_small(path):
    """Committed as run: every plotting cell keeps its PNG; the file stays < 300 KB."""
    assert path.stat().st_size < MAX_BYTES, path.stat().st_size
    nb = nbformat.read(path, as_version=4)
    assert any(c.get("outputs") for c in _code_cells(nb)), "no stored outputs"
    missing = [c.source.splitlines()[0] for c in _plotting_cells(nb) if not _has_png(c)]
    assert not missing, f"plotting cells without a stored image: {missing}"
    assert "matplotlib.use(" not in "".join(c.source for c in _code_cells(nb))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path, monkeypatch):
    # The kernel is a fresh process: give it the pool size up front. No MPLBACKEND: the
    # kernel's inline backend must turn every figure into an image/png output.
    monkeypatch.setenv("PJRT_NPROC", "32")
    monkeypatch.delenv("MPLBACKEND", raising=False)
    # The notebooks set their device count (8: jax_num_cpu_devices, or 03's setdefault of
    # XLA_FLAGS, given here as it would set it). The compile settings that tests/conftest.py
    # sets for the suite: XLA's CPU compiles (the eager cells compile every op) run faster
    # (tests/_compile_flags.py says what they change).
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                                    + COMPILE_FLAGS)
    root = str(path.parents[1])
    monkeypatch.setenv("PYTHONPATH", root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    nb = nbformat.read(path, as_version=4)
    for c in _code_cells(nb):
        c.outputs = []                                   # judge this run, not stored ones
    if path.stem in SHORTER:
        line, short = SHORTER[path.stem]
        cells = [c for c in _code_cells(nb) if line in c.source]
        assert len(cells) == 1, f"{path.name}: expected one cell with {line!r}"
        cells[0].source = cells[0].source.replace(line, short)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    errors = [o for c in _code_cells(nb) for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
    plots = _plotting_cells(nb)
    blank = [c.source.splitlines()[0] for c in plots if not _has_png(c)]
    assert not blank, f"plotting cells that produced no image: {blank}"
