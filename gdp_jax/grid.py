"""The chunk grid: API tensors <-> per-chunk tensors [B, NC, HV, C, X].

GDP with n Householder steps is the gated delta rule on the interleaved sequence of
L = n*T steps (docs/ALGORITHMS.md 1): step r = t*n + j carries key k[t, j], value v[t, j],
step size beta[t, j]; the gate g[t] sits on sub-step j = 0 and the query q[t] on j = n-1.

That sequence is cut into chunks of C = 64 steps on a static grid. Packed sequences are
laid out so that every chunk belongs to ONE sequence (each sequence starts a new chunk and
its tail chunk is padded with identity steps k = v = beta = g = 0); a chunk flagged
``reset`` starts from its sequence's initial state instead of the previous chunk's end
state. Every engine (XLA, CuTe DSL) works on this grid; this module owns the layout, the
interleave, the relayouts in both directions, the readout's cotangent and which chunk rows
are read out (:func:`readout_every`).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from gdp_jax import _vma
from gdp_jax._prefix import prefix_sum
from gdp_jax.reference import l2_normalize
from gdp_jax.spec import CallSpec

CHUNK = 64


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Contiguous:
    """``src`` / ``out_slot`` of a batched (not packed) layout: row r of the chunk grid is
    interleaved step r (n T of them, then padding), token t reads out at step n t + n - 1.
    A static marker, so relayouts are pad/reshape/slice (no gather, and no scatter in the
    backward, which XLA runs far slower on the GPU)."""
    n: int
    T: int


class ChunkLayout(NamedTuple):
    """Where each chunk row comes from and how chunks chain (int32/bool arrays).

    src:          [B, NC*C] index into the interleaved step axis, -1 for padding rows
                  (a :class:`Contiguous` marker for batched layouts).
    reset:        [B, NC] chunk starts a sequence (start from its initial state).
    seq_of_chunk: [B, NC] sequence (index into initial/final states) of each chunk.
    is_last:      [B, NC] chunk is the last one of its sequence.
    first_chunk:  [N] flat chunk index (b*NC + c) of each sequence's first chunk.
    last_chunk:   [N] flat chunk index of each sequence's last chunk.
    seq_len:      [N] tokens per sequence (0 allowed).
    out_slot:     [B, T] flat row (c*C + i) holding token t's readout (sub-step n-1)
                  (the :class:`Contiguous` marker for batched layouts).
    """
    src: jax.Array
    reset: jax.Array
    seq_of_chunk: jax.Array
    is_last: jax.Array
    first_chunk: jax.Array
    last_chunk: jax.Array
    seq_len: jax.Array
    out_slot: jax.Array


class ChunkInputs(NamedTuple):
    """Per-chunk operands in the compute dtype, [B, NC, HV, C, X]; g and beta [B, NC, HV, C]."""
    q: jax.Array
    k: jax.Array
    v: jax.Array
    g: jax.Array
    beta: jax.Array


def num_chunks(L: int, N: int, packed: bool, C: int = CHUNK) -> int:
    """Static chunk count: ceil(L/C) per row, plus at most one partial chunk per sequence."""
    if not packed:
        return -(-L // C)
    return (L + N * (C - 1)) // C


def make_layout(B, T, n, cu_seqlens: Optional[jax.Array], C: int = CHUNK) -> ChunkLayout:
    """Chunk grid for B rows of T tokens (or one row of packed sequences at ``cu_seqlens``)."""
    L = n * T
    if cu_seqlens is None:
        NC = num_chunks(L, B, False, C)
        c = jnp.arange(NC)
        reset = jnp.broadcast_to(c == 0, (B, NC))
        seq_of_chunk = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, NC))
        is_last = jnp.broadcast_to(c == NC - 1, (B, NC))
        b = jnp.arange(B, dtype=jnp.int32)
        flat = Contiguous(n, T)
        return ChunkLayout(flat, reset, seq_of_chunk, is_last, b * NC, b * NC + NC - 1,
                           jnp.full((B,), T, jnp.int32), flat)

    cu = cu_seqlens.astype(jnp.int32)
    N = cu.shape[0] - 1
    NC = num_chunks(L, N, True, C)
    seq_len = cu[1:] - cu[:-1]                                   # [N] tokens
    steps = n * seq_len                                          # [N] interleaved steps
    nchunks = (steps + C - 1) // C
    chunk_start = jnp.concatenate([jnp.zeros((1,), jnp.int32), prefix_sum(nchunks)[:-1]])
    c = jnp.arange(NC, dtype=jnp.int32)
    # Ties (zero-length sequences share a start) resolve to the later, non-empty one.
    s = jnp.clip(jnp.searchsorted(chunk_start, c, side="right") - 1, 0, N - 1).astype(jnp.int32)
    reset = (c == chunk_start[s]) & (steps[s] > 0)
    is_last = (c == chunk_start[s] + nchunks[s] - 1) & (steps[s] > 0)
    rows = jnp.arange(NC * C, dtype=jnp.int32)
    rs = s[rows // C]
    pos = (rows // C - chunk_start[rs]) * C + rows % C           # step within the sequence
    src = jnp.where(pos < steps[rs], n * cu[rs] + pos, -1)
    t = jnp.arange(T, dtype=jnp.int32)
    ts = jnp.clip(jnp.searchsorted(cu, t, side="right") - 1, 0, N - 1)
    out_slot = chunk_start[ts] * C + n * (t - cu[ts]) + n - 1
    last_chunk = jnp.maximum(chunk_start + nchunks - 1, 0)
    return ChunkLayout(src[None], reset[None], s[None], is_last[None], chunk_start,
                       last_chunk, seq_len, out_slot[None])


def to_chunks(layout: ChunkLayout, x: jax.Array, C: int = CHUNK) -> jax.Array:
    """[B, L, HV, ...] interleaved steps -> [B, NC, HV, C, ...] (padding rows are zero)."""
    B = x.shape[0]
    src = layout.src
    if isinstance(src, Contiguous):
        NC = layout.reset.shape[1]
        pad = [(0, 0), (0, NC * C - x.shape[1])] + [(0, 0)] * (x.ndim - 2)
        y = jnp.pad(x, pad).reshape((B, NC, C) + x.shape[2:])
        return jnp.moveaxis(y, 2, 3)
    idx = jnp.clip(src, 0, x.shape[1] - 1)
    y = jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)
    y = jnp.where((src >= 0).reshape(src.shape + (1,) * (x.ndim - 2)), y, 0)
    NC = src.shape[1] // C
    y = y.reshape((B, NC, C) + x.shape[2:])
    return jnp.moveaxis(y, 2, 3)                                  # rows after the head axis


def readout_every(n: int, C: int = CHUNK) -> int:
    """The row stride of the read-out rows of every chunk: n when n divides C, else 1.

    Token t's steps are rows n t .. n t + n - 1 of its sequence, and every sequence starts
    a chunk (both layouts of :func:`make_layout`; also every CP rank's and intra-CP
    segment's local layout, built by the same function), so with n | C the rows read out
    (sub-step n - 1) are exactly rows n - 1, 2n - 1, .., C - 1 of every chunk; the other
    rows of q are zeros and their readout terms can be skipped. Otherwise (n = 3: a token
    may cross a chunk boundary) 1: every row is treated as read out."""
    return n if C % n == 0 else 1


def every_of(rows: int, C: int = CHUNK) -> int:
    """The readout stride of a chunk tensor with ``rows`` rows per chunk (C or C / every)."""
    if rows < 1 or C % rows:
        raise ValueError(f"{rows} rows per chunk are not the readout rows of {C}")
    return C // rows


def readout_rows(x: jax.Array, every: int, axis: int = -2) -> jax.Array:
    """Rows every - 1, 2 every - 1, .. of ``axis`` (the C chunk rows): [.., C, X] ->
    [.., C / every, X] (``axis=-1`` for [.., C] vectors). Row r of the result is chunk row
    every r + every - 1. ``every = 1``: x itself."""
    if every == 1:
        return x
    return lax.slice_in_dim(x, every - 1, x.shape[axis], every, axis=axis % x.ndim)


def from_readout_rows(x: jax.Array, every: int, axis: int = -2) -> jax.Array:
    """Transpose of :func:`readout_rows`: [.., C / every, X] -> [.., C, X] with zeros in
    the rows that are not read out (a pad and a reshape, no scatter)."""
    if every == 1:
        return x
    axis = axis % x.ndim
    y = jnp.expand_dims(x, axis + 1)
    pad = [(0, 0)] * y.ndim
    pad[axis + 1] = (every - 1, 0)
    y = jnp.pad(y, pad)
    return y.reshape(x.shape[:axis] + (x.shape[axis] * every,) + x.shape[axis + 1:])


def readout_lower(rows: int, C: int = CHUNK, strict: bool = False) -> jax.Array:
    """Causality of the read-out rows, [rows, C] bool: readout row r (chunk row
    i = every r + every - 1, every = C / rows) reads chunk rows j <= i (j < i with
    ``strict``). rows = C: ``tril`` (``tril(.., -1)``)."""
    i = (jnp.arange(rows) + 1) * every_of(rows, C) - 1
    j = jnp.arange(C)
    return j[None, :] < i[:, None] if strict else j[None, :] <= i[:, None]


def from_chunks(layout: ChunkLayout, y: jax.Array) -> jax.Array:
    """Readout rows: [B, NC, HV, C, V] -> [B, T, HV, V] at each token's last sub-step.

    ``y`` may hold all C rows of every chunk or only its read-out rows
    ([B, NC, HV, C / every, V], :func:`readout_rows` with every = :func:`readout_every`)."""
    B, NC, HV, Cr, V = y.shape
    every = every_of(Cr)
    flat = jnp.moveaxis(y, 3, 2).reshape(B, NC * Cr, HV, V)
    if isinstance(layout.out_slot, Contiguous):
        n, T = layout.out_slot.n, layout.out_slot.T
        if every == 1:
            return flat[:, :n * T].reshape(B, T, n, HV, V)[:, :, n - 1]
        assert every == n, (every, n)
        return flat[:, :T]              # token t is read-out row t of its row
    # out_slot = c C + i with i = every - 1 (mod every): readout row c (C / every) + i // every
    return jnp.take_along_axis(flat, (layout.out_slot // every)[:, :, None, None], axis=1)


def interleave(q, k, v, g, beta, *, H, HV, compute_dtype, use_qk_l2norm):
    """API tensors -> interleaved step tensors [B, L, HV, ...] in the compute dtype.

    q: [B, T, H, K] (placed on sub-step n-1, zero elsewhere); k: [B, T, n, H, K];
    v: [B, T, n, HV, V]; g: [B, T, HV] or None (placed on sub-step 0); beta: [B, T, n, HV].
    Key heads are repeated to the HV value heads (GVA); autodiff sums them back.
    """
    B, T, n = k.shape[:3]
    cdt = compute_dtype
    qf, kf = q.astype(cdt), k.astype(cdt)
    if use_qk_l2norm:
        qf, kf = l2_normalize(qf), l2_normalize(kf)
    group = HV // H
    qf = jnp.repeat(qf, group, axis=2)
    kf = jnp.repeat(kf, group, axis=3)
    zeros_q = jnp.zeros((B, T, n - 1) + qf.shape[2:], cdt)
    q_il = jnp.concatenate([zeros_q, qf[:, :, None]], axis=2)
    gf = jnp.zeros((B, T, HV), cdt) if g is None else g.astype(cdt)
    zeros_g = jnp.zeros((B, T, n - 1, HV), cdt)
    g_il = jnp.concatenate([gf[:, :, None], zeros_g], axis=2)
    L = n * T
    flat = lambda x: x.reshape((B, L) + x.shape[3:])
    return (flat(q_il), flat(kf), flat(v.astype(cdt)), flat(g_il), flat(beta.astype(cdt)))


def chunk_inputs(layout, q, k, v, g, beta, **kw) -> ChunkInputs:
    """API tensors -> :class:`ChunkInputs` on the layout's chunk grid."""
    q_il, k_il, v_il, g_il, b_il = interleave(q, k, v, g, beta, **kw)
    tc = lambda x: to_chunks(layout, x)
    return ChunkInputs(tc(q_il), tc(k_il), tc(v_il), tc(g_il[..., None])[..., 0],
                       tc(b_il[..., None])[..., 0])




def layout_of(spec: CallSpec, cu_seqlens) -> ChunkLayout:
    """The chunk grid of one call (``cu_seqlens``: LOCAL offsets under CP, or None)."""
    return make_layout(spec.B, spec.T, spec.n, cu_seqlens)


def chunks_of(spec: CallSpec, layout: ChunkLayout, q, k, v, g, beta) -> ChunkInputs:
    """API tensors -> :class:`ChunkInputs` in the spec's compute dtype."""
    return chunk_inputs(layout, q, k, v, g, beta, H=spec.H, HV=spec.HV,
                        compute_dtype=spec.cdt, use_qk_l2norm=spec.use_qk_l2norm)


def readout_cotangent(layout: ChunkLayout, do, every: int = 1) -> jax.Array:
    """Transpose of :func:`from_chunks`: [B, T, HV, V] -> [B, NC, HV, C / every, V] (the
    read-out rows only for ``every`` = :func:`readout_every` > 1)."""
    B, NC = layout.reset.shape
    zeros = _vma.like(jnp.zeros((B, NC, do.shape[2], CHUNK // every, do.shape[3]), do.dtype),
                      do, layout)
    _, pull = jax.vjp(lambda y: from_chunks(layout, y), zeros)
    return pull(do)[0]
