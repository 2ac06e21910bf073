"""Where the cutedsl forward's kernels spend their time: each kernel alone at a shape.

    python -m benchmarks.prep_probe [--shape B,T,H,n] [--bv 32,64] [--iters 20]

On random chunk inputs of the benchmark shape (one sequence per row; q, k of unit rows,
gates in (-0.2, 0), beta in (0.05, 1.95)):

- the operands kernel (``ChunkPrepKernel``, forward and with X), timed alone (ms), and its
  probe variant: the SM clock cycles of each phase of every CTA
  (``chunk_prep_sm90.PROBE_PHASES``), printed as mean / median / max over the CTAs, with
  the CTAs' mean latency against the kernel's time (how many CTAs an SM overlaps);
- the forward recursion (``ChunkForwardKernel``) alone on those operands, for each value
  tile in ``--bv`` with and without the hi + lo split and as warpgroup MMAs, and the
  reverse recursion (``StateGradKernel``) likewise, also forming ddo = P^T dO itself
  (``fuse_ddo``);
- with ``--tokens``: the operands kernel reading q, k, v from token-major tensors
  (``ChunkPrepKernel.raw_call_tokens``, what the plain forward runs on 16-bit inputs), with
  and without its in-kernel L2 norm, on the read-out rows (n >= 2: the op's forward, and
  with X its backward's pass), and its probe;
- with ``--local-grad``: the backward's chunk-local gradient kernel (``LocalGradKernel``)
  alone on those factors and random dO, S0, dS_end, with chunk-major float32 results and
  with token-major 16-bit ones (``raw_call_tokens``), and its probe
  (``chunk_grad_sm90.PROBE_PHASES``) the same way; then the variants the op's backward
  runs: q, k, v chunk-major or token-major, the L2 norm's backward on given row norms or
  the norm itself inside (the default since s33).

Needs a GPU with the CuTe DSL; prints one line per measurement and ``--json`` writes them.
"""
from __future__ import annotations

import argparse
import json

import numpy as np


def chunk_inputs(B: int, NC: int, HV: int, K: int, V: int, seed: int = 0):
    """Random float32 chunk inputs [B, NC, HV, C, .] (:class:`gdp_jax.grid.ChunkInputs`)."""
    import jax.numpy as jnp
    from gdp_jax import grid
    rng = np.random.default_rng(seed)
    C = grid.CHUNK
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    q = unit(rng.standard_normal((B, NC, HV, C, K), np.float32))
    k = unit(rng.standard_normal((B, NC, HV, C, K), np.float32))
    v = rng.standard_normal((B, NC, HV, C, V), np.float32)
    g = rng.uniform(-0.2, 0.0, (B, NC, HV, C)).astype(np.float32)
    beta = rng.uniform(0.05, 1.95, (B, NC, HV, C)).astype(np.float32)
    return grid.ChunkInputs(*(jnp.asarray(x) for x in (q, k, v, g, beta)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="8,4096,16,2")
    p.add_argument("--bv", default="32,64")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("--local-grad", action="store_true")
    p.add_argument("--skip-prep-probe", action="store_true")
    p.add_argument("--tokens", action="store_true")
    p.add_argument("--warps-n", default="2",
                   help="local-gradient kernel: warps along N to time (comma list)")
    p.add_argument("--lg-variants", default="",
                   help="local-gradient kernel: more chunk-major variants to time and probe "
                        "(';' list of ablate strings whose results are right, e.g. roundtrip; "
                        "'gmma' / 'gmmao' / 'gmmaa' in one: warpgroup MMAs, overlapped, "
                        "all phases)")
    p.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                   help="set a gdp_jax module switch first (as benchmarks.run's --set), "
                        "e.g. kernels.chunk_prep.U16=True")
    a = p.parse_args(argv)
    from benchmarks.run import apply_settings
    apply_settings(a.set)

    import jax
    import jax.numpy as jnp
    from benchmarks.measure import log, median_ms
    from gdp_jax import grid
    from gdp_jax.kernels.chunk_forward import ChunkForwardKernel
    from gdp_jax.kernels.chunk_prep import ChunkPrepKernel
    from gdp_jax.kernels.chunk_prep_sm90 import PROBE_PHASES
    from gdp_jax.kernels.state_grad import StateGradKernel

    B, T, H, n = (int(x) for x in a.shape.split(","))
    K = V = 128
    NC = -(-T * n // grid.CHUNK)
    ch = chunk_inputs(B, NC, H, K, V)
    sync = jax.block_until_ready
    out = {"shape": a.shape, "chunks": [B, NC, H], "set": a.set}

    def timed(name, fn, *args):
        f = jax.jit(fn)
        ms = median_ms(lambda: f(*args), sync, a.iters, a.reps)
        out[name] = ms
        log(f"{name}: {ms:.3f} ms")
        return f(*args)

    scale = jnp.full((B,), K ** -0.5, jnp.float32)
    args = (ch.q, ch.k, ch.v, ch.g, ch.beta, scale)
    ops = timed("prep", lambda *x: ChunkPrepKernel.raw_call(*x, ab_dtype="bfloat16"), *args)
    timed("prep+X", lambda *x: ChunkPrepKernel.raw_call(*x, ab_dtype="bfloat16",
                                                        inverse=True), *args)
    def report(name, slots, names):
        cyc = np.asarray(slots)[..., :len(names)].reshape(-1, len(names))
        cyc = cyc.astype(np.int64) % (1 << 32)          # clock() wraps at 32 bits
        total = cyc.sum(1)
        phases = {ph: [float(cyc[:, i].mean()), float(np.median(cyc[:, i])),
                       float(cyc[:, i].max())] for i, ph in enumerate(names)}
        out[name + " cycles"] = phases
        for ph, (mean, med, mx) in phases.items():
            log(f"  {name} {ph:>18}: mean {mean:8.0f}  median {med:8.0f}  max {mx:8.0f} "
                f"cycles ({100 * mean / total.mean():4.1f}%)")
        log(f"  {name} CTA latency mean {total.mean():.0f} cycles; "
            f"{cyc.shape[0]} CTAs")

    for inverse in (() if a.skip_prep_probe else (False, True)):
        name = "probe" + ("+X" if inverse else "")
        res = timed(name, lambda *x, i=inverse: ChunkPrepKernel.raw_call(
            *x, ab_dtype="bfloat16", inverse=i, probe=True), *args)
        report(name, res[6], PROBE_PHASES)

    if a.tokens:
        from gdp_jax.kernels.chunk_prep import token_rows
        rng = np.random.default_rng(1)
        unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
        bf = lambda x: jnp.asarray(x, jnp.bfloat16)
        tq = bf(unit(rng.standard_normal((B, T, H, K), np.float32)))
        tk = bf(unit(rng.standard_normal((B, T * n, H, K), np.float32)))
        tv = bf(rng.standard_normal((B, T * n, H, V), np.float32))
        rows = token_rows(grid.make_layout(B, T, n, None), n, T)
        targs = (tq, tk, tv, ch.g, ch.beta, scale, rows)
        for l2 in (False, True):
            timed(f"prep tokens l2norm={int(l2)}", lambda *x, l2=l2:
                  ChunkPrepKernel.raw_call_tokens(*x, ab_dtype="bfloat16", l2norm=l2),
                  *targs)
        if n >= 2:
            # what the op runs at n >= 2: qg, P on the read-out rows (the plain forward;
            # with X, the backward's operands pass)
            for inv in (False, True):
                timed(f"prep tokens l2norm=1 readout rows{' +X' if inv else ''}",
                      lambda *x, inv=inv: ChunkPrepKernel.raw_call_tokens(
                          *x, ab_dtype="bfloat16", l2norm=True, inverse=inv,
                          readout_rows=True), *targs)
        if not a.skip_prep_probe:
            res = timed("probe tokens l2norm=1", lambda *x: ChunkPrepKernel.raw_call_tokens(
                *x, ab_dtype="bfloat16", l2norm=True, probe=True), *targs)
            report("probe tokens l2norm=1", res[6], PROBE_PHASES)
            if n >= 2:
                # the op's forward variant (read-out rows, the defaults' norm and MMAs)
                res = timed("probe tokens l2norm=1 readout rows", lambda *x:
                            ChunkPrepKernel.raw_call_tokens(*x, ab_dtype="bfloat16",
                                                            l2norm=True, probe=True,
                                                            readout_rows=True), *targs)
                report("probe tokens l2norm=1 readout rows", res[6], PROBE_PHASES)

    if a.local_grad:
        from gdp_jax.kernels.chunk_grad_sm90 import PROBE_PHASES as LG_PHASES
        from gdp_jax.kernels.local_grad import LocalGradKernel
        from benchmarks.local_grad import variant_kwargs
        *_, bad, X = jax.jit(lambda *x: ChunkPrepKernel.raw_call(
            *x, ab_dtype="bfloat16", inverse=True))(*args)
        w_, u_ = ops[0], ops[4]
        rnd = lambda i, shape: (0.1 * jax.random.normal(jax.random.key(i), shape)).astype(
            jnp.bfloat16)
        doc = rnd(2, (B, NC, H, grid.CHUNK, V))
        S0, ds_end = rnd(3, (B, NC, H, K, V)), rnd(4, (B, NC, H, K, V))
        lg = (ch.q, ch.k, w_, doc, ch.v, ch.g, ch.beta, scale, X, u_, S0, ds_end)
        from gdp_jax.kernels.chunk_prep import token_rows
        lrows = token_rows(grid.make_layout(B, T, n, None), n, T)
        lg_results = {}
        for wn in (int(x) for x in a.warps_n.split(",") if x):
            tag = f"wn={wn}"
            timed(f"local grad {tag}", lambda *x, wn=wn: LocalGradKernel.raw_call(
                *x, ab_dtype="bfloat16", warps_n=wn), *lg)
            res = timed(f"local grad probe {tag}", lambda *x, wn=wn: LocalGradKernel.raw_call(
                *x, ab_dtype="bfloat16", ablate="probe", warps_n=wn), *lg)
            report(f"local grad probe {tag}", res[4], LG_PHASES)
            # the single-device backward's variant: dq, dk, dv token-major in 16 bits
            for split in (True, False):
                res = timed(f"local grad tokens {tag} split={int(split)}",
                            lambda *x, wn=wn, sp=split: LocalGradKernel.raw_call_tokens(
                                *x, n=n, T=T, ab_dtype="bfloat16", split=sp, warps_n=wn),
                            *lg, lrows)
                # the same results whatever the warp count (dq, dk, dv bitwise; dg, dbeta
                # sum the warps' row sums in another order)
                first = lg_results.setdefault(split, res)
                diff = [float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)))
                             / (float(jnp.max(jnp.abs(y.astype(jnp.float32)))) + 1e-30))
                        for x, y in zip(res, first)]
                out[f"local grad tokens {tag} split={int(split)} rel diff"] = diff
                log("  vs the first warp count: max |diff| / max |x| of dq, dk, dv, dg, "
                    "dbeta: " + " ".join(f"{d:.1e}" for d in diff))

        # what the op's backward runs (2 warps along N): reading q, k, v chunk-major or
        # token-major (TOKEN_BACKWARD), the norm's backward on XLA's rho (FUSED_NORM_BWD)
        # or with the norm itself inside (NORM_IN_KERNELS, the default since s33). Token
        # inputs are random (a kernel's time does not depend on their values)
        tq, tk, tv = (rnd(10 + i, (B, T * m, H, d)) for i, (m, d) in
                      enumerate(((1, K), (n, K), (n, V))))
        rho = (jnp.ones((B, T, H), jnp.float32), jnp.ones((B, n * T, H), jnp.float32))
        tok_lg = (tq, tk) + lg[2:4] + (tv,) + lg[5:]
        for tag, args_, kw in (("chunk tiles, norm bwd (rho)", lg, dict(rho=rho)),
                               ("tokens in, norm bwd (rho)", tok_lg,
                                dict(tokens_in=True, rho=rho)),
                               ("tokens in, norm inside (l2norm)", tok_lg,
                                dict(tokens_in=True, l2norm=True))):
            timed(f"local grad {tag}", lambda *x, kw=kw: LocalGradKernel.raw_call_tokens(
                *x, n=n, T=T, ab_dtype="bfloat16", **kw), *args_, lrows)

        for v in (x for x in a.lg_variants.split(";") if x):
            # "gmma" / "gmmao" / "gmmaa" in a variant: the kernel's products as warpgroup
            # MMAs (benchmarks.local_grad's names); the rest ablate
            kw = variant_kwargs(v)
            gm, abl = kw["gmma"], kw["ablate"]
            timed(f"local grad [{v}]", lambda *x, abl=abl, gm=gm: LocalGradKernel.raw_call(
                *x, ab_dtype="bfloat16", ablate=abl, gmma=gm), *lg)
            res = timed(f"local grad probe [{v}]",
                        lambda *x, abl=abl, gm=gm: LocalGradKernel.raw_call(
                            *x, ab_dtype="bfloat16", ablate=",".join(("probe", abl)).strip(","),
                            gmma=gm), *lg)
            report(f"local grad probe [{v}]", res[4], LG_PHASES)

    w, kt, qg, pm, u, decay = ops[:6]
    flags = (jnp.zeros((B, NC), jnp.int32).at[:, 0].set(1),
             jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, NC)),
             jnp.zeros((B, NC), jnp.int32).at[:, -1].set(1))
    h0 = jnp.zeros((B, H, K, V), jnp.float32)
    do = (jax.random.normal(jax.random.key(1), (B, NC, H, grid.CHUNK, V))
          .astype(jnp.bfloat16))
    for bv in (int(x) for x in a.bv.split(",") if x):
        # (split, gmma): the walks' products as warp MMAs with / without the hi + lo
        # split, and as warpgroup MMAs (no split)
        for split, gm in ((True, False), (False, False), (False, True)):
            tag = f"BV={bv} split={int(split)}" + (" wgmma" if gm else "")
            timed(f"fwd {tag}", lambda *x, bv=bv, sp=split, gm=gm: ChunkForwardKernel.raw_call(
                *x, BV=bv, split=sp, gmma=gm), w, kt, qg, pm, u, decay, *flags, h0)
            timed(f"rev {tag}", lambda *x, bv=bv, sp=split, gm=gm: StateGradKernel.raw_call(
                *x, BV=bv, split=sp, gmma=gm), kt, w, qg, u, do, decay, *flags, h0)
            # ddo = P^T dO in the kernel (pipeline.FUSED_DDO): P in ddo's place
            timed(f"rev fused-ddo {tag}", lambda *x, bv=bv, sp=split, gm=gm:
                  StateGradKernel.raw_call(*x, BV=bv, split=sp, fuse_ddo=True, gmma=gm),
                  kt, w, qg, pm, do, decay, *flags, h0)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
