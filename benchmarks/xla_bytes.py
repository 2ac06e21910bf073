"""XLA's own accounting of the xla backend at one shape, compiled (not run) for this host.

    JAX_PLATFORMS=cpu python -m benchmarks.xla_bytes --shape 8,4096,16,2 [--error 1,512,2,2]
        [--backend cutedsl-emulated]

For the jitted forward (o) and fwd+bwd (value and gradients of sum(o * w) w.r.t. q, k, v,
g, beta) of the benchmark runner's inputs (bf16, ``use_qk_l2norm``, gates on; shapes only:
nothing is executed at ``--shape``) prints XLA's compiled temporary bytes
(``memory_analysis().temp_size_in_bytes``: the peak of the buffers the program allocates
beyond its arguments and outputs) and the cost analysis's "bytes accessed" (the sum over
the optimized HLO's fusions of the bytes each reads and writes: the data movement XLA
plans). Compiled for the default device (a CPU here: the GPU's fusion and scheduling
differ, so these are a proxy for the GPU's numbers, compared before / after a change).

``--error B,T,H,n``: also runs the fwd+bwd at that (small) shape in bf16 and in float64
and prints the relative RMS error of o and of each gradient vs the float64 run (the max
is the runner's check), and ``--f64-ref FILE`` saves / compares the float64 results
(max |diff| / max |ref| per tensor: a change that must leave float64 unchanged).
"""
from __future__ import annotations

import argparse
import json
import os


def _loss_fn(w, backend="xla", **kw):
    import jax.numpy as jnp
    from gdp_jax import gated_delta_product

    def loss(q, k, v, g, beta):
        o = gated_delta_product(q, k, v, g, beta, backend=backend, use_qk_l2norm=True, **kw)
        return jnp.sum(o.astype(w.dtype) * w)
    return loss


def abstract_inputs(shape, dtype="bfloat16"):
    """ShapeDtypeStructs of the runner's inputs (registry.Inputs) in ``dtype``."""
    import jax
    import jax.numpy as jnp
    B, T, H, n, K, V = shape
    dt = jnp.dtype(dtype)
    f32 = jnp.float32
    s = jax.ShapeDtypeStruct
    x = (s((B, T, H, K), dt), s((B, T, n, H, K), dt), s((B, T, n, H, V), dt),
         s((B, T, H), f32), s((B, T, n, H), dt))
    return x, s((B, T, H, V), f32)


def compiled_bytes(shape, dtype="bfloat16", backend="xla", **kw):
    """{"fwd": {...}, "fwdbwd": {...}}: temp bytes and bytes accessed, GB. ``backend``
    "cutedsl-emulated": the cutedsl pipeline with its kernels emulated in XLA
    (:func:`gdp_jax.testing.emulated_kernels`): the glue's buffers are the real ones, the
    kernels' own temporaries are XLA's - a proxy for comparing two trees, not the GPU's
    peak."""
    import contextlib
    import jax
    from gdp_jax import testing
    x, w = abstract_inputs(shape, dtype)
    emulated = backend == "cutedsl-emulated"
    out = {}
    for name in ("fwd", "fwdbwd"):
        def f(w, *a):
            loss = _loss_fn(w, "cutedsl" if emulated else backend, **kw)
            if name == "fwd":
                return loss(*a)
            return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))(*a)
        with testing.emulated_kernels() if emulated else contextlib.nullcontext():
            c = jax.jit(f).lower(w, *x).compile()
        mem = c.memory_analysis()
        cost = c.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        out[name] = {"temp_GB": mem.temp_size_in_bytes / 1e9,
                     "bytes_accessed_GB": float(cost.get("bytes accessed", float("nan"))) / 1e9,
                     "flops_G": float(cost.get("flops", float("nan"))) / 1e9}
    return out


def errors(shape, f64_ref=None, seed=0):
    """Relative RMS of o and the five gradients (bf16 run vs float64 run)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    jax.config.update("jax_enable_x64", True)
    from benchmarks import registry
    B, T, H, n, K, V = shape
    inp = registry.make_inputs(registry.Shape(B, T, H, n, K, V), seed)
    x = (inp.q, inp.k, inp.v, inp.g, inp.beta)
    names = ("o",) + registry.GRAD_NAMES

    def run(dt, wdt):
        a = tuple(t.astype(dt) for t in x)
        a = a[:3] + (x[3].astype(wdt),) + a[4:]
        w = inp.w.astype(wdt)
        loss = _loss_fn(w)

        def f(*a):
            from gdp_jax import gated_delta_product
            o = gated_delta_product(*a, backend="xla", use_qk_l2norm=True)
            return o, jax.grad(loss, argnums=(0, 1, 2, 3, 4))(*a)
        o, gr = jax.jit(f)(*a)
        return [np.asarray(t.astype(jnp.float64)) for t in (o,) + tuple(gr)]

    ref = run(jnp.float64, jnp.float64)
    low = run(jnp.bfloat16, jnp.float32)
    rms = lambda a, b: float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2)))
    out = {"rel_rms_bf16_vs_f64": {nm: rms(a, b) for nm, a, b in zip(names, low, ref)}}
    out["max_rel_rms"] = max(out["rel_rms_bf16_vs_f64"].values())
    if f64_ref:
        if os.path.exists(f64_ref):
            old = np.load(f64_ref)
            out["f64_max_diff_vs_saved"] = {
                nm: float(np.max(np.abs(a - old[nm])) / np.max(np.abs(old[nm])))
                for nm, a in zip(names, ref)}
        else:
            np.savez(f64_ref, **dict(zip(names, ref)))
            out["f64_saved"] = f64_ref
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="8,4096,16,2", help="B,T,H,n[,K,V]")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--backend", default="xla", choices=("xla", "cutedsl-emulated"),
                   help="cutedsl-emulated: the cutedsl glue with emulated kernels (any host)")
    p.add_argument("--recompute-chunk-num", type=int, default=None)
    p.add_argument("--error", default=None, help="B,T,H,n[,K,V]: also the error vs float64")
    p.add_argument("--f64-ref", default=None, help=".npz of float64 results to save / compare")
    p.add_argument("--segment-problems", type=int, default=None,
                   help="force segments of this many chunk problems (benchmarks.segments)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    parse = lambda s: (tuple(int(v) for v in s.split(",")) + (128, 128))[:6] \
        if len(s.split(",")) == 4 else tuple(int(v) for v in s.split(","))
    shape = parse(a.shape)
    kw = {} if a.recompute_chunk_num is None else {"recompute_chunk_num": a.recompute_chunk_num}
    res = {"shape": list(shape), "dtype": a.dtype, "backend": a.backend, **kw}
    kw["backend"] = a.backend
    if a.segment_problems is not None:
        from benchmarks.segments import segments
        res["segment_problems"] = a.segment_problems
        with segments(a.segment_problems):
            res.update(compiled_bytes(shape, a.dtype, **kw))
    else:
        res.update(compiled_bytes(shape, a.dtype, **kw))
    for name in ("fwd", "fwdbwd"):
        r = res[name]
        print(f"{shape} {a.dtype} {name}: temp {r['temp_GB']:.3f} GB, bytes accessed "
              f"{r['bytes_accessed_GB']:.2f} GB, {r['flops_G']:.1f} GFLOP", flush=True)
    if a.error:
        e = errors(parse(a.error), a.f64_ref)
        res["error"] = e
        print(f"error at {a.error}: " + json.dumps(e))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
