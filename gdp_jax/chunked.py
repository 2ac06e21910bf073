"""Chunkwise (WY) Gated DeltaProduct in plain jax.numpy: the math of the ``xla`` engine.

Works on the chunk grid of :mod:`gdp_jax.grid` (chunk tensors [B, NC, HV, C, X]). Per
chunk, with G the chunk-local cumsum of the gate, gam_i = exp(G_i),
Gam_ij = exp(G_i - G_j) (i >= j) and S0 the chunk's start state:

    (I + A) W = diag(beta gam) K,  (I + A) U = diag(beta) V,  A = tril(diag(beta) K K^T * Gam, -1)
    Delta = U - W S0                                    # the pseudo-values beta (v - S^T k)
    S_end = exp(G_last) S0 + (exp(G_last - G) K)^T Delta
    o     = scale * (diag(gam) Q S0 + tril(Q K^T * Gam) Delta)

Only the state recursion is sequential (a ``lax.scan`` over chunks); everything else runs
on all chunks at once. Shapes inside: chunk tensors are [B, NC, HV, C, X].
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from gdp_jax import _vma
from gdp_jax._prefix import compensated_prefix_sum, prefix_sum
from gdp_jax.grid import (ChunkInputs, ChunkLayout, every_of, from_readout_rows,
                          readout_lower, readout_rows)

# ---------------------------------------------------------------------------------------
# Per-chunk math (all chunks at once)
# ---------------------------------------------------------------------------------------

class Intra(NamedTuple):
    """Chunk-local quantities: shapes [B, NC, HV, C, X]."""
    G_last: jax.Array     # [..., ] total log-decay of the chunk
    Gam: jax.Array        # [..., C, C] exp(G_i - G_j) for i >= j, else 0
    gam: jax.Array        # [..., C] exp(G_i)
    w: jax.Array          # [..., C, K]
    u: jax.Array          # [..., C, V]
    Kt: jax.Array         # [..., C, K] exp(G_last - G_i) k_i


def _t(x):
    return jnp.swapaxes(x, -1, -2)


def mm(a, b):
    """a @ b accumulated in float32 at least (``preferred_element_type``): two 16-bit
    operands stay 16-bit into the product (half the bytes read) and the result is the
    float32 (float64) one; operands of one wider dtype give exactly ``a @ b``."""
    acc = jnp.promote_types(jnp.result_type(a, b), jnp.float32)
    return jnp.matmul(a, b, preferred_element_type=acc)


def causal_mm(X, R, strict=False):
    """X @ R for lower-triangular X [.., m, m] (strictly lower with ``strict``), such that
    row i reads only rows j <= i (j < i) of R [.., m, X]. X may also be the read-out rows
    [.., m / every, m] of one (row r is row every r + every - 1, :func:`gdp_jax.grid.readout_rows`).

    A plain matmul multiplies the structural zeros X[i, j > i] by R's later rows, so one
    inf or NaN there (a non-finite input, an overflow) would turn the earlier rows into
    NaN (0 * inf). Here non-finite rows of R enter the product as zeros and every row at
    or after the first one is set to NaN instead: causal, and exact when all is finite.
    X's entries above the diagonal must be finite (zero) in the rows not set to NaN.
    """
    finite, bad = nonfinite_rows(R, strict)
    out = mm(X, jnp.where(finite[..., None], R, jnp.zeros((), R.dtype)))
    bad = readout_rows(bad, every_of(X.shape[-2], R.shape[-2]), axis=-1)
    return jnp.where(bad[..., None], jnp.asarray(jnp.nan, out.dtype), out)


def nonfinite_rows(R, strict=False, finite=None):
    """(finite [.., m]: row i of R [.., m, X] is all finite, bad [.., m]: some row j <= i
    (j < i with ``strict``) is not). ``finite`` given: use it instead of R's."""
    if finite is None:
        finite = jnp.all(jnp.isfinite(R), axis=-1)
    # a prefix count, not lax.cummax: no reduce_window in the GPU lowering (see prefix_sum)
    bad = prefix_sum((~finite).astype(jnp.int32), axis=-1) > 0
    if strict:      # row i does not read row i itself
        bad = jnp.concatenate([jnp.zeros_like(bad[..., :1]), bad[..., :-1]], axis=-1)
    return finite, bad


def mask_nonfinite_rows(w, u, Kt, qg, P):
    """The forward recursion's operands (chunk tensors [.., C, X]) made safe for plain
    matmuls, and ``bad`` [.., Cr]: the output rows to set to NaN. The readout operands qg
    [.., Cr, K] and P [.., Cr, C] hold all Cr = C rows or only the read-out ones
    (Cr = C // every, :func:`gdp_jax.grid.readout_rows`); ``bad`` has their rows.

    ``P @ Delta`` multiplies P's zeros above the diagonal by later rows of Delta = u - w S,
    so a non-finite row there would reach earlier output rows. A row with a non-finite w
    or u enters as zeros and its Kt row as NaN (the chunk's end state, and all after it,
    are NaN); a non-finite readout row (qg, P) enters as zeros; ``bad`` marks the rows
    from the first non-finite w / u row on and every non-finite readout row. Exact when
    all is finite. Returns ((w, u, Kt, qg, P), bad)."""
    rows = lambda a: jnp.all(jnp.isfinite(a), axis=-1)
    state_ok, bad = nonfinite_rows(None, finite=rows(w) & rows(u))
    bad = readout_rows(bad, every_of(P.shape[-2], P.shape[-1]), axis=-1)
    read_ok = rows(qg) & rows(P)
    keep = lambda a, ok, fill: jnp.where(ok[..., None], a, jnp.asarray(fill, a.dtype))
    return ((keep(w, state_ok, 0), keep(u, state_ok, 0), keep(Kt, state_ok, jnp.nan),
             keep(qg, read_ok, 0), keep(P, read_ok, 0)), bad | ~read_ok)


def causal_rows(f, A):
    """``f(A)`` for a row-causal map f of [.., m, m] (row i of f(A) depends on rows <= i of
    A, e.g. (I + A)^-1 for lower A) run where a non-finite row of A must not reach earlier
    rows through f's own arithmetic (a kernel): f sees those rows as zeros, and the rows
    of the result from the first of them on are NaN."""
    finite, bad = nonfinite_rows(A)
    X = f(jnp.where(finite[..., None], A, 0))
    return jnp.where(bad[..., None], jnp.asarray(jnp.nan, X.dtype), X)


def _reverse_cumsum(x, axis=-1):
    return prefix_sum(x, axis, reverse=True)


def segment_sums(g):
    """seg[..., i, j] = g_{j+1} + ... + g_i for j <= i (0 on the diagonal), else 0.

    From a compensated prefix sum G = hi + lo (each addition's rounding error kept in
    lo, TwoSum): seg = (hi_i - hi_j) + (lo_i - lo_j) is then as accurate as a direct sum,
    where a plain difference of float32 cumsums would cancel catastrophically for strong
    gates (|G| ~ 1e4 loses 3 digits). Built from [.., C] vectors: no [C, C] prefix sums.
    Gates below -GATE_FLOOR count as -GATE_FLOOR (every decay through one is exp(< -1e4),
    0 in float64 as in float32), so -inf never meets -inf in a difference.
    """
    C = g.shape[-1]
    hi, lo = compensated_prefix_sum(jnp.maximum(g, -GATE_FLOOR))
    lower = jnp.tril(jnp.ones((C, C), bool))
    seg = ((hi[..., :, None] - hi[..., None, :]) + (lo[..., :, None] - lo[..., None, :]))
    return jnp.where(lower, seg, 0.0)


GATE_FLOOR = 1e4


# The diagonal blocks of (I + A)^-1 that forward substitution solves (m - 2 batched products
# on m x m blocks) before the merges. Small blocks: the substitution's products are a chain
# of whole-grid kernels each, the merges few and on small operands. H200 (s16-1,
# benchmarks/results/history/2026-12-04): fwd+bwd at (8, 4096, 16, 1) 12.87 (16) -> 12.69
# (8) -> 12.24 ms (4), at n = 3 35.13 -> 34.57 -> 33.33 ms; the errors vs float64 equal to
# two digits (the substitution and the merges are both forward substitution, by blocks).
SUBSTITUTION_BLOCK = 4


def with_closed_form_vjp(inverse):
    """``inverse`` (A -> (I + A)^-1 for strictly lower-triangular A [..., m, m]) as a
    custom_vjp whose backward is the closed form dA = -tril(X^T dX X^T, -1) (residual: X
    only): differentiating through the inverse's own steps is never needed."""
    f = jax.custom_vjp(inverse)

    def fwd(A):
        X = inverse(A)
        return X, X

    def bwd(X, dX):
        Xt = jnp.swapaxes(X, -1, -2)
        m = X.shape[-1]
        strict = jnp.tril(jnp.ones((m, m), bool), -1)
        return (jnp.where(strict, -(Xt @ dX @ Xt), 0.0),)

    f.defvjp(fwd, bwd)
    return f


def _blocked_inverse(A, plain=False):
    """(I + A)^-1 for strictly lower-triangular A [..., m, m], any m.

    Blocked, in batched matmuls: the diagonal blocks of at most b =
    :data:`SUBSTITUTION_BLOCK` rows by forward substitution, then merges of halves
    (b -> 2 b -> ... -> m for m = b 2^j) with
    [[L11, 0], [L21, L22]]^-1 = [[X11, 0], [-X22 L21 X11, X22]].
    Used instead of ``lax.linalg.triangular_solve``, which was far slower on the GPU and
    on CPU, where its LAPACK call could also deadlock XLA's thread pool
    (benchmarks/results/history/2026-11-29/NOTES.md).
    """
    m = A.shape[-1]
    # ``plain``: plain products where the caller checks the result finite
    # (:func:`gdp_jax.recurrence.factors_and_operands`), else row-causal ones
    if m <= SUBSTITUTION_BLOCK:
        # X <- I - A X, m - 1 times from X = I: after t steps rows 0..t are final (A is
        # strictly lower), i.e. forward substitution, in m - 1 batched matmuls (unrolled:
        # no device loop; the custom vjp keeps them out of the backward).
        # causal_mm: a non-finite row of X reaches only the rows after it.
        eye = jnp.eye(m, dtype=A.dtype)
        X = eye - A
        for _ in range(m - 2):
            X = eye - (mm(A, X) if plain else causal_mm(A, X, strict=True))
        return X
    h = m // 2
    if m % 2:       # unequal halves: two calls
        X11, X22 = (_blocked_inverse(A[..., :h, :h], plain),
                    _blocked_inverse(A[..., h:, h:], plain))
    else:           # both halves in one call
        diag = _blocked_inverse(jnp.stack([A[..., :h, :h], A[..., h:, h:]], axis=0), plain)
        X11, X22 = diag[0], diag[1]
    X21 = -(mm if plain else causal_mm)(X22, A[..., h:, :h] @ X11)   # X11's rows precede X21's
    top = jnp.concatenate([X11, jnp.zeros(X11.shape[:-1] + (m - h,), X11.dtype)], axis=-1)
    return jnp.concatenate([top, jnp.concatenate([X21, X22], axis=-1)], axis=-2)


unit_lower_inverse = with_closed_form_vjp(lambda A: _blocked_inverse(A))
"""(I + A)^-1 for strictly lower-triangular A [..., m, m] in XLA (blocked, see
:func:`_blocked_inverse`), closed-form vjp. The cutedsl backend swaps in a kernel
(``gdp_jax.kernels.inverse``)."""

plain_unit_lower_inverse = with_closed_form_vjp(lambda A: _blocked_inverse(A, plain=True))
"""The same with plain products: exact where the result is finite, not row-causal."""


def intra_chunk(ch: ChunkInputs, inverse=None) -> Intra:
    """WY factors and decays of every chunk (see the module docstring).

    ``inverse``: A -> (I + A)^-1 for the strictly lower [..., C, C] A (default: the XLA
    :data:`unit_lower_inverse`).
    """
    return wy_factors(ch, inverse)[0]


def wy_factors(ch: ChunkInputs, inverse=None, narrow=None, plain=False):
    """(:class:`Intra`, X = (I + A)^-1 [.., C, C]) of every chunk: ``intra_chunk`` with
    the inverse kept (the direct backward :func:`local_grads_direct` reuses it).

    ``narrow`` (a 16-bit dtype, the xla engine's for 16-bit inputs): w, u and Kt
    [.., C, K | V] come back in it (products accumulated in float32, then rounded: what
    the scans and the backward read); w and u from two products (no [.., C, K + V]
    concatenate). None: all in the compute dtype (the cutedsl backend's callers).
    ``plain``: plain products (and :data:`plain_unit_lower_inverse`), not
    :func:`causal_mm`: the same values wherever they are all finite."""
    if inverse is None:
        inverse = plain_unit_lower_inverse if plain else unit_lower_inverse
    rows_mm = mm if plain else causal_mm
    C = ch.k.shape[-2]
    G = prefix_sum(ch.g, axis=-1)                                # log-decay from chunk start
    G_last = G[..., -1]
    lower = jnp.tril(jnp.ones((C, C), bool))
    strict = jnp.tril(jnp.ones((C, C), bool), -1)
    Gam = jnp.where(lower, jnp.exp(segment_sums(ch.g)), 0.0)
    kk = mm(ch.k, _t(ch.k))
    A = jnp.where(strict, ch.beta[..., :, None] * kk * Gam, 0.0)
    gam = jnp.exp(G)
    X = inverse(A)
    if narrow is not None:
        Rw, Ru = (ch.beta * gam)[..., None] * ch.k, ch.beta[..., None] * ch.v
        Xw = X                       # the inverse as the products w, u read it
        if NARROW_WY:
            Xw, Rw, Ru = X.astype(narrow), Rw.astype(narrow), Ru.astype(narrow)
        w, u = rows_mm(Xw, Rw).astype(narrow), rows_mm(Xw, Ru).astype(narrow)
        Kt = (jnp.exp(_to_end(ch.g))[..., None] * ch.k).astype(narrow)
        return Intra(G_last, Gam, gam, w, u, Kt), X
    rhs = jnp.concatenate([(ch.beta * gam)[..., None] * ch.k, ch.beta[..., None] * ch.v], -1)
    wu = rows_mm(X, rhs)
    K = ch.k.shape[-1]
    Kt = jnp.exp(_to_end(ch.g))[..., None] * ch.k
    return Intra(G_last, Gam, gam, wu[..., :K], wu[..., K:], Kt), X


# ``narrow``: the products w = X Rw, u = X Ru on 16-bit X and Rw, Ru (FLA's choice) instead
# of float32 ones. Off: on the H200 (s13-2, benchmarks/results/history/2026-12-03) fwd+bwd
# -0.3..-0.8 ms at the benchmark shapes, but peak memory +0.13 GB at (8, 4096, 16, 1) and
# +0.38 GB at n = 3, and the error vs float64 3.6-4.2e-3 -> 3.9-4.5e-3.
NARROW_WY = False


def _to_end(g):
    """G_last - G_i = g_{i+1} + ... + g_{C-1}, summed directly (no cancellation)."""
    rc = _reverse_cumsum(g)
    return jnp.concatenate([rc[..., 1:], jnp.zeros_like(rc[..., :1])], -1)


def causal_scores(q, k, Gam):
    """tril(q k^T * Gam) [.., C, C], masked with ``where``: q_i . k_j for a later j may be
    inf, and inf * 0 (Gam's zeros) would be NaN in an earlier row.

    q [.., Cr, K] and Gam [.., Cr, C] may be the read-out rows only (Cr = C // every,
    :func:`gdp_jax.grid.readout_rows`): then the [.., Cr, C] rows of the same product."""
    lower = readout_lower(q.shape[-2], k.shape[-2])
    return jnp.where(lower, mm(q, _t(k)) * Gam, 0.0)


def advance(S, w, u, Kt, G_last):
    """A chunk's map on its start state S [.., K, V]: (end state, Delta = u - w S).

    S_end = exp(G_last) S + Kt^T Delta (shapes of :class:`Intra`, one chunk per leading
    index)."""
    delta = u - w @ S
    return jnp.exp(G_last)[..., None, None] * S + _t(Kt) @ delta, delta


def chunk_map(ch: ChunkInputs, it: Intra, S0, scale):
    """Output rows and end state of every chunk given its start state S0 [B, NC, HV, K, V]."""
    S_end, delta = advance(S0, it.w, it.u, it.Kt, it.G_last)
    qk = causal_scores(ch.q, ch.k, it.Gam)
    o = scale * ((it.gam[..., None] * ch.q) @ S0 + causal_mm(qk, delta))
    return o, S_end


# ---------------------------------------------------------------------------------------
# The sequential parts: forward state scan, reverse state-gradient scan
# ---------------------------------------------------------------------------------------

def _flat_chunks(x):
    return x.reshape((-1,) + x.shape[2:])


def state_scan(it: Intra, layout: ChunkLayout, h0):
    """Start state of every chunk, [B, NC, HV, K, V], from initial states h0 [N, HV, K, V]."""
    def step(S, xs):
        w, u, Kt, G_last, reset, sid = xs
        S = jnp.where(reset[:, None, None, None], h0[sid], S)
        return advance(S, w, u, Kt, G_last)[0], S

    B, NC, HV = it.w.shape[:3]
    K, V = it.w.shape[-1], it.u.shape[-1]
    xs = (it.w, it.u, it.Kt, it.G_last, layout.reset, layout.seq_of_chunk)
    xs = tuple(jnp.moveaxis(x, 1, 0) for x in xs)
    init = _vma.like(jnp.zeros((B, HV, K, V), h0.dtype), xs, h0)
    _, S0 = lax.scan(step, init, xs)
    return jnp.moveaxis(S0, 0, 1)


def states_from_checkpoints(it: Intra, layout: ChunkLayout, h0, ckpts, stride: int):
    """Start state of every chunk [B, NC, HV, K, V] from checkpoints kept by the forward.

    ckpts: [B, NG, HV, K, V], NG = ceil(NC / stride): the start state of chunks 0, stride,
    2 stride, ... (after any reset). The stride - 1 states after each checkpoint are
    recomputed by a scan of stride - 1 steps that runs all groups at once (the
    ``recompute_chunk_num`` trade: N = stride - 1).
    """
    B, NC = it.w.shape[:2]
    NG = ckpts.shape[1]
    if stride == 1:
        return ckpts[:, :NC]
    pad = NG * stride - NC

    def groups(x):  # [B, NC, ...] -> [stride, B, NG, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape((B, NG, stride) + x.shape[2:]), 2, 0)

    w, u, Kt, G_last = (groups(x) for x in (it.w, it.u, it.Kt, it.G_last))
    reset, sid = groups(layout.reset), groups(layout.seq_of_chunk)

    def step(S, xs):
        # advance over chunk j - 1, then restart if chunk j begins a sequence
        w, u, Kt, G_last, reset, sid = xs
        S = advance(S, w, u, Kt, G_last)[0]
        S = jnp.where(reset[..., None, None, None], h0[sid].astype(S.dtype), S)
        return S, S

    xs = (w[:-1], u[:-1], Kt[:-1], G_last[:-1], reset[1:], sid[1:])
    S0 = ckpts.astype(it.w.dtype)
    _, rest = lax.scan(step, _vma.like(S0, xs, h0), xs)
    S = jnp.concatenate([S0[None], rest], axis=0)              # [stride, B, NG, HV, K, V]
    S = jnp.moveaxis(S, 0, 2).reshape((B, NG * stride) + S.shape[3:])
    return S[:, :NC]


def final_states(it, layout, S0, h0):
    """End state of each sequence [N, HV, K, V] (its initial state if it has no tokens)."""
    lc = layout.last_chunk
    pick = lambda x: _flat_chunks(x)[lc]
    S_end, _ = advance(pick(S0), pick(it.w), pick(it.u), pick(it.Kt), pick(it.G_last))
    return jnp.where((layout.seq_len > 0)[:, None, None, None], S_end, h0)


def _readout_grads(ch, it, doc, scale):
    """What the output rows' cotangents doc [.., Cr, V] send to Delta [.., C, V] and to the
    chunk start state [.., K, V] (o = scale (gam Q S0 + tril(Q K^T Gam) Delta)); doc
    holds all Cr = C rows or the read-out ones (Cr = C // every: only those rows of Q)."""
    every = every_of(doc.shape[-2], ch.k.shape[-2])
    q, gam, Gam = (readout_rows(ch.q, every), readout_rows(it.gam, every, axis=-1),
                   readout_rows(it.Gam, every))
    qk = jnp.einsum("...ik,...jk->...ij", q, ch.k) * Gam
    ddelta = scale * jnp.swapaxes(qk, -1, -2) @ doc
    dS0 = scale * jnp.swapaxes(gam[..., None] * q, -1, -2) @ doc
    return ddelta, dS0


def reverse_state_grad_scan(ch, it, layout, doc, dfinal, scale):
    """Gradient w.r.t. each chunk's END state, [B, NC, HV, K, V] (reverse recursion).

    doc: [B, NC, HV, C or C // every, V] output-row cotangents; dfinal: [N, HV, K, V] final-state
    cotangents. Per chunk (reverse order), dS_end = (dS_start of the next chunk unless it
    resets) + (dfinal if the chunk ends its sequence), and
        dDelta   = scale * tril(Q K^T * Gam)^T dO + Kt dS_end
        dS_start = scale * (gam Q)^T dO + exp(G_last) dS_end - W^T dDelta.
    """
    ddelta_out, dS_out = _readout_grads(ch, it, doc, scale)

    def step(carry, xs):
        ddo, dso, w, Kt, G_last, reset, is_last, sid = xs
        dS_end = carry + jnp.where(is_last[:, None, None, None], dfinal[sid], 0.0)
        ddelta = ddo + Kt @ dS_end
        dS_start = dso + jnp.exp(G_last)[..., None, None] * dS_end - jnp.swapaxes(w, -1, -2) @ ddelta
        return jnp.where(reset[:, None, None, None], 0.0, dS_start), (dS_end, dS_start)

    xs = (ddelta_out, dS_out, it.w, it.Kt, it.G_last, layout.reset, layout.is_last,
          layout.seq_of_chunk)
    xs = tuple(jnp.moveaxis(x, 1, 0) for x in xs)
    init = jnp.zeros(dS_out.shape[:1] + dS_out.shape[2:], dS_out.dtype)
    _, (dS_end, dS_start) = lax.scan(step, _vma.like(init, xs, dfinal), xs, reverse=True)
    return jnp.moveaxis(dS_end, 0, 1), jnp.moveaxis(dS_start, 0, 1)


def initial_state_grads(layout, dS_start, dfinal):
    """d loss / d initial state of each sequence [N, HV, K, V]."""
    first = _flat_chunks(dS_start)[layout.first_chunk]
    return jnp.where((layout.seq_len > 0)[:, None, None, None], first, dfinal)


# ---------------------------------------------------------------------------------------
# Local forward / backward on the chunk grid
# ---------------------------------------------------------------------------------------

def chunk_forward(ch: ChunkInputs, layout: ChunkLayout, h0, scale):
    """Returns (output rows [B, NC, HV, C, V], final states [N, HV, K, V], S0)."""
    it = intra_chunk(ch)
    S0 = state_scan(it, layout, h0)
    final = final_states(it, layout, S0, h0)
    o = chunk_map(ch, it, S0, scale)[0]
    return o, final, S0


def chunk_backward(ch: ChunkInputs, layout: ChunkLayout, h0, doc, dfinal, scale):
    """Gradients of (output rows, final states) w.r.t. (chunk inputs, initial states).

    Recomputes the chunk start states, runs the reverse state-gradient recursion, then
    differentiates the chunk-local map (no sequential dependency) for all chunks at once.
    """
    it, it_pull = jax.vjp(intra_chunk, ch)
    S0 = state_scan(it, layout, h0)
    dS_end, dS_start = reverse_state_grad_scan(ch, it, layout, doc, dfinal, scale)
    dch = local_grads(ch, it, it_pull, S0, doc, dS_end, scale)
    return dch, initial_state_grads(layout, dS_start, dfinal)


def local_grads(ch: ChunkInputs, it: Intra, it_pull, S0, doc, dS_end, scale) -> ChunkInputs:
    """Cotangents of the chunk inputs from those of every chunk's output rows ``doc`` and
    end state ``dS_end``, through the chunk-local map at start states ``S0``, by autodiff:
    the reference of the written-out :func:`local_grads_direct` that the engines run.

    ``(it, it_pull) = jax.vjp(intra_chunk, ch)`` is computed once by the caller and reused
    (the intra-chunk factors are the expensive part of both passes).
    """
    _, pull = jax.vjp(lambda c, i, s: chunk_map(c, i, s, scale), ch, it, S0)
    # Under shard_map the cotangents must vary over the same mesh axes as the outputs.
    dch, dit, _ = pull(_vma.like((doc, dS_end), ch, S0))
    (dch_intra,) = it_pull(dit)
    return jax.tree_util.tree_map(jnp.add, dch, dch_intra)


def _rows(a, b):
    """sum over the last axis of a * b: [.., C, X] -> [.., C]."""
    return jnp.sum(a * b, axis=-1)


def local_grads_direct(ch: ChunkInputs, it: Intra, X, S0, doc, dS_end, scale) -> ChunkInputs:
    """:func:`local_grads` written out (no autodiff): the cotangents of the chunk inputs
    from the output-row cotangents ``doc`` [.., C, V] and end-state cotangents ``dS_end``
    [.., K, V] at start states ``S0`` [.., K, V]; ``(it, X) = wy_factors(ch)``.

    With Delta = U - W S0, P = tril(q k^T Gam), Kt = diag(exp(G_last - G)) k:
        dDelta = scale P^T dO + Kt dS_end,   dW = -dDelta S0^T,   dU = dDelta
        dX = dW Rw^T + dU Ru^T (Rw = diag(beta gam) k, Ru = diag(beta) v)
        dA = -X^T dX X^T (strictly lower),   dRw = X^T dW,   dRu = X^T dU
    then A = tril(diag(beta) k k^T Gam, -1), P and the decays back to q, k, v, beta and
    the gate (G, G_last - G and the segment sums of Gam are sums of g: their adjoints are
    reverse / forward cumulative sums and a rectangle sum). Inputs are finite here (the
    forward's non-finite rows give NaN gradients for their chunk).

    ``doc`` may hold only the read-out rows, [.., C // every, V] (row r is chunk row
    every r + every - 1, :func:`gdp_jax.grid.readout_rows`; q is zero on the others):
    then the q-side terms (P, dP, dq, q S0) are computed on those rows alone, suffix
    ``_r`` below, and dq comes back on all C rows (zeros elsewhere).
    """
    q, k, v, g, beta = ch
    acc = jnp.promote_types(g.dtype, jnp.float32)   # 16-bit operands (w, S0, ..) meet it
    # :data:`NARROW_GRADS`: the operands that only feed further products in w's 16-bit dtype
    nd = it.w.dtype if NARROW_GRADS and it.w.dtype.itemsize == 2 else None
    r = (lambda a: a) if nd is None else (lambda a: a.astype(nd))
    C = k.shape[-2]
    every = every_of(doc.shape[-2], C)
    strict = jnp.tril(jnp.ones((C, C), bool), -1)
    Gam, gam = it.Gam, it.gam
    Rw = r((beta * gam)[..., None] * k)          # both only meet dW, dDelta in dX
    Ru = r(beta[..., None] * v)
    delta = r(it.u - mm(it.w, S0))
    et = jnp.exp(_to_end(g))
    # the read-out rows of q, gam, Gam and of the causal mask ([.., Cr, X], Cr = C // every)
    lower_r = readout_lower(doc.shape[-2], C)
    q_r, gam_r = readout_rows(q, every), readout_rows(gam, every, axis=-1)
    Gam_r = readout_rows(Gam, every)
    qk_r = jnp.where(lower_r, mm(q_r, _t(k)), 0.0)
    P_r = qk_r * Gam_r

    ddelta = r(scale * mm(_t(P_r), doc) + mm(it.Kt, dS_end))             # [.., C, V]
    dP_r = jnp.where(lower_r, scale * mm(doc, _t(delta)), 0.0)       # [.., Cr, C]
    dKt = mm(delta, _t(dS_end))                                         # [.., C, K]
    dW = r(-mm(ddelta, _t(S0)))
    dX = r(mm(dW, _t(Rw)) + mm(ddelta, _t(Ru)))
    Xt = r(_t(X))
    dA = jnp.where(strict, -mm(r(mm(Xt, dX)), Xt), 0.0)
    dRw = mm(Xt, dW)
    dRu = mm(Xt, ddelta)

    kk = mm(k, _t(k))
    dkk = dA * beta[..., :, None] * Gam
    dqk_r = dP_r * Gam_r
    doS0_r = mm(doc, _t(S0))                                            # [.., Cr, K]

    dq = from_readout_rows(scale * gam_r[..., None] * doS0_r + mm(dqk_r, k), every)
    dk = (mm(_t(dqk_r), q_r) + mm(dkk + _t(dkk), k) + (beta * gam)[..., None] * dRw
          + et[..., None] * dKt)
    dv = beta[..., None] * dRu
    dbeta = _rows(dA * kk, Gam) + gam * _rows(dRw, k) + _rows(dRu, v)

    # the gate: G_i = sum_{l <= i} g_l, (G_last - G)_i = sum_{l > i} g_l,
    # seg_ij = sum_{j < l <= i} g_l (Gam = exp(seg)), G_last = sum_l g_l
    # rows(dO, q S0) = rows(q, dO S0^T): no second product with the states
    dG = gam * (from_readout_rows(scale * _rows(q_r, doS0_r), every, axis=-1)
                + beta * _rows(dRw, k))
    dto_end = et * _rows(dKt, k)
    dG_last = jnp.exp(it.G_last) * jnp.sum(dS_end.astype(acc) * S0.astype(acc), axis=(-2, -1))
    # seg's adjoint: g_l collects dseg_ij over the rectangle j < l <= i. dseg is lower
    # triangular, where [j < l <= i] = [l <= i] - [l <= j]: reverse cumsums of its row
    # and column sums (no [C, C] prefix sum). dGam = dA beta kk + dP qk; with every > 1
    # the second term lives on the read-out rows only: its row sums go back to those
    # rows and its column sums add (no [C, C] scatter).
    if every == 1:
        dseg = (dA * beta[..., :, None] * kk + dP_r * qk_r) * Gam
        row_sums, col_sums = jnp.sum(dseg, axis=-1), jnp.sum(dseg, axis=-2)
    else:
        dseg_A = dA * beta[..., :, None] * kk * Gam
        dseg_P = dP_r * qk_r * Gam_r                                 # [.., Cr, C]
        row_sums = (jnp.sum(dseg_A, axis=-1)
                    + from_readout_rows(jnp.sum(dseg_P, axis=-1), every, axis=-1))
        col_sums = jnp.sum(dseg_A, axis=-2) + jnp.sum(dseg_P, axis=-2)
    rect = _reverse_cumsum(row_sums - col_sums)
    dg = (_reverse_cumsum(dG) + (prefix_sum(dto_end, axis=-1) - dto_end) + rect
          + dG_last[..., None])
    if SPLIT_ROW_SUMS:
        dg, dbeta = lax.optimization_barrier((dg, dbeta))
    # Under shard_map an input replicated over a mesh axis (the zero gate of an ungated
    # call) needs a cotangent that is too.
    return _vma.cotangent_like(ChunkInputs(dq, dk, dv, dg, dbeta), ch)


# 16-bit inputs: the chunk-local backward's intermediates that feed only further products
# (Delta, dDelta, dW, dX, X^T dX, and the operands X, Rw, Ru they meet) are rounded to the
# 16-bit dtype of w, as FLA keeps its own; every product still accumulates in float32.
NARROW_GRADS = True


# The [.., C] row sums of dg and dbeta end their fusions here: on the H200 XLA fused the
# dbeta reduction over [C, C] with the relayout to the API's token order, one 2.1 ms
# kernel for what reads 0.8 GB (benchmarks/results/history/2026-12-02, s7_gpu1).
SPLIT_ROW_SUMS = True


# ---------------------------------------------------------------------------------------
# Fragment summaries for context parallelism: parallel (log-depth) composition of the
# per-chunk affine maps, restarting at sequence boundaries. No sequential scan.
# ---------------------------------------------------------------------------------------

def _segmented_compose(m, e, brk):
    """Inclusive prefix composition along the chunk axis (1) of affine maps x -> m x + e.

    brk[b, c]: element c does not chain onto the elements before it (a restart).
    Returns (M, E) with M[c] = m_c ... m_{c0}, E[c] the image of 0, c0 the last restart.
    """
    def combine(a, b):
        ma, ea, ra = a
        mb, eb, rb = b
        r = rb[..., None, None, None]
        return (jnp.where(r, mb, mb @ ma), jnp.where(r, eb, mb @ ea + eb), ra | rb)

    M, E, _ = lax.associative_scan(combine, (m, e, brk), axis=1)
    return M, E


def _chunk_transitions(it: Intra):
    """m_c = exp(G_last) I - Kt_c^T w_c: the linear part of chunk c's map on its start state."""
    K = it.w.shape[-1]
    eye = jnp.eye(K, dtype=it.w.dtype)
    return jnp.exp(it.G_last)[..., None, None] * eye - jnp.swapaxes(it.Kt, -1, -2) @ it.w


def forward_summaries(ch: ChunkInputs, layout: ChunkLayout):
    """(E, M) of every sequence, [N, HV, K, V] and [N, HV, K, K]: S_end = M S_start + E.

    A sequence without tokens has E = 0, M = I.
    """
    it = intra_chunk(ch)
    m = _chunk_transitions(it)
    e = jnp.swapaxes(it.Kt, -1, -2) @ it.u
    M, E = _segmented_compose(m, e, layout.reset)
    lc, has = layout.last_chunk, (layout.seq_len > 0)[:, None, None, None]
    eye = jnp.eye(m.shape[-1], dtype=m.dtype)
    return (jnp.where(has, _flat_chunks(E)[lc], 0.0),
            jnp.where(has, _flat_chunks(M)[lc], eye))


def backward_summaries(ch: ChunkInputs, layout: ChunkLayout, doc, dfinal, scale):
    """(gamma, M^T) of every sequence: dS_start = M^T dS_end + gamma.

    gamma is the gradient w.r.t. the sequence's start state from the output cotangents
    ``doc`` [B, NC, HV, C, V] and final-state cotangents ``dfinal`` [N, HV, K, V], with no
    gradient arriving from beyond the sequence's end. Per chunk (see
    :func:`reverse_state_grad_scan`): dS_start = m^T dS_end + b, b = scale (gam Q)^T dO -
    W^T scale tril(Q K^T Gam)^T dO (+ m^T dfinal on the sequence's last chunk).
    """
    it = intra_chunk(ch)
    mt = jnp.swapaxes(_chunk_transitions(it), -1, -2)
    ddelta_out, dS_out = _readout_grads(ch, it, doc, scale)
    b = dS_out - jnp.swapaxes(it.w, -1, -2) @ ddelta_out
    df = jnp.where(layout.is_last[:, :, None, None, None], dfinal[layout.seq_of_chunk], 0.0)
    b = b + mt @ df
    # Chunk c does not chain onto chunk c + 1 when c + 1 starts a sequence (or c is last).
    brk = jnp.concatenate([layout.reset[:, 1:], jnp.ones_like(layout.reset[:, :1])], axis=1)
    rev = lambda x: jnp.flip(x, axis=1)
    Mt, G = _segmented_compose(rev(mt), rev(b), rev(brk))
    Mt, G = rev(Mt), rev(G)
    fc, has = layout.first_chunk, (layout.seq_len > 0)[:, None, None, None]
    eye = jnp.eye(mt.shape[-1], dtype=mt.dtype)
    return (jnp.where(has, _flat_chunks(G)[fc], dfinal),
            jnp.where(has, _flat_chunks(Mt)[fc], eye))
