"""CuTe DSL kernel: the sequential chunk-state recursion fused with the chunk output.

One CTA per (value tile, value head, batch row) walks the chunks of its row in order and
keeps its [K, BV] slice of the state S in float32 registers (the accumulator of a
tensor-core MMA). Per chunk c (operands precomputed by XLA, see ``gdp_jax.kernels.pipeline``):

    S      <- h0[seq[c]]                 if reset[c]           (a sequence starts here)
    Delta   = u_c - w_c S                                       [C, BV]
    o_c     = qg_c S + P_c Delta                                [C, BV]   qg = scale*gam*q,
                                                                          P = scale*tril(q k^T * Gam)
    S      <- decay_c S + Kt_c^T Delta                          decay = exp(G_last)
    final[seq[c]] <- S                   if is_last[c]
    states[c // ckpt] <- S (start of c)  if ckpt > 0 and c % ckpt == 0   (backward checkpoints,
                                                     in the states tensor's dtype)

Operands enter the MMAs in the 16-bit input dtype (bf16 or fp16) with float32
accumulation; u is read in its dtype (16-bit or float32) and subtracted in float32.
With ``split`` (the default for bfloat16), the two recurrent operands S and Delta are
split into hi + lo 16-bit parts (x = hi + lo up to 2^-16 relative) and every product with
them is done twice, which removes their bf16 rounding from the recursion: with plain bf16
operands (FLA's choice) the error of o is ~1.4x larger on ungated sequences with beta near
2, for ~20-25% less kernel time (benchmarks/results/history/2026-11-29/NOTES.md). The value axis of the state is independent per
column, so V is split into tiles of BV columns over the grid's x dimension (more CTAs at
small batch*heads).

MMAs: SM80-style warp MMA (mma.sync m16n8k16, 4 warps split the M dimension), operands
from swizzled shared memory through ldmatrix. This runs on sm_90a but does not use the
Hopper warpgroup MMA or TMA yet (see docs in ``gdp_jax/kernels/__init__.py``).

This module imports cutlass; import it only through ``gdp_jax.kernels.chunk_forward`` (lazily).
"""
from __future__ import annotations

import cutlass
import cutlass.memory
import cutlass.cute as cute

from gdp_jax.kernels.sm90 import (C, MMA_K, NUM_THREADS, READOUT_ROWS, ab_type,
                                  acc_to_smem, c_tile, c_tile_or_zero, chunk_scalars, g2s,
                                  g2s_copy, ldmatrix_copies, load_chunk_scalars, make_acc,
                                  mma_split_b, operand, own_tile, readout_operands,
                                  recurrent, smem_layout, smem_tile, tile_group,
                                  top_rows_view, transpose_view, warp_mma, warp_mma_rows,
                                  wg_operand, wg_products, wg_tiled, barrier, zero_below)


class ChunkFwdSm90:
    """Static configuration: head dims K, V, value tile BV, operand dtype."""

    def __init__(self, K: int, V: int, BV: int, ab_dtype, split: bool, ckpt: int = 0,
                 readout: bool = True, u_cols: int = 0, stages: int = 1, rows: int = C,
                 pairs: int = 1, gmma: bool = False, gmma_rows: bool = False,
                 o_tokens: bool = False):
        assert K in (64, 128) and V % BV == 0 and BV in (16, 32, 64, 128) and ckpt >= 0
        assert stages in (1, 2)
        # 2: a CTA of two 4-warp groups walks two adjacent value tiles (group g: tile
        # 2 x + g) with one copy of the chunk's shared operands (w, Kt, qg, P) in smem,
        # each group loading half of them - the same products in the same order as two
        # CTAs of one tile, on half the operand loads (one operand set only)
        assert pairs in (1, 2) and (pairs == 1 or (stages == 1 and (V // BV) % 2 == 0))
        self.pairs = pairs
        # rows of qg, P and o a chunk: C, or READOUT_ROWS (their read-out rows only, n >= 2;
        # a walk with a readout)
        assert rows == C or (rows == READOUT_ROWS and readout)
        self.rows = rows
        self.K, self.V, self.BV = K, V, BV
        self.ab = ab_dtype
        self.split = split
        self.ckpt = ckpt      # write the start state of every ckpt-th chunk (0: none)
        # False: the walk alone (no qg, P loads, no o): the CP pass's summary walk
        self.readout = readout
        # u holds the first u_cols state columns only, the rest are 0 (0: all V): the CP
        # pass's K response columns need no zeros in HBM
        self.u_cols = u_cols or V
        assert self.u_cols % BV == 0 and self.u_cols <= V
        # 2: the next chunk's operands load (into a second set of smem tiles) while this
        # chunk computes - twice the operand smem, so for launches of at most one CTA an
        # SM, where nothing else hides a chunk's load latency (``ChunkForwardKernel``)
        self.stages = stages
        # the recursion's products as Hopper warpgroup MMAs (wgmma: the CTA's 4 warps are
        # one warpgroup; operands read from the smem tiles through descriptors, S and
        # Delta as they are already copied there) instead of ldmatrix + mma.sync; the
        # read-out rows' o products (rows < C) stay warp MMAs. One operand set, one tile
        # group, one 16-bit rounding of S and Delta. ``gmma_rows``: the read-out rows' o
        # products too, as [C, *] products on qg, P tiles of C rows whose rows past the
        # read-out ones are zero (wgmma's M is 64; 255 -> 240 registers, no spills at
        # BV = 64)
        self.gmma = gmma
        self.gmma_rows = gmma and gmma_rows and rows < C
        assert not gmma or (stages == 1 and pairs == 1 and not split)
        # o written token-major: mO is [B, T, HV, V] and read-out tile row r goes to token
        # tok + r of the row table (NaN where the operands kernel's bad flag is set) - no
        # relayout (and NaN pass) of [B, NC, HV, R, V] rows in XLA after the walk. The
        # wgmma walks' o accumulators only (C rows: R = C at n = 1, or the read-out rows
        # on C-row tiles)
        self.o_tokens = o_tokens
        assert not o_tokens or (readout and gmma and (rows == C or gmma_rows))

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, stream, mW, mKt, mQg, mP, mU, mDecay, mReset, mSeq, mLast, mH0,
                 mO, mFinal, mStates, mRows=None, mBad=None):
        """With ``o_tokens``: mO is [B, T, HV, V], mRows the row table [B, NC, 4] int32
        (``chunk_prep.token_rows``) and mBad the operands kernel's bad rows [B, NC, HV, C]
        int32; otherwise those two are placeholders."""
        K, BV, ab = self.K, self.BV, self.ab
        sK_layout = smem_layout(C, K)         # w, Kt, qg: [C, K]
        sS_layout = smem_layout(K, BV)        # S (16-bit copy): [K, BV]
        sD_layout = smem_layout(C, BV)        # Delta (16-bit): [C, BV]
        # qg: [rows, K], P: [rows, C]; with gmma C rows (wgmma's M is 64: the read-out
        # rows fill the top, zeros below)
        tile_rows = C if self.gmma_rows else self.rows
        sQ_layout = smem_layout(tile_rows, K)
        sPr_layout = smem_layout(tile_rows, C)

        B, HV = mW.shape[0], mW.shape[2]
        grid = (self.V // BV, HV, B)
        if cutlass.const_expr(not self.o_tokens):
            mRows = mReset
            mBad = mReset
        if cutlass.const_expr(self.stages == 2):
            Storage = _storage_pipelined(ab, sK_layout, sS_layout, sD_layout,
                                         sPr_layout if self.readout else None, self.split,
                                         sQ_layout)
            self.kernel_pipelined(
                mW, mKt, mQg, mP, mU, mDecay, mReset, mSeq, mLast, mH0, mO, mFinal, mStates,
                sK_layout, sPr_layout, sS_layout, sD_layout, g2s_copy(ab, K), g2s_copy(ab, C),
                warp_mma(ab), Storage, sQ_layout,
                warp_mma_rows(ab, BV) if self.rows < C else warp_mma(ab)).launch(
                    grid=grid, block=[NUM_THREADS, 1, 1], stream=stream)
        else:
            Storage = _storage(ab, sK_layout, sS_layout, sD_layout,
                               sPr_layout if self.readout else None, sQ_layout, self.pairs)
            self.kernel(mW, mKt, mQg, mP, mU, mDecay, mReset, mSeq, mLast, mH0, mO, mFinal,
                        mStates, mRows, mBad, sK_layout, sPr_layout, sS_layout,
                        sD_layout,
                        g2s_copy(ab, K, NUM_THREADS * self.pairs),
                        g2s_copy(ab, C, NUM_THREADS * self.pairs), warp_mma(ab),
                        Storage, sQ_layout,
                        warp_mma_rows(ab, BV) if self.rows < C else warp_mma(ab)).launch(
                            grid=(self.V // BV // self.pairs, HV, B),
                            block=[NUM_THREADS * self.pairs, 1, 1], stream=stream)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, mW, mKt, mQg, mP, mU, mDecay, mReset, mSeq, mLast, mH0, mO, mFinal,
               mStates, mRows, mBad, sK_layout: cute.ComposedLayout,
               sP_layout: cute.ComposedLayout, sS_layout: cute.ComposedLayout,
               sD_layout: cute.ComposedLayout,
               copy_K: cute.TiledCopy, copy_P: cute.TiledCopy, tiled_mma: cute.TiledMma,
               Storage: cutlass.Constexpr, sQ_layout: cute.ComposedLayout,
               tiled_mma_o: cute.TiledMma):
        K, BV, ab, R = self.K, self.BV, self.ab, self.rows
        tidx, _, _ = cute.arch.thread_idx()
        vt, hv, b = cute.arch.block_idx()
        NC = mW.shape[1]
        # with pairs: this thread's group, index in it and value tile (the operand loads
        # are spread over all the CTA's threads, tidx_cta)
        tidx_cta = tidx
        grp, tidx, vt = tile_group(tidx, vt, self.pairs)

        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(Storage)
        sW = st.sW.get_tensor(sK_layout)
        sKt = st.sKt.get_tensor(sK_layout)
        sS = own_tile(st.sS, sS_layout, grp, self.pairs)      # S: [K, BV]
        sD = own_tile(st.sD, sD_layout, grp, self.pairs)      # Delta: [C, BV]
        sSl = own_tile(st.sSl, sS_layout, grp, self.pairs)    # low parts (split): S - S_hi
        sDl = own_tile(st.sDl, sD_layout, grp, self.pairs)    # Delta - Delta_hi

        if cutlass.const_expr(self.gmma):
            # (the accumulators, c_tile and acc_to_smem below then take its partitions)
            tiled_mma = wg_tiled(ab, BV, True)
            tiled_t = wg_tiled(ab, BV, False)           # Kt^T Delta: A read M-major
        thr_mma = tiled_mma.get_slice(tidx)
        acc_S = make_acc(thr_mma, (K, BV))
        acc_D = make_acc(thr_mma, (C, BV))
        acc_S.fill(0.0)

        # (acc, A operand) pairs of the two phases' products besides the recursion's own
        first, second = [], []
        if cutlass.const_expr(self.gmma):
            thr_t = tiled_t.get_slice(tidx)
            a_op = lambda tiled, thr, t, rows, cols, k_major: wg_operand(
                tiled, thr, t, rows, cols, k_major, True, ab)
            b_op = lambda tiled, thr, t, rows, cols: wg_operand(
                tiled, thr, t, rows, cols, False, False, ab)
            W = a_op(tiled_mma, thr_mma, sW, C, K, True)                  # [C, K]
            KtT = a_op(tiled_t, thr_t, sKt, C, K, False)                  # Kt^T: [K, C]
            S = b_op(tiled_mma, thr_mma, sS, K, BV)                       # S: [K, BV]
            D_t = b_op(tiled_t, thr_t, sD, C, BV)                         # Delta: [C, BV]
            D = b_op(tiled_mma, thr_mma, sD, C, BV)
        else:
            # MMA operands: smem -> registers by ldmatrix (Kt^T is M-major, hence
            # transposed; the B operands S and Delta are read as [BV, K] / [BV, C] views)
            cA, cAt, cBt = ldmatrix_copies(tiled_mma, ab, tidx)
            W = operand(thr_mma, cA, sW, True)
            KtT = operand(thr_mma, cAt, transpose_view(sKt, C, K), True)     # Kt^T: [K, C]
            S = operand(thr_mma, cBt, transpose_view(sS, K, BV), False)
            D = operand(thr_mma, cBt, transpose_view(sD, C, BV), False)
            Sl = operand(thr_mma, cBt, transpose_view(sSl, K, BV), False)
            Dl = operand(thr_mma, cBt, transpose_view(sDl, C, BV), False)
        if cutlass.const_expr(self.readout):
            sQ = st.sQ.get_tensor(sQ_layout)
            sP = st.sP.get_tensor(sP_layout)
            if cutlass.const_expr(self.gmma and (R == C or self.gmma_rows)):
                # (R < C: rows R.. of the qg, P tiles stay zero, their o rows unstored)
                acc_O = make_acc(thr_mma, (C, BV))
                first = [(acc_O, a_op(tiled_mma, thr_mma, sQ, C, K, True))]
                second = [(acc_O, a_op(tiled_mma, thr_mma, sP, C, C, True))]
            elif cutlass.const_expr(R == C):
                acc_O = make_acc(thr_mma, (C, BV))
                first = [(acc_O, operand(thr_mma, cA, sQ, True))]
                second = [(acc_O, operand(thr_mma, cA, sP, True))]
            else:
                # the read-out rows' products on their own 2 x 2 warp tiling (R = 32 rows),
                # B operands S, Delta read again from smem in its partition
                thr_o, cA_o, S_o, Sl_o, D_o, Dl_o = readout_operands(
                    tiled_mma_o, tidx, ab, K, BV, sS, sSl, sD, sDl)
                acc_O = make_acc(thr_o, (R, BV))
                Q_o, P_o = operand(thr_o, cA_o, sQ, True), operand(thr_o, cA_o, sP, True)

        # accumulators -> smem operands (16-bit, hi + lo in split mode)
        toS = acc_to_smem(tiled_mma, tidx, acc_S, ab)
        toD = acc_to_smem(tiled_mma, tidx, acc_D, ab)
        tCsS, tCsSl = toS.dest(sS), toS.dest(sSl)
        tCsD, tCsDl = toD.dest(sD), toD.dest(sDl)

        # (copy_K, copy_P are built for all the CTA's threads)
        gK, gP = g2s(copy_K, tidx_cta), g2s(copy_P, tidx_cta)
        tKsW, tKsKt = gK.dest(sW), gK.dest(sKt)
        if cutlass.const_expr(self.readout and self.gmma_rows):
            # the read-out rows load into the tiles' top R rows; the rows below are zeros
            tKsQ, tPsP = zero_below(gK, sQ, R, K, ab), zero_below(gP, sP, R, C, ab)
        elif cutlass.const_expr(self.readout):
            tKsQ, tPsP = gK.dest(sQ), gP.dest(sP)

        for c in cutlass.range(NC, unroll=1):
            # the chunk's scalars first: their global loads then wait alongside the tile
            # loads instead of each stalling a later phase (a use after a barrier)
            seq = mSeq[b, c]
            reset = mReset[b, c]
            decay = mDecay[b, c, hv]
            last = mLast[b, c]
            if cutlass.const_expr(self.o_tokens):
                # o's token rows and bad flags now: their dependent global loads then wait
                # alongside the tile loads, not on the serial path after the products
                o_rows = self._o_token_rows(thr_mma, mBad, mRows, b, c, hv)
            # ---- operands of chunk c -> smem (async; with pairs, one copy for both groups)
            gK.load(mW[b, c, hv, None, None], (C, K), tKsW)
            gK.load(mKt[b, c, hv, None, None], (C, K), tKsKt)
            if cutlass.const_expr(self.readout):
                gK.load(mQg[b, c, hv, None, None], (R, K), tKsQ)
                gP.load(mP[b, c, hv, None, None], (R, C), tPsP)
            cute.arch.cp_async_commit_group()

            # ---- chunk start state (reset -> the sequence's initial state)
            if reset != 0:
                acc_S.store(c_tile(thr_mma, mH0[seq, hv, None, None], (K, BV), (0, vt)).load())
            if cutlass.const_expr(self.ckpt > 0):
                # checkpoint for the backward (recompute_chunk_num = ckpt - 1)
                if c % self.ckpt == 0:
                    c_tile(thr_mma, mStates[b, c // self.ckpt, hv, None, None], (K, BV),
                           (0, vt)).store(acc_S.load().to(mStates.element_type))
            toS.store_split(acc_S.load(), tCsS, tCsSl, self.split)
            if cutlass.const_expr(self.u_cols == self.V):
                u = c_tile(thr_mma, mU[b, c, hv, None, None], (C, BV), (0, vt)).load().to(
                    cutlass.Float32)
            else:
                u = c_tile_or_zero(thr_mma, mU[b, c, hv, None, None], (C, BV), vt,
                                   self.u_cols // BV)
            cute.arch.cp_async_wait_group(0)
            barrier(self.gmma)

            # ---- Delta = u - w S ;  o = qg S  (shared B operand S)
            acc_D.fill(0.0)
            for acc, _ in first:
                acc.fill(0.0)
            if cutlass.const_expr(self.gmma):
                wg_products([(tiled_mma, K // MMA_K, [(acc_D, W, S)]
                              + [(acc, a, S) for acc, a in first])])
            else:
                mma_split_b(tiled_mma, K // MMA_K, [(acc_D, W)] + first, S, Sl, self.split)
            if cutlass.const_expr(self.readout and R < C and not self.gmma_rows):
                acc_O.fill(0.0)
                mma_split_b(tiled_mma_o, K // MMA_K, [(acc_O, Q_o)], S_o, Sl_o, self.split)
            toD.store_split(u - acc_D.load(), tCsD, tCsDl, self.split)
            barrier(self.gmma)

            # ---- S <- decay S + Kt^T Delta ;  o += P Delta  (shared B operand Delta)
            acc_S.store(acc_S.load() * decay)
            if cutlass.const_expr(self.gmma):
                wg_products([(tiled_t, C // MMA_K, [(acc_S, KtT, D_t)]),
                             (tiled_mma, C // MMA_K, [(acc, a, D) for acc, a in second])])
            else:
                mma_split_b(tiled_mma, C // MMA_K, [(acc_S, KtT)] + second, D, Dl, self.split)

            if cutlass.const_expr(self.o_tokens):
                if tidx < 32 * (R // 16):
                    for acc, _ in first:
                        self._store_o_tokens(thr_mma, acc, mO, b, hv, vt, o_rows)
            elif cutlass.const_expr(self.gmma_rows):
                # o's R rows: the warps holding accumulator rows < R store them,
                # through a [C, V] view of the chunk's rows (rows >= R are never touched)
                if tidx < 32 * (R // 16):
                    gO = top_rows_view(mO[b, c, hv, None, None], self.V)
                    for acc, _ in first:
                        c_tile(thr_mma, gO, (C, BV), (0, vt)).store(acc.load().to(ab))
            else:
                for acc, _ in first:
                    c_tile(thr_mma, mO[b, c, hv, None, None], (C, BV), (0, vt)).store(
                        acc.load().to(ab))
            if cutlass.const_expr(self.readout and R < C and not self.gmma_rows):
                mma_split_b(tiled_mma_o, C // MMA_K, [(acc_O, P_o)], D_o, Dl_o, self.split)
                c_tile(thr_o, mO[b, c, hv, None, None], (R, BV), (0, vt)).store(
                    acc_O.load().to(ab))
            if last != 0:
                c_tile(thr_mma, mFinal[seq, hv, None, None], (K, BV), (0, vt)).store(
                    acc_S.load())
            # smem is overwritten by the next chunk's loads
            cute.arch.sync_threads()


    @cute.jit
    def _o_token_rows(self, thr_mma, mBad, mRows, b, c, hv):
        """``o_tokens``: where this thread's o rows of chunk c go -> (tok, ok0, ok1, bad0,
        bad1). An accumulator row lives in one quad: this thread holds tile rows r0 and
        r0 + 8, chunk rows i = n r + n - 1 (R < C: the read-out rows; R = C: n = 1, i = r);
        ok: i < count (a token of the chunk), bad: the operands kernel flagged row i."""
        count, tok, n = mRows[b, c, 1], mRows[b, c, 2], mRows[b, c, 3]
        r0 = thr_mma.partition_C(cute.make_identity_tensor((C, self.BV)))[0][0]
        i0, i1 = r0, r0 + 8
        if cutlass.const_expr(self.rows < C):
            i0, i1 = n * r0 + n - 1, n * (r0 + 8) + n - 1
        bad0 = mBad[b, c, hv, cutlass.min(i0, C - 1)] != 0
        bad1 = mBad[b, c, hv, cutlass.min(i1, C - 1)] != 0
        return tok, i0 < count, i1 < count, bad0, bad1

    @cute.jit
    def _store_o_tokens(self, thr_mma, acc, mO, b, hv, vt, o_rows):
        """``o_tokens``: this thread's o elements (accumulator rows r < R of a [C, BV]
        tile) to token tok + r of mO [B, T, HV, V] where ok, NaN where bad (``o_rows``
        from :meth:`_o_token_rows`, as XLA marked the rows it laid out)."""
        tok, ok0, ok1, bad0, bad1 = o_rows
        # a [C, V] view of tokens tok, tok + 1, ..: rows past the chunk's read-out rows
        # are never stored through it
        g = cute.make_tensor(mO[b, tok, hv, None].iterator,
                             cute.make_layout((C, self.V), stride=(mO.shape[2] * self.V, 1)))
        part = c_tile(thr_mma, g, (C, self.BV), (0, vt))
        crd = thr_mma.partition_C(cute.make_identity_tensor((C, self.BV)))
        x = cute.make_fragment_like(part)
        x.store(acc.load().to(self.ab))
        r0 = crd[0][0]
        nan = cutlass.Float32(float("nan")).to(self.ab)
        for e in cutlass.range_constexpr(cute.size(part)):
            r, _ = crd[e]
            first = r == r0
            if cutlass.select_(first, ok0, ok1):
                part[e] = cutlass.select_(cutlass.select_(first, bad0, bad1), nan, x[e])

    @cute.kernel
    def kernel_pipelined(self, mW, mKt, mQg, mP, mU, mDecay, mReset, mSeq, mLast, mH0, mO,
                         mFinal, mStates, sK_layout: cute.ComposedLayout,
                         sP_layout: cute.ComposedLayout, sS_layout: cute.ComposedLayout,
                         sD_layout: cute.ComposedLayout, copy_K: cute.TiledCopy,
                         copy_P: cute.TiledCopy, tiled_mma: cute.TiledMma,
                         Storage: cutlass.Constexpr, sQ_layout: cute.ComposedLayout,
                         tiled_mma_o: cute.TiledMma):
        """:meth:`kernel` with two sets of operand tiles: chunk c + 1's w, Kt (qg, P) go
        to one set by cp.async, its scalars and u to registers, while chunk c computes on
        the other - the same products in the same order (the same bits)."""
        K, BV, ab, R = self.K, self.BV, self.ab, self.rows
        F32 = cutlass.Float32
        tidx, _, _ = cute.arch.thread_idx()
        vt, hv, b = cute.arch.block_idx()
        NC = mW.shape[1]

        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(Storage)
        thr_mma = tiled_mma.get_slice(tidx)
        cA, cAt, cBt = ldmatrix_copies(tiled_mma, ab, tidx)
        # the state S [K, BV] and Delta [C, BV]: accumulators, smem operands, writers
        r = recurrent(tiled_mma, thr_mma, tidx, cBt, ab, st, sS_layout, sD_layout, K, BV,
                      self.split)
        acc_S, acc_D = r.acc_S, r.acc_D
        # o's products: on the MMA tiling of the walk (R = C), or on the read-out rows'
        # own 2 x 2-warp tiling with S, Delta read again in its partition (R = 32)
        thr_o, cA_o = thr_mma, cA
        if cutlass.const_expr(R < C):
            sS, sD = st.sS.get_tensor(sS_layout), st.sD.get_tensor(sD_layout)
            sSl, sDl = sS, sD
            if cutlass.const_expr(self.split):
                sSl, sDl = st.sSl.get_tensor(sS_layout), st.sDl.get_tensor(sD_layout)
            thr_o, cA_o, S_o, Sl_o, D_o, Dl_o = readout_operands(
                tiled_mma_o, tidx, ab, K, BV, sS, sSl, sD, sDl)
        acc_O = make_acc(thr_o, (R, BV))
        gK, gP = g2s(copy_K, tidx), g2s(copy_P, tidx)

        # u's column tile: the CP pass's response columns (vt >= u_cols / BV) take u = 0;
        # they read the last real tile (in bounds, finite) and multiply it by 0
        u_tiles = self.u_cols // BV
        u_vt = cutlass.min(vt, u_tiles - 1)
        u_keep = cutlass.select_(vt < u_tiles, F32(1.0), F32(0.0))

        # the two operand sets: MMA operand views, cp.async destinations, and registers
        # for the chunk's u and scalars (seq, reset, last; decay)
        slots = []
        for i in cutlass.range_constexpr(2):
            sW = getattr(st, f"sW{i}").get_tensor(sK_layout)
            sKt = getattr(st, f"sKt{i}").get_tensor(sK_layout)
            slot = dict(W=operand(thr_mma, cA, sW, True),
                        KtT=operand(thr_mma, cAt, transpose_view(sKt, C, K), True),
                        tW=gK.dest(sW), tKt=gK.dest(sKt),
                        u=make_acc(thr_mma, (C, BV)), scalars=chunk_scalars())
            if cutlass.const_expr(self.readout):
                sQ = getattr(st, f"sQ{i}").get_tensor(sQ_layout)
                sP = getattr(st, f"sP{i}").get_tensor(sP_layout)
                slot.update(Q=operand(thr_o, cA_o, sQ, True),
                            Pm=operand(thr_o, cA_o, sP, True),
                            tQ=gK.dest(sQ), tP=gP.dest(sP))
            slots.append(slot)

        args = (b, hv, u_vt, thr_mma, gK, gP, mW, mKt, mQg, mP, mU, mDecay, mReset, mSeq,
                mLast)
        self._fetch(0, slots[0], *args)
        for c2 in cutlass.range(0, NC, 2, unroll=1):
            for h in cutlass.range_constexpr(2):
                cur, nxt = slots[h], slots[1 - h]
                c = c2 + h
                if c < NC:
                    # the next chunk's loads (the last chunk loads itself again, unread)
                    self._fetch(c + 1 - (c + 1) // NC, nxt, *args)
                    (si, sf) = cur["scalars"]
                    seq, reset, last, decay = si[0], si[1], si[2], sf[0]

                    # ---- chunk start state (reset -> the sequence's initial state)
                    if reset != 0:
                        acc_S.store(c_tile(thr_mma, mH0[seq, hv, None, None], (K, BV),
                                           (0, vt)).load())
                    if cutlass.const_expr(self.ckpt > 0):
                        if c % self.ckpt == 0:
                            c_tile(thr_mma, mStates[b, c // self.ckpt, hv, None, None],
                                   (K, BV), (0, vt)).store(
                                       acc_S.load().to(mStates.element_type))
                    r.toS.store_split(acc_S.load(), r.tCsS, r.tCsSl, self.split)
                    u = cur["u"].load()
                    if cutlass.const_expr(self.u_cols != self.V):
                        u = u * u_keep
                    cute.arch.cp_async_wait_group(1)     # this chunk's group (not the next)
                    cute.arch.sync_threads()

                    # ---- Delta = u - w S ;  o = qg S  (shared B operand S)
                    acc_D.fill(0.0)
                    first, second = [], []
                    if cutlass.const_expr(self.readout):
                        acc_O.fill(0.0)
                        if cutlass.const_expr(R == C):
                            first, second = [(acc_O, cur["Q"])], [(acc_O, cur["Pm"])]
                    mma_split_b(tiled_mma, K // MMA_K, [(acc_D, cur["W"])] + first, r.S, r.Sl,
                                self.split)
                    if cutlass.const_expr(self.readout and R < C):
                        mma_split_b(tiled_mma_o, K // MMA_K, [(acc_O, cur["Q"])], S_o, Sl_o,
                                    self.split)
                    r.toD.store_split(u - acc_D.load(), r.tCsD, r.tCsDl, self.split)
                    cute.arch.sync_threads()

                    # ---- S <- decay S + Kt^T Delta ;  o += P Delta
                    acc_S.store(acc_S.load() * decay)
                    mma_split_b(tiled_mma, C // MMA_K, [(acc_S, cur["KtT"])] + second, r.D,
                                r.Dl, self.split)
                    if cutlass.const_expr(self.readout and R < C):
                        mma_split_b(tiled_mma_o, C // MMA_K, [(acc_O, cur["Pm"])], D_o, Dl_o,
                                    self.split)
                    if cutlass.const_expr(self.readout):
                        c_tile(thr_o, mO[b, c, hv, None, None], (R, BV), (0, vt)).store(
                            acc_O.load().to(ab))
                    if last != 0:
                        c_tile(thr_mma, mFinal[seq, hv, None, None], (K, BV),
                               (0, vt)).store(acc_S.load())
                    # this slot and the S, Delta tiles are overwritten by later chunks
                    cute.arch.sync_threads()
        cute.arch.cp_async_wait_group(0)

    def _fetch(self, c, slot, b, hv, u_vt, thr_mma, gK, gP, mW, mKt, mQg, mP, mU, mDecay,
               mReset, mSeq, mLast):
        """Start chunk c's loads into ``slot`` of :meth:`kernel_pipelined`: w, Kt (qg, P)
        by cp.async (one group), its u and scalars into the slot's registers (used a chunk
        later, so their latency hides behind this chunk's products)."""
        K, BV = self.K, self.BV
        gK.load(mW[b, c, hv, None, None], (C, K), slot["tW"])
        gK.load(mKt[b, c, hv, None, None], (C, K), slot["tKt"])
        if cutlass.const_expr(self.readout):
            gK.load(mQg[b, c, hv, None, None], (self.rows, K), slot["tQ"])
            gP.load(mP[b, c, hv, None, None], (self.rows, C), slot["tP"])
        cute.arch.cp_async_commit_group()
        load_chunk_scalars(slot["scalars"], mSeq, mReset, mLast, mDecay, b, c, hv)
        slot["u"].store(c_tile(thr_mma, mU[b, c, hv, None, None], (C, BV),
                               (0, u_vt)).load().to(cutlass.Float32))


def _storage(ab, sK_layout, sS_layout, sD_layout, sP_layout, sQ_layout, pairs=1):
    """The recursion's shared memory (a ``cute.struct``): w, Kt, S hi / lo, Delta hi / lo
    (one of each per group: ``pairs``) and, where ``sP_layout`` is given (the readout),
    qg (``sQ_layout``) and P. (Built as an object: this module's annotations are strings,
    which only a ``cute.jit`` body evaluates.)"""
    fields = {"sW": smem_tile(ab, sK_layout), "sKt": smem_tile(ab, sK_layout)}
    if sP_layout is not None:
        fields.update(sQ=smem_tile(ab, sQ_layout), sP=smem_tile(ab, sP_layout))
    fields.update(sS=smem_tile(ab, sS_layout, pairs), sD=smem_tile(ab, sD_layout, pairs),
                  sSl=smem_tile(ab, sS_layout, pairs), sDl=smem_tile(ab, sD_layout, pairs))
    return cute.struct(type("Storage", (), {"__annotations__": fields}))


def _storage_pipelined(ab, sK_layout, sS_layout, sD_layout, sP_layout, split, sQ_layout):
    """:func:`_storage` with two sets of the chunk operand tiles (w, Kt; qg, P where
    ``sP_layout`` is given), and the lo parts only in ``split`` mode."""
    fields = {}
    for i in range(2):
        fields.update({f"sW{i}": smem_tile(ab, sK_layout), f"sKt{i}": smem_tile(ab, sK_layout)})
        if sP_layout is not None:
            fields.update({f"sQ{i}": smem_tile(ab, sQ_layout),
                           f"sP{i}": smem_tile(ab, sP_layout)})
    fields.update(sS=smem_tile(ab, sS_layout), sD=smem_tile(ab, sD_layout))
    if split:
        fields.update(sSl=smem_tile(ab, sS_layout), sDl=smem_tile(ab, sD_layout))
    return cute.struct(type("Storage", (), {"__annotations__": fields}))


_KERNELS = {}


def get_kernel(K: int, V: int, BV: int, ab_name: str, split: bool,
               ckpt: int = 0, readout: bool = True, u_cols: int = 0,
               stages: int = 1, rows: int = C, pairs: int = 1,
               gmma: bool = False, gmma_rows: bool = False,
               o_tokens: bool = False) -> ChunkFwdSm90:
    key = (K, V, BV, ab_name, split, ckpt, readout, u_cols or V, stages, rows, pairs, gmma,
           gmma_rows, o_tokens)
    if key not in _KERNELS:
        _KERNELS[key] = ChunkFwdSm90(K, V, BV, ab_type(ab_name), split, ckpt, readout,
                                     u_cols, stages, rows, pairs, gmma, gmma_rows, o_tokens)
    return _KERNELS[key]
