"""Pure-JAX stand-ins with the exact contracts of the CuTe DSL kernels (for CPU tests).

``chunk_kernel_call``, ``dh_kernel_call``, ``inverse_kernel_call``, ``chunk_prep_call``,
``local_grad_call`` and ``step_kernel_call`` take and return what the ``raw_call`` of
``ChunkForwardKernel``, ``StateGradKernel``, ``WYInverseKernel``, ``ChunkPrepKernel``,
``LocalGradKernel`` and ``StepKernel`` do, computed
with ``lax.scan`` (or XLA's chunked math) in the operands' precision (no 16-bit rounding
inside, no hi/lo split). Rows the kernels leave
unwritten are NaN here, so a test fails if the glue ever reads them.
:func:`gdp_jax.testing.emulated_kernels` swaps them in to run the whole ``cutedsl``
pipeline - checkpoints, recompute, CP wiring - on a machine without a GPU.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from gdp_jax import _vma, chunked
from gdp_jax.engine import zero_columns
from gdp_jax.grid import READOUT_ROWS, ChunkInputs
from gdp_jax.kernels.chunk_prep import as_read, u_dtype


def _scatter_rows(n_rows, rows, values, keep):
    """[n_rows, ...] NaN array with values[i] written at rows[i] where keep[i]."""
    out = jnp.full((n_rows,) + values.shape[1:], jnp.nan, values.dtype)
    idx = jnp.where(keep, rows, n_rows)                      # out of range: dropped
    return out.at[idx].set(values, mode="drop")


def _scan_chunks(step, state_shape, dtype, xs, reverse=False):
    """``lax.scan`` of ``step`` over the chunk axis (1) of every [B, NC, ...] operand in
    ``xs``, from a zero [B, HV, K, V] state; the per-chunk outputs come back [B, NC, ...]."""
    xs = tuple(jnp.moveaxis(x, 1, 0) for x in xs)
    init = _vma.like(jnp.zeros(state_shape, dtype), xs)
    _, ys = lax.scan(step, init, xs, reverse=reverse)
    return tuple(jnp.moveaxis(y, 0, 1) for y in ys)


def chunk_kernel_call(w, kt, qg, p, u, decay, reset, seq, last, h0, *, BV, split=None, ckpt=0,
                      states_dtype=None, readout=True, stages=1, pairs=1,
                      gmma=None, o_tokens=None):
    del BV, split, stages, pairs, gmma
    B, NC, HV, C, K = w.shape
    acc = decay.dtype                                  # u may be 16-bit (chunk_prep.U16)
    u = zero_columns(u, h0.shape[-1] - u.shape[-1])    # u = 0 in the state columns past u's
    f = lambda x: x.astype(acc)

    def step(S, xs):
        w, kt, qg, p, u, decay, reset, seq = xs
        S = jnp.where(reset[:, None, None, None] != 0, h0[seq].astype(acc), S)
        delta = u - f(w) @ S
        o = f(qg) @ S + f(p) @ delta
        S_end = decay[..., None, None] * S + jnp.swapaxes(f(kt), -1, -2) @ delta
        return S_end, (o, S, S_end)

    o, S0, S_end = _scan_chunks(step, (B, HV, K, u.shape[-1]), acc,
                                (w, kt, qg, p, u, decay, reset, seq))
    N = h0.shape[0]
    final = _scatter_rows(N, seq.reshape(-1), S_end.reshape((B * NC,) + S_end.shape[2:]),
                          last.reshape(-1) != 0)
    states = S0[:, ::ckpt].astype(states_dtype or acc) if ckpt else jnp.zeros((1,), acc)
    o = o.astype(w.dtype) if readout else jnp.full((1,), jnp.nan, w.dtype)
    if o_tokens is not None:
        o = _o_to_tokens(o, *o_tokens)
    return o, final, states


def _o_to_tokens(o, rows, bad, T):
    """The walk's ``o_tokens`` contract: o rows [B, NC, HV, R, V] -> [B, T, HV, V], tile
    row r of chunk c at token tok + r where its chunk row i (n r + n - 1 for R < C, else
    r) is < count, NaN where bad[i]; tokens no chunk writes stay NaN (as the kernel leaves
    them unwritten)."""
    B, NC, HV, R, V = o.shape
    C = bad.shape[-1]
    base, count, tok, n = (rows[..., j, None] for j in range(4))        # [B, NC, 1]
    r = jnp.arange(R, dtype=jnp.int32)
    i = n * r + n - 1 if R < C else jnp.broadcast_to(r, (B, NC, R))
    ok = i < count                                                       # [B, NC, R]
    isbad = jnp.take_along_axis(bad, jnp.minimum(i, C - 1)[:, :, None, :], axis=-1) != 0
    o = jnp.where(isbad[..., None], jnp.asarray(jnp.nan, o.dtype), o)
    idx = jnp.where(ok, tok + r, T)                                      # T: dropped
    out = jnp.full((B, T, HV, V), jnp.nan, o.dtype)
    bidx = jnp.broadcast_to(jnp.arange(B)[:, None, None], idx.shape)
    vals = jnp.moveaxis(o, 2, 3)                                         # [B, NC, R, HV, V]
    return out.at[bidx, idx].set(vals, mode="drop")


def dh_kernel_call(kt, w, qg, ddo, do, decay, reset, seq, last, dfinal, *, BV, split=None,
                   ds_dtype=None, fuse_ddo=False, write_ds=True, stages=1, pairs=1,
                   gmma=None):
    """The reverse kernel's contract (``StateGradKernel.raw_call``): dS_end in
    ``ds_dtype`` (rounded once, as stored; the walk carries the accumulator dtype; a NaN
    [1] placeholder with ``write_ds=False``); with
    ``fuse_ddo`` ``ddo`` is the readout matrix P and ddo = P^T dO (in the accumulator
    dtype: P and dO are exact 16-bit values)."""
    del BV, split, stages, pairs, gmma
    B, NC, HV, C, K = kt.shape
    acc = dfinal.dtype
    f = lambda x: x.astype(acc)
    extra = dfinal.shape[-1] - do.shape[-1]    # dO, ddo = 0 in the state columns past theirs
    do = zero_columns(do, extra)
    ddo = ddo if fuse_ddo else zero_columns(ddo, extra)
    if fuse_ddo:
        ddo = jnp.swapaxes(f(ddo), -1, -2) @ f(do)
    ddo = f(ddo)

    def step(dS, xs):
        kt, w, qg, ddo, do, decay, seq, last, reset = xs
        dS = dS + jnp.where(last[:, None, None, None] != 0, dfinal[seq].astype(acc), 0.0)
        ddelta = ddo + f(kt) @ dS
        dS_start = (decay[..., None, None] * dS + jnp.swapaxes(f(qg), -1, -2) @ f(do)
                    - jnp.swapaxes(f(w), -1, -2) @ ddelta)
        carry = jnp.where(reset[:, None, None, None] != 0, 0.0, dS_start)
        return carry, (dS, dS_start)

    ds_end, ds_start = _scan_chunks(step, (B, HV, K, do.shape[-1]), acc,
                                    (kt, w, qg, ddo, do, decay, seq, last, reset), reverse=True)
    dh0 = _scatter_rows(dfinal.shape[0], seq.reshape(-1),
                        ds_start.reshape((B * NC,) + ds_start.shape[2:]),
                        reset.reshape(-1) != 0)
    if not write_ds:
        return jnp.full((1,), jnp.nan, ds_dtype or acc), dh0
    return ds_end.astype(ds_dtype or acc), dh0


def inverse_kernel_call(A):
    """(I + A)^-1 of [num, 64, 64] strictly lower A, any float dtype. The kernel never
    reads A on or above the diagonal: neither does this (junk there must not matter)."""
    assert A.ndim == 3 and A.shape[1:] == (64, 64), A.shape
    strict = jnp.tril(jnp.ones((64, 64), bool), -1)
    return chunked._blocked_inverse(jnp.where(strict, A, 0.0))


def chunk_prep_call(q, k, v, g, beta, scale, rows=None, *, ab_dtype, inverse=False,
                    readout_rows=False, plain=False):
    """The operands kernel's contract (``ChunkPrepKernel.raw_call``; ``scale`` [B], one
    per row): the forward kernel's operands, cast (16-bit; u in ``chunk_prep.u_dtype``,
    decay in the accumulator dtype) and made causal-safe, the int32 ``bad`` rows - as
    ``pipeline.causal_operands(pipeline.forward_operands(..))`` on the chunk inputs with
    q, k, v rounded to ``ab_dtype`` (tests/test_cutedsl_emulated.py holds the two equal) -
    and X = (I + A)^-1 with ``inverse`` (a [1] placeholder without; in chunks with a
    non-finite input X is not part of the contract: the kernel zeroes such k rows).
    ``readout_rows``: q holds the read-out rows (n from ``rows`` [B, NC, 4] at [.., 3]),
    qg, p come back on them (:func:`_readout_rows_of`)."""
    if readout_rows:
        n = rows[..., 3]
        out = chunk_prep_call(_to_chunk_rows(q, n, k.shape[-2]), k, v, g, beta, scale,
                              ab_dtype=ab_dtype, inverse=inverse, plain=plain)
        w, kt, qg, p, *rest = out
        return (w, kt, _readout_rows_of(qg, n), _readout_rows_of(p, n), *rest)
    acc = jnp.promote_types(jnp.float32, ab_dtype)
    ch = as_read(ChunkInputs(q, k, v, g.astype(acc), beta.astype(acc)), ab_dtype, acc)
    q, k = ch.q, ch.k
    it, X = chunked.wy_factors(ch, inverse=inverse_kernel_call_batched)
    s = scale.astype(acc).reshape((-1,) + (1,) * (q.ndim - 1))
    cast = lambda x: x.astype(ab_dtype)
    w, kt, u = cast(it.w), cast(it.Kt), it.u.astype(u_dtype(ab_dtype, plain))
    qg = cast(s * it.gam[..., None] * q)
    p = cast(s * chunked.causal_scores(q, k, it.Gam))
    rows = lambda x: jnp.all(jnp.isfinite(x), axis=-1)
    state_ok, bad = chunked.nonfinite_rows(None, finite=rows(w) & rows(u))
    read_ok = rows(qg) & rows(p)
    keep = lambda x, ok, fill: jnp.where(ok[..., None], x, jnp.asarray(fill, x.dtype))
    return (keep(w, state_ok, 0), keep(kt, state_ok, jnp.nan), keep(qg, read_ok, 0),
            keep(p, read_ok, 0), keep(u, state_ok, 0), jnp.exp(it.G_last).astype(acc),
            (bad | ~read_ok).astype(jnp.int32),
            X.astype(acc) if inverse else jnp.zeros((1,), acc))


def _gather_token_rows(rows, C, q, k, v):
    """The chunk tiles [B, NC, heads, C, X] of token-major q [B, T, H, K], k [B, L, H, K],
    v [B, L, HV, V] (L = n T steps) by the row table ``rows`` (:func:`_gather_rows`; q on
    the read-out rows)."""
    return (_gather_rows(rows, C, q, True), _gather_rows(rows, C, k, False),
            _gather_rows(rows, C, v, False))


def _gather_rows(rows, C, x, readout):
    """The chunk tiles [B, NC, heads, C, X] of token-major x [B, L, heads, X] by the row
    table ``rows`` [B, NC, 4] = (base, count, tok, n): chunk row i < count is step
    base + i, or with ``readout`` only the read-out rows i = n - 1 (mod n), token
    tok + i // n; other rows zero (as the kernels read them)."""
    B, NC = rows.shape[:2]
    base, count, tok, n = (rows[..., j, None] for j in range(4))    # [B, NC, 1]
    i = jnp.arange(C, dtype=jnp.int32)
    ok = i < count
    idx = base + i
    if readout:
        ok, idx = ok & (i % n == n - 1), tok + i // n
    idx = jnp.clip(idx, 0, x.shape[1] - 1).reshape(B, NC * C, 1, 1)
    y = jnp.take_along_axis(x, idx, axis=1).reshape((B, NC, C) + x.shape[2:])
    y = jnp.where(ok[..., None, None], y, jnp.zeros((), x.dtype))
    return jnp.moveaxis(y, 2, 3)


def chunk_prep_tokens_call(q, k, v, g, beta, scale, rows, *, ab_dtype, l2norm,
                           inverse=False, readout_rows=False, plain=False):
    """The token-major operands kernel's contract (``ChunkPrepKernel.raw_call_tokens``):
    the chunk inputs gathered from q [B, T, H, K], k [B, L, H, K], v [B, L, HV, V] by the
    row table ``rows`` [B, NC, 4] = (base, count, tok, n), q and k L2-normalised in
    float32 and rounded to ``ab_dtype`` with ``l2norm``, then :func:`chunk_prep_call`;
    ``readout_rows``: qg, p on their read-out rows (:func:`_readout_rows_of`). (The kernel
    under ``chunk_prep.GRAM_NORM`` skips k's rounding after the norm: the same to one
    16-bit rounding of k.) ``plain``: the plain forward's (u's dtype)."""
    from gdp_jax.reference import l2_normalize
    HV, C = g.shape[2:]
    H = k.shape[2]
    qc, kc, vc = _gather_token_rows(rows, C, q, k, v)
    if l2norm:
        norm = lambda x: l2_normalize(x.astype(jnp.float32)).astype(x.dtype)
        qc, kc = norm(qc), norm(kc)
    qc, kc = jnp.repeat(qc, HV // H, axis=2), jnp.repeat(kc, HV // H, axis=2)
    out = chunk_prep_call(qc, kc, vc, g, beta, scale, ab_dtype=ab_dtype, inverse=inverse,
                          plain=plain)
    if not readout_rows:
        return out
    w, kt, qg, p, *rest = out
    n = rows[..., 3]
    return (w, kt, _readout_rows_of(qg, n), _readout_rows_of(p, n), *rest)


def _to_chunk_rows(x, n, C):
    """[B, NC, HV, READOUT_ROWS, X] (row m: chunk row n m + n - 1) -> [B, NC, HV, C, X]
    with zeros in the rows that are not read out: the inverse of :func:`_readout_rows_of`."""
    i = jnp.arange(C, dtype=jnp.int32)
    n = n[..., None]                                               # [B, NC, 1]
    ok = (i % n == n - 1) & (i // n < READOUT_ROWS)                 # [B, NC, C]
    idx = jnp.clip(i // n, 0, READOUT_ROWS - 1)[:, :, None, :, None]
    y = jnp.take_along_axis(x, jnp.broadcast_to(idx, x.shape[:3] + (C, 1)), axis=-2)
    return jnp.where(ok[:, :, None, :, None], y, jnp.zeros((), x.dtype))


def _readout_rows_of(x, n):
    """[B, NC, HV, C, X] -> [B, NC, HV, READOUT_ROWS, X]: row m is chunk row n m + n - 1
    (``n`` [B, NC], the row table's), zeros after the C // n read-out rows."""
    C = x.shape[-2]
    m = jnp.arange(READOUT_ROWS, dtype=jnp.int32)
    src = n[..., None] * m + n[..., None] - 1                      # [B, NC, R]
    ok = src < C
    idx = jnp.clip(src, 0, C - 1)[:, :, None, :, None]
    y = jnp.take_along_axis(x, jnp.broadcast_to(idx, x.shape[:3] + (READOUT_ROWS, 1)), axis=-2)
    return jnp.where(ok[:, :, None, :, None], y, jnp.zeros((), x.dtype))


def local_grad_call(q, k, w, doc, v, g, beta, scale, X, u, S0, ds_end, *, ab_dtype,
                    split=True, ablate="", warps_n=2, gmma=False):
    """The local-gradient kernel's contract (``LocalGradKernel.raw_call``): the chunk
    inputs' cotangents (dq, dk, dv, dg, dbeta) as :func:`gdp_jax.chunked.local_grads_direct`
    computes them from the given factors w, u, X, with q, k, v, w, doc, S0 rounded to
    ``ab_dtype`` as the kernel reads them; one readout scale per row."""
    del split, ablate, warps_n, gmma    # the kernel's tuning / measurement knobs
    acc = jnp.promote_types(jnp.float32, ab_dtype)
    rd = lambda x: x.astype(ab_dtype).astype(acc)
    ch = ChunkInputs(rd(q), rd(k), rd(v), g.astype(acc), beta.astype(acc))

    def row(ch, w, u, X, S0, doc, ds_end, s):
        it = chunked.intra_chunk(ch)._replace(w=w, u=u)
        return tuple(chunked.local_grads_direct(ch, it, X, S0, doc, ds_end, s))

    return jax.vmap(row)(ch, rd(w), u.astype(acc), X.astype(acc), rd(S0), rd(doc),
                         ds_end.astype(acc), scale.astype(acc))


def local_grad_tokens_call(q, k, w, doc, v, g, beta, scale, X, u, S0, ds_end, rows, *, n,
                           T, ab_dtype, split=True, warps_n=2, tokens_in=False, rho=None,
                           do_tokens=False, l2norm=False, gmma=False):
    """The token-major local-gradient kernel's contract (``LocalGradKernel.raw_call_tokens``):
    :func:`local_grad_call`'s dq, dk, dv moved to their token-major rows by the row table
    ``rows`` [B, NC, 4] = (base, count, tok, n) and rounded to ``ab_dtype``: chunk row
    i < count to step base + i of dk [B, n T, HV, K], dv; the read-out rows
    i = n - 1 (mod n) to token tok + i // n of dq [B, T, HV, K]. Rows no chunk row
    covers are zero here (the kernel leaves them unwritten). ``tokens_in``: q, k, v
    token-major (q [B, T, H, K], k [B, n T, H, K], v [B, n T, HV, V]), gathered to the
    chunk grid by the same rows. ``rho`` = (rho_q [B, T, H], rho_k [B, n T, H]): dq, dk
    as the raw rows' cotangents, d_raw = rho (d - y rows(y, d)) in float32 with y the
    16-bit q, k tiles, before the rounding. ``do_tokens``: doc is dO [B, T, HV, V],
    gathered onto the read-out rows by the same rows. ``l2norm``: the gathered q, k rows
    are raw, L2-normalised in float32 and rounded to ``ab_dtype`` (as
    :func:`chunk_prep_tokens_call` does), and rho is their own
    (:func:`gdp_jax.reference.l2_norm_scale`)."""
    from gdp_jax.reference import l2_norm_scale, l2_normalize
    del warps_n, gmma                   # tuning knobs (the products' machinery)
    if do_tokens:
        C = g.shape[-1]
        doc = _gather_rows(rows, C, doc, True)
    own_rho = None
    if tokens_in:
        HV, C = g.shape[2:]
        q, k, v = _gather_token_rows(rows, C, q, k, v)
        H = k.shape[2]
        if l2norm:
            f32 = lambda x: x.astype(jnp.float32)
            own_rho = tuple(jnp.repeat(l2_norm_scale(f32(x)), HV // H, axis=2)
                            for x in (q, k))
            q, k = (l2_normalize(f32(x)).astype(x.dtype) for x in (q, k))
        q, k = jnp.repeat(q, HV // H, axis=2), jnp.repeat(k, HV // H, axis=2)
    dq, dk, dv, dg, dbeta = local_grad_call(q, k, w, doc, v, g, beta, scale, X, u, S0,
                                            ds_end, ab_dtype=ab_dtype, split=split)
    B, NC, HV, C = g.shape
    base, count, tok, n_ = (rows[..., j, None] for j in range(4))   # [B, NC, 1]
    i = jnp.arange(C, dtype=jnp.int32)
    valid = i < count
    if rho is not None:                             # r [B, L, H] at rows idx [B, NC, C]
        b = jnp.arange(B)[:, None, None]
        at_rows = lambda r, idx: jnp.repeat(jnp.moveaxis(
            r[b, jnp.clip(idx, 0, r.shape[1] - 1)], 3, 2), HV // r.shape[2], axis=2)[..., None]
        own_rho = (at_rows(rho[0], tok + i // n_), at_rows(rho[1], base + i))
    if own_rho is not None:
        # the L2 norm's backward, d_raw = rho (d - y rows(y, d)), y the 16-bit q, k tiles
        acc = dq.dtype
        rd = lambda x: x.astype(ab_dtype).astype(acc)
        norm_bwd = lambda d, y, r: r.astype(acc) * (d - rd(y) * _row_dot(rd(y), d))
        dq, dk = norm_bwd(dq, q, own_rho[0]), norm_bwd(dk, k, own_rho[1])

    def scatter(x, idx, ok, length):               # [B, NC, HV, C, X] -> [B, length, HV, X]
        idx = jnp.where(ok, idx, length).reshape(B, NC * C)       # out of range: dropped
        rows_ = jnp.moveaxis(x, 3, 2).reshape((B, NC * C) + x.shape[2:3] + x.shape[4:])
        out = jnp.zeros((B, length) + rows_.shape[2:], ab_dtype)
        b = jnp.arange(B)[:, None]
        return out.at[b, idx].set(rows_.astype(ab_dtype), mode="drop")

    return (scatter(dq, tok + i // n_, valid & (i % n_ == n_ - 1), T),
            scatter(dk, base + i, valid, n * T), scatter(dv, base + i, valid, n * T), dg, dbeta)


def _row_dot(y, d):
    """sum(y * d) over the last axis, [..., 1], one term after another: an order that
    does not depend on the leading dims (as the kernel's per-row sums; XLA may vectorise a
    reduce differently for another batch, e.g. under jax.vmap)."""
    t = y * d
    s = t[..., :1]
    for j in range(1, t.shape[-1]):
        s = s + t[..., j:j + 1]
    return s


def inverse_kernel_call_batched(A):
    """:func:`inverse_kernel_call` on [..., 64, 64], row-causal (as the kernel's wrapper
    ``wy_inverse.unit_lower_inverse``): non-finite rows of A and the rows after them NaN."""
    flat = lambda A: inverse_kernel_call(A.reshape((-1, 64, 64))).reshape(A.shape)
    return chunked.causal_rows(flat, A)


def step_kernel_call(q, k, v, beta, decay, S):
    """The decoding-step kernel's contract (``StepKernel.raw_call``),
    column by column as the kernel does it, in the operands' precision."""
    s = decay[..., None, None] * S                                   # [B, HV, K, V]
    for j in range(k.shape[2]):
        kj = k[:, :, j, :, None]                                     # [B, HV, K, 1]
        pred = jnp.sum(s * kj, axis=2)                               # [B, HV, V]
        s = s + kj * (beta[:, :, j, None] * (v[:, :, j] - pred))[:, :, None, :]
    return jnp.sum(s * q[..., None], axis=2), s
