"""Forward timing on one GPU: gdp-jax cutedsl vs gdp-jax xla vs FLA (PyTorch/Triton).

All in ONE process (JAX with preallocation off, then torch). bf16, K = V = 128, random
inputs (keys L2-normalised in the op, beta in (0, 2), log-sigmoid gates). Medians of
per-iteration times after warm-up, ``block_until_ready`` / ``torch.cuda.synchronize``.
Roofline: FLOPs per token per head (4n+2)KV + 6nCK + 4nCV + (2/3)nC^2,
minimum HBM bytes 2(K + nK + nV + V + n) + 4; ceilings 790 TFLOP/s and 4.3 TB/s.

    python benchmarks/bench_fwd.py --out benchmarks/results [--fla] [--deadline 500]

Writes fwd_<date>.json and fwd_<date>.md (results written after every shape, so a run
cut short still leaves what it measured).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

SHAPES = [(8, 4096, 16, 1), (8, 4096, 16, 2), (8, 4096, 16, 3), (2, 16384, 16, 2),
          (1, 65536, 32, 2), (1, 32768, 64, 2)]
K = V = 128
C = 64
PEAK_FLOPS, PEAK_BW = 790e12, 4.3e12
T0 = time.time()


def flops(B, T, H, n):
    per = (4 * n + 2) * K * V + 6 * n * C * K + 4 * n * C * V + (2 / 3) * n * C * C
    return B * T * H * per


def min_bytes(B, T, H, n):
    return B * T * H * (2 * (K + n * K + n * V + V + n) + 4)


def roofline_ms(B, T, H, n):
    return 1e3 * max(flops(B, T, H, n) / PEAK_FLOPS, min_bytes(B, T, H, n) / PEAK_BW)


def time_fn(fn, sync, iters=10, reps=5, warmup=2):
    for _ in range(warmup):
        sync(fn())
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(iters):
            out = fn()
        sync(out)
        ts.append((time.perf_counter() - t) / iters * 1e3)
    return statistics.median(ts)


def fwdbwd_step(op, w):
    """The fwd+bwd step the scripts time: gradients of sum(op(q, k, v, g, beta) * w) w.r.t.
    all five inputs (not jitted)."""
    import jax
    import jax.numpy as jnp
    return jax.grad(lambda *a: jnp.sum(op(*a).astype(jnp.float32) * w), argnums=(0, 1, 2, 3, 4))


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def jax_inputs(B, T, H, n, seed=0):
    import jax
    import jax.numpy as jnp
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    bf = jnp.bfloat16
    q = jax.random.normal(ks[0], (B, T, H, K), jnp.float32).astype(bf)
    k = jax.random.normal(ks[1], (B, T, n, H, K), jnp.float32).astype(bf)
    v = jax.random.normal(ks[2], (B, T, n, H, V), jnp.float32).astype(bf)
    beta = jax.random.uniform(ks[3], (B, T, n, H), jnp.float32, 0.05, 1.95).astype(bf)
    g = jax.nn.log_sigmoid(jax.random.normal(ks[4], (B, T, H), jnp.float32) + 3.0)
    return q, k, v, g, beta


def bench_jax(shape, rec, check):
    import jax
    import numpy as np
    from gdp_jax import gated_delta_product
    from gdp_jax.kernels import fwd as kfwd
    from gdp_jax import chunked, ops, _checks

    B, T, H, n = shape
    q, k, v, g, beta = jax_inputs(B, T, H, n)
    sync = lambda x: jax.block_until_ready(x)
    outs = {}
    for backend in ("cutedsl", "xla"):
        f = jax.jit(lambda q, k, v, g, beta, b=backend: gated_delta_product(
            q, k, v, g, beta, use_qk_l2norm=True, backend=b))
        t = time.perf_counter()
        outs[backend] = sync(f(q, k, v, g, beta))
        rec[f"{backend}_first_call_s"] = round(time.perf_counter() - t, 2)
        rec[f"{backend}_ms"] = time_fn(lambda: f(q, k, v, g, beta), sync)
        log(shape, backend, f"{rec[f'{backend}_ms']:.3f} ms")
    if check:
        a = np.asarray(outs["cutedsl"], np.float32)
        b = np.asarray(outs["xla"], np.float32)
        rec["rel_rms_cutedsl_vs_xla"] = float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))
    # breakdown: the XLA operand preparation alone, and the kernel alone
    spec = _checks.check_inputs(q, k, v, g, beta)
    cfg = ops.OpConfig.from_spec(spec, True)

    def prep(q, k, v, g, beta):
        layout = cfg.layout(None)
        ch = cfg.chunk_inputs(layout, q, k, v, g, beta)
        ops_ = kfwd.chunk_operands(ch, cfg.scale, q.dtype)
        i32 = lambda x: x.astype(np.int32)
        return ops_ + (i32(layout.reset), i32(layout.seq_of_chunk), i32(layout.is_last))

    prep_j = jax.jit(prep)
    operands = sync(prep_j(q, k, v, g, beta))
    rec["xla_prep_ms"] = time_fn(lambda: prep_j(q, k, v, g, beta), sync)
    h0 = jax.numpy.zeros((B, H, K, V), jax.numpy.float32)
    kern = jax.jit(lambda *a: kfwd.chunk_kernel_call(*a, BV=kfwd.pick_bv(B, H, V)))
    sync(kern(*operands, h0))
    rec["kernel_ms"] = time_fn(lambda: kern(*operands, h0), sync)
    rec["kernel_bv"] = kfwd.pick_bv(B, H, V)
    rec["kernel_split"] = kfwd.default_split(q.dtype)
    kern_ns = jax.jit(lambda *a: kfwd.chunk_kernel_call(*a, BV=kfwd.pick_bv(B, H, V),
                                                        split=False))
    sync(kern_ns(*operands, h0))
    rec["kernel_nosplit_ms"] = time_fn(lambda: kern_ns(*operands, h0), sync)
    log(shape, f"prep {rec['xla_prep_ms']:.3f} ms, kernel {rec['kernel_ms']:.3f} ms "
        f"(unsplit bf16 operands {rec['kernel_nosplit_ms']:.3f} ms)")
    del operands, outs


def limit_triton_autotune(max_configs):
    """Keep only the first ``max_configs`` configs of every Triton autotuner (FLA's first
    call otherwise autotunes for many minutes). Recorded in the results."""
    import triton.runtime.autotuner as at
    orig = at.Autotuner.__init__

    def init(self, fn, arg_names, configs, *a, **kw):
        orig(self, fn, arg_names, configs[:max_configs], *a, **kw)
    at.Autotuner.__init__ = init


def bench_fla(shape, rec):
    import torch
    from fla.ops.gated_delta_product import chunk_gated_delta_product
    B, T, H, n = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    q = torch.randn(B, T, H, K, device=dev, generator=gen).to(bf)
    k = torch.randn(B, T * n, H, K, device=dev, generator=gen).to(bf)
    v = torch.randn(B, T * n, H, V, device=dev, generator=gen).to(bf)
    beta = (torch.rand(B, T * n, H, device=dev, generator=gen) * 1.9 + 0.05).to(bf)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device=dev, generator=gen) + 3.0)

    def f():
        with torch.no_grad():
            return chunk_gated_delta_product(q, k, v, g, beta, num_householder=n,
                                             use_qk_l2norm_in_kernel=True)[0]
    t = time.perf_counter()
    f()
    torch.cuda.synchronize()
    rec["fla_first_call_s"] = round(time.perf_counter() - t, 2)
    rec["fla_ms"] = time_fn(f, lambda _: torch.cuda.synchronize())
    log(shape, f"fla {rec['fla_ms']:.3f} ms (first call {rec['fla_first_call_s']} s)")


def write(out_dir, meta, rows):
    os.makedirs(out_dir, exist_ok=True)
    date = meta["date"][:10]
    with open(os.path.join(out_dir, f"fwd_{date}.json"), "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    lines = [f"# Forward benchmark {meta['date']}", "",
             f"Command: `{meta['command']}`", "",
             f"Device: {meta['device']}; jax {meta['jax']}; FLA autotune: {meta['fla_autotune']}",
             "", "bf16, K = V = 128, use_qk_l2norm, gates on. Times are medians in ms. "
             "Roofline fraction = max(FLOPs/790T, bytes/4.3T) / time.", "",
             "| B | T | H | n | cutedsl | xla | FLA | cutedsl vs FLA | cutedsl vs xla | "
             "roofline ms | cutedsl % roofline | FLA % roofline | XLA prep | kernel | "
             "kernel (unsplit) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda x, p=3: "-" if x is None else f"{x:.{p}f}"
    for r in rows:
        cm, xm, fm, rl = r.get("cutedsl_ms"), r.get("xla_ms"), r.get("fla_ms"), r["roofline_ms"]
        lines.append("| " + " | ".join([
            str(r["B"]), str(r["T"]), str(r["H"]), str(r["n"]), fmt(cm), fmt(xm), fmt(fm),
            "-" if not (cm and fm) else f"{fm / cm:.2f}x",
            "-" if not (cm and xm) else f"{xm / cm:.2f}x", fmt(rl),
            "-" if not cm else f"{100 * rl / cm:.1f}%",
            "-" if not fm else f"{100 * rl / fm:.1f}%",
            fmt(r.get("xla_prep_ms")), fmt(r.get("kernel_ms")),
            fmt(r.get("kernel_nosplit_ms"))]) + " |")
    notes = meta.get("notes", [])
    if notes:
        lines += ["", "Notes:"] + [f"- {x}" for x in notes]
    with open(os.path.join(out_dir, f"fwd_{date}.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines[-len(rows) - 2 - (len(notes) + 2 if notes else 0):]), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--fla", action="store_true", help="also time FLA (needs torch + fla)")
    ap.add_argument("--fla-max-configs", type=int, default=0,
                    help="keep only the first N Triton autotune configs (0: all)")
    ap.add_argument("--deadline", type=float, default=1e9,
                    help="seconds: skip remaining work after this (results so far kept)")
    ap.add_argument("--shapes", default="all", help="comma list of indices into SHAPES")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--skip-jax", action="store_true", help="FLA only")
    ap.add_argument("--fla-shapes", default="all", help="comma list of indices into SHAPES")
    args = ap.parse_args()

    import jax
    shapes = SHAPES if args.shapes == "all" else [SHAPES[int(i)] for i in args.shapes.split(",")]
    meta = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": "python " + " ".join(sys.argv), "device": str(jax.devices()[0]),
            "jax": jax.__version__, "python": platform.python_version(),
            "fla_autotune": ("off" if not args.fla else
                             "full" if not args.fla_max_configs else
                             f"first {args.fla_max_configs} configs per kernel"),
            "notes": []}
    rows = []
    for (B, T, H, n) in shapes:
        rows.append({"B": B, "T": T, "H": H, "n": n, "flops": flops(B, T, H, n),
                     "min_bytes": min_bytes(B, T, H, n), "roofline_ms": roofline_ms(B, T, H, n)})
    for r in ([] if args.skip_jax else rows):
        if time.time() - T0 > args.deadline:
            meta["notes"].append(f"deadline hit before jax timing of {r['B'], r['T'], r['H'], r['n']}")
            break
        try:
            bench_jax((r["B"], r["T"], r["H"], r["n"]), r, not args.no_check)
        except Exception as e:  # record and continue
            r["jax_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            log("jax error", r["jax_error"])
        write(args.out, meta, rows)
    if args.fla:
        if args.fla_max_configs:
            limit_triton_autotune(args.fla_max_configs)
        import jax as _jax
        _jax.clear_caches()
        fla_rows = rows if args.fla_shapes == "all" else [
            r for r in rows if SHAPES.index((r["B"], r["T"], r["H"], r["n"]))
            in [int(i) for i in args.fla_shapes.split(",")]]
        for r in fla_rows:
            if time.time() - T0 > args.deadline:
                meta["notes"].append(f"deadline hit before FLA timing of "
                                     f"{r['B'], r['T'], r['H'], r['n']}")
                break
            try:
                bench_fla((r["B"], r["T"], r["H"], r["n"]), r)
            except Exception as e:
                r["fla_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                log("fla error", r["fla_error"])
            write(args.out, meta, rows)
    write(args.out, meta, rows)


if __name__ == "__main__":
    main()
