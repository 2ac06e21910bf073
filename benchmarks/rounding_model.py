"""Rounding model of the forward walk's 16-bit operands, on the CPU (no GPU, no kernel).

Question it answers: which 16-bit roundings can a forward walk afford and stay below FLA's
error? It replays the chunk walk in float32 with the roundings a kernel does written out
(``r16``: round to bfloat16, products of rounded operands accumulated in float32, as
mma.sync does) and reports the relative RMS error of o and the final state against the
float64 token recurrence on the same (bf16-rounded, L2-normalised) inputs:

- ``today``: the chain's walk (``chunk_fwd_sm90``, split off): w, Kt, qg, P in 16 bits, u
  float32, S and Delta rounded to 16 bits as MMA operands.
- ``xwalk``: the walk that never sees w, u (docs/KERNELS.md, "the walk forms w S and u
  itself"): Delta = X diag(beta) (v - gam * (k S)) with X diag(beta) as 16-bit hi + lo,
  v - gam k S rounded to 16 bits once; Kt^T Delta as k^T (exp(G_last - G) * Delta) and
  qg S as scale gam * (q S).
- ``xwalk-split``: the same with v - gam k S as hi + lo (one more product).
- ``today-u16``: today's with u in 16 bits (half of u's bytes).
- ``fla-like``: a model of FLA's chain: the WY inverse rounded to 16 bits once (FLA
  keeps it in the input dtype), w = X16 (beta gam k)16 and u = X16 (beta v)16 from 16-bit
  operands, both stored in 16 bits; the walk as today's.

o is rounded to 16 bits as the kernels write it; the final state stays float32.

    python -m benchmarks.rounding_model                 # B=2 T=1024 H=4 n=2 K=V=128
    python -m benchmarks.rounding_model --n 1 --T 2048

The GPU's own numbers (kernels and FLA on the same inputs) are the bar
(``../shared/device/precision_vs_fla.py``, tests/test_cutedsl_gpu.py); this model only
ranks the roundings before a kernel is written.
"""
from __future__ import annotations

import argparse

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402

from gdp_jax import chunked, engine, grid  # noqa: E402
from gdp_jax._checks import check_inputs  # noqa: E402
from gdp_jax.reference import gated_delta_product_reference  # noqa: E402
from gdp_jax.testing import make_inputs, rel_rms  # noqa: E402

F32 = jnp.float32


def r16(x):
    """Round to bfloat16, back in float32 (a 16-bit MMA operand)."""
    return x.astype(jnp.bfloat16).astype(F32)


def mm(a, b):
    """A float32-accumulated product of (already rounded) operands."""
    return jnp.matmul(a.astype(F32), b.astype(F32), precision=jax.lax.Precision.HIGHEST)


def _t(x):
    return jnp.swapaxes(x, -1, -2)


def walk(scheme: str, ch, it, X, scale, h0):
    """o rows [B, NC, HV, C, V] and the final state [B, HV, K, V] of one row per batch
    entry (no packing: the state starts from h0 at chunk 0)."""
    B, NC = ch.k.shape[:2]
    G = chunked.prefix_sum(ch.g, axis=-1)
    gam = jnp.exp(G).astype(F32)                                              # exp(G_i)
    end = jnp.exp(G[..., -1:] - G).astype(F32)                                # exp(G_last - G_i)
    decay = jnp.exp(it.G_last).astype(F32)
    P = r16(scale * chunked.causal_scores(ch.q, ch.k, it.Gam))
    k16, q16, v32 = r16(ch.k), r16(ch.q), ch.v.astype(F32)
    w16, Kt16, u32 = r16(it.w), r16(it.Kt), it.u.astype(F32)
    qg16 = r16(scale * it.gam[..., None] * ch.q)
    if scheme == "today-u16":
        u32 = r16(it.u)
    if scheme == "fla-like":
        X16 = r16(X)
        bk = r16(ch.beta[..., None] * it.gam[..., None] * ch.k)
        bv = r16(ch.beta[..., None] * ch.v)
        w16, u32 = r16(mm(X16, bk)), r16(mm(X16, bv))
    Xb = X * ch.beta[..., None, :]                                            # X diag(beta)
    Xh = r16(Xb)
    Xl = r16(Xb - Xh.astype(Xb.dtype))
    S = h0.astype(F32)
    outs = []
    for c in range(NC):
        S16 = r16(S)
        if scheme in ("today", "today-u16", "fla-like"):
            D16 = r16(u32[:, c] - mm(w16[:, c], S16))
            o = mm(qg16[:, c], S16) + mm(P[:, c], D16)
            S = decay[:, c, :, None, None] * S + mm(_t(Kt16[:, c]), D16)
        else:
            R = v32[:, c] - gam[:, c, ..., None] * mm(k16[:, c], S16)
            Rh = r16(R)
            D = mm(Xh[:, c], Rh) + mm(Xl[:, c], Rh)
            if scheme == "xwalk-split":
                D = D + mm(Xh[:, c], r16(R - Rh))
            D16 = r16(D)
            o = scale * gam[:, c, ..., None] * mm(q16[:, c], S16) + mm(P[:, c], D16)
            S = (decay[:, c, :, None, None] * S
                 + mm(_t(k16[:, c]), r16(end[:, c, ..., None] * D)))
        outs.append(r16(o))                       # o is written in 16 bits
    return jnp.stack(outs, axis=1), S


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--B", type=int, default=2)
    p.add_argument("--T", type=int, default=1024)
    p.add_argument("--H", type=int, default=4)
    p.add_argument("--n", type=int, default=2)
    p.add_argument("--K", type=int, default=128)
    p.add_argument("--V", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gate", default="normal", help="make_inputs' gate: normal, strong, none")
    a = p.parse_args(argv)
    f64 = jnp.float64
    inp = make_inputs(a.seed, a.B, a.T, a.n, a.H, a.H, a.K, a.V, f64, gate=a.gate,
                      beta_range=(0.05, 1.95), N=a.B)
    up = lambda x: None if x is None else x.astype(jnp.bfloat16).astype(f64)
    q, k, v = up(inp.q), up(inp.k), up(inp.v)
    g, beta, h0 = inp.g, inp.beta, inp.initial_state
    o_ref, s_ref = gated_delta_product_reference(q, k, v, g, beta, initial_state=h0,
                                                 output_final_state=True, use_qk_l2norm=True)
    spec = check_inputs(q, k, v, g, beta, initial_state=h0, use_qk_l2norm=True)
    prob = engine.forward_problem(spec, q, k, v, g, beta, None)
    ch = prob.ch
    ch = ch._replace(q=up(ch.q), k=up(ch.k))        # the kernels' 16-bit normalised q, k
    it, X = chunked.wy_factors(ch)
    print(f"B={a.B} T={a.T} H={a.H} n={a.n} K={a.K} V={a.V} gate={a.gate} seed={a.seed}: "
          "relative RMS error vs the float64 recurrence (bf16 inputs)")
    for scheme in ("today", "today-u16", "fla-like", "xwalk", "xwalk-split"):
        oc, S = walk(scheme, ch, it, X, spec.scale, h0)
        o = grid.from_chunks(prob.layout, oc)
        print(f"  {scheme:12s} o {rel_rms(o, o_ref):.2e}   final {rel_rms(S, s_ref):.2e}",
              flush=True)


if __name__ == "__main__":
    main()
