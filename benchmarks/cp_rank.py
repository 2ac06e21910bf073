"""One CP rank's work on ONE device: the four protocol functions against the op on T / P.

    python -m benchmarks.cp_rank --backend xla --B 1 --T 131072 --H 16 --n 2 --P 2

Rank r = P - 1 of a P-rank run holds tokens [(P - 1) T / P, T) of every row. Its
preceding summaries come from a real fold: every other rank's ``cp_forward_prepare`` on
its own shard (and, for the backward, every rank's ``cp_backward_prepare`` after its
``cp_forward_apply``), computed once before timing. Timed, each jitted alone, medians after
warm-up:

    rank fwd       prepare + apply (forward, as a call nothing differentiates runs them:
                   ``for_inference()``), the summary returned (not dead code)
    rank fwd+bwd   the same, then backward prepare + apply (its summary returned)
    op fwd         gated_delta_product on the rank's T / P tokens
    op fwd+bwd     its value and vjp with the same output cotangent

and the per-rank overhead ratio rank / op (issue 21's bar: <= 1.1, at most 1.3). The
rank's outputs are first checked against the one-device op on the whole sequence (its
token slice; relative RMS). Batched rows only (no packing), gates and l2norm on.
"""
from __future__ import annotations

import argparse
import json


def _time(fn, args, iters=10, reps=5):
    import jax
    from benchmarks.measure import median_ms
    return median_ms(lambda: fn(*args), jax.block_until_ready, iters, reps)


def _rel_rms(a, b):
    import numpy as np
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / max(np.sqrt(np.mean(b ** 2)), 1e-30))


def inputs(B, T, H, n, K, V, dtype, seed=0):
    import jax
    import jax.numpy as jnp
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    q = jax.random.normal(ks[0], (B, T, H, K), dtype)
    k = jax.random.normal(ks[1], (B, T, n, H, K), dtype)
    v = jax.random.normal(ks[2], (B, T, n, H, V), dtype)
    g = -jax.nn.softplus(jax.random.normal(ks[3], (B, T, H), jnp.float32))
    beta = 2 * jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, n, H), jnp.float32))
    do = jax.random.normal(ks[5], (B, T, H, V), dtype)
    return (q, k, v, g, beta), do


def rank_functions(backend: str, x, do, P: int, recompute_chunk_num: int = 0):
    """(rank_fwd, rank_fwdbwd, args, fixed) for rank P - 1: jittable functions of the
    rank's shard (q, k, v, g, beta), and the real fold's summaries they close over."""
    import jax
    import jax.numpy as jnp
    from gdp_jax import _checks
    from gdp_jax.cp import driver
    from gdp_jax.cp.protocol import GDPInputs, SummarySlice

    q = x[0]
    B, T = q.shape[:2]
    Tl = T // P
    shard = lambda a, r: a[:, r * Tl:(r + 1) * Tl]
    spec = _checks.check_inputs(*(shard(a, 0) for a in x), cp_size=P, use_qk_l2norm=True,
                                backend=backend, recompute_chunk_num=recompute_chunk_num)
    be = driver.backend_for(spec, backend)
    h0 = jnp.zeros((spec.N, spec.HV, spec.K, spec.V), spec.cdt)

    def gdp_inputs(xs, r):
        m = driver.rank_metadata(None, r, P, Tl, B)
        return GDPInputs(*xs, h0, None, m.first_seq, m.last_seq, m.continues_in,
                         m.continues_out)

    def meta(r):
        return driver.rank_metadata(None, r, P, Tl, B)

    # the real fold: every rank's forward summary, then forward apply and backward summary
    fwd_sum = [jax.jit(lambda *xs, r=r: be.cp_forward_prepare(gdp_inputs(xs, r))[0])(
        *(shard(a, r) for a in x)) for r in range(P)]
    fwd_sum = jnp.stack(fwd_sum)
    bwd_sum = []
    for r in range(P):
        def one(*xs, r=r):
            summary, ctx = be.cp_forward_prepare(gdp_inputs(xs, r))
            _, _, saved = be.cp_forward_apply(ctx, SummarySlice(fwd_sum, meta(r).fwd_mask))
            dfinal = jnp.zeros_like(h0)
            return be.cp_backward_prepare((shard(do, r), dfinal), saved)[0]
        bwd_sum.append(jax.jit(one)(*(shard(a, r) for a in x)))
    bwd_sum = jnp.stack(bwd_sum)

    r = P - 1
    preceding = SummarySlice(fwd_sum, meta(r).fwd_mask)
    following = SummarySlice(bwd_sum, meta(r).bwd_mask)
    do_r = shard(do, r)

    def rank_fwd(*xs):               # the forward as the driver's primal runs it
        bi = be.for_inference()
        summary, ctx = bi.cp_forward_prepare(gdp_inputs(xs, r))
        o, final, _ = bi.cp_forward_apply(ctx, preceding)
        return o, final, summary

    def rank_fwdbwd(*xs):            # the forward as the driver's custom_vjp fwd runs it
        bd = be.for_differentiation()
        summary, ctx = bd.cp_forward_prepare(gdp_inputs(xs, r))
        o, final, saved = bd.cp_forward_apply(ctx, preceding)
        bsum, bctx = be.cp_backward_prepare((do_r, jnp.zeros_like(final)), saved)
        grads = be.cp_backward_apply(bctx, following)
        return o, summary, bsum, grads[:5]

    return rank_fwd, rank_fwdbwd, tuple(shard(a, r) for a in x), do_r


def measure(backend, B, T, H, n, P, K=128, V=128, dtype="bfloat16", iters=10, reps=5,
            recompute_chunk_num=0):
    import jax
    import jax.numpy as jnp
    from gdp_jax import gated_delta_product

    dt = jnp.dtype(dtype)
    x, do = inputs(B, T, H, n, K, V, dt)
    rank_fwd, rank_fwdbwd, xr, do_r = rank_functions(backend, x, do, P, recompute_chunk_num)
    op = lambda *a: gated_delta_product(*a, backend=backend, use_qk_l2norm=True,
                                        recompute_chunk_num=recompute_chunk_num)

    def op_fwdbwd(*a):
        o, pull = jax.vjp(op, *a)
        return o, pull(do_r)

    # check: the rank's output = the one-device op on the whole sequence, its tokens
    o_rank = jax.jit(rank_fwd)(*xr)[0]
    Tl = T // P
    o_full = jax.jit(lambda *a: gated_delta_product(*a, backend="xla",
                                                    use_qk_l2norm=True))(*x)
    row = {"backend": backend, "B": B, "T": T, "H": H, "n": n, "P": P, "K": K, "V": V,
           "dtype": dtype, "recompute_chunk_num": recompute_chunk_num,
           "check_o": _rel_rms(o_rank, o_full[:, (P - 1) * Tl:])}
    timed = {"rank fwd": (rank_fwd, xr), "rank fwd+bwd": (rank_fwdbwd, xr),
             "op fwd": (op, xr), "op fwd+bwd": (op_fwdbwd, xr)}
    for name, (fn, args) in timed.items():
        row[name] = _time(jax.jit(fn), args, iters, reps)
    row["overhead fwd"] = row["rank fwd"] / row["op fwd"]
    row["overhead fwd+bwd"] = row["rank fwd+bwd"] / row["op fwd+bwd"]
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="xla", choices=("xla", "cutedsl"))
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--T", type=int, default=131072)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--n", type=int, default=2)
    p.add_argument("--K", type=int, default=128)
    p.add_argument("--V", type=int, default=128)
    p.add_argument("--P", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--recompute-chunk-num", type=int, default=0)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default=None, help="also write the row to this file")
    a = p.parse_args(argv)
    if a.P < 2 or a.T % a.P:
        p.error(f"--P {a.P} must be >= 2 and divide --T {a.T}")
    row = measure(a.backend, a.B, a.T, a.H, a.n, a.P, a.K, a.V, a.dtype, a.iters, a.reps,
                  a.recompute_chunk_num)
    print(json.dumps(row))
    print(f"{a.backend} rank {a.P - 1} of {a.P} on T = {a.T}: fwd {row['rank fwd']:.3f} ms "
          f"vs op on T/P {row['op fwd']:.3f} ms ({row['overhead fwd']:.2f}x); fwd+bwd "
          f"{row['rank fwd+bwd']:.3f} vs {row['op fwd+bwd']:.3f} ms "
          f"({row['overhead fwd+bwd']:.2f}x); check o {row['check_o']:.1e}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
