"""The xla engine's sequential passes over the chunk grid: the forward state recursion
with the readout fused into each step and the chunk-state checkpoints, and the reverse
state-gradient recursion.

By default each row's chunks are walked in ONE level (a ``lax.scan`` of NC steps on the
time-major grid, L = NC). Optionally (``MIN_BLOCKED_CHUNKS``) the chunks are cut into
blocks of L and the passes use the affine-map algebra of the CP protocol inside one device
(three stages, 2 L + NB sequential steps instead of NC, NB = ceil(NC / L) blocks):

1. every block at once: the block's map on its start state, S_end = M S_start + E
   (forward; the state with K extra columns, started from [0 | I]) or dS_start =
   M^T dS_end + gamma (reverse) - L steps;
2. every row: fold the blocks in order - NB steps of one small matmul;
3. every block at once: the pass itself from its folded start - L steps.

That pays only where a step costs a fixed time whatever its size; on the H200 the scans
are throughput-bound, so it is off (see ``MIN_BLOCKED_CHUNKS``).

Tensors are on the BLOCKED grid [L, R, HV, ...] (R = B * NB block rows): chunk j of block
row r is chunk (r % NB) * L + j of row r // NB (see :class:`Blocking`); the padding chunks
are identity maps (w = u = Kt = 0, G_last = 0), never reset, never last.

Per chunk (shapes of :class:`gdp_jax.chunked.Intra`, one chunk): Delta = u - w S,
o = qg S + P Delta, S_end = exp(G_last) S + Kt^T Delta, with qg = scale gam q and
P = scale tril(q k^T Gam); in reverse dS_end = dS_next + dfinal (last chunk),
dDelta = P^T dO + Kt dS_end, dS_start = qg^T dO + exp(G_last) dS_end - w^T dDelta.
The readout side (qg, P, o, dO) has Cr rows per chunk: all C, or with n Householder steps
only the Cr = C // n rows that are read out (``every`` = n,
:func:`gdp_jax.grid.readout_every`): the other rows of q are zeros.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from gdp_jax import _vma, chunked
from gdp_jax.grid import ChunkInputs, ChunkLayout, Contiguous, every_of, readout_rows

# Rows of more chunks than this are walked in two levels. Off (None) by default: on the
# H200 the scans turned out throughput-bound, not step-bound (benchmarks/results/history/
# 2026-12-01/two_level_scan.md: blocking L = 8..32 cost 12-13 ms against 7.4 ms unblocked
# at (8, 4096, 16, 2)); kept for rows of few problems per step, where it is untested.
MIN_BLOCKED_CHUNKS = None

# ``unroll`` of the one-level walks' ``lax.scan`` (steps per loop iteration) by platform,
# for walks of fewer than UNROLL_BELOW problems (rows x heads) per step, whose steps are
# too small to hide the loop's own cost; 1 otherwise (compile time grows with it). H200,
# s12-2 (benchmarks/results/history/2026-12-03): unroll 8 took (2, 16384, 16, 2), 32
# problems per step, from 38.13 to 34.19 ms fwd+bwd but (8, 4096, 16, 2), 128 per step,
# from 26.46 to 28.81.
SCAN_UNROLL = {"gpu": 8}
UNROLL_BELOW = 64


def _unroll(problems: int) -> int:
    return SCAN_UNROLL.get(jax.default_backend(), 1) if problems < UNROLL_BELOW else 1


def block_len(NC: int, stride: int = 1) -> int:
    """Chunks per block: NC (one level) unless NC > MIN_BLOCKED_CHUNKS, then
    ~sqrt(NC / 2) (minimises 2 L + NC / L); a multiple of the checkpoint stride
    (checkpoint groups never cross blocks)."""
    if MIN_BLOCKED_CHUNKS is None or NC <= MIN_BLOCKED_CHUNKS:
        L = NC
    else:
        L = max(2, round(math.sqrt(NC / 2)))
    return stride * -(-L // stride)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Blocking:
    """The relayout [B, NC, ...] <-> blocked [L, B * NB, ...] of one call's chunk grid."""
    B: int
    NC: int
    L: int

    @property
    def NB(self) -> int:
        return -(-self.NC // self.L)

    def block(self, x, fill=0):
        """[B, NC, ...] -> [L, B * NB, ...]; padding chunks filled with ``fill``."""
        pad = self.NB * self.L - self.NC
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
        x = x.reshape((self.B * self.NB, self.L) + x.shape[2:])
        return jnp.moveaxis(x, 1, 0)

    def unblock(self, y):
        """[L, B * NB, ...] -> [B, NC, ...]."""
        y = jnp.moveaxis(y, 0, 1).reshape((self.B, self.NB * self.L) + y.shape[2:])
        return y[:, :self.NC]

    def tree_block(self, tree):
        return jax.tree_util.tree_map(self.block, tree)

    def tree_unblock(self, tree):
        return jax.tree_util.tree_map(self.unblock, tree)

    def rows(self, x):
        """[B * NB, ...] -> [B, NB, ...]."""
        return x.reshape((self.B, self.NB) + x.shape[1:])

    def flat(self, x):
        """[B, NB, ...] -> [B * NB, ...]."""
        return x.reshape((self.B * self.NB,) + x.shape[2:])


class Flags(NamedTuple):
    """The layout's per-chunk flags on the blocked grid, [L, R]."""
    reset: jax.Array
    seq: jax.Array
    last: jax.Array


def flags(blk: Blocking, layout: ChunkLayout) -> Flags:
    return Flags(blk.block(layout.reset, False), blk.block(layout.seq_of_chunk, 0),
                 blk.block(layout.is_last, False))


def _t(x):
    return jnp.swapaxes(x, -1, -2)


def _b(mask, x):
    """Broadcast a [R] mask over x [R, ...]."""
    return mask.reshape(mask.shape + (1,) * (x.ndim - mask.ndim))


# ------------------------------------------------------------------------------ forward

class Forward(NamedTuple):
    """What the forward pass reads per chunk, blocked [L, R, HV, ...]."""
    w: jax.Array          # [C, K]
    u: jax.Array          # [C, V]
    Kt: jax.Array         # [C, K]
    G_last: jax.Array     # []
    qg: jax.Array         # [Cr, K] scale * gam * q   (Cr = C // every read-out rows)
    P: jax.Array          # [Cr, C] scale * tril(q k^T Gam)


def readout_operands(ch: ChunkInputs, it: chunked.Intra, scale, every: int = 1):
    """(qg, P) of every chunk on its read-out rows (:func:`gdp_jax.grid.readout_rows`,
    Cr = C // every): scale gam q [.., Cr, K], scale tril(q k^T Gam) [.., Cr, C]."""
    q = readout_rows(ch.q, every)
    gam, Gam = readout_rows(it.gam, every, axis=-1), readout_rows(it.Gam, every)
    return scale * gam[..., None] * q, scale * chunked.causal_scores(q, ch.k, Gam)


def forward_operands(ch: ChunkInputs, it: chunked.Intra, scale, every: int = 1,
                     narrow=None):
    """The forward pass's operands with non-finite rows masked (readout operands on the
    Cr = C // every read-out rows), and ``bad`` [.., Cr] (the output rows to set to NaN):
    :func:`gdp_jax.chunked.mask_nonfinite_rows`. ``narrow``: the matrix operands (w, u,
    Kt, qg, P) in that 16-bit dtype (the scans read them; products accumulate in
    float32 against the float32 state)."""
    qg, P = readout_operands(ch, it, scale, every)
    (w, u, Kt, qg, P), bad = chunked.mask_nonfinite_rows(it.w, it.u, it.Kt, qg, P)
    if narrow is not None:
        w, u, Kt, qg, P = (a.astype(narrow) for a in (w, u, Kt, qg, P))
    return Forward(w, u, Kt, it.G_last, qg, P), bad


# The chunk factors and forward operands computed with plain products first, and again
# with the row-causal ones (:func:`gdp_jax.chunked.causal_mm`) only when some value of the
# call is not finite (a ``lax.cond`` on one flag): matmul and add chains never turn a
# non-finite value finite, so all-finite plain results are the causal ones exactly. By
# platform: on for GPUs (H200, s12-2: fwd+bwd -10% at (8, 4096, 16, 1), -4% at n = 2);
# off elsewhere, as the cond's second branch costs ~50% more XLA compile time (CPU,
# a small fwd+bwd: 11 -> 17 s), which CPU users (demo, notebooks, tests) pay at start.
OPTIMISTIC_FACTORS = {"gpu": True}


def _optimistic() -> bool:
    return bool(OPTIMISTIC_FACTORS.get(jax.default_backend(), False))


def factors_and_operands(ch: ChunkInputs, scale, every: int = 1, narrow=None):
    """(:class:`gdp_jax.chunked.Intra`, X = (I + A)^-1, :class:`Forward` operands, ``bad``)
    of every chunk: :func:`gdp_jax.chunked.wy_factors` and :func:`forward_operands`, with
    :data:`OPTIMISTIC_FACTORS` the plain-product path where the call is all finite."""
    def causal():
        it, X = chunked.wy_factors(ch, narrow=narrow)
        return (it, X, *forward_operands(ch, it, scale, every, narrow))

    if not _optimistic():
        return causal()
    it, X = chunked.wy_factors(ch, narrow=narrow, plain=True)
    qg, P = readout_operands(ch, it, scale, every)
    if narrow is not None:
        qg, P = qg.astype(narrow), P.astype(narrow)
    x = Forward(it.w, it.u, it.Kt, it.G_last, qg, P)
    # X is not read: a non-finite entry of X makes its whole row of w = X Rw non-finite
    # (inf times a finite value is inf or NaN)
    finite = lambda a: jnp.all(jnp.isfinite(a))
    ok = finite(x.w) & finite(x.u) & finite(x.Kt) & finite(qg) & finite(P)
    bad = _vma.like(jnp.zeros(P.shape[:-1], bool), P)
    return lax.cond(ok, lambda: (it, X, x, bad), causal)


def _mm(a, b):
    """a @ b accumulated in float32 at least (:func:`gdp_jax.chunked.mm`): a 16-bit
    operand (w, Kt, qg, P, dO, a 16-bit checkpoint) against the float32 state is widened,
    not the state narrowed (16-bit state operands doubled the error of o, 3.3e-3 vs
    1.7e-3 at (8, 4096, 16, 2), H200); two 16-bit operands stay 16-bit into the product."""
    return chunked.mm(a, b)


def _advance(S, w, u, Kt, G_last):
    delta = u - _mm(w, S)
    return jnp.exp(G_last)[..., None, None] * S + _mm(_t(Kt), delta), delta


def _fold_blocks(blk: Blocking, summaries, V: int, ref, reverse: bool):
    """Stage 2: each block's incoming value from its row's block maps [R, HV, K, V + K]
    (``[c | A]``: X -> A X + c), folded in order (``reverse``: from the row's last block),
    starting from 0; -> [R, HV, K, V] (``ref``: the dtype and varying axes)."""
    c, A = blk.rows(summaries[..., :V]), blk.rows(summaries[..., V:])   # [B, NB, HV, K, .]

    def step(X, xs):
        c_b, A_b = xs
        return c_b + A_b @ X, X

    X0 = _vma.like(jnp.zeros(c.shape[:1] + c.shape[2:], ref.dtype), c, ref)
    _, into = lax.scan(step, X0, (jnp.moveaxis(c, 1, 0), jnp.moveaxis(A, 1, 0)),
                       reverse=reverse)
    return blk.flat(jnp.moveaxis(into, 0, 1))


def _block_start_states(blk: Blocking, x: Forward, f: Flags, h0):
    """Stages 1-2 of the forward: the start state of every block, [R, HV, K, V]."""
    L, R, HV, _, K = x.w.shape
    V = x.u.shape[-1]
    if blk.NB == 1:
        return _vma.like(jnp.zeros((R, HV, K, V), h0.dtype), x.w, h0)
    eye = jnp.broadcast_to(jnp.eye(K, dtype=h0.dtype), (R, HV, K, K))
    Z0 = _vma.like(jnp.concatenate([jnp.zeros((R, HV, K, V), h0.dtype), eye], -1), x.w, h0)
    h0z = jnp.concatenate([h0, jnp.zeros(h0.shape[:-1] + (K,), h0.dtype)], -1)

    def summary_step(Z, xs):
        w, u, Kt, G_last, reset, sid = xs
        Z = jnp.where(_b(reset, Z), h0z[sid], Z)
        D = -_mm(w, Z)
        D = D.at[..., :V].add(u)
        return jnp.exp(G_last)[..., None, None] * Z + _mm(_t(Kt), D), None

    Z, _ = lax.scan(summary_step, Z0, (x.w, x.u, x.Kt, x.G_last, f.reset, f.seq))
    return _fold_blocks(blk, Z, V, h0, reverse=False)


def forward(blk: Blocking, x: Forward, f: Flags, h0, N: int, stride: int = 0,
            states_dtype=None, batched: bool = False, walk_dtype=None):
    """The forward pass: (o rows [L, R, HV, C // every, V] (the rows of ``x.qg``), final
    states [N, HV, K, V],
    checkpoints [L / stride, R, HV, K, V] in ``states_dtype`` or None for stride = 0:
    the start state of chunks 0, stride, 2 stride, ... of every block).

    ``batched``: one sequence per row on one level (see :func:`is_batched`). Final
    states of sequences without a chunk are left 0 (the caller's fallback).
    ``walk_dtype``: :func:`forward_walk`."""
    L, R, HV, _, K = x.w.shape
    V = x.u.shape[-1]
    if batched:
        S, fin, o, states = forward_walk(x, f, h0, N, stride, states_dtype,
                                         _vma.like(h0, x.w), None, batched=True,
                                         walk_dtype=walk_dtype)
        return o, S, states
    S_blk = _block_start_states(blk, x, f, h0)
    fin0 = _vma.like(jnp.zeros((N, HV, K, V), h0.dtype), x.w, h0)
    _, fin, o, states = forward_walk(x, f, h0, N, stride, states_dtype, S_blk, fin0)
    return o, fin, states


def is_batched(blk: Blocking, layout: ChunkLayout) -> bool:
    """One sequence per row (not packed) walked in one level: a row's only reset is its
    first chunk and its only last chunk is its last real one (the padding after it is
    identity maps), so the walks start from h0 / dfinal and need no per-chunk flags."""
    return isinstance(layout.src, Contiguous) and blk.NB == 1


def forward_walk(x: Forward, f: Flags, h0, N: int, stride: int, states_dtype, S, fin,
                 batched: bool = False, walk_dtype=None):
    """The forward recursion over the L chunks of ``x`` [L, R, HV, ...] from the start
    states ``S`` [R, HV, K, V], final states collected into ``fin`` [N, HV, K, V]:
    (S after the last chunk, fin, o rows [L, R, HV, C, V], checkpoints or None).
    ``batched`` (:func:`is_batched`): no resets (S holds h0), ``fin`` is not touched.

    Only the state is sequential: the scan carries S and keeps every chunk's start
    state; the readout, the final states and the checkpoints are read off those
    afterwards for all chunks at once (a step is two matmuls on the state).
    ``walk_dtype`` (batched only): the kept start states in that dtype (the 16-bit
    checkpoint dtype: the readout then reads what the backward will, [L, R, HV, K, V] at
    half the bytes; the carry stays in h0's dtype)."""

    def chunk(S, xs):
        *maps, reset, sid = xs
        if not batched:
            S = jnp.where(_b(reset, S), h0[sid], S)
        keep = S if walk_dtype is None or not batched else S.astype(walk_dtype)
        if by_maps:
            ktw, ktu, G_last = maps
            return (jnp.exp(G_last)[..., None, None] * S - _mm(ktw, S)
                    + ktu.astype(S.dtype)), keep
        return _advance(S, *maps)[0], keep

    problems = x.w.shape[1] * x.w.shape[2]
    by_maps = _transition_walk(problems)
    maps = (*transitions(x), x.G_last) if by_maps else (x.w, x.u, x.Kt, x.G_last)
    S, S0 = lax.scan(chunk, S, (*maps, f.reset, f.seq), unroll=_unroll(problems))
    o = readout(x, S0)
    if not batched:
        fin = _collect_final(x, f, S0, fin)
    states = S0[::stride].astype(states_dtype) if stride else None
    return S, fin, o, states


# The walks on each chunk's affine map, S_end = exp(G_last) S - Kt^T w S + Kt^T u, with
# Kt^T w [K, K] and Kt^T u [K, V] built for all chunks before the scan (batched products;
# the identity part stays exact): a forward step is one product on the state instead of
# two dependent ones with an elementwise pass between (Delta = u - w S), and a reverse
# step exp(G_last) dS_end + [qf; -Kt^T w]^T [dO; dS_end], one product. It moves more
# bytes (the maps are [K, K], w and Kt [C, K]), so it pays only where a step's kernels
# are too small to be bandwidth-bound: by platform, walks of fewer (row, head) problems
# per step than this. H200 (s15-3, benchmarks/results/history/2026-12-04): fwd+bwd at
# (2, 16384, 16, 2), 32 problems per step, 32.74 -> 28.64 ms (float32 maps); at 128 per
# step (8, 4096, 16, n) n = 3 went 34.91 -> 37.18 ms (16-bit maps), n = 1 12.78 -> 12.98.
TRANSITION_WALK = {"gpu": 64}


def _transition_walk(problems: int) -> bool:
    return problems < TRANSITION_WALK.get(jax.default_backend(), 0)


# ... with Kt^T w and Kt^T u in float32 (else w's 16-bit dtype for 16-bit inputs). Off:
# float32 maps raised peak memory by 0.4-1.8 GB at the benchmark shapes (s15-3); 16-bit
# ones raise the error vs float64 slightly (the CLI check's n = 3 case, CPU: o 4.67e-3 ->
# 4.92e-3; on the H200 o 3.5-3.9e-3 -> 3.6-4.0e-3, FLA 4.5-4.9e-3).
WIDE_TRANSITIONS = False


def _transition_dtype(w):
    return jnp.promote_types(w.dtype, jnp.float32) if WIDE_TRANSITIONS else w.dtype


def transition(w, Kt):
    """Kt^T w [.., K, K] of every chunk (accumulated in float32, :func:`_transition_dtype`)."""
    return _mm(_t(Kt), w).astype(_transition_dtype(w))


def transitions(x: "Forward"):
    """(Kt^T w [.., K, K], Kt^T u [.., K, V]) of every chunk (accumulated in float32, in
    :func:`_transition_dtype`): its map on its start state is
    S_end = exp(G_last) S - (Kt^T w) S + Kt^T u. A non-finite row (Kt NaN there,
    :func:`forward_operands`) makes both NaN, as it makes the stepped S_end."""
    return transition(x.w, x.Kt), _mm(_t(x.Kt), x.u).astype(_transition_dtype(x.w))


# The readout qg S0 + P (u - w S0) as (qg - P w) S0 + P u: S0 [.., K, V] is then read by
# one product of Cr rows instead of two of C + Cr (w S0 and qg S0), and no [.., C, V]
# Delta is written; P w and P u meet only masked operands (w, u are zero on non-finite
# rows, :func:`forward_operands`, or all finite on the optimistic path). The reverse pass
# then reads (qg - P w)^T dO: one product per step and no [.., C, V] P^T dO for all chunks.
FOLDED_READOUT = True


# The reverse step's two products with the chunk's operands, qf^T dO - w^T dD, as one:
# [qf; -w]^T [dO; dD] with [qf; -w] stacked for all chunks before the scan - per step one
# product and two sliced operands fewer (the step's dO and dD are stacked instead). H200
# (s15-1, benchmarks/results/history/2026-12-04): fwd+bwd at (8, 4096, 16, 1) 13.42 ->
# 13.09 ms.
MERGED_REVERSE_STEP = True
# ... with [dO; dD] in dO's 16-bit dtype (dD rounded), a 16-bit product: s15-2, 13.09 ->
# 12.78 ms at (8, 4096, 16, 1), 35.52 -> 34.91 at n = 3, the GPU checks unchanged to two
# digits (the CLI's n = 3 bf16 case on CPU: gradients 5.98e-3 -> 6.22e-3, bound 1e-2).
NARROW_REVERSE_RHS = True


def folded_query(qg, P, w):
    """qg - P w [.., Cr, K], in qg's dtype (accumulated in float32): what each output row
    reads of its chunk's start state, o = (qg - P w) S0 + P u; and transposed, what the
    output-row cotangents send to it, (qg - P w)^T dO."""
    return (qg.astype(jnp.promote_types(qg.dtype, jnp.float32)) - _mm(P, w)).astype(qg.dtype)


def readout(x: Forward, S0):
    """Output rows [.., Cr, V] of every chunk from its start state S0 [.., K, V]:
    qg S0 + P Delta, Delta = u - w S0. :data:`FOLDED_READOUT`: as (qg - P w) S0 + P u,
    the folded [.., Cr, K] operand in qg's dtype; else with Delta (P's zeros never meet a
    later non-finite row: :func:`gdp_jax.chunked.causal_mm`)."""
    if FOLDED_READOUT:
        return _mm(folded_query(x.qg, x.P, x.w), S0) + _mm(x.P, x.u)
    delta = x.u - _mm(x.w, S0)
    return _mm(x.qg, S0) + chunked.causal_mm(x.P, delta)


def _chunk_of_each(flag, seq, N: int):
    """[N] flat index (into L * R) of the chunk flagged for each sequence, -1 where no
    chunk of this grid is (``flag`` [L, R]: at most one per sequence)."""
    flat = jnp.arange(flag.size, dtype=jnp.int32).reshape(flag.shape)
    return jnp.full((N,), -1, jnp.int32).at[jnp.where(flag, seq, N)].set(flat, mode="drop")


def _pick(idx, a):
    """Rows ``idx`` [N] of a per-chunk tensor a [L, R, ...] (clipped; mask the -1s)."""
    return a.reshape((-1,) + a.shape[2:])[jnp.maximum(idx, 0)]


def _collect_final(x: Forward, f: Flags, S0, fin):
    """``fin`` [N, HV, K, V] with the end state of every sequence whose last chunk is on
    this grid: that chunk's map on its start state."""
    idx = _chunk_of_each(f.last, f.seq, fin.shape[0])
    S_end = _advance(*(_pick(idx, a) for a in (S0, x.w, x.u, x.Kt, x.G_last)))[0]
    return jnp.where(_b(idx >= 0, fin), S_end.astype(fin.dtype), fin)


def states_from_checkpoints(x: Forward, f: Flags, h0, ckpts, stride: int,
                            batched: bool = False):
    """Start state of every chunk, [L, R, HV, K, V], from ``forward``'s checkpoints
    [L / stride, R, HV, K, V]: the stride - 1 chunks after each are recomputed by a scan
    of stride - 1 steps over all groups at once (recompute_chunk_num = stride - 1).
    The states come back in the checkpoints' dtype (at stride 1 the checkpoints
    themselves: a float32 copy of bfloat16 ones would hold no more information in twice
    the memory; the matmuls widen them); the recomputed ones are rounded to it too (the
    recomputing carry stays in h0's dtype)."""
    if stride == 1:
        return ckpts
    S0 = ckpts.astype(h0.dtype)
    L = x.w.shape[0]
    grp = lambda a: jnp.moveaxis(a.reshape((L // stride, stride) + a.shape[1:]), 1, 0)
    w, u, Kt, G_last = (grp(a) for a in (x.w, x.u, x.Kt, x.G_last))
    reset, sid = grp(f.reset), grp(f.seq)

    def step(S, xs):
        w, u, Kt, G_last, reset, sid = xs          # chunk j - 1's map, chunk j's reset
        S = _advance(S, w, u, Kt, G_last)[0]
        return S if batched else jnp.where(_b(reset, S), h0[sid], S), None

    def collect(S, xs):
        S, _ = step(S, xs)
        return S, S.astype(ckpts.dtype)

    xs = (w[:-1], u[:-1], Kt[:-1], G_last[:-1], reset[1:], sid[1:])
    _, rest = lax.scan(collect, _vma.like(S0, xs, h0), xs)
    S = jnp.concatenate([ckpts[None], rest], axis=0)       # [stride, L / stride, R, ...]
    return jnp.moveaxis(S, 0, 1).reshape((L,) + S.shape[2:])


# ------------------------------------------------------------------------------ reverse

class Reverse(NamedTuple):
    """What the reverse pass reads per chunk, blocked [L, R, HV, ...]."""
    w: jax.Array          # [C, K]
    Kt: jax.Array         # [C, K]
    G_last: jax.Array     # []
    qg: jax.Array         # [Cr, K] (Cr = C // every read-out rows, as in Forward)
    P: jax.Array          # [Cr, C]
    do: jax.Array         # [Cr, V] output-row cotangents


def _block_end_grads(blk: Blocking, x: Reverse, f: Flags, dfinal):
    """Stages 1-2 of the reverse pass: the gradient arriving at every block's end from
    the blocks after it, [R, HV, K, V]."""
    L, R, HV, _, K = x.w.shape
    V = x.do.shape[-1]
    if blk.NB == 1:
        return _vma.like(jnp.zeros((R, HV, K, V), dfinal.dtype), x.w, dfinal)
    eye = jnp.broadcast_to(jnp.eye(K, dtype=dfinal.dtype), (R, HV, K, K))
    Y0 = _vma.like(jnp.concatenate([jnp.zeros((R, HV, K, V), dfinal.dtype), eye], -1),
                   x.w, dfinal)
    dfz = jnp.concatenate([dfinal, jnp.zeros(dfinal.shape[:-1] + (K,), dfinal.dtype)], -1)

    def summary_step(Y, xs):
        w, Kt, G_last, qg, P, do, reset, sid, last = xs
        Y = Y + jnp.where(_b(last, Y), dfz[sid], 0)
        dD = _mm(Kt, Y)
        dD = dD.at[..., :V].add(_mm(_t(P), do).astype(Y.dtype))
        Y_start = jnp.exp(G_last)[..., None, None] * Y - _mm(_t(w), dD)
        Y_start = Y_start.at[..., :V].add(_mm(_t(qg), do).astype(Y.dtype))
        return jnp.where(_b(reset, Y_start), 0, Y_start), None

    Y, _ = lax.scan(summary_step, Y0, (*x, *f), reverse=True)
    return _fold_blocks(blk, Y, V, dfinal, reverse=True)


def reverse(blk: Blocking, x: Reverse, f: Flags, dfinal, N: int, batched: bool = False,
            walk_dtype=None):
    """The reverse state-gradient pass: (dS_end of every chunk [L, R, HV, K, V], the
    gradient at each sequence's first chunk start [N, HV, K, V]; 0 for sequences
    without a chunk). ``batched``: :func:`is_batched`; ``walk_dtype``:
    :func:`reverse_walk`."""
    L, R, HV, _, K = x.w.shape
    V = x.do.shape[-1]
    if batched:
        first, _, dS_end = reverse_walk(x, f, dfinal, N, _vma.like(dfinal, x.w), None,
                                        batched=True, walk_dtype=walk_dtype)
        return dS_end, first
    dS_blk = _block_end_grads(blk, x, f, dfinal)
    first0 = _vma.like(jnp.zeros((N, HV, K, V), dfinal.dtype), x.w, dfinal)
    _, first, dS_end = reverse_walk(x, f, dfinal, N, dS_blk, first0)
    return dS_end, first


def reverse_walk(x: Reverse, f: Flags, dfinal, N: int, dS, first, batched: bool = False,
                 walk_dtype=None):
    """The reverse recursion over the L chunks of ``x`` [L, R, HV, ...], last chunk first,
    from the gradient ``dS`` [R, HV, K, V] arriving after the last one, first-chunk
    gradients collected into ``first`` [N, HV, K, V]: (the gradient leaving the first
    chunk's start, first, dS_end of every chunk [L, R, HV, K, V]). ``batched``
    (:func:`is_batched`): ``dS`` holds dfinal, no flags; the gradient leaving the first
    chunk is the first-chunk gradient (``first`` is not touched).

    What the output rows send to the chunk start, (qg - P w)^T dO with
    :data:`FOLDED_READOUT` (else qg^T dO - w^T P^T dO with P^T dO computed for all chunks
    before the scan), is a product inside each step; the first chunks' start gradients
    are computed after the scan, from dS_end. ``walk_dtype``
    (batched only): the kept dS_end in that (16-bit) dtype, half the bytes of the
    [L, R, HV, K, V] the backward's local gradients read; the carry keeps dS's."""
    acc = dS.dtype
    w, Kt = x.w, x.Kt
    problems = x.w.shape[1] * x.w.shape[2]
    if FOLDED_READOUT:      # (qf, None): no [L, R, HV, C, V] P^T dO
        qo, ddo = folded_query(x.qg, x.P, x.w), None
        if _transition_walk(problems):   # [qf; -Kt^T w] [.., Cr + K, K]
            ktw = transition(x.w, x.Kt)
            qo = jnp.concatenate([qo.astype(ktw.dtype), -ktw], axis=-2)
            w, Kt = None, None
        elif MERGED_REVERSE_STEP:   # [qf; -w] [.., Cr + C, K]: one operand, one product
            qo, w = jnp.concatenate([qo, -x.w], axis=-2), None
    else:
        qo, ddo = x.qg, _mm(_t(x.P), x.do).astype(acc)           # [L, R, HV, C, V]

    def step(dS, xs):
        w, Kt, G_last, qo, ddo, do, reset, sid, last = xs
        if batched:
            dS_start = _start_grad(w, Kt, G_last, qo, ddo, do, dS)
            return dS_start, dS if walk_dtype is None else dS.astype(walk_dtype)
        dS_end = dS + jnp.where(_b(last, dS), dfinal[sid], 0)
        dS_start = _start_grad(w, Kt, G_last, qo, ddo, do, dS_end)
        return jnp.where(_b(reset, dS), 0, dS_start), dS_end

    xs = (w, Kt, x.G_last, qo, ddo, x.do, f.reset, f.seq, f.last)
    dS, dS_end = lax.scan(step, dS, xs, reverse=True, unroll=_unroll(problems))
    if batched:
        return dS, first, dS_end
    idx = _chunk_of_each(f.reset, f.seq, N)
    pick = lambda a: None if a is None else _pick(idx, a)
    at_first = _start_grad(*(pick(a) for a in xs[:6]), _pick(idx, dS_end))
    first = jnp.where(_b(idx >= 0, first), at_first.astype(first.dtype), first)
    return dS, first, dS_end


def _start_grad(w, Kt, G_last, qo, ddo, do, dS_end):
    """A chunk's start-state gradient from its end-state gradient dS_end [.., K, V]:
    qg^T dO + exp(G_last) dS_end - w^T (P^T dO + Kt dS_end). ``ddo`` None: ``qo`` is the
    folded query qg - P w (:func:`folded_query`), and the step is
    qo^T dO + exp(G_last) dS_end - w^T Kt dS_end; else qo = qg and ddo = P^T dO.
    ``w`` None (:data:`MERGED_REVERSE_STEP`): ``qo`` is [qf; -w] [.., Cr + C, K] and the
    last two terms one product, [qf; -w]^T [dO; Kt dS_end]; ``Kt`` None too
    (:data:`TRANSITION_WALK`): ``qo`` is [qf; -Kt^T w] [.., Cr + K, K] and the step
    exp(G_last) dS_end + [qf; -Kt^T w]^T [dO; dS_end]."""
    acc = dS_end.dtype
    decayed = jnp.exp(G_last)[..., None, None] * dS_end
    if Kt is None:          # qo = [qf; -Kt^T w]
        return decayed + _mm(_t(qo), jnp.concatenate([do.astype(acc), dS_end], axis=-2))
    dD = _mm(Kt, dS_end) if ddo is None else ddo + _mm(Kt, dS_end)
    if w is None:           # qo = [qf; -w]
        rhs_dtype = do.dtype if NARROW_REVERSE_RHS and do.dtype.itemsize == 2 else acc
        rhs = jnp.concatenate([do.astype(rhs_dtype), dD.astype(rhs_dtype)], axis=-2)
        return decayed + _mm(_t(qo), rhs)
    return _mm(_t(qo), do).astype(acc) + decayed - _mm(_t(w), dD)


# ------------------------------------------------------- segments: bounded memory per pass

# A pass over more (chunk, row, head) problems than this runs in segments of consecutive
# chunks: the chunk-local factors and gradients of one segment at a time (a ``lax.scan``
# over segments carrying the state), so the temporaries stay the size of one segment while
# the walk is the same NC sequential steps. Below it everything is computed at once, which
# is what the benchmark shapes up to (8, 4096, 16, 3) and (2, 16384, 16, 2) run.
MAX_PROBLEMS = 32768
SEGMENT_PROBLEMS = 8192


def segment_len(NC: int, rows: int, stride: int = 1):
    """Chunks per segment for NC chunks of ``rows`` (row, head) pairs, a multiple of the
    checkpoint stride; None when one segment (no segmenting) is used."""
    if NC * rows <= MAX_PROBLEMS:
        return None
    Ls = max(1, SEGMENT_PROBLEMS // rows)
    Ls = stride * max(1, Ls // stride)
    return None if Ls >= NC else Ls


def _segments(Ls: int, tree):
    """[L, ...] -> [L / Ls, Ls, ...] for every leaf."""
    return jax.tree_util.tree_map(lambda a: a.reshape((a.shape[0] // Ls, Ls) + a.shape[1:]),
                                  tree)


def _unsegment(tree):
    return jax.tree_util.tree_map(lambda a: a.reshape((-1,) + a.shape[2:]), tree)


def forward_segmented(chb: ChunkInputs, f: Flags, h0, N: int, stride: int, states_dtype,
                      scale, Ls: int, batched: bool = False, every: int = 1, narrow=None,
                      walk_dtype=None):
    """The xla engine's forward in segments of Ls chunks (one level, L a multiple of Ls):
    each segment's factors and operands, then its walk from the carried state. Returns
    (o rows [L, R, HV, C // every, V] with non-finite rows NaN, final states, checkpoints
    or None). ``batched``: :func:`is_batched`; ``every``, ``narrow``:
    :func:`forward_operands`; ``walk_dtype``: :func:`forward_walk`."""
    L, R, HV, _, K = chb.k.shape
    V = chb.v.shape[-1]
    S0 = _vma.like(h0 if batched else jnp.zeros((R, HV, K, V), h0.dtype), chb.k, h0)
    fin0 = None if batched else _vma.like(jnp.zeros((N, HV, K, V), h0.dtype), chb.k, h0)

    def step(carry, xs):
        c, fs = xs
        _, _, x, bad = factors_and_operands(c, scale, every, narrow)
        S, fin, o, states = forward_walk(x, fs, h0, N, stride, states_dtype, *carry,
                                         batched=batched, walk_dtype=walk_dtype)
        o = jnp.where(bad[..., None], jnp.asarray(jnp.nan, o.dtype), o)
        return (S, fin), (o, states)

    (S, fin), (o, states) = lax.scan(step, (S0, fin0), _segments(Ls, (chb, f)))
    return _unsegment(o), S if batched else fin, None if states is None else _unsegment(states)


def backward_segmented(chb: ChunkInputs, docb, f: Flags, h0, dfinal, states, N: int,
                       stride: int, scale, Ls: int, batched: bool = False, narrow=None,
                       walk_dtype=None):
    """The xla engine's backward in segments of Ls chunks, last segment first: each
    segment's factors, its chunk start states from the checkpoints, its reverse walk from
    the carried gradient and its chunk-local gradients. Returns (the chunk-input
    cotangents on the blocked grid, the first-chunk start-state gradients [N, HV, K, V]).
    ``batched``: :func:`is_batched`. ``docb`` [L, R, HV, C // every, V]: all rows or the
    read-out rows (the readout terms then run on those only). ``narrow``,
    ``walk_dtype``: :func:`forward_segmented`'s, and dS_end kept in ``walk_dtype``."""
    L, R, HV, _, K = chb.k.shape
    V = chb.v.shape[-1]
    every = every_of(docb.shape[-2], chb.k.shape[-2])
    dS0 = _vma.like(dfinal if batched else jnp.zeros((R, HV, K, V), dfinal.dtype),
                    chb.k, dfinal)
    first0 = None if batched else _vma.like(jnp.zeros((N, HV, K, V), dfinal.dtype),
                                            chb.k, dfinal)

    def step(carry, xs):
        c, do, fs, st = xs
        it, X, x, _ = factors_and_operands(c, scale, every, narrow)
        S0 = states_from_checkpoints(x, fs, h0, st, stride, batched=batched)
        rev = Reverse(it.w, it.Kt, it.G_last, x.qg, x.P, do)
        dS, first, dS_end = reverse_walk(rev, fs, dfinal, N, *carry, batched=batched,
                                         walk_dtype=walk_dtype)
        dch = chunked.local_grads_direct(c, it, X, S0, do, dS_end, scale)
        return (dS, first), dch

    seg_states = states.reshape((L // Ls, Ls // stride) + states.shape[1:])
    (dS, first), dch = lax.scan(step, (dS0, first0),
                                (*_segments(Ls, (chb, docb, f)), seg_states), reverse=True)
    return _unsegment(dch), dS if batched else first
