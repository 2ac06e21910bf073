"""CuTe DSL kernel: the forward's per-chunk operands, every chunk in parallel.

One CTA (4 warps) per (chunk, value head, batch row) reads the chunk inputs q, k [C, K],
v [C, V] (16-bit), g, beta [C] (float32) and the row's readout scale, and writes what the
forward chunk kernel reads (``gdp_jax.kernels.chunk_fwd_sm90``), already made causal-safe,
and with ``inverse`` also X (float32) for the backward (``gdp_jax.kernels.chunk_grad_sm90``):

    seg_ij = g_{j+1} + ... + g_i (j <= i), Gam = exp(seg), G_i = g_0 + ... + g_i, gam = exp(G)
    A  = tril(beta K K^T * Gam, -1),   X = (I + A)^-1
    w  = X diag(beta gam) K,  u = X diag(beta) V,  Kt = exp(G_last - G) K
    qg = scale gam q,  P = scale tril(Q K^T * Gam),  decay = exp(G_last)

with the non-finite row rules of ``gdp_jax.kernels.pipeline.causal_operands`` (a row whose
w or u is not finite enters as zeros with a NaN Kt row, output rows from the first such row
on are flagged ``bad``; a non-finite readout row (qg, P) enters as zeros and is flagged;
the values of qg and P in flagged rows are not part of the contract).

Precision: q, k, v are exact 16-bit MMA operands, so K K^T and Q K^T are single MMAs with
float32 accumulation; X is float32 and enters w and u with its column scales folded in,
split hi + lo (x = hi + lo to ~2^-16 relative): w and u carry no 16-bit rounding of X or
of beta, gam (X's entries reach ~1e2 when beta ~ 2).

With ``tokens`` q, k, v come from the op's token-major tensors q [B, T, H, K],
k [B, n T, H, K], v [B, n T, HV, V] instead (chunk row i = step base + i of the row table
``mRows``, q on the read-out rows i = n - 1 mod n, the key head hv // (HV / H)), and with
``l2norm`` phase 1 first L2-normalises the q rows in registers (the lanes holding a row
reduce by butterfly shuffles) and writes the 16-bit normalised rows back to smem; k's rows
likewise, or with ``gram_norm`` they stay raw and phase 2 takes rho_i = 1 / |k_i| from
the diagonal of K K^T (scaling A, P, w's column scales and Kt; Kt is then stored after
phase 2).

Phases, separated by CTA barriers:
  0. cp.async of the q, k, v tiles (128-bit, swizzled smem), overlapped with the gates:
     thread i < C sums its row's segment sums from the diagonal down (the XLA
     ``segment_sums`` order: never a difference of cumsums, safe for strong gates) into
     Gam (float32 smem); threads C.. sum G_last - G_i the same way.
  1. each thread, on its cp.async elements: row flags of k and v (a non-finite row is
     zeroed in smem, so it cannot reach other rows through the MMAs), Kt and qg to global.
  2. K K^T and Q K^T on warp MMAs; epilogue A (in place of Gam, float32) and P (stored).
  3. X = (I + A)^-1 in 32 x 32 blocks: the two diagonal blocks by forward substitution
     (warps 0, 1: a thread per column), then X21 = -X22 (A21 X11) with every thread.
  4. w = (X diag(beta gam))_hi+lo K, u = (X diag(beta))_hi+lo V on warp MMAs, the A
     operands built in registers from X; row flags; stores; row rules.

Where the tiles wait (opt-ins): ``late_v`` commits v's cp.async group apart and waits for
it, and takes v's row flags, only before phase 4. ``pipelined`` makes the kernel persistent
(2 x SMs CTAs, 2 an SM; each takes chunks block, block + grid, ...): k's and q's tiles have
two smem stages, so the next chunk's k, q load while this one computes, its v tile (one
stage) loads once this chunk's u product has read it, its g, beta into registers (the
row-table entry a chunk earlier still); phases
0-4 and the row rules are the same code (``_tile``) either way.

Row flags (is a row finite?) come without branches: each lane sums x * 0 over its
elements of the row (0, or NaN if one is inf or NaN) and the lanes holding the row (a
half warp or less in phase 1, a quad of an MMA accumulator) combine theirs by one warp
ballot; every lane then stores the same flag. The row rules (prefix ORs over the rows)
are ballots too.

This module imports cutlass; import it only through ``gdp_jax.kernels.chunk_prep`` (lazily).
"""
from __future__ import annotations

import cutlass
import cutlass.memory
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp

from gdp_jax.kernels.sm90 import (C, L2_EPS, MMA_K, NUM_THREADS, READOUT_ROWS, RegOperand,
                                  ab_type, c_tile, g2s, l2_normalize_rows,
                                  g2s_copy, ldmatrix_copies, make_acc, mma_split_b,
                                  offsets32, operand, smem_layout, smem_tile,
                                  top_rows_view, transpose_view,
                                  warp_mma, wg_operand, wg_products, wg_tiled)
from gdp_jax.kernels.sm90 import pick as _pick

F32 = cutlass.Float32
I32 = cutlass.Int32
INF = float("inf")
HB = C // 2         # the inverse's block size
# row stride of the float32 [C, C] tiles (Gam / A, X): rows 16 bytes aligned, so the
# inverse reads 4 consecutive entries of a row in one shared load (its loads, not its
# FMAs, bound it); 68 also spreads a column of rows and an MMA fragment over the banks
PAD = C + 4
# CTAs an SM runs at once: the ~70 KB of shared memory allow 3 and the registers are
# capped to fit them (unbounded, the assembler took ~190 a thread: 2 CTAs); the kernel's
# phases are latency-bound, so more CTAs in flight hide more of it
CTAS_PER_SM = 3
# with ``gram_norm``: a k row with an entry of at least this size is normalised in
# registers first (its squares could overflow float32 in K K^T); 2^56: 128 squares < 2^120
GRAM_BIG = float(2 ** 56)


def _finite(x):
    """x is neither inf nor NaN (a comparison: NaN < inf is false)."""
    return cute.math.absf(x) < F32(INF)


def _nonfinite(z, lanes: int):
    """Int32 1 if a row holds an inf or NaN, else 0. ``z``: this lane's sum of x * 0 over
    its elements of the row (0, or NaN if one is not finite), over the row's ``lanes``
    lanes (aligned groups of a power of two <= 16) by one warp ballot; every lane of the
    group gets the answer, so all of them may store it. All 32 lanes must call it."""
    good = cute.arch.vote_ballot_sync(z == F32(0.0))
    group = I32((1 << lanes) - 1) << (cute.arch.lane_idx() & I32(32 - lanes))
    return I32(cutlass.select_((good & group) == group, I32(0), I32(1)))


def _chunk_coords(t, NC, HV):
    """(b, c, hv) of the pipelined kernel's chunk number t (c fastest, as the one-CTA-a-chunk
    grid (NC, HV, B))."""
    return t // (NC * HV), t % NC, (t // NC) % HV


def _row_entry(mRows, b, c):
    """mRows[b, c] = (base, count, tok, n) read into registers."""
    return mRows[b, c, 0], mRows[b, c, 1], mRows[b, c, 2], mRows[b, c, 3]


def _stage_ptrs(st, stage, k_elems, q_elems):
    """Pointers to smem stage ``stage`` (0 or 1) of the pipelined kernel's k and q / X tiles."""
    return (st.sK.data_ptr() + cute.assume(stage * k_elems, divby=k_elems),
            st.sQ.data_ptr() + cute.assume(stage * q_elems, divby=q_elems))


def _quad(sM, i, l0):
    """sM[i, l0 .. l0 + 3] of a float32 [C, C] tile (rows PAD apart; ``l0`` a multiple of
    4) as one 16-byte shared load: 4 registers."""
    off = cute.assume(i * PAD + l0, divby=4)
    v = cute.make_rmem_tensor((4,), F32)
    cute.autovec_copy(cute.make_tensor(sM.iterator + off, cute.make_layout(4)), v)
    return v


def _t_row(sA, sT, col, i, j):
    """T[i, j] = A21[i, :] X11[:, j] (``col``: X11[:, j] in registers; two partial sums,
    even and odd l)."""
    acc0, acc1 = F32(0.0), F32(0.0)
    for l0 in range(0, HB, 4):
        a = _quad(sA, HB + i, l0)
        acc0 = acc0 + a[0] * col[l0]
        acc1 = acc1 + a[1] * col[l0 + 1]
        acc0 = acc0 + a[2] * col[l0 + 2]
        acc1 = acc1 + a[3] * col[l0 + 3]
    sT[i, j] = acc0 + acc1


def _x21_row(sX, col, i, j):
    """X21[i, j] = -X22[i, :] T[:, j] (``col``: T[:, j]; X22 lower: m <= i only)."""
    acc0, acc1 = F32(0.0), F32(0.0)
    for m0 in range(0, HB, 4):
        x = _quad(sX, HB + i, HB + m0)
        for d in range(4):
            m = m0 + d
            t = _pick(m <= i, x[d] * col[m], F32(0.0))
            if d % 2 == 0:
                acc0 = acc0 - t
            else:
                acc1 = acc1 - t
    sX[HB + i, j] = acc0 + acc1


class ChunkPrepSm90:
    """Static configuration: head dims K, V and the 16-bit operand dtype."""

    def __init__(self, K: int, V: int, ab_dtype, inverse: bool = False, probe: bool = False,
                 tokens: bool = False, l2norm: bool = False, readout_rows: bool = False,
                 gmma: bool = False, gram_norm: bool = False, staged: bool = False,
                 late_v: bool = False, ctas: int = CTAS_PER_SM, pipelined: int = 0):
        assert K in (64, 128) and V in (64, 128)
        self.K, self.V, self.ab = K, V, ab_dtype
        self.inverse = inverse        # also write X = (I + A)^-1 (the backward's factor)
        # measurement only: thread 0 writes the SM clock cycles of each phase into bad[..,
        # :PROBE_SLOTS] (benchmarks/prep_probe.py); the kernel's results are otherwise unchanged
        self.probe = probe
        # q, k, v read straight from the op's token-major tensors (``tokens``: no relayout
        # to chunks in XLA; ``mRows`` says where each chunk's rows start), L2-normalised
        # in the kernel with ``l2norm``
        self.tokens = tokens
        self.l2norm = l2norm
        assert tokens or not l2norm
        # q's smem tile, qg and P on the read-out rows only: tile row m holds chunk row
        # n m + n - 1 (n >= 2 from the row table), m < C // n; the rows after are zeros
        # (qg, P are [READOUT_ROWS, *]; q's tile rows from READOUT_ROWS on are zeros too).
        # Chunk-major (not ``tokens``): q arrives compact, [B, NC, HV, READOUT_ROWS, K]
        self.readout_rows = readout_rows
        # the products of phases 2 (K K^T, Q K^T from the smem tiles) and 4 (w, u: X's hi
        # and lo parts from registers) as Hopper warpgroup MMAs (the CTA's 4 warps are one
        # warpgroup) instead of ldmatrix + mma.sync, in the warp MMAs' order
        self.gmma = gmma
        # with ``l2norm``: k's rows enter the products raw, their norms taken from the
        # diagonal of K K^T (phase 2): rho_i = 1 / sqrt((K K^T)_ii + eps) scales A's rows and
        # columns, P's columns, w's (X's column scales) and Kt's rows - no normalising pass
        # over k in registers, and one 16-bit rounding fewer (k is exact). A warp whose k
        # rows hold an entry >= GRAM_BIG normalises them first (rho is then ~1).
        self.gram_norm = gram_norm
        assert l2norm or not gram_norm
        # P, w (and a 16-bit u) leave through shared memory: the accumulators go to a
        # padded tile (P: q's dead tile; w, u: A's), then 16-byte row pieces to global -
        # whole 32-byte sectors and a quarter of the store instructions, where the
        # accumulator layout stores 4 bytes a thread (half a sector a row a quad)
        self.staged = staged
        # v's tile arrives in a cp.async group of its own, waited for only before phase 4
        # (the one product that reads it): its load overlaps phases 1-3 instead of
        # holding up phase 1; its row flags are taken then
        self.late_v = late_v
        # CTAs an SM the registers are capped for (3: ~167 a thread; 2: the assembler's
        # choice up to 255) - a measurement of whether the phases speed up with registers
        assert ctas in (2, 3)
        self.ctas = ctas
        # a persistent kernel of ``pipelined`` CTAs (0: one CTA a chunk), 2 an SM, each
        # walking its chunks with the next chunk's k, q tiles loading into a second stage
        # (and its v tile, as with ``late_v``, into the one v tile once the u product has
        # read it) while this chunk computes: no CTA waits on HBM but for its first chunk
        self.pipelined = pipelined
        assert not pipelined or ctas == 2

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, stream, mQ, mK, mV, mG, mBeta, mScale, mRows, mW, mKt, mQg, mP, mU,
                 mDecay, mBad, mX):
        K, V, ab = self.K, self.V, self.ab
        sK_layout = smem_layout(C, K)
        sV_layout = smem_layout(C, V)
        pad = cute.make_layout((C, C), stride=(PAD, 1))        # float32
        sT_layout = cute.make_layout((HB, HB), stride=(HB + 1, 1))

        # q's tile is dead after Q K^T: X (float32) reuses it (~70 KB in all at K = V =
        # 128: three CTAs an SM)
        qx_elems = max(cute.cosize(sK_layout), 2 * C * PAD)
        stages = 2 if self.pipelined else 1        # (a multiple of 1024 bytes a stage)

        @cute.struct
        class Storage:
            sK: smem_tile(ab, sK_layout, stages)
            sQ: cute.struct.Align[cute.struct.MemRange[ab, stages * qx_elems], 1024]  # q, X
            sV: smem_tile(ab, sV_layout)
            sA: cute.struct.Align[cute.struct.MemRange[F32, C * PAD], 128]  # Gam, A
            sT: cute.struct.Align[cute.struct.MemRange[F32, HB * (HB + 1)], 128]
            sg: cute.struct.MemRange[F32, C]        # g
            sb: cute.struct.MemRange[F32, C]        # beta
            sgam: cute.struct.MemRange[F32, C]      # exp(G)
            send: cute.struct.MemRange[F32, C]      # exp(G_last - G)
            # row flags (1 = set; written once per row, by the lanes holding the row)
            fK: cute.struct.MemRange[I32, C]        # k row not finite (zeroed)
            fV: cute.struct.MemRange[I32, C]        # v row not finite (zeroed)
            fA: cute.struct.MemRange[I32, C]        # A row not finite
            fP: cute.struct.MemRange[I32, C]        # P row (16-bit) not finite
            fQ: cute.struct.MemRange[I32, C]        # qg row (16-bit) not finite
            fWU: cute.struct.MemRange[I32, C]       # w (16-bit) or u row not finite
            srho: cute.struct.MemRange[F32, C]      # gram_norm: 1 / |k row|
            ok: cute.struct.MemRange[I32, C]        # state row enters (causal_operands)

        (mQ, mK, mV, mG, mBeta, mRows, mW, mKt, mQg, mP, mU, mDecay, mBad, mX) = (
            offsets32(t) for t in (mQ, mK, mV, mG, mBeta, mRows, mW, mKt, mQg, mP, mU,
                                   mDecay, mBad, mX))
        B, NC, HV = mG.shape[0], mG.shape[1], mG.shape[2]
        self.kernel(mQ, mK, mV, mG, mBeta, mScale, mRows, mW, mKt, mQg, mP, mU, mDecay, mBad,
                    mX,
                    sK_layout, sV_layout, pad, sT_layout, g2s_copy(ab, K), g2s_copy(ab, V),
                    warp_mma(ab), Storage).launch(grid=self._grid(B, NC, HV),
                                                  block=[NUM_THREADS, 1, 1], stream=stream,
                                                  min_blocks_per_mp=self.ctas,
                                                  preferred_smem_carveout=100)

    def _grid(self, B, NC, HV):
        """One CTA a chunk, or ``pipelined`` CTAs (at most one a chunk)."""
        if self.pipelined:
            return (cutlass.min(B * NC * HV, I32(self.pipelined)), 1, 1)
        return (NC, HV, B)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, mQ, mK, mV, mG, mBeta, mScale, mRows, mW, mKt, mQg, mP, mU, mDecay, mBad,
               mX,
               sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
               pad: cute.Layout, sT_layout: cute.Layout, copy_K: cute.TiledCopy,
               copy_V: cute.TiledCopy, tiled_mma: cute.TiledMma, Storage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(Storage)
        vec = lambda f: f.get_tensor(cute.make_layout(C))
        sm = dict(sV=st.sV.get_tensor(sV_layout),
                  sA=st.sA.get_tensor(pad),                # Gam, then A in place
                  sT=st.sT.get_tensor(sT_layout),
                  # (the 16-bit staging tile of w, u: A's space, dead after the inverse)
                  sStage=st.sA.get_tensor(cute.make_layout((C, 2 * PAD), stride=(2 * PAD, 1)),
                                          dtype=self.ab))
        for name in ("sg", "sb", "sgam", "send", "fK", "fV", "fA", "fP", "fQ", "fWU", "ok",
                     "srho"):
            sm[name] = vec(getattr(st, name))
        cpK, cpV = g2s(copy_K, tidx), g2s(copy_V, tidx)
        tV = cpV.dest(sm["sV"])
        gmem = (mQ, mK, mV, mG, mBeta, mScale, mRows, mW, mKt, mQg, mP, mU, mDecay, mBad, mX)
        P_layout = cute.make_layout((C, C + 8), stride=(C + 8, 1))
        if cutlass.const_expr(self.pipelined):
            self._persistent(tidx, st, sm, gmem, cpK, cpV, tV, sK_layout, pad, P_layout,
                             tiled_mma)
        else:
            c, hv, b = cute.arch.block_idx()
            sK = st.sK.get_tensor(sK_layout)
            sQ = st.sQ.get_tensor(sK_layout)
            sX = st.sQ.get_tensor(pad, dtype=F32)       # from phase 3 on
            sPst = st.sQ.get_tensor(P_layout)           # staged P (q's tile, dead by then)
            marks = [cute.arch.clock()] if cutlass.const_expr(self.probe) else []
            # ---- phase 0: q, k, v -> smem (async) | gates
            tK, tQ = cpK.dest(sK), cpK.dest(sQ)
            self._issue_loads(cpK, cpV, tK, tQ, tV, sQ, gmem, b, c, hv, True, True)
            cute.arch.cp_async_commit_group()
            self._tile(tidx, sm, gmem, cpK, cpV, tK, tQ, tV, sK, sQ, sX, sPst, tiled_mma,
                       b, c, hv, marks)

    @cute.jit
    def _issue_loads(self, cpK, cpV, tK, tQ, tV, sQ, gmem, b, c, hv, kq: cutlass.Constexpr,
                     v: cutlass.Constexpr, rows=None):
        """Phase 0's cp.async of chunk (b, c, hv)'s k and q tiles (``kq``) and / or its v
        tile (``v``); with both and ``late_v`` k, q form a cp.async group of their own
        (the caller commits the last group). ``rows``: the chunk's row-table entry, if
        already loaded (token-major inputs)."""
        mQ, mK, mV, mRows = gmem[0], gmem[1], gmem[2], gmem[6]
        K, V = self.K, self.V
        if cutlass.const_expr(self.tokens):
            self._load_token_rows(cpK, cpV, tK, tQ, tV, mQ, mK, mV, mRows, b, c, hv,
                                  kq=kq, v=v, rows=rows)
        else:
            if cutlass.const_expr(kq):
                cpK.load(mK[b, c, hv, None, None], (C, K), tK)
                if cutlass.const_expr(self.readout_rows):
                    # compact q: its READOUT_ROWS rows to the tile's first ones, zeros after
                    top = cute.local_tile(sQ, (READOUT_ROWS, K), (0, 0))
                    cpK.load(mQ[b, c, hv, None, None], (READOUT_ROWS, K), cpK.dest(top))
                    bottom = cpK.dest(cute.local_tile(sQ, (READOUT_ROWS, K), (1, 0)))
                    for e in cutlass.range_constexpr(cute.size(bottom)):
                        bottom[e] = F32(0.0).to(self.ab)
                else:
                    cpK.load(mQ[b, c, hv, None, None], (C, K), tQ)
            if cutlass.const_expr(self.late_v and kq and v):
                cute.arch.cp_async_commit_group()
            if cutlass.const_expr(v):
                cpV.load(mV[b, c, hv, None, None], (C, V), tV)

    @cute.jit
    def _persistent(self, tidx, st, sm, gmem, cpK, cpV, tV, sK_layout, pad, P_layout,
                    tiled_mma):
        """``pipelined``: this CTA's chunks t = block + i grid, in order; chunk t + grid's
        k, q tiles load into the other stage (k: ``sK``'s second tile, q / X: ``sQ``'s)
        while chunk t computes, its v tile once chunk t's u product has read ``sV``, and
        its g, beta into registers. cp.async groups, oldest first, when chunk t starts:
        k q (t), v (t), k q (t + grid) - so phase 1 waits for all but 2 and phase 4 for
        all but 1."""
        mG, mBeta = gmem[3], gmem[4]
        bid, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        NC, HV = mG.shape[1], mG.shape[2]
        tiles = mG.shape[0] * NC * HV
        k_elems = cute.cosize(sK_layout)
        q_elems = max(k_elems, 2 * C * PAD)         # a stage of sQ: q, then X (float32)
        gi = tidx % C

        b0, c0, hv0 = _chunk_coords(bid, NC, HV)
        rows0 = None
        if cutlass.const_expr(self.tokens):
            mRows = gmem[6]
            rows0 = _row_entry(mRows, b0, c0)
        sK0 = cute.make_tensor(st.sK.data_ptr(), sK_layout)
        sQ0 = cute.make_tensor(st.sQ.data_ptr(), sK_layout)
        self._issue_loads(cpK, cpV, cpK.dest(sK0), cpK.dest(sQ0), tV, sQ0, gmem, b0, c0, hv0,
                          True, False, rows0)
        cute.arch.cp_async_commit_group()
        self._issue_loads(cpK, cpV, None, None, tV, None, gmem, b0, c0, hv0, False, True,
                          rows0)
        cute.arch.cp_async_commit_group()
        g_next = mG[b0, c0, hv0, gi].to(F32)
        beta_next = mBeta[b0, c0, hv0, gi].to(F32)
        if cutlass.const_expr(self.tokens):
            # the row-table entry of the chunk after next, a chunk ahead in registers (its
            # copies are addressed from it: no L2 round trip before they issue)
            b1, c1, _ = _chunk_coords(cutlass.min(bid + grid, tiles - 1), NC, HV)
            rb, rc, rt, rn = _row_entry(mRows, b1, c1)
        for i in cutlass.range((tiles - bid + grid - 1) // grid, unroll=1):
            t = bid + i * grid
            b, c, hv = _chunk_coords(t, NC, HV)
            stage = i % 2
            marks = [cute.arch.clock()] if cutlass.const_expr(self.probe) else []
            kptr, qptr = _stage_ptrs(st, stage, k_elems, q_elems)
            sK = cute.make_tensor(kptr, sK_layout)
            sQ = cute.make_tensor(qptr, sK_layout)
            tn = t + grid
            bn, cn, hvn = _chunk_coords(cutlass.min(tn, tiles - 1), NC, HV)
            rows = None
            if cutlass.const_expr(self.tokens):
                rows = (rb, rc, rt, rn)
                b2, c2, _ = _chunk_coords(cutlass.min(tn + grid, tiles - 1), NC, HV)
                rb, rc, rt, rn = _row_entry(mRows, b2, c2)
            if tn < tiles:
                nk, nq = _stage_ptrs(st, 1 - stage, k_elems, q_elems)
                sQn = cute.make_tensor(nq, sK_layout)
                self._issue_loads(cpK, cpV, cpK.dest(cute.make_tensor(nk, sK_layout)),
                                  cpK.dest(sQn), tV, sQn, gmem, bn, cn, hvn, True, False,
                                  rows)
            cute.arch.cp_async_commit_group()
            g_now, beta_now = g_next, beta_next
            g_next = mG[bn, cn, hvn, gi].to(F32)
            beta_next = mBeta[bn, cn, hvn, gi].to(F32)
            self._tile(tidx, sm, gmem, cpK, cpV, cpK.dest(sK), cpK.dest(sQ), tV, sK, sQ,
                       cute.make_tensor(cute.recast_ptr(qptr, dtype=F32), pad),
                       cute.make_tensor(qptr, P_layout), tiled_mma, b, c, hv, marks,
                       g_now, beta_now, tn < tiles, (bn, cn, hvn, rows))

    @cute.jit
    def _tile(self, tidx, sm, gmem, cpK, cpV, tK, tQ, tV, sK, sQ, sX, sPst, tiled_mma, b, c,
              hv, marks, g_in=None, beta_in=None, has_next=None, nxt=None):
        """Phases 0 (gates; the caller issued the loads) to 4 and the row rules of chunk
        (b, c, hv). ``pipelined``: ``g_in``, ``beta_in`` are this thread's g, beta entry
        (row tidx % C), and after the u product chunk ``nxt``'s v tile is issued where
        ``has_next``."""
        K, V, ab = self.K, self.V, self.ab
        late = self.late_v or self.pipelined
        (mQ, mK, mV, mG, mBeta, mScale, mRows, mW, mKt, mQg, mP, mU, mDecay, mBad,
         mX) = gmem
        sV, sA, sT, sStage = sm["sV"], sm["sA"], sm["sT"], sm["sStage"]
        sg, sb, sgam, send = sm["sg"], sm["sb"], sm["sgam"], sm["send"]
        fK, fV, fA, fP, fQ = sm["fK"], sm["fV"], sm["fA"], sm["fP"], sm["fQ"]
        fWU, ok, srho = sm["fWU"], sm["ok"], sm["srho"]
        scale = mScale[b]
        if tidx < C:
            if cutlass.const_expr(self.pipelined):
                sg[tidx] = g_in
                sb[tidx] = beta_in
            else:
                sg[tidx] = mG[b, c, hv, tidx].to(F32)
                sb[tidx] = mBeta[b, c, hv, tidx].to(F32)
            if cutlass.const_expr(self.readout_rows):
                fP[tidx] = I32(0)                 # rows not read out: no flags
                fQ[tidx] = I32(0)
        cute.arch.sync_threads()
        # exp as ex2.approx (2^-22 relative; below ~1e-38 it flushes to 0): a short
        # dependency chain in these serial loops
        if tidx < C:
            i = tidx
            s = F32(0.0)                          # seg_ij, j from i down to 0
            if cutlass.const_expr(self.pipelined):
                # no loads to hide these loops behind: 8 entries at a time without
                # branches, so their g loads and exps overlap (fully unrolled, +14
                # registers). Past the row's first entry (jj > i) the store goes to padding
                # column C, which nothing reads, and s gains an exact 0: the same sums,
                # the same bits
                for jj in cutlass.range(C, unroll=8):
                    sA[i, cutlass.select_(jj <= i, i - jj, C)] = cute.math.exp(
                        s, fastmath=True)
                    s = s + _pick(jj <= i, sg[cutlass.select_(jj <= i, i - jj, 0)],
                                  F32(0.0))
            else:
                for jj in cutlass.range(i + 1, unroll=1):
                    j = i - jj
                    sA[i, j] = cute.math.exp(s, fastmath=True)
                    s = s + sg[j]
            sgam[i] = cute.math.exp(s, fastmath=True)            # s = G_i
            if i == C - 1:
                mDecay[b, c, hv] = cute.math.exp(s, fastmath=True)
        else:
            i = tidx - C
            t = F32(0.0)                          # G_last - G_i = g_{i+1} + ... + g_{C-1}
            if cutlass.const_expr(self.pipelined):
                for jj in cutlass.range(C - 1, unroll=7):
                    t = t + _pick(C - 1 - jj > i, sg[C - 1 - jj], F32(0.0))
            else:
                for jj in cutlass.range(C - 1 - i, unroll=1):
                    t = t + sg[C - 1 - jj]
            send[i] = cute.math.exp(t, fastmath=True)
        # all groups (late_v: but v's; pipelined: but v's and the next chunk's k, q)
        cute.arch.cp_async_wait_group(2 if self.pipelined else (1 if self.late_v else 0))
        cute.arch.sync_threads()
        if cutlass.const_expr(self.probe):
            marks.append(cute.arch.clock())

        # ---- phase 1: on this thread's cp.async elements (8 consecutive columns of a row
        # per pass, a row held by K/8 or V/8 consecutive lanes): flags, zeroed rows, Kt, qg
        n = mRows[b, c, 3] if cutlass.const_expr(self.readout_rows) else None
        self._rows_of_k_and_q(cpK, tK, tQ, mKt[b, c, hv, None, None],
                              mQg[b, c, hv, None, None], scale, sgam, send, fK, fQ, n)
        if cutlass.const_expr(not late):
            self._rows_of_v(cpV, tV, fV)
        if cutlass.const_expr(self.gmma):
            # what cp.async and the threads wrote to the tiles is what wgmma reads (the
            # async proxy) after the barrier
            cute.arch.fence_view_async_shared()
        cute.arch.sync_threads()
        if cutlass.const_expr(self.probe):
            marks.append(cute.arch.clock())

        # ---- phase 2: K K^T, Q K^T -> A (smem, in place of Gam), P
        thr_mma = tiled_mma.get_slice(tidx)
        cA, _, cBt = ldmatrix_copies(tiled_mma, ab, tidx)
        # thr_c: the accumulators' partition of phase 2 (with gmma the warpgroup MMA's; a
        # thread holds the same rows either way)
        thr_c = thr_mma
        if cutlass.const_expr(self.gmma):
            tiled_kk = wg_tiled(ab, C, True, b_k_major=True)      # [C, K] x [C, K]^T
            thr_c = tiled_kk.get_slice(tidx)
            acc_kk = make_acc(thr_c, (C, C))
            acc_qk = make_acc(thr_c, (C, C))
            acc_kk.fill(0.0)
            acc_qk.fill(0.0)
            op = lambda t, is_a: wg_operand(tiled_kk, thr_c, t, C, K, True, is_a, ab)
            wg_products([(tiled_kk, K // MMA_K, [(acc_kk, op(sK, True), op(sK, False)),
                                                 (acc_qk, op(sQ, True), op(sK, False))])])
        else:
            ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False,
                                                              num_matrices=4), ab)
            cB = cute.make_tiled_copy_B(ldsm, tiled_mma).get_slice(tidx)  # B: [N, K] tiles
            acc_kk = make_acc(thr_mma, (C, C))
            acc_qk = make_acc(thr_mma, (C, C))
            acc_kk.fill(0.0)
            acc_qk.fill(0.0)
            mma_split_b(tiled_mma, K // MMA_K,
                        [(acc_kk, operand(thr_mma, cA, sK, True)),
                         (acc_qk, operand(thr_mma, cA, sQ, True))],
                        operand(thr_mma, cB, sK, False), None, False)
        # an accumulator row lives in one quad of lanes: this thread's rows r0 and r0 + 8
        crd = thr_c.partition_C(cute.make_identity_tensor((C, C)))
        r0, _ = crd[0]
        r1 = r0 + 8
        if cutlass.const_expr(self.gram_norm):
            for e in cutlass.range_constexpr(cute.size(acc_kk)):
                i, j = crd[e]
                if i == j:
                    srho[i] = cute.math.rsqrt(acc_kk[e] + F32(L2_EPS))
            cute.arch.sync_threads()
        # P's row of accumulator row r: chunk row r, or with readout_rows n r + n - 1 (read
        # out where < C; q was zero past them, and Gam is read in bounds)
        pr0, pr1, gr0, gr1 = r0, r1, r0, r1
        if cutlass.const_expr(self.readout_rows):
            pr0, pr1 = n * r0 + n - 1, n * r1 + n - 1
            gr0, gr1 = cutlass.min(pr0, C - 1), cutlass.min(pr1, C - 1)
        za0, za1, zp0, zp1 = F32(0.0), F32(0.0), F32(0.0), F32(0.0)
        for e in cutlass.range_constexpr(cute.size(acc_kk)):
            i, j = crd[e]
            in0 = i == r0
            gm = sA[i, j]
            kk, qk = acc_kk[e], acc_qk[e]
            if cutlass.const_expr(self.gram_norm):
                kk = kk * (srho[i] * srho[j])
                qk = qk * srho[j]
            a = _pick(j < i, (sb[i] * kk) * gm, F32(0.0))
            if cutlass.const_expr(self.readout_rows):
                pi = I32(cutlass.select_(in0, pr0, pr1))
                gp = sA[cutlass.select_(in0, gr0, gr1), j]
                p = _pick((j <= pi) & (pi < C), (qk * gp) * scale, F32(0.0))
                acc_kk[e] = a          # A enters sA after every thread read Gam (below)
            else:
                sA[i, j] = a
                p = _pick(j <= i, (qk * gm) * scale, F32(0.0))
            acc_qk[e] = p
            za = a * F32(0.0)
            zp = p.to(ab).to(F32) * F32(0.0)
            za0, za1 = za0 + _pick(in0, za, F32(0.0)), za1 + _pick(in0, F32(0.0), za)
            zp0, zp1 = zp0 + _pick(in0, zp, F32(0.0)), zp1 + _pick(in0, F32(0.0), zp)
        fA[r0], fA[r1] = _nonfinite(za0, 4), _nonfinite(za1, 4)
        bp0, bp1 = _nonfinite(zp0, 4), _nonfinite(zp1, 4)
        if cutlass.const_expr(self.readout_rows):
            cute.arch.sync_threads()
            for e in cutlass.range_constexpr(cute.size(acc_kk)):
                i, j = crd[e]
                sA[i, j] = acc_kk[e]
            if pr0 < C:
                fP[pr0] = bp0
            if pr1 < C:
                fP[pr1] = bp1
        else:
            fP[r0], fP[r1] = bp0, bp1
        cute.arch.sync_threads()
        rok0, rok1 = (fP[gr0] | fQ[gr0]) == 0, (fP[gr1] | fQ[gr1]) == 0
        for e in cutlass.range_constexpr(cute.size(acc_qk)):
            i, _ = crd[e]
            keep = cutlass.Boolean(cutlass.select_(i == r0, rok0, rok1))
            acc_qk[e] = _pick(keep, acc_qk[e], F32(0.0))
        if cutlass.const_expr(self.staged):
            # P through q's tile (dead since the products; X overwrites it in phase 3)
            p_rows = READOUT_ROWS if self.readout_rows else C
            if tidx < 32 * (p_rows // 16):               # 16 accumulator rows a warp
                c_tile(thr_c, sPst, (C, C), (0, 0)).store(acc_qk.load().to(ab))
            cute.arch.sync_threads()
            self._copy_rows(tidx, sPst, C + 8, mP[b, c, hv, None, None], p_rows, C)
            cute.arch.sync_threads()
        elif cutlass.const_expr(self.readout_rows):
            # accumulator rows 0 .. READOUT_ROWS - 1 (warps 0, 1) are P's rows; a [C, C]
            # view of P's [READOUT_ROWS, C] rows, stored by those warps only
            gP = top_rows_view(mP[b, c, hv, None, None], C)
            if tidx < 32 * (READOUT_ROWS // 16):       # 16 rows a warp
                c_tile(thr_c, gP, (C, C), (0, 0)).store(acc_qk.load().to(ab))
        else:
            c_tile(thr_c, mP[b, c, hv, None, None], (C, C), (0, 0)).store(
                acc_qk.load().to(ab))
        if cutlass.const_expr(self.gram_norm):
            self._store_kt(cpK, tK, mKt[b, c, hv, None, None], send, srho)
        if cutlass.const_expr(self.probe):
            marks.append(cute.arch.clock())

        # ---- phase 3: X = (I + A)^-1
        self._inverse(tidx, sA, sX, sT)
        if cutlass.const_expr(self.probe):
            marks.append(cute.arch.clock())
        if cutlass.const_expr(self.inverse):
            # consecutive threads, consecutive columns: coalesced float32 stores
            gX = mX[b, c, hv, None, None]
            for e in cutlass.range_constexpr(C * C // NUM_THREADS):
                idx = e * NUM_THREADS + tidx
                gX[idx // C, idx % C] = sX[idx // C, idx % C]

        if cutlass.const_expr(late):
            # v's tile (this thread's cp.async elements), its flags and zeroed rows, seen
            # by every thread (and wgmma's async proxy) after the barrier
            cute.arch.cp_async_wait_group(1 if self.pipelined else 0)
            self._rows_of_v(cpV, tV, fV)
            if cutlass.const_expr(self.gmma):
                cute.arch.fence_view_async_shared()
            cute.arch.sync_threads()

        # ---- phase 4: w = Xw K, u = Xu V (Xw = X diag(beta gam), Xu = X diag(beta))
        w_bad = self._product(tidx, tiled_mma, cBt, sX, sK, K, sb, sgam, srho, True,
                             mW[b, c, hv, None, None], r0, sStage, False)
        u_bad = self._product(tidx, tiled_mma, cBt, sX, sV, V, sb, sgam, srho, False,
                             mU[b, c, hv, None, None], r0, sStage, True)
        if tidx % 4 == 0:                         # one lane of the quad holding the rows
            fWU[r0] = w_bad[0] | u_bad[0]
            fWU[r1] = w_bad[1] | u_bad[1]
        cute.arch.sync_threads()
        if cutlass.const_expr(self.pipelined):
            # every thread has read sV: the next chunk's v tile may land there
            if has_next:
                self._issue_loads(cpK, cpV, None, None, tV, None, gmem, nxt[0], nxt[1],
                                  nxt[2], False, True, nxt[3])
            cute.arch.cp_async_commit_group()
        if cutlass.const_expr(self.probe):
            marks.append(cute.arch.clock())

        # ---- row rules: ok_i = no non-finite A / k / v / beta gam / beta row at or before
        # i, finite w, u; bad_i = some row <= i does not enter, or the readout row is not
        # finite. Prefix ORs over the rows by warp ballots: warp 0, lane l holds rows l
        # and l + 32.
        if tidx < 32:
            self._row_rules(tidx, sb, sgam, fA, fK, fV, fWU, fP, fQ, ok,
                            mBad[b, c, hv, None])
        cute.arch.sync_threads()
        if cutlass.const_expr(self.probe):
            marks.append(cute.arch.clock())

        # rows that do not enter (rare: non-finite inputs): w, u rows zeroed, Kt rows NaN
        if (ok[r0] == 0) | (ok[r1] == 0):
            self._zero_rows(thr_mma, mW[b, c, hv, None, None], (C, K), ok, r0)
            self._zero_rows(thr_mma, mU[b, c, hv, None, None], (C, V), ok, r0)
        if tidx < C:
            if ok[tidx] == 0:
                for col in cutlass.range(K, unroll=1):
                    mKt[b, c, hv, tidx, col] = F32(float("nan")).to(ab)
        if cutlass.const_expr(self.probe):
            cute.arch.sync_threads()
            marks.append(cute.arch.clock())
            if tidx == 0:
                for s in cutlass.range_constexpr(len(marks) - 1):
                    mBad[b, c, hv, s] = marks[s + 1] - marks[s]
        if cutlass.const_expr(self.pipelined):
            # the next chunk writes its gates and flags where this one's are read
            cute.arch.sync_threads()

    # ------------------------------------------------------------ device-side pieces
    @cute.jit
    def _load_token_rows(self, cpK, cpV, tK, tQ, tV, mQ, mK, mV, mRows, b, c, hv,
                         kq: cutlass.Constexpr = True, v: cutlass.Constexpr = True,
                         rows=None):
        """Phase 0's cp.async of q, k, v from the token-major tensors q [B, T, H, K],
        k [B, L, H, K], v [B, L, HV, V] (L = n T interleaved steps): chunk row i is step
        base + i for i < count (else zeros); q sits on rows i = n - 1 (mod n), token
        tok + i // n. mRows[b, c] = (base, count, tok, n). Key head: hv // (HV / H).
        ``kq`` / ``v``: issue k's and q's copies / v's (the pipelined kernel issues them
        at different points); ``rows``: mRows[b, c] already in registers."""
        ab = self.ab
        atom = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), ab,
            num_bits_per_copy=128)
        hk = hv // (mV.shape[2] // mK.shape[2])
        if cutlass.const_expr(rows is None):
            base, count, tok, n = _row_entry(mRows, b, c)
        else:
            base, count, tok, n = rows
        zero = F32(0.0).to(ab)
        crd = cpK.thr.partition_D(cute.make_identity_tensor((C, self.K)))
        for m in cutlass.range_constexpr(cute.size(tK) // 8 if kq else 0):
            r, col = crd[8 * m]
            if r < count:
                cute.copy(atom, cute.local_tile(mK[b, base + r, hk, None], (8,), (col // 8,)),
                          tK[None, m, 0])
            else:
                for e in cutlass.range_constexpr(8 * m, 8 * m + 8):
                    tK[e] = zero
            if cutlass.const_expr(self.readout_rows):
                # tile row r: the token of chunk row n r + n - 1 (read out), rows >=
                # READOUT_ROWS zero
                if (r < READOUT_ROWS) & (n * r + n - 1 < count):
                    cute.copy(atom, cute.local_tile(mQ[b, tok + r, hk, None], (8,),
                                                    (col // 8,)), tQ[None, m, 0])
                else:
                    for e in cutlass.range_constexpr(8 * m, 8 * m + 8):
                        tQ[e] = zero
            else:
                if (r < count) & (r % n == n - 1):
                    cute.copy(atom, cute.local_tile(mQ[b, tok + r // n, hk, None], (8,),
                                                    (col // 8,)), tQ[None, m, 0])
                else:
                    for e in cutlass.range_constexpr(8 * m, 8 * m + 8):
                        tQ[e] = zero
        if cutlass.const_expr(self.late_v and kq and v):
            cute.arch.cp_async_commit_group()     # k, q; then v's group (phase 0's commit)
        crd = cpV.thr.partition_D(cute.make_identity_tensor((C, self.V)))
        for m in cutlass.range_constexpr(cute.size(tV) // 8 if v else 0):
            r, col = crd[8 * m]
            if r < count:
                cute.copy(atom, cute.local_tile(mV[b, base + r, hv, None], (8,), (col // 8,)),
                          tV[None, m, 0])
            else:
                for e in cutlass.range_constexpr(8 * m, 8 * m + 8):
                    tV[e] = zero

    @cute.jit
    def _rows_of_k_and_q(self, cpK, tK, tQ, gKt, gQg, scale, sgam, send, fK, fQ, n):
        """Phase 1 for k and q: fK (the row is zeroed in smem if set), Kt = exp(G_last -
        G) k and qg = scale gam q to global, fQ (qg's 16-bit row not finite). With
        ``readout_rows`` q's tile row r is chunk row n r + n - 1 (gam's and fQ's index;
        fQ only where < C), and only the pieces of q's rows < READOUT_ROWS (the first
        ones of the partition) are normalised and give qg (row r of gQg [READOUT_ROWS,
        K]); ``n`` is read only then."""
        K, ab = self.K, self.ab
        lanes = K // 8
        crd = cpK.thr.partition_D(cute.make_identity_tensor((C, K)))
        pieces = cute.size(tK) // 8
        q_pieces = pieces * READOUT_ROWS // C if self.readout_rows else pieces
        rk = cute.make_fragment_like(tK)
        rq = cute.make_fragment_like(tQ)
        cute.autovec_copy(tK, rk)
        cute.autovec_copy(tQ, rq)
        if cutlass.const_expr(self.l2norm):
            # pieces a step at a time (sm90.l2_normalize_rows): on all q rows 4 made this
            # variant 128 KiB of machine code (the suspected instruction-cache limit)
            group = 4 if self.readout_rows else 1
            if cutlass.const_expr(self.gram_norm):
                # k's rows stay raw (phase 2 takes their norms) unless one of this warp's
                # rows could overflow K K^T: then the warp's rows are normalised (a row
                # lies in one warp; the branch is warp-uniform, as the shuffles need)
                mx = F32(0.0)
                for e in cutlass.range_constexpr(cute.size(rk)):
                    mx = cute.arch.fmax(mx, cute.math.absf(rk[e].to(F32)))
                if cute.arch.vote_any_sync(mx >= F32(GRAM_BIG)):
                    l2_normalize_rows(rk, tK, lanes, pieces, ab, group=group)
            else:
                l2_normalize_rows(rk, tK, lanes, pieces, ab, group=group)
            l2_normalize_rows(rq, tQ, lanes, q_pieces, ab, group=group)
        for m in cutlass.range_constexpr(pieces):
            has_q = m < q_pieces
            r, col = crd[8 * m]
            rg = r                                    # q's chunk row (gam's, fQ's index)
            if cutlass.const_expr(self.readout_rows):
                rg = cutlass.min(n * r + n - 1, C - 1)
            en = send[r]
            if cutlass.const_expr(has_q):
                sc = scale * sgam[rg]
            kt = cute.make_rmem_tensor((8,), F32)
            qg = cute.make_rmem_tensor((8,), F32)
            zk, zq = F32(0.0), F32(0.0)
            for e in cutlass.range_constexpr(8):
                x = rk[8 * m + e].to(F32)
                zk = zk + x * F32(0.0)
                if cutlass.const_expr(not self.gram_norm):
                    kt[e] = en * x
                if cutlass.const_expr(has_q):
                    y = sc * rq[8 * m + e].to(F32)
                    qg[e] = y
                    zq = zq + y.to(ab).to(F32) * F32(0.0)
            bad_k = _nonfinite(zk, lanes)
            if cutlass.const_expr(has_q):
                bad_q = _nonfinite(zq, lanes)
            fK[r] = bad_k
            if cutlass.const_expr(has_q):
                if cutlass.const_expr(self.readout_rows):
                    if n * r + n - 1 < C:
                        fQ[rg] = bad_q
                else:
                    fQ[r] = bad_q
                for e in cutlass.range_constexpr(8):
                    qg[e] = _pick(bad_q == 0, qg[e], F32(0.0))
            # 8 consecutive columns: one 128-bit store each (a 1-D view: the generic
            # objects' row strides are run-time values); with gram_norm Kt waits for rho
            if cutlass.const_expr(not self.gram_norm):
                cute.local_tile(gKt[r, None], (8,), (col // 8,)).store(kt.load().to(ab))
            if cutlass.const_expr(has_q):
                cute.local_tile(gQg[r, None], (8,), (col // 8,)).store(qg.load().to(ab))
            if bad_k != 0:                      # rare: keep it out of the MMAs
                for e in cutlass.range_constexpr(8 * m, 8 * m + 8):
                    tK[e] = F32(0.0).to(ab)

    @cute.jit
    def _store_kt(self, cpK, tK, gKt, send, srho):
        """gram_norm: Kt = exp(G_last - G) rho k to global from the k tile (this thread's
        cp.async pieces: 8 consecutive columns of a row, one 128-bit store each)."""
        crd = cpK.thr.partition_D(cute.make_identity_tensor((C, self.K)))
        for m in cutlass.range_constexpr(cute.size(tK) // 8):
            r, col = crd[8 * m]
            x = cute.make_fragment_like(tK[None, m, 0])
            cute.autovec_copy(tK[None, m, 0], x)
            en = send[r] * srho[r]
            kt = cute.make_rmem_tensor((8,), F32)
            for e in cutlass.range_constexpr(8):
                kt[e] = en * x[e].to(F32)
            cute.local_tile(gKt[r, None], (8,), (col // 8,)).store(kt.load().to(self.ab))

    @cute.jit
    def _row_rules(self, lane, sb, sgam, fA, fK, fV, fWU, fP, fQ, ok, gBad):
        """The row rules of rows ``lane`` and ``lane + 32`` (one warp): prefix ORs of
        per-row flags, each a ballot and a mask of the lanes at or below this one."""
        upto = ~(I32(-2) << lane)                 # bits 0..lane
        for_rows = lambda f: (f(lane), f(lane + 32))

        def nan_row(l):                           # a non-finite A / k / v / beta gam / beta
            rhs = I32(cutlass.select_(_finite(sb[l] * sgam[l]) & _finite(sb[l]),
                                      I32(0), I32(1)))
            return (fA[l] | fK[l] | fV[l] | rhs) != 0

        def prefix(flags):                        # (OR over rows <= lane, <= lane + 32)
            m0 = cute.arch.vote_ballot_sync(flags[0])
            m1 = cute.arch.vote_ballot_sync(flags[1])
            return (m0 & upto) != 0, (m0 != 0) | ((m1 & upto) != 0)

        nan = prefix(for_rows(nan_row))
        enters = (~(nan[0] | (fWU[lane] != 0)), ~(nan[1] | (fWU[lane + 32] != 0)))
        anybad = prefix((~enters[0], ~enters[1]))
        for h in cutlass.range_constexpr(2):
            i = lane + 32 * h
            ok[i] = I32(cutlass.select_(enters[h], I32(1), I32(0)))
            gBad[i] = I32(cutlass.select_(anybad[h], I32(1), I32(0))) | fP[i] | fQ[i]

    @cute.jit
    def _rows_of_v(self, cpV, tV, fV):
        """Phase 1 for v: fV (the row is zeroed in smem if set)."""
        lanes = self.V // 8
        crd = cpV.thr.partition_D(cute.make_identity_tensor((C, self.V)))
        rv = cute.make_fragment_like(tV)
        cute.autovec_copy(tV, rv)
        for m in cutlass.range_constexpr(cute.size(tV) // 8):
            r, _ = crd[8 * m]
            z = F32(0.0)
            for e in cutlass.range_constexpr(8 * m, 8 * m + 8):
                z = z + rv[e].to(F32) * F32(0.0)
            bad_v = _nonfinite(z, lanes)
            fV[r] = bad_v
            if bad_v != 0:
                for e in cutlass.range_constexpr(8 * m, 8 * m + 8):
                    tV[e] = F32(0.0).to(self.ab)

    @cute.jit
    def _inverse(self, tidx, sA, sX, sT):
        """X = (I + A)^-1 (float32, strictly lower A) in HB x HB blocks: X11, X22 by
        forward substitution (one thread per column: warp 0 the first block, warp 1 the
        second; X12 = 0), T = A21 X11, X21 = -X22 T. A row that is not finite makes its
        own X row and the later ones non-finite, never an earlier one (X22's sum runs
        over m <= i only)."""
        if tidx < C:
            ob = (tidx // HB) * HB                # block offset
            jc = tidx % HB                        # this thread's column of the block
            x = cute.make_rmem_tensor((HB,), F32)
            for i in cutlass.range_constexpr(HB):
                # two partial sums (even, odd l): half the dependent FMA chain
                acc0 = _pick(jc == i, F32(1.0), F32(0.0))
                acc1 = F32(0.0)
                for l0 in cutlass.range_constexpr(0, i, 4):
                    a = _quad(sA, ob + i, ob + l0)
                    for l in cutlass.range_constexpr(l0, min(l0 + 4, i)):
                        if cutlass.const_expr(l % 2 == 0):
                            acc0 = acc0 - a[l - l0] * x[l]
                        else:
                            acc1 = acc1 - a[l - l0] * x[l]
                x[i] = acc0 + acc1
            for i in cutlass.range_constexpr(HB):
                sX[ob + i, ob + jc] = x[i]
            if ob == 0:
                for i in cutlass.range_constexpr(HB):
                    sX[i, HB + jc] = F32(0.0)
        cute.arch.sync_threads()
        # every thread: column j, rows w, w + 4, ... of the HB x HB off-diagonal block
        j = tidx % HB
        w0 = tidx // HB
        col = cute.make_rmem_tensor((HB,), F32)
        for l in cutlass.range_constexpr(HB):
            col[l] = sX[l, j]                     # X11[:, j]
        for s in cutlass.range_constexpr(HB // 4):
            _t_row(sA, sT, col, w0 + 4 * s, j)
        cute.arch.sync_threads()
        for m in cutlass.range_constexpr(HB):
            col[m] = sT[m, j]                     # T[:, j]
        for s in cutlass.range_constexpr(HB // 4):
            _x21_row(sX, col, w0 + 4 * s, j)
        cute.arch.sync_threads()

    @cute.jit
    def _product(self, tidx, tiled_mma, cBt, sX, sR, N: cutlass.Constexpr,
                 sb, sgam, srho, with_gam: cutlass.Constexpr, gOut, r0, sStage,
                 stage_used: cutlass.Constexpr):
        """out = (X diag(s))_hi+lo R (s = beta gam, with ``gram_norm`` beta gam rho, or
        beta; a column with a non-finite s
        enters as zeros; X: the float32 smem tile ``sX``) on warp MMAs (``tiled_mma``, its
        B operand by ``cBt``) or with ``gmma`` warpgroup MMAs with A from registers, float32
        accumulation, stored to ``gOut`` (w 16-bit, u in ``gOut``'s dtype: 16-bit or
        float32); returns the non-finite flags of this thread's rows r0, r0 + 8 (as
        stored), reduced over their quads. With ``staged`` a 16-bit result leaves through
        ``sStage`` (:meth:`_store_staged`; ``stage_used``: an earlier product staged there)."""
        ab = self.ab
        narrow = cutlass.const_expr(with_gam or gOut.element_type != F32)
        tiled = tiled_mma
        if cutlass.const_expr(self.gmma):
            tiled = wg_tiled(ab, N, True, reg_a=True)
        thr_mma = tiled.get_slice(tidx)
        tXs = thr_mma.partition_A(sX)
        crd_x = thr_mma.partition_A(cute.make_identity_tensor((C, C)))
        xh = thr_mma.make_fragment_A(thr_mma.partition_shape_A((C, C)))
        xl = thr_mma.make_fragment_A(thr_mma.partition_shape_A((C, C)))
        for e in cutlass.range_constexpr(cute.size(xh)):
            _, r = crd_x[e]
            s = sb[r] * sgam[r] if with_gam else sb[r]
            if cutlass.const_expr(with_gam and self.gram_norm):
                s = s * srho[r]
            y = _pick(_finite(s), tXs[e] * s, F32(0.0))
            hi = y.to(ab)
            xh[e] = hi
            xl[e] = (y - hi.to(F32)).to(ab)
        acc = make_acc(thr_mma, (C, N))
        acc.fill(0.0)
        if cutlass.const_expr(self.gmma):
            R = wg_operand(tiled, thr_mma, sR, C, N, False, False, ab)   # R^T: [N, C]
            wg_products([(tiled, C // MMA_K, [(acc, xh, R), (acc, xl, R)])], kb_outer=True)
        else:
            R = operand(thr_mma, cBt, transpose_view(sR, C, N), False)     # R^T: [N, C]
            mma_split_b(tiled_mma, C // MMA_K, [(acc, RegOperand(xh)), (acc, RegOperand(xl))],
                        R, None, False)
        crd = thr_mma.partition_C(cute.make_identity_tensor((C, N)))
        z0, z1 = F32(0.0), F32(0.0)
        for e in cutlass.range_constexpr(cute.size(acc)):
            i, _ = crd[e]
            y = acc[e].to(ab).to(F32) if narrow else acc[e]
            z = y * F32(0.0)
            z0, z1 = z0 + _pick(i == r0, z, F32(0.0)), z1 + _pick(i == r0, F32(0.0), z)
        if cutlass.const_expr(self.staged and narrow):
            self._store_staged(tidx, thr_mma, acc, sStage, gOut, N, stage_used)
        else:
            out = c_tile(thr_mma, gOut, (C, N), (0, 0))
            if cutlass.const_expr(narrow):
                out.store(acc.load().to(ab))
            else:
                out.store(acc.load())
        return _nonfinite(z0, 4), _nonfinite(z1, 4)

    @cute.jit
    def _store_staged(self, tidx, thr_mma, acc, sStage, gOut, N: cutlass.Constexpr,
                      stage_used: cutlass.Constexpr):
        """gOut [C, N] (16-bit) = acc through the smem tile ``sStage`` ([C, 2 PAD]: rows
        16 bytes apart mod 128, so a quad's 8 rows of an accumulator store hit distinct
        banks): every thread writes its accumulators, then copies 16-byte row pieces,
        consecutive threads along a row (coalesced). ``stage_used``: wait until every
        thread has read the tile's previous contents."""
        if cutlass.const_expr(stage_used):
            cute.arch.sync_threads()
        c_tile(thr_mma, sStage, (C, N), (0, 0)).store(acc.load().to(self.ab))
        cute.arch.sync_threads()
        self._copy_rows(tidx, sStage, 2 * PAD, gOut, C, N)

    @cute.jit
    def _copy_rows(self, tidx, sSrc, stride: cutlass.Constexpr, gOut,
                   rows: cutlass.Constexpr, N: cutlass.Constexpr):
        """gOut[:rows, :N] = the smem rows ``sSrc`` (16-bit, rows ``stride`` elements apart,
        16-byte aligned) in 16-byte pieces, consecutive threads along a row."""
        per_row = N // 8
        for e in cutlass.range_constexpr(rows * per_row // NUM_THREADS):
            idx = e * NUM_THREADS + tidx
            r, p = idx // per_row, idx % per_row
            off = cute.assume(r * stride + p * 8, divby=8)
            piece = cute.make_rmem_tensor((8,), self.ab)
            cute.autovec_copy(cute.make_tensor(sSrc.iterator + off, cute.make_layout(8)),
                              piece)
            cute.local_tile(gOut[r, None], (8,), (p,)).store(piece.load())

    @cute.jit
    def _zero_rows(self, thr_mma, gOut, shape: cutlass.Constexpr, ok, r0):
        """Zero this thread's elements of the rows of ``gOut`` that do not enter."""
        out = c_tile(thr_mma, gOut, shape, (0, 0))
        crd = thr_mma.partition_C(cute.make_identity_tensor(shape))
        for e in cutlass.range_constexpr(cute.size(out)):
            i, _ = crd[e]
            if ok[i] == 0:
                out[e] = F32(0.0).to(out.element_type)


_KERNELS = {}


# the phases the probe times, in order (each ends at a CTA barrier)
PROBE_PHASES = ("loads+gates", "rows of k, q, v", "K K^T, Q K^T, P", "inverse",
                "w, u", "row rules", "rare rows")


def get_kernel(K: int, V: int, ab_name: str, inverse: bool = False,
               probe: bool = False, tokens: bool = False,
               l2norm: bool = False, readout_rows: bool = False,
               gmma: bool = False, gram_norm: bool = False,
               staged: bool = False, late_v: bool = False,
               ctas: int = CTAS_PER_SM, pipelined: int = 0) -> ChunkPrepSm90:
    key = (K, V, ab_name, inverse, probe, tokens, l2norm, readout_rows, gmma, gram_norm,
           staged, late_v, ctas, pipelined)
    if key not in _KERNELS:
        _KERNELS[key] = ChunkPrepSm90(K, V, ab_type(ab_name), inverse, probe, tokens,
                                      l2norm, readout_rows, gmma, gram_norm, staged, late_v,
                                      ctas, pipelined)
    return _KERNELS[key]
