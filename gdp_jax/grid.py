"""The chunk grid: API tensors <-> per-chunk tensors [B, NC, HV, C, X].

GDP with n Householder steps is the gated delta rule on the interleaved sequence of
L = n*T steps (docs/ALGORITHMS.md 1): step r = t*n + j carries key k[t, j], value v[t, j],
step size beta[t, j]; the gate g[t] sits on sub-step j = 0 and the query q[t] on j = n-1.

That sequence is cut into chunks of C = 64 rows on a static grid. A chunk holds whole
tokens: the S = n (C // n) steps of C // n tokens (:func:`steps_per_chunk`; S = C when n
divides C), then C - S identity rows (k = v = beta = g = 0), so token t's readout is row
n (t mod C // n) + n - 1 of its chunk, at the same stride in every chunk. Packed sequences
are laid out so that every chunk belongs to ONE sequence (each sequence starts a new chunk
and its tail chunk is padded with identity steps); a chunk flagged ``reset`` starts from
its sequence's initial state instead of the previous chunk's end state. Every engine (XLA,
CuTe DSL) works on this grid; this module owns the layout, the interleave, the relayouts in
both directions, the readout's cotangent and which chunk rows are read out
(:func:`readout_every`).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from gdp_jax import _vma
from gdp_jax._prefix import prefix_sum
from gdp_jax.norm import l2_normalize as invariant_l2_normalize, repeat_heads
from gdp_jax.reference import l2_normalize
from gdp_jax.spec import CallSpec

CHUNK = 64
# Rows a chunk of the kernels' readout operands (qg, P) and output has where only the
# read-out rows are kept (n >= 2 sub-steps a token: C // n <= 32 rows, then padding);
# equals gdp_jax.kernels.sm90.READOUT_ROWS
READOUT_ROWS = 32


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Contiguous:
    """``src`` / ``out_slot`` of a batched (not packed) layout: row i of chunk c holds
    interleaved step c S + i for i < S = :func:`steps_per_chunk` (n T steps, then
    padding), token t reads out at row n (t mod C // n) + n - 1 of chunk t // (C // n).
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
    """Per-chunk operands, [B, NC, HV, C, X]; g and beta [B, NC, HV, C]. In the compute
    dtype, but for the fields an engine reads narrower (``Engine.input_dtypes``)."""
    q: jax.Array
    k: jax.Array
    v: jax.Array
    g: jax.Array
    beta: jax.Array


def steps_per_chunk(n: int, C: int = CHUNK) -> int:
    """Interleaved steps per chunk: n (C // n), the steps of the C // n whole tokens a chunk
    holds (C when n divides C; the last C - n (C // n) rows are identity steps), or C for
    n > C, where a token's steps run across chunks."""
    return n * (C // n) if n <= C else C


def num_chunks(T: int, n: int, N: int, packed: bool, C: int = CHUNK) -> int:
    """Static chunk count of T tokens of n steps: ceil(n T / S) per row (S =
    :func:`steps_per_chunk`), plus at most one partial chunk per packed sequence."""
    S = steps_per_chunk(n, C)
    if not packed:
        return -(-n * T // S)
    return (n * T + N * (S - 1)) // S


def make_layout(B, T, n, cu_seqlens: Optional[jax.Array], C: int = CHUNK) -> ChunkLayout:
    """Chunk grid for B rows of T tokens (or one row of packed sequences at ``cu_seqlens``)."""
    S = steps_per_chunk(n, C)
    if cu_seqlens is None:
        NC = num_chunks(T, n, B, False, C)
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
    NC = num_chunks(T, n, N, True, C)
    seq_len = cu[1:] - cu[:-1]                                   # [N] tokens
    steps = n * seq_len                                          # [N] interleaved steps
    nchunks = (steps + S - 1) // S
    chunk_start = jnp.concatenate([jnp.zeros((1,), jnp.int32), prefix_sum(nchunks)[:-1]])
    c = jnp.arange(NC, dtype=jnp.int32)
    # Ties (zero-length sequences share a start) resolve to the later, non-empty one.
    s = jnp.clip(jnp.searchsorted(chunk_start, c, side="right") - 1, 0, N - 1).astype(jnp.int32)
    reset = (c == chunk_start[s]) & (steps[s] > 0)
    is_last = (c == chunk_start[s] + nchunks[s] - 1) & (steps[s] > 0)
    rows = jnp.arange(NC * C, dtype=jnp.int32)
    rs, i = s[rows // C], rows % C
    pos = (rows // C - chunk_start[rs]) * S + i                  # step within the sequence
    src = jnp.where((i < S) & (pos < steps[rs]), n * cu[rs] + pos, -1)
    t = jnp.arange(T, dtype=jnp.int32)
    ts = jnp.clip(jnp.searchsorted(cu, t, side="right") - 1, 0, N - 1)
    step = n * (t - cu[ts]) + n - 1                              # readout step in the sequence
    out_slot = (chunk_start[ts] + step // S) * C + step % S
    last_chunk = jnp.maximum(chunk_start + nchunks - 1, 0)
    return ChunkLayout(src[None], reset[None], s[None], is_last[None], chunk_start,
                       last_chunk, seq_len, out_slot[None])


def to_chunks(layout: ChunkLayout, x: jax.Array, C: int = CHUNK) -> jax.Array:
    """[B, L, HV, ...] interleaved steps -> [B, NC, HV, C, ...] (padding rows are zero)."""
    B = x.shape[0]
    src = layout.src
    if isinstance(src, Contiguous):
        NC, S = layout.reset.shape[1], steps_per_chunk(src.n, C)
        pad = [(0, 0), (0, NC * S - x.shape[1])] + [(0, 0)] * (x.ndim - 2)
        y = jnp.pad(x, pad).reshape((B, NC, S) + x.shape[2:])
        if S < C:                                                 # identity rows
            y = jnp.pad(y, [(0, 0), (0, 0), (0, C - S)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(y, 2, 3)
    idx = jnp.clip(src, 0, x.shape[1] - 1)
    y = jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)
    y = jnp.where((src >= 0).reshape(src.shape + (1,) * (x.ndim - 2)), y, 0)
    NC = src.shape[1] // C
    y = y.reshape((B, NC, C) + x.shape[2:])
    return jnp.moveaxis(y, 2, 3)                                  # rows after the head axis


def readout_every(n: int, C: int = CHUNK) -> int:
    """The row stride of the read-out rows of every chunk: n where C // n read-out rows
    name n back (:func:`every_of`; n = 1..10, 12, 16, 21, 32, 64 for C = 64), else 1 (all
    rows are treated as read out).

    Every chunk holds whole tokens from its first row on (:func:`steps_per_chunk`; also
    every CP rank's and intra-CP segment's local layout, built by the same function), so
    the rows read out (sub-step n - 1) are exactly rows n - 1, 2n - 1, .., n (C // n) - 1 of
    every chunk: C // n rows; the other rows of q are zeros and their readout terms can be
    skipped."""
    if n > C or C // (C // n) != n:
        return 1
    return n


def every_of(rows: int, C: int = CHUNK) -> int:
    """The readout stride of a chunk tensor with ``rows`` rows per chunk (C, or C // every
    read-out rows)."""
    if rows == C:
        return 1
    every = C // rows if 1 <= rows < C else 0
    if every < 2 or C // every != rows:
        raise ValueError(f"{rows} rows per chunk are not the readout rows of {C}")
    return every


def readout_rows(x: jax.Array, every: int, axis: int = -2) -> jax.Array:
    """Rows every - 1, 2 every - 1, .. of ``axis`` (the C chunk rows): [.., C, X] ->
    [.., C // every, X] (``axis=-1`` for [.., C] vectors). Row r of the result is chunk
    row every r + every - 1. ``every = 1``: x itself."""
    if every == 1:
        return x
    return lax.slice_in_dim(x, every - 1, x.shape[axis], every, axis=axis % x.ndim)


def from_readout_rows(x: jax.Array, every: int, axis: int = -2, C: int = CHUNK) -> jax.Array:
    """Transpose of :func:`readout_rows`: [.., C // every, X] -> [.., C, X] with zeros in
    the rows that are not read out (pads and a reshape, no scatter)."""
    if every == 1:
        return x
    axis = axis % x.ndim
    y = jnp.expand_dims(x, axis + 1)
    pad = [(0, 0)] * y.ndim
    pad[axis + 1] = (every - 1, 0)
    y = jnp.pad(y, pad)
    y = y.reshape(x.shape[:axis] + (x.shape[axis] * every,) + x.shape[axis + 1:])
    tail = [(0, 0)] * y.ndim
    tail[axis] = (0, C - y.shape[axis])             # C % every rows after the last token
    return jnp.pad(y, tail)


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
    ([B, NC, HV, C // every, V], :func:`readout_rows` with every = :func:`readout_every`)."""
    B, NC, HV, Cr, V = y.shape
    every = every_of(Cr)
    if isinstance(layout.out_slot, Contiguous):
        n, T = layout.out_slot.n, layout.out_slot.T
        if n > CHUNK:                   # tokens run across chunks; all rows
            flat = jnp.moveaxis(y, 3, 2).reshape(B, NC * Cr, HV, V)
            return flat[:, :n * T].reshape(B, T, n, HV, V)[:, :, n - 1]
        if every == 1:                  # all rows: each token's last sub-step is a row
            y = readout_rows(y, n)      # n - 1 (mod n) of the first n (C // n): a slice
        else:
            assert every == n, (every, n)
        flat = jnp.moveaxis(y, 3, 2).reshape(B, -1, HV, V)
        return flat[:, :T]              # token t is read-out row t of its row
    flat = jnp.moveaxis(y, 3, 2).reshape(B, NC * Cr, HV, V)
    # out_slot = c C + i with i = every - 1 (mod every): read-out row c Cr + i // every
    slot = layout.out_slot
    if every > 1:
        slot = slot // CHUNK * Cr + slot % CHUNK // every
    return jnp.take_along_axis(flat, slot[:, :, None, None], axis=1)


def token_inputs(q, k, v, g, beta, *, H, HV, compute_dtype, use_qk_l2norm,
                 batch_invariant: bool = False):
    """API tensors -> per-token operands in the compute dtype: the op's only nonlinear
    input map (the L2 norm) and the GVA repeat; :func:`steps_to_chunks` then only moves
    them.

    Returns q [B, T, HV, K], k [B, T, n, HV, K], v [B, T, n, HV, V], g [B, T, HV] (zeros
    for None), beta [B, T, n, HV]. Key heads are repeated to the HV value heads (GVA);
    autodiff sums them back. ``batch_invariant``: the norm's sums and the GVA head sum in an
    order that does not depend on the tensor's shape (:mod:`gdp_jax.norm`; the op's flag).
    """
    B, T = k.shape[:2]
    cdt = compute_dtype
    qf, kf = q.astype(cdt), k.astype(cdt)
    if use_qk_l2norm:
        norm = invariant_l2_normalize if batch_invariant else l2_normalize
        qf, kf = norm(qf), norm(kf)
    group = HV // H
    if batch_invariant:
        qf, kf = repeat_heads(qf, group, 2), repeat_heads(kf, group, 3)
    else:
        qf, kf = jnp.repeat(qf, group, axis=2), jnp.repeat(kf, group, axis=3)
    gf = jnp.zeros((B, T, HV), cdt) if g is None else g.astype(cdt)
    return qf, kf, v.astype(cdt), gf, beta.astype(cdt)


def steps_to_chunks(layout: ChunkLayout, q, k, v, g, beta) -> ChunkInputs:
    """:func:`token_inputs`' per-token operands -> :class:`ChunkInputs` on the layout's
    grid, in their own dtypes: the interleave (docs/ALGORITHMS.md 1: q on sub-step n - 1,
    g on sub-step 0, zeros on the others) and :func:`to_chunks`. Linear: its vjp only
    moves cotangents (in whatever dtype they come)."""
    B, T, n = k.shape[:3]
    q_il = jnp.concatenate([jnp.zeros((B, T, n - 1) + q.shape[2:], q.dtype), q[:, :, None]],
                           axis=2)
    g_il = jnp.concatenate([g[:, :, None], jnp.zeros((B, T, n - 1) + g.shape[2:], g.dtype)],
                           axis=2)
    tc = lambda x: to_chunks(layout, x.reshape((B, n * T) + x.shape[3:]))
    return ChunkInputs(tc(q_il), tc(k), tc(v), tc(g_il[..., None])[..., 0],
                       tc(beta[..., None])[..., 0])


def chunk_inputs(layout, q, k, v, g, beta, **kw) -> ChunkInputs:
    """API tensors -> :class:`ChunkInputs` on the layout's chunk grid (``kw``: those of
    :func:`token_inputs`)."""
    return steps_to_chunks(layout, *token_inputs(q, k, v, g, beta, **kw))


def layout_of(spec: CallSpec, cu_seqlens) -> ChunkLayout:
    """The chunk grid of one call (``cu_seqlens``: LOCAL offsets under CP, or None)."""
    return make_layout(spec.B, spec.T, spec.n, cu_seqlens)


def tokens_of(spec: CallSpec, q, k, v, g, beta):
    """API tensors -> :func:`token_inputs` in the spec's compute dtype."""
    return token_inputs(q, k, v, g, beta, H=spec.H, HV=spec.HV, compute_dtype=spec.cdt,
                        use_qk_l2norm=spec.use_qk_l2norm, batch_invariant=spec.batch_invariant)


def chunks_of(spec: CallSpec, layout: ChunkLayout, q, k, v, g, beta) -> ChunkInputs:
    """API tensors -> :class:`ChunkInputs` in the spec's compute dtype."""
    return steps_to_chunks(layout, *tokens_of(spec, q, k, v, g, beta))


def readout_cotangent(layout: ChunkLayout, do, every: int = 1) -> jax.Array:
    """Transpose of :func:`from_chunks`: [B, T, HV, V] -> [B, NC, HV, C // every, V] (the
    read-out rows only for ``every`` = :func:`readout_every` > 1)."""
    B, NC = layout.reset.shape
    zeros = _vma.like(jnp.zeros((B, NC, do.shape[2], CHUNK // every, do.shape[3]), do.dtype),
                      do, layout)
    _, pull = jax.vjp(lambda y: from_chunks(layout, y), zeros)
    return pull(do)[0]
