"""The chunk-local gradient kernel on the GPU: precision, kernel time, and its effect on the op.

    python -m benchmarks.local_grad [--shape 8,4096,16,2] [--skip-op]

1. Precision: ``LocalGradKernel`` and XLA's ``chunked.local_grads_direct`` (float32) on
   the same random chunks (bf16-representable q, k, v, doc, S0; L2-normalised q, k, beta
   in (0.05, 1.95), moderate and strong gates), each against ``local_grads_direct`` in
   float64 on the same inputs: relative RMS error of dq, dk, dv, dg, dbeta, for every
   (K, V) the kernel takes.
2. Kernel time: the kernel alone vs XLA's local gradients alone (jitted, inputs
   precomputed) on the chunk tensors of ``--shape`` (B, T, H, n: NC = n T / 64 chunks).
3. The op: cutedsl fwd+bwd at ``--shape`` through the benchmark runner (check vs float64,
   medians, peak memory) as the engine runs it, with XLA's factors and float32 dS_end
   (``pipeline.KERNEL_FACTORS = False``), with XLA's local gradients too
   (``pipeline.LOCAL_GRAD_KERNEL = False``), with the kernel's [C, C] factors in one
   16-bit rounding (``kernels.local_grad.SPLIT = False``), and with the forward's
   operands kept for the backward (``pipeline.SAVE_OPERANDS = True``).
"""
from __future__ import annotations

import argparse
import json
import types


def chunk_inputs(key, B, NC, HV, K, V, strong=False):
    """Random chunk tensors: ((ch, S0, doc, ds_end), float32, bf16-representable)."""
    import jax
    import jax.numpy as jnp
    from gdp_jax import grid
    C = grid.CHUNK
    ks = jax.random.split(key, 8)
    bf = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    q = bf(unit(jax.random.normal(ks[0], (B, NC, HV, C, K))))
    k = bf(unit(jax.random.normal(ks[1], (B, NC, HV, C, K))))
    v = bf(jax.random.normal(ks[2], (B, NC, HV, C, V)))
    beta = jax.random.uniform(ks[3], (B, NC, HV, C), jnp.float32, 0.05, 1.95)
    if strong:
        g = -jax.random.uniform(ks[4], (B, NC, HV, C), jnp.float32, 0.0, 20.0)
    else:
        g = jax.nn.log_sigmoid(jax.random.normal(ks[4], (B, NC, HV, C)) + 3.0)
    S0 = bf(0.5 * jax.random.normal(ks[5], (B, NC, HV, K, V)))
    doc = bf(jax.random.normal(ks[6], (B, NC, HV, C, V)))
    ds_end = jax.random.normal(ks[7], (B, NC, HV, K, V))
    return grid.ChunkInputs(q, k, v, g, beta), S0, doc, ds_end


def xla_grads(ch, S0, doc, ds_end, scale):
    from gdp_jax import chunked
    it, X = chunked.wy_factors(ch)
    return tuple(chunked.local_grads_direct(ch, it, X, S0, doc, ds_end, scale))


def kernel_grads(ch, S0, doc, ds_end, scale, variant=""):
    import jax.numpy as jnp
    from gdp_jax import chunked
    from gdp_jax.kernels.local_grad import LocalGradKernel
    it, X = chunked.wy_factors(ch)
    return LocalGradKernel.call(ch.q, ch.k, ch.v, ch.g, ch.beta, it.w, it.u, X, S0, doc,
                                ds_end, scale=scale, ab_dtype=jnp.bfloat16,
                                **variant_kwargs(variant))


def variant_kwargs(variant: str) -> dict:
    """The ``LocalGradKernel.call`` options of a variant name: "nosplit", "warps4",
    "gmma" (warpgroup MMAs), "gmmao" (and overlapped), "gmmaa" (and phases 9, 10) and
    ``ablate`` parts ("serial": "gmmaa" without the overlap), comma-combined."""
    parts = [x for x in variant.split(",") if x]
    knobs = ("nosplit", "warps4", "gmma", "gmmao", "gmmaa")
    return dict(split="nosplit" not in parts, warps_n=1 if "warps4" in parts else 2,
                gmma="all" if "gmmaa" in parts else "overlap" if "gmmao" in parts
                else "gmma" in parts,
                ablate=",".join(x for x in parts if x not in knobs))


# variants whose results are right (the others are timing ablations)
EXACT_VARIANTS = ("nosplit", "warps4", "roundtrip", "gmma", "gmmao", "gmmaa", "serial")


def precision(cases, scale=0.088, variants=()):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from benchmarks.measure import x64
    names = ("dq", "dk", "dv", "dg", "dbeta")
    rows = []
    for K, V, strong in cases:
        inp = chunk_inputs(jax.random.PRNGKey(K + V + strong), 2, 3, 2, K, V, strong)
        with x64():
            up = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float64), inp)
            ref = [np.asarray(r) for r in jax.jit(xla_grads, static_argnums=4)(*up, scale)]
        got_k = [np.asarray(r, np.float64) for r in
                 jax.jit(kernel_grads, static_argnums=4)(*inp, scale)]
        got_x = [np.asarray(r, np.float64) for r in
                 jax.jit(xla_grads, static_argnums=4)(*inp, scale)]
        rel = lambda a, b: float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
        row = {"K": K, "V": V, "strong": strong,
               "kernel": {n: rel(a, b) for n, a, b in zip(names, got_k, ref)},
               "xla_f32": {n: rel(a, b) for n, a, b in zip(names, got_x, ref)},
               "finite": all(bool(np.all(np.isfinite(a))) for a in got_k)}
        for v in variants:
            got_v = [np.asarray(r, np.float64) for r in
                     jax.jit(kernel_grads, static_argnums=(4, 5))(*inp, scale, v)]
            row[f"kernel[{v}]"] = {n: rel(a, b) for n, a, b in zip(names, got_v, ref)}
        print("precision", json.dumps(row), flush=True)
        rows.append(row)
    return rows


def kernel_time(B, NC, HV, K=128, V=128, scale=0.088, variants=()):
    import jax
    from benchmarks import measure
    from gdp_jax import chunked
    from gdp_jax.kernels.local_grad import LocalGradKernel
    import jax.numpy as jnp
    ch, S0, doc, ds_end = chunk_inputs(jax.random.PRNGKey(1), B, NC, HV, K, V)
    it, X = jax.jit(chunked.wy_factors)(ch)
    S0b, docb = S0.astype(jnp.bfloat16), doc.astype(jnp.bfloat16)
    kern = lambda split=True, ablate="", warps_n=2, gmma=False: jax.jit(
        lambda ch, it, X, S0, doc, ds: LocalGradKernel.call(
            ch.q, ch.k, ch.v, ch.g, ch.beta, it.w.astype(jnp.bfloat16), it.u, X, S0, doc, ds,
            scale=scale, ab_dtype=jnp.bfloat16, split=split, ablate=ablate,
            warps_n=warps_n, gmma=gmma))
    fx = jax.jit(lambda ch, it, X, S0, doc, ds: tuple(chunked.local_grads_direct(
        ch, it, X, S0, doc, ds, scale)))
    sync = lambda r: jax.block_until_ready(r)
    out = {}
    runs = [("kernel", kern()), ("xla", fx)]
    for v in variants:       # "nosplit", "warps4", "roundtrip" or ablations ("nomma", ...)
        runs.append((f"kernel[{v}]", kern(**variant_kwargs(v))))
    for name, f in runs:
        out[name + "_ms"] = measure.median_ms(lambda: f(ch, it, X, S0b, docb, ds_end), sync,
                                              10, 5)
        print("time", name, f"{out[name + '_ms']:.3f} ms", flush=True)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="8,4096,16,2")
    p.add_argument("--skip-op", action="store_true")
    p.add_argument("--skip-precision", action="store_true")
    p.add_argument("--variants", default="",
                   help="kernel variants to time besides the default, ';'-separated: "
                        "nosplit, warps4, roundtrip, gmma, gmmao, gmmaa, serial (results right), nomma, "
                        "nogates, notail (comma-combined)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    B, T, H, n = (int(x) for x in a.shape.split(","))
    variants = [v for v in a.variants.split(";") if v]
    exact = [v for v in variants if set(v.split(",")) <= set(EXACT_VARIANTS)]
    res = {"precision": [] if a.skip_precision else precision(
        [(128, 128, False), (128, 128, True), (64, 64, False), (64, 128, False),
         (128, 64, True)], variants=exact)}
    res["time"] = kernel_time(B, n * T // 64, H, variants=variants)
    if not a.skip_op:
        from benchmarks import op, registry
        from gdp_jax.kernels import local_grad, pipeline
        shape = registry.shapes("op", a.shape)[0]
        x = registry.make_inputs(shape, 0)
        ref = op.reference(x, min(4, shape.H), True)
        args = types.SimpleNamespace(check_heads=4, iters=5, reps=5)
        res["op"] = []
        saved = (pipeline.LOCAL_GRAD_KERNEL, pipeline.KERNEL_FACTORS,
                 local_grad.SPLIT, pipeline.SAVE_OPERANDS)
        for use, factors, split, save in ((True, True, True, False),
                                          (True, True, True, True),
                                          (True, True, False, False),
                                          (True, False, True, False),
                                          (False, False, True, False)):
            pipeline.LOCAL_GRAD_KERNEL, pipeline.KERNEL_FACTORS = use, factors
            local_grad.SPLIT, pipeline.SAVE_OPERANDS = split, save
            row = {"shape": shape.label(), "local_grad_kernel": use,
                   "kernel_factors": factors, "split": split, "save_operands": save}
            try:
                op.one(registry.impl("cutedsl", "fwdbwd"), x, shape, "fwdbwd", ref, args, row)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:400]
            print("op", json.dumps(row), flush=True)
            res["op"].append(row)
        (pipeline.LOCAL_GRAD_KERNEL, pipeline.KERNEL_FACTORS,
         local_grad.SPLIT, pipeline.SAVE_OPERANDS) = saved
    print("\n| K | V | strong gates | kernel dq / dk / dv / dg / dbeta | xla f32 (same) |")
    print("|---|---|---|---|---|")
    for r in res["precision"]:
        f = lambda d: " / ".join(f"{d[k]:.1e}" for k in ("dq", "dk", "dv", "dg", "dbeta"))
        print(f"| {r['K']} | {r['V']} | {r['strong']} | {f(r['kernel'])} | {f(r['xla_f32'])} |")
        for v in exact:
            print(f"|   kernel[{v}] | | | {f(r[f'kernel[{v}]'])} | |")
    t = res["time"]
    print(f"\nlocal gradients alone at {a.shape}: " + ", ".join(
        f"{k[:-3]} {v:.3f} ms" for k, v in t.items()))
    for r in res.get("op", []):
        if "error" in r:
            print(f"op kernel={r['local_grad_kernel']} factors={r['kernel_factors']} "
                  f"split={r['split']} save={r['save_operands']}: error {r['error']}")
        else:
            print(f"op kernel={r['local_grad_kernel']} factors={r['kernel_factors']} "
                  f"split={r['split']} save={r['save_operands']}: "
                  f"fwd {r['fwd_ms']:.2f} ms, fwd+bwd "
                  f"{r['fwdbwd_ms']:.2f} ms, peak {r['peak_gb']:.2f} GB, kept "
                  f"{r.get('kept_gb', float('nan')):.2f} GB, check max "
                  f"{r['check_max']:.2e}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
