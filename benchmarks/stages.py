"""Where the time goes: each stage of the xla engine's chunk pipeline timed alone.

    python -m benchmarks.stages --B 8 --T 4096 --H 16 --n 2 [--dtype bfloat16]

Stages (each its own jitted function on the same inputs, medians after warm-up; the
whole op forward and forward + backward last, for the sum to be checked against):
grid (API tensors -> chunk tensors), block (the time-major relayout), factors+operands
(WY factors, readout operands, non-finite row masks), forward pass (the state recursion
with the readout and checkpoints), states (chunk states from the checkpoints), reverse
pass (dS at every chunk end), local grads (the written-out chunk-local backward), then
the whole op per backend. Prints one line per stage: ms, and XLA's compiled temporary bytes.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp


def _time(fn, *args, iters=10, reps=5):
    from benchmarks.measure import median_ms
    return median_ms(lambda: fn(*args), jax.block_until_ready, iters, reps)


def _temp_gb(fn, *args):
    try:
        m = fn.lower(*args).compile().memory_analysis()
        return m.temp_size_in_bytes / 1e9
    except Exception:                      # noqa: BLE001 - not every backend reports it
        return float("nan")


def stages(B, T, H, n, dtype, K=128, V=128, seed=0, backends=("xla",)):
    from gdp_jax import chunked, engine, gated_delta_product, recurrence
    from gdp_jax._checks import check_inputs

    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(ks[0], (B, T, H, K), dtype)
    k = jax.random.normal(ks[1], (B, T, n, H, K), dtype)
    v = jax.random.normal(ks[2], (B, T, n, H, V), dtype)
    g = -jax.nn.softplus(jax.random.normal(ks[3], (B, T, H), jnp.float32))
    beta = 2 * jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, n, H), jnp.float32))
    spec = check_inputs(q, k, v, g, beta, use_qk_l2norm=True,
                        recompute_chunk_num=0)
    scale = spec.scale

    def to_grid(q, k, v, g, beta):
        return engine.forward_problem(spec, q, k, v, g, beta, None)

    prob = jax.jit(to_grid)(q, k, v, g, beta)
    layout, ch = prob.layout, prob.ch
    h0 = engine.start_states(spec, None)
    NC = ch.k.shape[1]
    blk = recurrence.Blocking(B, NC, recurrence.block_len(NC))
    chb = jax.jit(blk.tree_block)(ch)
    f = recurrence.flags(blk, layout)

    def operands(chb):
        it, X = chunked.wy_factors(chb)
        return it, X, recurrence.forward_operands(chb, it, scale)[0]

    it, X, x = jax.jit(operands)(chb)
    docb = jax.random.normal(ks[0], chb.v.shape, chb.v.dtype)
    dfinal = jnp.zeros_like(h0)
    fwd_pass = lambda x: recurrence.forward(blk, x, f, h0, spec.N, 1, spec.checkpoint_dtype)
    states = jax.jit(fwd_pass)(x)[2]
    S0 = jax.jit(lambda x, s: recurrence.states_from_checkpoints(x, f, h0, s, 1))(x, states)
    rev = recurrence.Reverse(it.w, it.Kt, it.G_last, x.qg, x.P, docb)
    dS_end = jax.jit(lambda r: recurrence.reverse(blk, r, f, dfinal, spec.N)[0])(rev)

    def fwd(backend):
        return lambda *a: gated_delta_product(*a, backend=backend, use_qk_l2norm=True)

    def fwdbwd(backend):
        loss = lambda *a: fwd(backend)(*a)[0].astype(jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1, 2, 3, 4))

    rows = [
        ("grid", jax.jit(to_grid), (q, k, v, g, beta)),
        ("block", jax.jit(blk.tree_block), (ch,)),
        ("factors+operands", jax.jit(operands), (chb,)),
        ("forward pass", jax.jit(fwd_pass), (x,)),
        ("states", jax.jit(lambda x, s: recurrence.states_from_checkpoints(x, f, h0, s, 1)),
         (x, states)),
        ("reverse pass", jax.jit(lambda r: recurrence.reverse(blk, r, f, dfinal, spec.N)),
         (rev,)),
        ("local grads", jax.jit(lambda c, i, X, S, d: chunked.local_grads_direct(
            c, i, X, S, docb, d, scale)), (chb, it, X, S0, dS_end)),
    ]

    def local_autodiff(c, S, d):
        # the reference path: vjp of the intra-chunk factors + autodiff of the chunk map
        it_, pull = jax.vjp(chunked.intra_chunk, c)
        return chunked.local_grads(c, it_, pull, S, docb, d, scale)

    def local_direct(c, S, d):
        # what the engines run: the factors with X, then the written-out backward
        it_, X_ = chunked.wy_factors(c)
        return chunked.local_grads_direct(c, it_, X_, S, docb, d, scale)

    rows += [("factors+local (autodiff)", jax.jit(local_autodiff), (chb, S0, dS_end)),
             ("factors+local (direct)", jax.jit(local_direct), (chb, S0, dS_end))]
    if "cutedsl" in backends:
        from gdp_jax.kernels import pipeline
        # on the cutedsl engine's own [B, NC, HV, ..] grid (ch, not the blocked chb)
        docc = jax.random.normal(ks[1], ch.v.shape, ch.v.dtype)
        work = lambda c, d: pipeline.BackwardWork(c, d, scale, spec.ab_dtype).operands
        rows += [("cutedsl operands", jax.jit(lambda c: pipeline.masked_operands(spec, c)),
                  (ch,)),
                 ("cutedsl bwd work", jax.jit(work), (ch, docc))]
    for b in backends:
        rows += [(f"{b} fwd", jax.jit(fwd(b)), (q, k, v, g, beta)),
                 (f"{b} fwd+bwd", jax.jit(fwdbwd(b)), (q, k, v, g, beta))]
    out = []
    for name, fn, args in rows:
        ms = _time(fn, *args)
        gb = _temp_gb(fn, *args)
        out.append((name, ms, gb))
        print(f"{name:26s} {ms:9.3f} ms   temp {gb:7.3f} GB", flush=True)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--B", type=int, default=8)
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--n", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--backends", default="xla", help="comma list: whole-op rows")
    a = p.parse_args(argv)
    print(f"stages of the xla engine at B={a.B} T={a.T} H={a.H} n={a.n} {a.dtype} "
          f"on {jax.devices()[0].device_kind}", flush=True)
    stages(a.B, a.T, a.H, a.n, jnp.dtype(a.dtype), backends=a.backends.split(","))


if __name__ == "__main__":
    main()
