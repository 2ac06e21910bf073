"""Forward + backward timing and backward memory on one GPU: cutedsl (N = 0, 2) vs xla vs FLA.

All in ONE process (JAX with preallocation off, then torch). bf16, K = V = 128,
``use_qk_l2norm``, log-sigmoid gates, beta in (0.05, 1.95). Loss = sum(o * w) with a fixed
random w; timed = the whole jitted value-and-grad w.r.t. q, k, v, g, beta (JAX) and
forward + ``o.backward(w)`` (FLA). Medians of 5 x 5 iterations after 2 warm-ups.

Memory kept for the backward ("saved"): JAX - the bytes of the residuals of ``jax.vjp``
(returned from a jitted function) minus the inputs' bytes; FLA - ``memory_allocated``
after the forward minus before, minus the output. Peak: XLA's compiled temp bytes of the
value-and-grad function; FLA's ``max_memory_allocated`` during forward + backward minus
the inputs already allocated.

FLOPs per token per head (the matrix products of the chunkwise form, docs/ALGORITHMS.md 2):
forward (4n+2)KV + 6nCK + 4nCV + (2/3)nC^2, backward n (16KV + 16CK + 10CV + 4C^2);
ceiling 790 TFLOP/s (dense bf16, achievable).

    python benchmarks/bench_fwdbwd.py --out benchmarks/results [--fla] [--deadline 500]

FLA 0.6.0 refuses its gated backward on Hopper with triton < 3.7.1 (its issue #640: wrong
results in some cases); for TIMING ONLY this script sets
``fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 = True``. Its gradients are never used as a
reference (tests/test_cutedsl_gpu.py compares with the float64 reference).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_fwd import (C, K, V, jax_inputs, limit_triton_autotune, log,  # noqa: E402
                       time_fn)

SHAPES = [(8, 4096, 16, 1), (8, 4096, 16, 2), (8, 4096, 16, 3), (2, 16384, 16, 2),
          (1, 65536, 32, 2)]
PEAK_FLOPS = 790e12
T0 = time.time()


def flops_fwdbwd(B, T, H, n):
    fwd = (4 * n + 2) * K * V + 6 * n * C * K + 4 * n * C * V + (2 / 3) * n * C * C
    bwd = n * (16 * K * V + 16 * C * K + 10 * C * V + 4 * C * C)
    return B * T * H * (fwd + bwd)


def bench_jax(shape, rec, variants):
    import jax
    import jax.numpy as jnp
    from gdp_jax import gated_delta_product

    B, T, H, n = shape
    q, k, v, g, beta = jax_inputs(B, T, H, n)
    w = jax.random.normal(jax.random.PRNGKey(11), (B, T, H, V), jnp.float32).astype(q.dtype)
    in_bytes = sum(x.nbytes for x in (q, k, v, g, beta))
    sync = jax.block_until_ready
    grads = {}
    for name, backend, N in variants:
        op = lambda q, k, v, g, beta: gated_delta_product(
            q, k, v, g, beta, use_qk_l2norm=True, backend=backend, recompute_chunk_num=N)
        loss = lambda *a: jnp.sum(op(*a).astype(jnp.float32) * w)
        f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
        try:
            t = time.perf_counter()
            out = sync(f(q, k, v, g, beta))
            rec[f"{name}_first_call_s"] = round(time.perf_counter() - t, 2)
            rec[f"{name}_ms"] = time_fn(lambda: f(q, k, v, g, beta), sync, iters=5)
            grads[name] = out[1]
            if N in (0, None):          # forward alone (no checkpoints kept without grad)
                fo = jax.jit(op)
                sync(fo(q, k, v, g, beta))
                rec[f"{name}_fwd_ms"] = time_fn(lambda: fo(q, k, v, g, beta), sync, iters=5)
            mem = f.lower(q, k, v, g, beta).compile().memory_analysis()
            rec[f"{name}_peak_temp_gb"] = round(mem.temp_size_in_bytes / 1e9, 3)
            res = jax.jit(lambda *a: jax.vjp(op, *a)[1])(q, k, v, g, beta)
            kept = sum(x.nbytes for x in jax.tree_util.tree_leaves(res) if hasattr(x, "nbytes"))
            rec[f"{name}_saved_gb"] = round((kept - in_bytes) / 1e9, 3)
            del res
            log(shape, name, f"{rec[f'{name}_ms']:.3f} ms, saved beyond inputs "
                f"{rec[f'{name}_saved_gb']} GB, peak temp {rec[f'{name}_peak_temp_gb']} GB")
        except Exception as e:  # record and continue (e.g. out of memory)
            rec[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            log(shape, name, "error", rec[f"{name}_error"])
    if "cutedsl_N0" in grads and "xla" in grads:
        import numpy as np
        errs = []
        for a, b in zip(grads["cutedsl_N0"], grads["xla"]):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            errs.append(float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2))))
        rec["grad_rel_rms_cutedsl_vs_xla_max"] = max(errs)
    rec["input_gb"] = round(in_bytes / 1e9, 3)


def bench_fla(shape, rec):
    import torch
    import fla.ops.common.chunk_o as chunk_o
    from fla.ops.gated_delta_product import chunk_gated_delta_product
    chunk_o.TRITON_ABOVE_3_7_1 = True          # timing only, see the module docstring
    B, T, H, n = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    mk = lambda *s: torch.randn(*s, device=dev, generator=gen).to(bf).requires_grad_()
    q, k, v = mk(B, T, H, K), mk(B, T * n, H, K), mk(B, T * n, H, V)
    beta = (torch.rand(B, T * n, H, device=dev, generator=gen) * 1.9 + 0.05).to(bf)
    beta.requires_grad_()
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device=dev, generator=gen) + 3.0)
    g.requires_grad_()
    w = torch.randn(B, T, H, V, device=dev, generator=gen).to(bf)
    inputs = (q, k, v, g, beta)

    def fwd():
        return chunk_gated_delta_product(q, k, v, g, beta, num_householder=n,
                                         use_qk_l2norm_in_kernel=True)[0]

    def step():
        for x in inputs:
            x.grad = None
        o = fwd()
        o.backward(w)
        return o

    t = time.perf_counter()
    step()
    torch.cuda.synchronize()
    rec["fla_first_call_s"] = round(time.perf_counter() - t, 2)
    rec["fla_ms"] = time_fn(step, lambda _: torch.cuda.synchronize(), iters=5)

    def fwd_only():
        with torch.no_grad():
            return fwd()
    rec["fla_fwd_ms"] = time_fn(fwd_only, lambda _: torch.cuda.synchronize(), iters=5)
    # memory kept for the backward
    for x in inputs:
        x.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    o = fwd()
    torch.cuda.synchronize()
    rec["fla_saved_gb"] = round((torch.cuda.memory_allocated() - before - o.nbytes) / 1e9, 3)
    del o
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    rec["fla_peak_temp_gb"] = round((torch.cuda.max_memory_allocated() - base) / 1e9, 3)
    log(shape, f"fla {rec['fla_ms']:.3f} ms, saved {rec['fla_saved_gb']} GB, "
        f"peak {rec['fla_peak_temp_gb']} GB (first call {rec['fla_first_call_s']} s)")


def write(out_dir, meta, rows, names):
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"fwdbwd_{meta['date'][:10]}")
    with open(stem + ".json", "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    fmt = lambda x, p=2: "-" if x is None else f"{x:.{p}f}"
    lines = [f"# Forward + backward benchmark {meta['date']}", "",
             f"Command: `{meta['command']}`", "",
             f"Device: {meta['device']}; jax {meta['jax']}; FLA autotune: {meta['fla_autotune']}",
             "", "bf16, K = V = 128, use_qk_l2norm, gates on. Medians in ms (fwd alone, then fwd+bwd); "
             "'% peak' = FLOPs (bench_fwdbwd.py docstring) / 790 TFLOP/s / time. Memory in GB: "
             "'saved' = kept for the backward beyond the inputs, 'peak' = temp of fwd+bwd.", "",
             "| B | T | H | n | fwd cutedsl / xla / FLA | " + " | ".join(names + ["FLA"])
             + " | FLA / cutedsl_N0 | "
             "% peak (cutedsl_N0 / FLA) | saved " + " / ".join(names + ["FLA"]) +
             " | peak " + " / ".join(names + ["FLA"]) + " | grad rel RMS vs xla |",
             "|---|---|---|---|---|" + "---|" * (len(names) + 1) + "---|---|---|---|---|"]
    for r in rows:
        ms = [r.get(f"{n}_ms") for n in names + ["fla"]]
        c0, fl = r.get("cutedsl_N0_ms"), r.get("fla_ms")
        pk = lambda t: "-" if not t else f"{100 * r['flops'] / PEAK_FLOPS / (t / 1e3):.1f}%"
        lines.append("| " + " | ".join(
            [str(r["B"]), str(r["T"]), str(r["H"]), str(r["n"]),
             " / ".join(fmt(r.get(f"{n}_fwd_ms")) for n in ("cutedsl_N0", "xla", "fla"))]
            + [fmt(x) for x in ms]
            + ["-" if not (c0 and fl) else f"{fl / c0:.2f}x", f"{pk(c0)} / {pk(fl)}",
               " / ".join(fmt(r.get(f"{n}_saved_gb")) for n in names + ["fla"]),
               " / ".join(fmt(r.get(f"{n}_peak_temp_gb")) for n in names + ["fla"]),
               fmt(r.get("grad_rel_rms_cutedsl_vs_xla_max"), 4)]) + " |")
    errs = [f"{(r['B'], r['T'], r['H'], r['n'])} {k}: {v}" for r in rows for k, v in r.items()
            if k.endswith("_error")]
    if errs:
        lines += ["", "Errors:"] + [f"- {e}" for e in errs]
    with open(stem + ".md", "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--fla", action="store_true")
    ap.add_argument("--fla-max-configs", type=int, default=0)
    ap.add_argument("--deadline", type=float, default=1e9)
    ap.add_argument("--shapes", default="all", help="comma list of indices into SHAPES")
    ap.add_argument("--no-xla", action="store_true", help="skip the xla backend")
    args = ap.parse_args()

    import jax
    shapes = SHAPES if args.shapes == "all" else [SHAPES[int(i)] for i in args.shapes.split(",")]
    variants = [("cutedsl_N0", "cutedsl", 0), ("cutedsl_N2", "cutedsl", 2)]
    if not args.no_xla:
        variants.append(("xla", "xla", None))
    names = [v[0] for v in variants]
    meta = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": "python " + " ".join(sys.argv), "device": str(jax.devices()[0]),
            "jax": jax.__version__, "python": platform.python_version(),
            "fla_autotune": ("off" if not args.fla else "full" if not args.fla_max_configs
                             else f"first {args.fla_max_configs} configs per kernel")}
    rows = [{"B": B, "T": T, "H": H, "n": n, "flops": flops_fwdbwd(B, T, H, n)}
            for (B, T, H, n) in shapes]
    for r in rows:
        if time.time() - T0 > args.deadline:
            break
        bench_jax((r["B"], r["T"], r["H"], r["n"]), r, variants)
        write(args.out, meta, rows, names)
    if args.fla:
        if args.fla_max_configs:
            limit_triton_autotune(args.fla_max_configs)
        jax.clear_caches()
        for r in rows:
            if time.time() - T0 > args.deadline:
                break
            try:
                bench_fla((r["B"], r["T"], r["H"], r["n"]), r)
            except Exception as e:
                r["fla_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                log("fla error", r["fla_error"])
            write(args.out, meta, rows, names)
    write(args.out, meta, rows, names)


if __name__ == "__main__":
    main()
