"""Where the cutedsl forward + backward spends its time, piece by piece (one GPU).

Each piece is jitted and timed alone on precomputed inputs (medians, block_until_ready):
chunk relayout, the intra-chunk factors (WY: cumsum, masks, triangular solve) and their
vjp, the kernels alone, the XLA chunk-local backward, and the whole op. bf16, K = V = 128.

    python benchmarks/profile_bwd.py --shape 8,4096,16,2
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
    ap.add_argument("--shape", default="8,4096,16,2")
    args = ap.parse_args()
    B, T, H, n = (int(x) for x in args.shape.split(","))

    import jax
    import jax.numpy as jnp
    from gdp_jax import _checks, chunked, gated_delta_product, ops
    from gdp_jax.kernels import bwd, fwd

    q, k, v, g, beta = jax_inputs(B, T, H, n)
    spec = _checks.check_inputs(q, k, v, g, beta)
    cfg = ops.OpConfig.from_spec(spec, True)
    layout = cfg.layout(None)
    mmd = fwd.matmul_dtype(q.dtype)
    sync = jax.block_until_ready
    res = {}

    def t(name, f, *a):
        jf = jax.jit(f)
        out = sync(jf(*a))
        res[name] = time_fn(lambda: jf(*a), sync, iters=5)
        print(f"{name:40s} {res[name]:8.3f} ms", flush=True)
        return out

    w = jax.random.normal(jax.random.PRNGKey(1), (B, T, H, 128), jnp.float32).astype(q.dtype)
    for N in (0, 2):
        op = lambda *a, N=N: gated_delta_product(*a, use_qk_l2norm=True, backend="cutedsl",
                                                 recompute_chunk_num=N)
        t(f"op forward (N={N}: no checkpoints)", op, q, k, v, g, beta)
        t(f"op fwd+bwd N={N}", fwdbwd_step(op, w), q, k, v, g, beta)
    xop = lambda *a: gated_delta_product(*a, use_qk_l2norm=True, backend="xla")
    t("xla fwd+bwd", fwdbwd_step(xop, w), q, k, v, g, beta)
    ch = t("chunk_inputs (relayout, l2norm)", lambda *a: cfg.chunk_inputs(layout, *a),
           q, k, v, g, beta)
    t("intra_chunk (WY factors, XLA inverse)", chunked.intra_chunk, ch)
    it = t("intra_chunk (WY factors, kernel inverse)", lambda c: fwd.intra_chunk(c, mmd), ch)
    t("intra_chunk without the WY inverse",
      lambda c: chunked.intra_chunk(c)._replace(w=None, u=None), ch)

    def intra_vjp(c, it_ct):
        _, pull = jax.vjp(lambda c: fwd.intra_chunk(c, mmd), c)
        return pull(it_ct)
    t("intra_chunk vjp (fwd + pull)", intra_vjp, ch, it)
    ops_f = t("fwd kernel operands (XLA)", lambda c: fwd.chunk_operands(c, cfg.scale, q.dtype), ch)
    flags = fwd.layout_flags(layout)
    h0 = jnp.zeros((B, H, 128, 128), jnp.float32)
    outs = t("fwd kernel alone (ckpt=1)", lambda *a: fwd.chunk_kernel_call(
        *a, BV=fwd.pick_bv(B, H, 128), ckpt=1), *ops_f, *flags, h0)
    S0 = outs[2]
    doc = jax.random.normal(jax.random.PRNGKey(2), ch.v.shape, jnp.float32)
    bops = t("bwd kernel operands (XLA)", lambda c, i, d: bwd.backward_operands(
        c, i, d, cfg.scale, q.dtype, mmd), ch, it, doc)
    ds_end, _ = t("dh kernel alone", lambda *a: bwd.dh_kernel_call(
        *a, BV=fwd.pick_bv(B, H, 128)), *bops, *flags, h0)

    def local(c, s, d, e):
        i, pull = jax.vjp(lambda c: fwd.intra_chunk(c, mmd), c)
        return chunked.local_grads(c, i, pull, s, d, e, cfg.scale, mmd)
    t("XLA chunk-local backward (local_grads)", local, ch, S0, doc, ds_end)

    def local_no_intra(c, i, s, d, e):
        _, pull = jax.vjp(lambda c, i, s: chunked.chunk_map(c, i, s, cfg.scale, mmd), c, i, s)
        return pull((d, e))[:2]
    t("  of which chunk_map vjp alone", local_no_intra, ch, it, S0, doc, ds_end)


if __name__ == "__main__":
    main()
