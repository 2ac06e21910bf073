"""The one benchmark runner. Examples (benchmarks/README.md has the GPU commands):

    python -m benchmarks.run fwdbwd --impl cutedsl,cutedsl-n2,fla --shapes main --deadline 480
    python -m benchmarks.run fwd    --impl cutedsl,xla,fla --shapes main
    python -m benchmarks.run step   --impl cutedsl,xla,fla
    python -m benchmarks.run cp     --P 2 --packed --fold auto
    JAX_PLATFORMS=cpu python -m benchmarks.run fwdbwd --impl xla --shapes tiny   # CPU smoke

Writes <bench>_<stamp>.{md,json,log} under --out (default outside git: $OUT/bench, else
/tmp/gdp_bench/<date>). Exit status 1 when a check of ours failed or no row was measured.
"""
from __future__ import annotations

import argparse
import os
import sys

BENCHES = ("fwd", "fwdbwd", "step", "cp")


def parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    p.add_argument("bench", choices=BENCHES)
    p.add_argument("--impl", default=None,
                   help="comma list: cutedsl, cutedsl-n<N> (recompute_chunk_num), xla, fla "
                        "(default: cutedsl,fla; cp: --backend)")
    p.add_argument("--shapes", default="main",
                   help="a named set (registry.SHAPE_SETS: main, long, all, tiny) or "
                        "';'-separated B,T,H,n[,K,V]")
    p.add_argument("--baseline", default="fla", help="the impl the 'time / X' column divides by")
    p.add_argument("--out", default=None, help="output folder (default: $OUT/bench or "
                                               "/tmp/gdp_bench/<date>)")
    p.add_argument("--deadline", type=float, default=1e9,
                   help="seconds since start after which no new shape / impl starts (GPU "
                        "commands stop at 600 s: use ~480); what was measured is written")
    p.add_argument("--iters", type=int, default=None,
                   help="calls per timed repetition (default fwd/fwdbwd 5, step 100, cp 5)")
    p.add_argument("--reps", type=int, default=None, help="repetitions, median taken "
                                                          "(default 5; step 9)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-check", action="store_true", help="skip the correctness checks")
    p.add_argument("--check-heads", type=int, default=2,
                   help="heads of row 0 checked against float64 (fwd/fwdbwd)")
    cp = p.add_argument_group("cp")
    cp.add_argument("--P", type=int, nargs="+", default=[2], help="mesh sizes")
    cp.add_argument("--packed", action="store_true", help="also 7 packed sequences")
    cp.add_argument("--fold", choices=("auto", "gather", "scan"), default="auto",
                    help="the CP fold (sets GDP_CP_FOLD before jax traces)")
    cp.add_argument("--backend", default="cutedsl", help="cp: xla or cutedsl")
    p.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                   help="set a gdp_jax module constant before tracing (a Python literal), "
                        "e.g. recurrence.SCAN_UNROLL={'gpu':4}: A/B runs of a switch; "
                        "recorded in the run's command")
    cp.add_argument("--devices", type=int, default=0,
                    help="simulate this many CPU devices (XLA_FLAGS), for a CPU run of cp")
    a = p.parse_args(argv)
    step = a.bench == "step"
    a.iters = a.iters or (100 if step else 5)
    a.reps = a.reps or (9 if step else 5)
    if a.impl is None:
        a.impl = a.backend if a.bench == "cp" else "cutedsl,fla"
    return a


def _set_env(a):
    """Before jax is imported: no preallocation (torch shares the GPU), the CP fold, and
    simulated devices for a CPU cp run."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if a.bench == "cp":
        os.environ["GDP_CP_FOLD"] = a.fold
    if a.devices:
        os.environ.setdefault("PJRT_NPROC", "32")   # CPU collectives deadlock on a small pool
        flag = f"--xla_force_host_platform_device_count={a.devices}"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


def apply_settings(settings):
    """``MODULE.NAME=VALUE`` strings: gdp_jax.MODULE.NAME = the literal VALUE (the
    attribute must exist: a misspelt switch is an error, not a silent no-op)."""
    import ast
    import importlib
    for item in settings:
        target, sep, value = item.partition("=")
        mod_name, _, name = target.rpartition(".")
        if not sep or not mod_name:
            raise SystemExit(f"--set {item!r}: expected MODULE.NAME=VALUE")
        mod = importlib.import_module(f"gdp_jax.{mod_name}")
        if not hasattr(mod, name):
            raise SystemExit(f"--set {item!r}: gdp_jax.{mod_name} has no {name}")
        setattr(mod, name, ast.literal_eval(value))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse(argv)
    _set_env(a)
    import jax
    jax.devices()                   # JAX takes the GPU before torch (FLA) is imported
    from benchmarks import measure, registry, report
    apply_settings(a.set)
    measure.reset_clock()
    names = [s.strip() for s in a.impl.split(",") if s.strip()]
    impls, fla_version = [], "not requested"
    if a.bench != "cp":
        impls = [registry.impl(nm, a.bench) for nm in names]   # unknown names fail here
    if "fla" in names:
        from benchmarks import fla
        fla_version = fla.version()
    run_ = report.Run(a.bench, a.out or report.default_out(), measure.environment(argv, fla_version))
    measure.log("run:", run_.env["command"], "->", run_.stem + ".{md,json,log}")
    measure.log("env:", {k: v for k, v in run_.env.items() if k != "command"})
    ready = []
    for im in impls:
        why = im.available()
        if why:
            run_.note(f"{im.name} NOT RUN: {why}")
        else:
            ready.append(im)
    if a.bench in ("fwd", "fwdbwd"):
        from benchmarks import op
        op.run(a, run_, ready)
    elif a.bench == "step":
        from benchmarks import step
        step.run(a, run_, ready)
    else:
        from benchmarks import cp
        cp.run(a, run_)
    run_.close()
    measured = [r for r in run_.rows if not r.get("error")]
    # a peer's failed check is reported in its row, not in the exit status (FLA's Hopper
    # backward runs past its own guard here: fla.py)
    failed = [r for r in run_.rows if r.get("check_ok") is False and r.get("family") == "ours"]
    print(f"wrote {run_.stem}.md / .json / .log: {len(measured)} rows measured, "
          f"{len(run_.rows) - len(measured)} with errors, {len(failed)} failed checks",
          flush=True)
    return 1 if failed or not measured else 0


if __name__ == "__main__":
    sys.exit(main())
