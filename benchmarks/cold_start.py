"""Cold start: a fresh process's import + first jitted fwd+bwd of the cutedsl op.

    python -m benchmarks.cold_start [--shape B,T,H,n] [--kernels DIR] [--build] [--modes ...]

Each mode runs in its own fresh subprocess (nothing cached in memory): ``prebuilt`` (the
objects of ``ffi/build.py`` in DIR), ``prebuilt+xla-cache`` (the same, with JAX's
persistent compilation cache filled by a previous process), ``compiled`` (no objects:
every variant compiled at trace time) and ``static`` (the former per-shape compile,
``GDP_JAX_KERNEL_SHAPES=static``).
The child times ``import jax, gdp_jax``, the first call of the jitted value-and-grad
(trace, kernel objects, XLA compile, run) and then the median of 10 further calls (the
steady state, which the modes should share). bf16, K = V = 128, HV = H, gates on,
use_qk_l2norm; inputs are made with numpy outside the timed parts. ``--build`` (or a DIR
without a manifest) runs ffi/build.py first and reports its time. Prints one JSON line
per mode, then a table.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]

CHILD = r"""
import sys, time, json
t0 = time.perf_counter()
import jax, jax.numpy as jnp
import gdp_jax
t_import = time.perf_counter() - t0
import numpy as np
B, T, H, n = {shape}
K = V = 128
r = np.random.default_rng(0)
f = lambda *s: r.standard_normal(s, dtype=np.float32)
bf = jnp.bfloat16
args = (jnp.asarray(f(B, T, H, K), bf), jnp.asarray(f(B, T, n, H, K), bf),
        jnp.asarray(f(B, T, n, H, V), bf),
        jnp.asarray(np.log(1 / (1 + np.exp(-(f(B, T, H) + 3))))),
        jnp.asarray(r.uniform(0.05, 1.95, (B, T, n, H)), bf))
w = jnp.asarray(f(B, T, H, V), bf)
jax.block_until_ready((args, w))

def loss(q, k, v, g, beta, w):          # w an argument: no constant in the program
    o = gdp_jax.gated_delta_product(q, k, v, g, beta, use_qk_l2norm=True, backend="cutedsl")
    return jnp.sum((o * w).astype(jnp.float32))

step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
args = args + (w,)
t1 = time.perf_counter()
jax.block_until_ready(step(*args))
t_first = time.perf_counter() - t1
times = []
for _ in range(10):
    t = time.perf_counter()
    jax.block_until_ready(step(*args))
    times.append(time.perf_counter() - t)
from gdp_jax.kernels import binding
print(json.dumps(dict(import_s=t_import, first_s=t_first, cold_s=t_import + t_first,
                      steady_ms=1e3 * sorted(times)[len(times) // 2],
                      cutlass_imported="cutlass" in sys.modules,
                      compiled=len(binding.compiled_variants()))))
"""


MODES = ("prebuilt", "prebuilt+xla-cache", "compiled", "static")


def _child(env, shape):
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", CHILD.format(shape=tuple(shape))], env=env,
                       capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        return dict(error=(r.stdout + r.stderr)[-3000:])
    return dict(process_s=time.perf_counter() - t, **json.loads(r.stdout.strip().splitlines()[-1]))


def run_mode(mode, shape, kernels, tmp):
    """One mode in fresh subprocesses -> its row (``error`` set if the child failed)."""
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env["GDP_JAX_KERNEL_SHAPES"] = "generic"
    env["GDP_JAX_KERNEL_DIR"] = str(kernels if mode.startswith("prebuilt") else tmp / "none")
    if mode == "static":
        env["GDP_JAX_KERNEL_SHAPES"] = "static"
    if mode == "prebuilt+xla-cache":
        # JAX's persistent cache: a first process fills it, the timed second one loads the
        # XLA executable (its key holds the kernel objects, which are now fixed bytes)
        env.update(JAX_COMPILATION_CACHE_DIR=str(tmp / "xla-cache"),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
        first = _child(env, shape)
        if "error" in first:
            return dict(mode=mode, **first)
    row = dict(mode=mode, shape=list(shape), **_child(env, shape))
    print(json.dumps(row), flush=True)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="8,4096,16,2", help="B,T,H,n (default 8,4096,16,2)")
    ap.add_argument("--kernels", type=pathlib.Path, default=None,
                    help="prebuilt kernel directory (default: gdp_jax's)")
    ap.add_argument("--build", action="store_true", help="run ffi/build.py first")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = ap.parse_args(argv)
    try:
        shape = tuple(int(s) for s in args.shape.split(","))
    except ValueError:
        ap.error(f"--shape must be B,T,H,n integers, got {args.shape!r}")
    if len(shape) != 4 or min(shape) < 1:
        ap.error(f"--shape must be 4 positive integers B,T,H,n, got {args.shape!r}")
    sys.path.insert(0, str(REPO))
    from gdp_jax.kernels import aot
    kernels = args.kernels or aot.store_dir()
    if (any(m.startswith("prebuilt") for m in args.modes)
            and (args.build or not (kernels / "manifest.json").exists())):
        t = time.perf_counter()
        subprocess.run([sys.executable, str(REPO / "ffi" / "build.py"), "--out", str(kernels),
                        "--jobs", str(min(8, os.cpu_count() or 1))], check=True)
        print(json.dumps(dict(build_s=time.perf_counter() - t)), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_mode(m, shape, kernels, pathlib.Path(tmp)) for m in args.modes]
    print(f"\ncold start, B,T,H,n = {','.join(map(str, shape))} (fresh process each)")
    print("| mode | import s | first fwd+bwd s | import + first s | steady ms | process s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['mode']} | failed: see above | | | | |")
            print(r["error"], file=sys.stderr)
            continue
        print(f"| {r['mode']} | {r['import_s']:.2f} | {r['first_s']:.2f} | {r['cold_s']:.2f} "
              f"| {r['steady_ms']:.2f} | {r['process_s']:.1f} |")


if __name__ == "__main__":
    main()
