"""Speed and accuracy of the op under each XLA matmul precision (one GPU).

The XLA parts of both backends (WY factors, readout operands, the chunk-local backward)
compute in float32. Whether their matmuls run on tensor cores (TF32 / bf16 passes) or on
the CUDA cores (full float32) is set by ``jax.default_matmul_precision``. For each setting
this script times (8, 4096, 16, n=2) bf16 forward and fwd+bwd (cutedsl N=0 and xla) and
measures every gradient's relative RMS error against the float64 token recurrence on a
small case (bf16, B=2, T=203, n=2, H=2, HV=4, K=V=128, gates, initial state).

    python benchmarks/matmul_precision.py [--precisions float32,tensorfloat32,bfloat16]
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_fwd import fwdbwd_step, jax_inputs, time_fn  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--precisions", default="default,float32,tensorfloat32,bfloat16")
    ap.add_argument("--shape", default="8,4096,16,2")
    ap.add_argument("--backends", default="cutedsl,xla")
    args = ap.parse_args()
    B, T, H, n = (int(x) for x in args.shape.split(","))

    import jax
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np
    from gdp_jax import gated_delta_product, gated_delta_product_reference

    def rel_rms(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.sqrt(np.mean((a - b) ** 2)) / (np.sqrt(np.mean(b ** 2)) + 1e-30))

    # accuracy case
    ks = jax.random.split(jax.random.PRNGKey(5), 8)
    f32, bf = jnp.float32, jnp.bfloat16
    b_, t_, h_, hv_ = 2, 203, 2, 4
    small = (jax.random.normal(ks[0], (b_, t_, h_, 128), f32).astype(bf),
             jax.random.normal(ks[1], (b_, t_, n, h_, 128), f32).astype(bf),
             jax.random.normal(ks[2], (b_, t_, n, hv_, 128), f32).astype(bf),
             jax.nn.log_sigmoid(jax.random.normal(ks[3], (b_, t_, hv_), f32) + 3.0),
             jax.random.uniform(ks[4], (b_, t_, n, hv_), f32, 0.05, 1.95).astype(bf),
             0.3 * jax.random.normal(ks[5], (b_, hv_, 128, 128), f32))
    wo = jax.random.normal(ks[6], (b_, t_, hv_, 128), f32)
    ws = jax.random.normal(ks[7], (b_, hv_, 128, 128), f32)

    def loss_fn(backend):
        def loss(q, k, v, g, beta, s0):
            if backend == "reference":
                up = lambda x: x.astype(jnp.float64)
                o, s = gated_delta_product_reference(
                    up(q), up(k), up(v), up(g), up(beta), initial_state=up(s0),
                    output_final_state=True, use_qk_l2norm=True)
                return jnp.sum(o * wo) + jnp.sum(s * ws)
            o, s = gated_delta_product(q, k, v, g, beta, initial_state=s0,
                                       output_final_state=True, use_qk_l2norm=True,
                                       backend=backend)
            return jnp.sum(o.astype(f32) * wo) + jnp.sum(s * ws)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)))

    ref = loss_fn("reference")(*small)
    names = ("dq", "dk", "dv", "dg", "dbeta", "dh0")

    q, k, v, g, beta = jax_inputs(B, T, H, n)
    w = jax.random.normal(jax.random.PRNGKey(1), (B, T, H, 128), f32).astype(q.dtype)
    sync = jax.block_until_ready
    for prec in args.precisions.split(","):
        ctx = (jax.default_matmul_precision(prec) if prec != "default"
               else jax.default_matmul_precision(None))
        with ctx:
            line = [f"precision={prec:14s}"]
            for backend in args.backends.split(","):
                op = lambda *a, b=backend: gated_delta_product(*a, use_qk_l2norm=True, backend=b)
                fwd = jax.jit(op)
                fb = jax.jit(fwdbwd_step(op, w))
                sync(fwd(q, k, v, g, beta))
                sync(fb(q, k, v, g, beta))
                tf = time_fn(lambda: fwd(q, k, v, g, beta), sync, iters=5)
                tb = time_fn(lambda: fb(q, k, v, g, beta), sync, iters=5)
                got = loss_fn(backend)(*small)
                errs = " ".join(f"{nm} {rel_rms(a, r):.2e}" for nm, a, r in zip(names, got, ref))
                line.append(f"{backend}: fwd {tf:7.3f} ms fwd+bwd {tb:7.3f} ms | {errs}")
            print("\n    ".join(line), flush=True)


if __name__ == "__main__":
    main()
