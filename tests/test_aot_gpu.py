"""Prebuilt kernels on an sm_90 GPU: bitwise the results of the in-process compile.

Run on the lent H200 only (``pytest -m gpu tests/test_aot_gpu.py``). ffi/build.py builds
every variant into a temporary directory (on this host: the objects must come from the
installed CuTe DSL); then three fresh processes (tests/_aot_gpu_worker.py) run the
cutedsl op forward + gradients (dense bf16, packed fp16 with checkpoints), the CP
summaries and a decoding step: with the prebuilt objects (no CuTe DSL import, nothing
compiled), with none (compiled at trace time) and with the former per-shape compile.
"""
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from gdp_jax.testing import sm90_gpu_present as _gpu_ok  # noqa: E402

if not _gpu_ok():
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

REPO = pathlib.Path(__file__).resolve().parents[1]


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env["GDP_JAX_KERNEL_SHAPES"] = "generic"
    # XLA's GEMM autotuner times candidates in each process and may pick another
    # algorithm in the next one: without it every child runs the same XLA programs.
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("kernels")
    r = subprocess.run([sys.executable, str(REPO / "ffi" / "build.py"), "--out", str(out),
                        "--jobs", str(min(8, os.cpu_count() or 1)), "--recompute", "0,1"],
                       env=_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    print(r.stdout.splitlines()[-1])
    return out


@pytest.fixture(scope="module")
def runs(built, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runs")
    paths = {"prebuilt": dict(GDP_JAX_KERNEL_DIR=str(built)),
             "compiled": dict(GDP_JAX_KERNEL_DIR=str(tmp / "none")),
             "static": dict(GDP_JAX_KERNEL_DIR=str(tmp / "none"),
                            GDP_JAX_KERNEL_SHAPES="static")}
    out = {}
    for name, extra in paths.items():
        npz = tmp / f"{name}.npz"
        r = subprocess.run([sys.executable, str(REPO / "tests" / "_aot_gpu_worker.py"),
                            str(npz)], env=_env(**extra), capture_output=True, text=True,
                           timeout=900)
        assert r.returncode == 0, f"{name}: {r.stdout}\n{r.stderr}"
        info = json.loads(r.stdout.strip().splitlines()[-1])
        print(name, info)
        out[name] = (info, dict(np.load(npz)))
    return out


def test_prebuilt_path_compiles_nothing(runs):
    info, _ = runs["prebuilt"]
    assert info == {"cutlass_imported": False, "compiled": 0}
    assert runs["compiled"][0]["compiled"] > 0


def test_prebuilt_equals_compiled_bitwise(runs):
    a, b = runs["prebuilt"][1], runs["compiled"][1]
    assert a.keys() == b.keys() and len(a) == 44
    for k in (k for k in a if k.endswith(".f32")):      # the size of any difference first
        err = np.linalg.norm(a[k] - b[k]) / max(np.linalg.norm(b[k]), 1e-30)
        print(f"prebuilt vs compiled {k}: rel {err:.2e}")
    differ = [k for k in a if k.endswith(".bytes") and not np.array_equal(a[k], b[k])]
    assert not differ, differ
    assert all(np.isfinite(a[k]).all() for k in a if k.endswith(".f32"))


def test_shape_generic_matches_per_shape_compile(runs):
    """The shape-generic objects (leading dims read at run time) against the former
    per-shape ones: the same arithmetic, so equal up to rounding (reported if bitwise)."""
    a, b = runs["compiled"][1], runs["static"][1]
    bitwise = all(np.array_equal(a[k], b[k]) for k in a if k.endswith(".bytes"))
    print("generic == static bitwise:", bitwise)
    for k in (k for k in a if k.endswith(".f32")):
        err = np.linalg.norm(a[k] - b[k]) / max(np.linalg.norm(b[k]), 1e-30)
        assert err < 1e-5, (k, err)
