"""One fresh process of the prebuilt-vs-compiled kernel check (run by tests/test_aot_gpu.py).

Usage: python _aot_gpu_worker.py OUT.npz

The parent picks the path through the environment (``GDP_JAX_KERNEL_DIR``: prebuilt
objects or an empty directory; ``GDP_JAX_KERNEL_SHAPES=static``: the per-shape compile).
Runs on the GPU, with fixed numpy inputs: the cutedsl op's forward and gradients (dense
bf16 and packed fp16), the CP summaries of the engine, and one decoding step; saves every
result to OUT.npz ("<name>.bytes": its raw bytes, "<name>.f32": as float32) and prints
one JSON line {"cutlass_imported", "compiled"}.
"""
from __future__ import annotations

import json
import sys

import numpy as np

import jax
import jax.numpy as jnp

from gdp_jax import _checks, grid, gated_delta_product, gated_delta_product_step
from gdp_jax.kernels import binding
from gdp_jax.kernels.pipeline import CUTEDSL


def _inputs(seed, B, T, n, H, HV, K, V, dtype, N):
    r = np.random.default_rng(seed)
    f = lambda *s: r.standard_normal(s, dtype=np.float32)
    return dict(q=jnp.asarray(f(B, T, H, K), dtype), k=jnp.asarray(f(B, T, n, H, K), dtype),
                v=jnp.asarray(f(B, T, n, HV, V), dtype),
                g=jnp.asarray(np.log(1 / (1 + np.exp(-(f(B, T, HV) + 3))))),
                beta=jnp.asarray(r.uniform(0.05, 1.95, (B, T, n, HV)), dtype),
                s0=jnp.asarray(0.3 * f(N, HV, K, V)))


def op_fwd_bwd(x, cu=None, recompute=0):
    def loss(q, k, v, g, beta, s0):
        o, s = gated_delta_product(q, k, v, g, beta, initial_state=s0, cu_seqlens=cu,
                                   output_final_state=True, use_qk_l2norm=True,
                                   backend="cutedsl", recompute_chunk_num=recompute)
        w = jnp.cos(jnp.arange(o.size, dtype=jnp.float32).reshape(o.shape))
        return jnp.sum(o.astype(jnp.float32) * w) + jnp.sum(jnp.sin(s)), (o, s)

    (_, (o, s)), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))(
        x["q"], x["k"], x["v"], x["g"], x["beta"], x["s0"])
    return [o, s, *grads]


def cp_summaries():
    B, T, n, HV, K, V = 1, 200, 2, 2, 128, 128
    r = np.random.default_rng(7)
    layout = grid.make_layout(B, T, n, None)
    NC = layout.reset.shape[1]
    f = lambda *s: jnp.asarray(0.3 * r.standard_normal(s, dtype=np.float32))
    ch = grid.ChunkInputs(f(B, NC, HV, grid.CHUNK, K), f(B, NC, HV, grid.CHUNK, K),
                          f(B, NC, HV, grid.CHUNK, V),
                          -jax.nn.softplus(f(B, NC, HV, grid.CHUNK)),
                          jnp.asarray(r.uniform(0.1, 1.9, (B, NC, HV, grid.CHUNK)), jnp.float32))
    spec = _checks.check_inputs(jnp.zeros((B, T, 1, K), jnp.bfloat16),
                                jnp.zeros((B, T, n, 1, K), jnp.bfloat16),
                                jnp.zeros((B, T, n, HV, V), jnp.bfloat16), None,
                                jnp.zeros((B, T, n, HV), jnp.bfloat16), scale=0.1)
    doc, dfinal = f(B, NC, HV, grid.CHUNK, V), f(B, HV, K, V)
    fwd = jax.jit(lambda c: CUTEDSL.forward_summaries(spec, c, layout)[0])(ch)
    bwd = jax.jit(lambda c, d, s: CUTEDSL.backward_summaries(spec, c, layout, d, s)[0])(
        ch, doc, dfinal)
    return [*fwd, *bwd]


def step():
    x = _inputs(3, 4, 1, 2, 2, 4, 128, 128, jnp.bfloat16, 4)
    run = jax.jit(lambda q, k, v, g, beta, s: gated_delta_product_step(
        q, k, v, g, beta, s, use_qk_l2norm=True, backend="cutedsl"))
    return list(run(x["q"][:, 0], x["k"][:, 0], x["v"][:, 0], x["g"][:, 0],
                    x["beta"][:, 0], x["s0"]))


def main(out):
    res = {}
    dense = _inputs(0, 2, 203, 2, 2, 4, 128, 128, jnp.bfloat16, 2)
    for i, a in enumerate(op_fwd_bwd(dense)):
        res[f"dense_{i}"] = a
    lens = [70, 0, 1, 130, 64]
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    packed = _inputs(1, 1, int(cu[-1]), 3, 1, 2, 64, 64, jnp.float16, len(lens))
    for i, a in enumerate(op_fwd_bwd(packed, cu, recompute=1)):
        res[f"packed_{i}"] = a
    for i, a in enumerate(cp_summaries()):
        res[f"cp_{i}"] = a
    for i, a in enumerate(step()):
        res[f"step_{i}"] = a
    # raw bytes: bitwise comparison (bf16 has no numpy dtype of its own)
    host = {k: np.asarray(jax.device_get(v)) for k, v in res.items()}
    np.savez(out, **{f"{k}.bytes": v.view(np.uint8) for k, v in host.items()},
             **{f"{k}.f32": v.astype(np.float32) for k, v in host.items()})
    print(json.dumps({"cutlass_imported": "cutlass" in sys.modules,
                      "compiled": len(binding.compiled_variants())}))


if __name__ == "__main__":
    main(sys.argv[1])
