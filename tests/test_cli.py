"""The ``gdp-jax`` command line: help, --version, argument errors, ``check`` and a tiny
``demo`` (fresh processes, as a user starts them: the CLI configures its CPU devices
itself, with the public ``jax_num_cpu_devices`` option)."""
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

from _compile_flags import TEXT as COMPILE_FLAGS
from gdp_jax import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_cli(*args, timeout=600):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    # The parent's test settings must not leak in: the CLI sets its own.
    for var in ("XLA_FLAGS", "PJRT_NPROC", "JAX_ENABLE_X64", "MPLBACKEND"):
        env.pop(var, None)
    # CI time: the suite's compile settings (tests/_compile_flags.py says what they change;
    # as tests/conftest.py sets them). No device flag: the CLI
    # configures its devices itself.
    env["XLA_FLAGS"] = COMPILE_FLAGS
    return subprocess.run([sys.executable, "-m", "gdp_jax", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


def test_no_arguments_prints_help_and_hint():
    r = run_cli()
    assert r.returncode == 0, r.stderr
    assert "demo" in r.stdout and "check" in r.stdout
    assert "gdp-jax check" in r.stdout


def test_console_script_entry_point(capsys):
    assert cli.main([]) == 0              # what pyproject's [project.scripts] points at
    assert "usage: gdp-jax" in capsys.readouterr().out


def test_version(capsys):
    import gdp_jax
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"gdp-jax {gdp_jax.__version__}"


@pytest.mark.parametrize("command,default", [("demo", "(default: 400)"),
                                             ("check", "(default: auto)")])
def test_help_shows_defaults(capsys, command, default):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    out = capsys.readouterr().out
    assert f"usage: gdp-jax {command}" in out and default in out


@pytest.mark.parametrize("argv,message", [
    (["demo", "--steps", "0"], "argument --steps: '0': expected an integer >= 1"),
    (["demo", "--nh", "0"], "argument --nh"),
    (["demo", "--lr", "-1"], "argument --lr"),
    (["check", "--devices", "x"], "argument --devices"),
    (["check", "--bogus"], "unrecognized arguments: --bogus"),
    (["demo", "--steps", "3", "--bogus", "1"], "unrecognized arguments: --bogus 1"),
])
def test_bad_flags_are_reported_by_the_subcommand(capsys, argv, message):
    """Exit code 2 with the subcommand's own usage line and error prefix."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"usage: gdp-jax {argv[0]}" in err and f"gdp-jax {argv[0]}: error:" in err, err
    assert message in err, err


def test_demo_without_flax_says_what_to_install(monkeypatch, capsys, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "flax" else real(name, *a))
    assert cli.main(["demo", "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert "needs flax" in err and "pip install" in err and "[demo]" in err, err


def test_cli_uses_public_jax_device_config():
    src = (ROOT / "gdp_jax" / "cli.py").read_text()
    assert "jax_num_cpu_devices" in src
    assert "XLA_FLAGS" not in src and "jax._src" not in src and "_Progress" not in src


def test_check_plan_uses_bf16_kernel_shapes_for_cutedsl():
    """Where the kernels run, their cases are bfloat16 with K, V in {64, 128}; xla keeps
    float32 and float64 (the H200 failure: cutedsl was fed float32)."""
    plan = cli._check_plan("auto")
    kern = [(c, d) for c, d, be in plan if be != "xla"]
    assert {be for _, _, be in plan} == {"xla", "cutedsl", "auto"}
    assert kern and all(d == "bfloat16" and c[5] in (64, 128) and c[6] in (64, 128)
                        for c, d in kern)
    assert {d for _, d, be in plan if be == "xla"} == {"float32", "float64"}
    assert all(be == "xla" for _, _, be in cli._check_plan("xla"))


def test_check_bf16_case_within_tolerance_on_xla():
    """The bf16 kernel case's inputs, tolerances and comparison, run on xla (CPU)."""
    eo, eg, worst, ok = cli._compare(cli.KERNEL_CASES[2], "bfloat16", "xla", 0, {})
    assert ok, (eo, eg, worst)
    assert 1e-5 < eo < cli.TOLERANCE["bfloat16"][0]     # bf16 rounding is visible, bounded


def test_check_backend_cutedsl_fails_clearly_without_kernels(capsys):
    from gdp_jax import backends
    ok, why = backends.cutedsl_available()
    if ok:
        pytest.skip("the kernels can run here")
    assert cli.main(["check", "--backend", "cutedsl"]) == 1
    assert f"FAIL: --backend cutedsl, but cutedsl cannot run here: {why}" in \
        capsys.readouterr().out


def test_check_passes_with_cp(monkeypatch, capsys, tmp_path):
    """`gdp-jax check --devices 2`, in this process (CI time: the full plan compiles 8
    programs; here the first xla case in float32 and float64, then CP over 2 devices in
    both; test_demo_tiny runs --devices 2 in a fresh process)."""
    import argparse
    monkeypatch.setattr(cli, "CHECK_CASES", cli.CHECK_CASES[:1])
    args = argparse.Namespace(backend="xla", devices=2, seed=0, out=str(tmp_path))
    assert cli.run_check(args) == 0
    out = capsys.readouterr().out
    assert "PASS: all 4 comparisons" in out
    assert "[1/4]" in out and "CP over 2 devices" in out
    assert "PASS: all 4 comparisons" in (tmp_path / "check.md").read_text()
    res = json.loads((tmp_path / "check.json").read_text())
    assert res["passed"] and len(res["rows"]) == 4 and all(x["ok"] for x in res["rows"])
    assert sum("CP over 2 devices" in x["case"] for x in res["rows"]) == 2


def test_demo_tiny(tmp_path):
    pytest.importorskip("matplotlib")
    pytest.importorskip("tqdm")
    out = tmp_path / "demo"
    r = run_cli("demo", "--steps", "3", "--seq-len", "16", "--batch", "4", "--devices", "2",
                "--eval-factor", "4", "--out", str(out), "--no-progress")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (out / "s3_accuracy.png").stat().st_size > 1000
    table = (out / "s3_results.md").read_text()
    assert "| 1 |" in table and "| 2 |" in table
    res = json.loads((out / "s3_results.json").read_text())
    assert [r["num_householder"] for r in res["results"]] == [1, 2]
    assert len(res["results"][0]["acc_per_position"]) == 64
    assert r.stdout.count("context parallel over 2 CPU devices") == 2
    assert "FAIL" not in r.stdout and r.stdout.count(": PASS") == 2


def test_check_on_emulated_kernels_runs_bf16_cutedsl_and_auto(monkeypatch, capsys, tmp_path):
    """What `gdp-jax check` does on an H200, on CPU: the kernels swapped for their pure-JAX
    contracts (tests/test_cutedsl_emulated.py), cutedsl available. The kernel rows are fed
    bf16 (the H200 crash: float32 into cutedsl) and pass their tolerances."""
    import argparse
    from gdp_jax import testing
    with testing.emulated_kernels():          # the same swaps as the emulated tests
        # The same cases, shorter (CPU time): T = 70, K = V = 64, packed with empty/1-token rows.
        short = tuple(c[:2] + (70,) + c[3:5] + (64, 64) + c[7:9]
                      + ((0, 20, 20, 21, 50, 70) if c[9] else None,) + c[10:]
                      for c in cli.KERNEL_CASES)
        monkeypatch.setattr(cli, "KERNEL_CASES", short)
        monkeypatch.setattr(cli, "CHECK_CASES", cli.CHECK_CASES[:1])   # xla: test_check_passes
        args = argparse.Namespace(backend="auto", devices=1, seed=0, out=str(tmp_path))
        assert cli.run_check(args) == 0
        out = capsys.readouterr().out
        assert f"[{len(cli._check_plan('auto'))}/{len(cli._check_plan('auto'))}]" in out
        rows = json.loads((tmp_path / "check.json").read_text())["rows"]
        kern = [r for r in rows if r["backend"] in ("cutedsl", "auto")]
        assert len(kern) == len(cli.KERNEL_CASES) + 1
        assert all(r["dtype"] == "bfloat16" and r["ok"] for r in kern), kern
