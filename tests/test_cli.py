"""The ``gdp-jax`` command line: help, ``check`` and a tiny ``demo`` (fresh processes).

Each command runs in its own interpreter, as a user would start it: the CLI must set
XLA_FLAGS itself before JAX starts its backend.
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_cli(*args, timeout=600):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    # The parent's test settings must not leak in: the CLI sets its own.
    for var in ("XLA_FLAGS", "PJRT_NPROC", "JAX_ENABLE_X64"):
        env.pop(var, None)
    env["MPLBACKEND"] = "Agg"
    return subprocess.run([sys.executable, "-m", "gdp_jax", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


def test_no_arguments_prints_help_and_hint():
    r = run_cli()
    assert r.returncode == 0, r.stderr
    assert "demo" in r.stdout and "check" in r.stdout
    assert "gdp-jax check" in r.stdout


def test_console_script_entry_point(capsys):
    from gdp_jax.cli import main          # what pyproject's [project.scripts] points at
    assert main([]) == 0
    assert "usage: gdp-jax" in capsys.readouterr().out


def test_check_passes():
    r = run_cli("check")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS" in r.stdout


def test_demo_tiny(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "demo"
    r = run_cli("demo", "--steps", "3", "--seq-len", "16", "--batch", "4", "--devices", "8",
                "--out", str(out), "--no-progress")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (out / "s3_accuracy.png").stat().st_size > 1000
    table = (out / "s3_results.md").read_text()
    assert "| 1 |" in table and "| 2 |" in table
    res = json.loads((out / "s3_results.json").read_text())
    assert [r["num_householder"] for r in res["results"]] == [1, 2]
    assert len(res["results"][0]["acc_per_position"]) == 64
    assert "context-parallel over 8" in r.stdout


def test_demo_rejects_bad_lengths():
    r = run_cli("demo", "--seq-len", "12", "--devices", "8")
    assert r.returncode != 0 and "multiple of --devices" in r.stderr
