"""GPU kernel time of one cutedsl fwd+bwd step, by kernel (jax.profiler trace).

Runs the jitted value-and-grad of sum(o * w) (bf16, K = V = 128, l2norm, gates) a few
times under ``jax.profiler.trace``, reads the Perfetto trace it writes, and prints the
GPU kernels grouped by name (total ms per step, calls per step), largest first. Also
writes the optimized HLO of the step (to map fusion names to ops).

    python benchmarks/trace_fwdbwd.py --shape 8,4096,16,2 --out /tmp/trace
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_fwd import fwdbwd_step, jax_inputs  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8,4096,16,2")
    ap.add_argument("--backend", default="cutedsl")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--out", default="/tmp/gdp_trace")
    args = ap.parse_args()
    B, T, H, n = (int(x) for x in args.shape.split(","))

    import jax
    import jax.numpy as jnp
    from gdp_jax import gated_delta_product

    q, k, v, g, beta = jax_inputs(B, T, H, n)
    w = jax.random.normal(jax.random.PRNGKey(1), (B, T, H, 128), jnp.float32).astype(q.dtype)
    op = lambda *a: gated_delta_product(*a, use_qk_l2norm=True, backend=args.backend)
    step = jax.jit(fwdbwd_step(op, w))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "step_hlo.txt"), "w") as f:
        f.write(step.lower(q, k, v, g, beta).compile().as_text())
    for _ in range(3):
        jax.block_until_ready(step(q, k, v, g, beta))
    with jax.profiler.trace(args.out, create_perfetto_trace=True):
        for _ in range(args.steps):
            jax.block_until_ready(step(q, k, v, g, beta))

    files = glob.glob(os.path.join(args.out, "**", "*.trace.json.gz"), recursive=True)
    files += glob.glob(os.path.join(args.out, "**", "perfetto_trace.json.gz"), recursive=True)
    if not files:
        print("no trace json found; files:", glob.glob(os.path.join(args.out, "**"), recursive=True))
        return
    with gzip.open(sorted(files, key=os.path.getmtime)[-1]) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    # GPU stream threads: find pids/tids whose process name mentions the GPU
    pnames = {e["pid"]: e["args"]["name"] for e in events
              if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu_pids = {p for p, nm in pnames.items() if "GPU" in nm}
    if not gpu_pids:
        print("no GPU process in the trace; processes:", pnames)
    tot = collections.Counter()
    cnt = collections.Counter()
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in gpu_pids:
            continue
        name = e.get("args", {}).get("hlo_op") or e["name"]
        tot[name] += e.get("dur", 0) / 1e3 / args.steps
        cnt[name] += 1 / args.steps
    total = sum(tot.values())
    print(f"GPU processes: {[pnames[p] for p in gpu_pids]}")
    print(f"total GPU kernel time per step: {total:.3f} ms ({len(tot)} distinct names)")
    for name, ms in tot.most_common(args.top):
        print(f"{ms:8.3f} ms {cnt[name]:5.0f}x  {name[:110]}")


if __name__ == "__main__":
    main()
