"""CuTe DSL kernel: the reverse chunk-state-gradient recursion of the backward (FLA's "dhu").

The mirror of :mod:`gdp_jax.kernels.chunk_fwd_sm90`. One CTA per (value tile, value head,
batch row) walks the chunks of its row BACKWARDS with its [K, BV] slice of dS (the
gradient w.r.t. the state) in float32 registers. Per chunk c, in reverse (operands
precomputed by XLA, see ``gdp_jax.kernels.pipeline``):

    dS     += dfinal[seq[c]]             if is_last[c]        (the sequence ends here)
    dS_end[c] <- dS                     (written, float32 or 16-bit; not with write_ds=False)
    dDelta  = ddo_c + Kt_c dS                                  [C, BV]   ddo = P^T dO
    dS     <- decay_c dS + qg_c^T dO_c - w_c^T dDelta          [K, BV]
    dh0[seq[c]] <- dS;  dS <- 0          if reset[c]          (the sequence starts here)

With ``fuse_ddo`` the kernel reads the readout matrix P_c [C, C] (16-bit) instead of ddo
and forms ddo_c = P_c^T dO_c itself (one more MMA a chunk, off the dS chain; P and dO are
exact 16-bit values, so the product is the one XLA forms, in float32).

Same MMA scheme as the forward (mma.sync m16n8k16, ldmatrix from swizzled smem, the two
recurrent operands dS and dDelta split into hi + lo 16-bit parts with ``split``), or with
``gmma`` Hopper warpgroup MMAs reading the same smem tiles through descriptors. No
atomics: every output element is written by exactly one thread, so the kernel is
deterministic.

This module imports cutlass; import it only through ``gdp_jax.kernels.state_grad`` (lazily).
"""
from __future__ import annotations

import cutlass
import cutlass.memory
import cutlass.cute as cute

from gdp_jax.kernels.sm90 import (C, MMA_K, NUM_THREADS, READOUT_ROWS, ab_type,
                                  acc_to_smem, c_tile, c_tile_or_zero, chunk_scalars, g2s,
                                  g2s_copy, ldmatrix_copies, load_chunk_scalars, make_acc,
                                  mma_split_b, operand, own_tile, recurrent, smem_layout,
                                  smem_tile, tile_group, transpose_view, warp_mma,
                                  warp_mma_rows, wg_operand, wg_products, wg_tiled, barrier)


class ChunkBwdDhSm90:
    """Static configuration: head dims K, V, value tile BV, operand dtype, hi/lo split."""

    def __init__(self, K: int, V: int, BV: int, ab_dtype, split: bool,
                 fuse_ddo: bool = False, do_cols: int = 0, write_ds: bool = True,
                 stages: int = 1, pairs: int = 1, rows: int = C, gmma: bool = False):
        assert K in (64, 128) and V % BV == 0 and BV in (16, 32, 64, 128) and stages in (1, 2)
        # rows of qg, P and dO a chunk: C, or READOUT_ROWS (their read-out rows only, n >= 2:
        # the only rows where dO is not zero); one operand set, one value tile a CTA
        assert rows == C or (rows == READOUT_ROWS and stages == 1 and pairs == 1)
        self.rows = rows
        # 2: a CTA of two 4-warp groups on two adjacent value tiles, one copy of the
        # chunk's Kt, w, qg (P) in smem (the forward walk's ``pairs``; one operand set)
        assert pairs in (1, 2) and (pairs == 1 or (stages == 1 and (V // BV) % 2 == 0))
        self.pairs = pairs
        self.K, self.V, self.BV = K, V, BV
        self.ab = ab_dtype
        self.split = split
        self.fuse_ddo = fuse_ddo      # mDdo holds P [.., C, C] (16-bit): ddo = P^T dO here
        # dO (and ddo) hold the first do_cols state columns only, the rest are 0 (0: all
        # V): the CP pass's K response columns need no zeros in HBM
        self.do_cols = do_cols or V
        assert self.do_cols % BV == 0 and self.do_cols <= V
        # False: the walk for the start-state gradients alone (a CP summary): mDsEnd is a
        # placeholder nobody reads, and no chunk's dS_end is stored
        self.write_ds = write_ds
        # 2: the next chunk's operands load while this one computes (the forward walk's
        # ``stages``; ``chunk_forward.ChunkForwardKernel.pick_stages``)
        self.stages = stages
        # the recursion's products as Hopper warpgroup MMAs (the forward walk's ``gmma``:
        # the CTA's 4 warps are one warpgroup, operands read from the smem tiles by
        # descriptors) - for the one-set, one-tile walk without the split
        self.gmma = gmma
        assert not gmma or (stages == 1 and pairs == 1 and not split)

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, stream, mKt, mW, mQg, mDdo, mDo, mDecay, mReset, mSeq, mLast,
                 mDfinal, mDsEnd, mDh0):
        K, BV, ab, R = self.K, self.BV, self.ab, self.rows
        sK_layout = smem_layout(C, K)         # Kt, w: [C, K]
        sS_layout = smem_layout(K, BV)        # dS (16-bit copy): [K, BV]
        sD_layout = smem_layout(C, BV)        # -dDelta (16-bit): [C, BV]
        sP_layout = smem_layout(R, C)         # P (16-bit, ``fuse_ddo``): [R, C]
        sQ_layout = smem_layout(R, K)         # qg: [R, K]
        sO_layout = smem_layout(R, BV)        # dO (16-bit): [R, BV]
        B, HV = mKt.shape[0], mKt.shape[2]
        grid = (self.V // BV, HV, B)
        if cutlass.const_expr(self.stages == 2):
            Storage = _storage_pipelined(ab, sK_layout, sS_layout, sD_layout,
                                         sP_layout if self.fuse_ddo else None, self.split)
            self.kernel_pipelined(
                mKt, mW, mQg, mDdo, mDo, mDecay, mReset, mSeq, mLast, mDfinal, mDsEnd, mDh0,
                sK_layout, sS_layout, sD_layout, sP_layout, g2s_copy(ab, K), g2s_copy(ab, C),
                warp_mma(ab), Storage).launch(grid=grid, block=[NUM_THREADS, 1, 1],
                                              stream=stream)
        else:
            Storage = _storage(ab, sK_layout, sS_layout, sD_layout,
                               sP_layout if self.fuse_ddo else None, self.pairs,
                               sQ_layout, sO_layout)
            threads = NUM_THREADS * self.pairs
            self.kernel(mKt, mW, mQg, mDdo, mDo, mDecay, mReset, mSeq, mLast, mDfinal,
                        mDsEnd, mDh0, sK_layout, sS_layout, sD_layout, sP_layout,
                        g2s_copy(ab, K, threads), g2s_copy(ab, C, threads), warp_mma(ab),
                        Storage, sQ_layout, sO_layout,
                        warp_mma_rows(ab, BV) if R < C else warp_mma(ab)).launch(
                            grid=(self.V // BV // self.pairs, HV, B),
                            block=[threads, 1, 1], stream=stream)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, mKt, mW, mQg, mDdo, mDo, mDecay, mReset, mSeq, mLast, mDfinal, mDsEnd,
               mDh0, sK_layout: cute.ComposedLayout, sS_layout: cute.ComposedLayout,
               sD_layout: cute.ComposedLayout, sP_layout: cute.ComposedLayout,
               copy_K: cute.TiledCopy, copy_C: cute.TiledCopy, tiled_mma: cute.TiledMma,
               Storage: cutlass.Constexpr, sQ_layout: cute.ComposedLayout,
               sO_layout: cute.ComposedLayout, tiled_mma_o: cute.TiledMma):
        K, BV, ab, pairs, R = self.K, self.BV, self.ab, self.pairs, self.rows
        tidx, _, _ = cute.arch.thread_idx()
        vt, hv, b = cute.arch.block_idx()
        NC = mKt.shape[1]
        # with pairs: this thread's group, index in it and value tile (the operand loads
        # are spread over all the CTA's threads, tidx_cta)
        tidx_cta = tidx
        grp, tidx, vt = tile_group(tidx, vt, pairs)

        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(Storage)
        sKt = st.sKt.get_tensor(sK_layout)
        sW = st.sW.get_tensor(sK_layout)
        sQ = st.sQ.get_tensor(sQ_layout)                   # qg: [R, K]
        sS = own_tile(st.sS, sS_layout, grp, pairs)        # dS hi: [K, BV]
        sSl = own_tile(st.sSl, sS_layout, grp, pairs)      # dS lo
        sD = own_tile(st.sD, sD_layout, grp, pairs)        # -dDelta hi: [C, BV]
        sDl = own_tile(st.sDl, sD_layout, grp, pairs)      # -dDelta lo
        sO = own_tile(st.sO, sO_layout, grp, pairs)        # dO: [R, BV]

        if cutlass.const_expr(self.gmma):
            # (the accumulators, c_tile and acc_to_smem below then take its partitions)
            tiled_mma = wg_tiled(ab, BV, True)          # Kt dS: A as stored
            tiled_t = wg_tiled(ab, BV, False)           # w^T, qg^T, P^T: A read M-major
            if cutlass.const_expr(R == C):
                tiled_mma_o = tiled_mma                 # dO enters smem as dDelta does
        thr_mma = tiled_mma.get_slice(tidx)
        acc_S = make_acc(thr_mma, (K, BV))
        acc_D = make_acc(thr_mma, (C, BV))
        acc_S.fill(0.0)

        if cutlass.const_expr(self.gmma):
            thr_t = tiled_t.get_slice(tidx)
            a_t = lambda t, rows, cols: wg_operand(tiled_t, thr_t, t, rows, cols, False,
                                                   True, ab)
            b_t = lambda t, rows, cols: wg_operand(tiled_t, thr_t, t, rows, cols, False,
                                                   False, ab)
            Kt = wg_operand(tiled_mma, thr_mma, sKt, C, K, True, True, ab)      # [C, K]
            S = wg_operand(tiled_mma, thr_mma, sS, K, BV, False, False, ab)     # [K, BV]
            WT, QT = a_t(sW, C, K), a_t(sQ, R, K)                     # w^T, qg^T: [K, C / R]
            D, O = b_t(sD, C, BV), b_t(sO, R, BV)                     # -dDelta, dO: [C / R, BV]
        else:
            # MMA operands (w^T, qg^T: M-major [K, C] views; B operands as [BV, *] views)
            cA, cAt, cBt = ldmatrix_copies(tiled_mma, ab, tidx)
            Kt = operand(thr_mma, cA, sKt, True)
            WT = operand(thr_mma, cAt, transpose_view(sW, C, K), True)
            QT = operand(thr_mma, cAt, transpose_view(sQ, R, K), True)      # qg^T: [K, R]
            S = operand(thr_mma, cBt, transpose_view(sS, K, BV), False)
            Sl = operand(thr_mma, cBt, transpose_view(sSl, K, BV), False)
            D = operand(thr_mma, cBt, transpose_view(sD, C, BV), False)
            Dl = operand(thr_mma, cBt, transpose_view(sDl, C, BV), False)
            O = operand(thr_mma, cBt, transpose_view(sO, R, BV), False)

        toS = acc_to_smem(tiled_mma, tidx, acc_S, ab)
        toD = acc_to_smem(tiled_mma, tidx, acc_D, ab)
        tCsS, tCsSl = toS.dest(sS), toS.dest(sSl)
        tCsD, tCsDl = toD.dest(sD), toD.dest(sDl)
        # dO's [R, BV] tile enters smem through the accumulator layout of a tiled MMA of
        # R rows: the walk's (R = C) or the read-out rows' 2 x 2 warps (R = READOUT_ROWS)
        thr_o = tiled_mma_o.get_slice(tidx)
        toO = toD
        if cutlass.const_expr(R < C):
            toO = acc_to_smem(tiled_mma_o, tidx, make_acc(thr_o, (R, BV)), ab)
        tCsO = toO.dest(sO)

        gK = g2s(copy_K, tidx_cta)
        tKsKt, tKsW, tKsQ = gK.dest(sKt), gK.dest(sW), gK.dest(sQ)
        if cutlass.const_expr(self.fuse_ddo):
            sP = st.sP.get_tensor(sP_layout)    # P: [R, C]
            if cutlass.const_expr(self.gmma):
                PT = a_t(sP, R, C)                                            # P^T: [C, R]
            else:
                PT = operand(thr_mma, cAt, transpose_view(sP, R, C), True)    # P^T: [C, R]
            gP = g2s(copy_C, tidx_cta)
            tPsP = gP.dest(sP)

        for i in cutlass.range(NC, unroll=1):
            c = NC - 1 - i
            # the chunk's scalars first: their global loads then wait alongside the tile
            # loads instead of each stalling a later phase (a use after a barrier)
            seq = mSeq[b, c]
            last = mLast[b, c]
            reset = mReset[b, c]
            decay = mDecay[b, c, hv]
            # ---- operands of chunk c -> smem (async)
            gK.load(mKt[b, c, hv, None, None], (C, K), tKsKt)
            gK.load(mW[b, c, hv, None, None], (C, K), tKsW)
            gK.load(mQg[b, c, hv, None, None], (R, K), tKsQ)
            if cutlass.const_expr(self.fuse_ddo):
                gP.load(mDdo[b, c, hv, None, None], (R, C), tPsP)
            cute.arch.cp_async_commit_group()

            # ---- gradient w.r.t. the chunk's end state
            if last != 0:
                gF = c_tile(thr_mma, mDfinal[seq, hv, None, None], (K, BV), (0, vt))
                acc_S.store(acc_S.load() + gF.load())
            if cutlass.const_expr(self.write_ds):
                c_tile(thr_mma, mDsEnd[b, c, hv, None, None], (K, BV), (0, vt)).store(
                    acc_S.load().to(mDsEnd.element_type))
            toS.store_split(acc_S.load(), tCsS, tCsSl, self.split)
            if cutlass.const_expr(self.do_cols == self.V):
                toO.store(c_tile(thr_o, mDo[b, c, hv, None, None], (R, BV), (0, vt)).load(),
                          tCsO)
                if cutlass.const_expr(not self.fuse_ddo):
                    ddo = c_tile(thr_mma, mDdo[b, c, hv, None, None], (C, BV),
                                 (0, vt)).load().to(cutlass.Float32)
            else:
                tiles = self.do_cols // BV
                toO.store(c_tile_or_zero(thr_o, mDo[b, c, hv, None, None], (R, BV), vt,
                                         tiles).to(ab), tCsO)
                if cutlass.const_expr(not self.fuse_ddo):
                    ddo = c_tile_or_zero(thr_mma, mDdo[b, c, hv, None, None], (C, BV), vt,
                                         tiles)
            cute.arch.cp_async_wait_group(0)
            barrier(self.gmma)

            # ---- dDelta = ddo + Kt dS   (kept negated in smem: the next MMA subtracts it)
            acc_D.fill(0.0)
            if cutlass.const_expr(self.gmma):
                # (P^T dO first, as the warp MMAs add them)
                wg_products(([(tiled_t, R // MMA_K, [(acc_D, PT, O)])] if self.fuse_ddo
                             else []) + [(tiled_mma, K // MMA_K, [(acc_D, Kt, S)])])
            else:
                if cutlass.const_expr(self.fuse_ddo):
                    mma_split_b(tiled_mma, R // MMA_K, [(acc_D, PT)], O, None, False)
                mma_split_b(tiled_mma, K // MMA_K, [(acc_D, Kt)], S, Sl, self.split)
            if cutlass.const_expr(self.fuse_ddo):
                toD.store_split(-acc_D.load(), tCsD, tCsDl, self.split)
            else:
                toD.store_split(-(ddo + acc_D.load()), tCsD, tCsDl, self.split)
            barrier(self.gmma)

            # ---- dS <- decay dS + qg^T dO + w^T (-dDelta)
            acc_S.store(acc_S.load() * decay)
            if cutlass.const_expr(self.gmma):
                # (w^T (-dDelta), then qg^T dO: another order than the warp MMAs', so the
                # float32 sums differ from theirs by rounding - s39-2's GPU test)
                wg_products([(tiled_t, C // MMA_K, [(acc_S, WT, D)]),
                             (tiled_t, R // MMA_K, [(acc_S, QT, O)])])
            elif cutlass.const_expr(R == C):
                mma_split_b(tiled_mma, C // MMA_K, [(acc_S, WT)], D, Dl, self.split,
                            plain=[(acc_S, QT, O)])
            else:
                # qg^T dO over the read-out rows, then w^T (-dDelta) over the chunk's
                mma_split_b(tiled_mma, R // MMA_K, [(acc_S, QT)], O, None, False)
                mma_split_b(tiled_mma, C // MMA_K, [(acc_S, WT)], D, Dl, self.split)

            if reset != 0:
                c_tile(thr_mma, mDh0[seq, hv, None, None], (K, BV), (0, vt)).store(acc_S.load())
                acc_S.fill(0.0)
            # smem is overwritten by the next chunk's loads
            cute.arch.sync_threads()


    @cute.kernel
    def kernel_pipelined(self, mKt, mW, mQg, mDdo, mDo, mDecay, mReset, mSeq, mLast,
                         mDfinal, mDsEnd, mDh0, sK_layout: cute.ComposedLayout,
                         sS_layout: cute.ComposedLayout, sD_layout: cute.ComposedLayout,
                         sP_layout: cute.ComposedLayout, copy_K: cute.TiledCopy,
                         copy_C: cute.TiledCopy, tiled_mma: cute.TiledMma,
                         Storage: cutlass.Constexpr):
        """:meth:`kernel` with two sets of operand tiles: the next chunk's Kt, w, qg (P) go
        to one set by cp.async, its dO (ddo) and scalars to registers, while this chunk
        computes on the other - the same products in the same order (the same bits)."""
        K, BV, ab = self.K, self.BV, self.ab
        F32 = cutlass.Float32
        tidx, _, _ = cute.arch.thread_idx()
        vt, hv, b = cute.arch.block_idx()
        NC = mKt.shape[1]

        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(Storage)
        thr_mma = tiled_mma.get_slice(tidx)
        cA, cAt, cBt = ldmatrix_copies(tiled_mma, ab, tidx)
        # dS [K, BV] and -dDelta [C, BV]: accumulators, smem operands, writers
        r = recurrent(tiled_mma, thr_mma, tidx, cBt, ab, st, sS_layout, sD_layout, K, BV,
                      self.split)
        acc_S, acc_D = r.acc_S, r.acc_D
        sO = st.sO.get_tensor(sD_layout)        # dO: [C, BV]
        O = operand(thr_mma, cBt, transpose_view(sO, C, BV), False)
        tCsO = r.toD.dest(sO)
        gK, gP = g2s(copy_K, tidx), g2s(copy_C, tidx)

        # dO's (ddo's) column tile: the CP pass's response columns take 0 (they read the
        # last real tile, in bounds and finite, and multiply it by 0)
        do_tiles = self.do_cols // BV
        do_vt = cutlass.min(vt, do_tiles - 1)
        do_keep = cutlass.select_(vt < do_tiles, F32(1.0), F32(0.0))

        slots = []
        for j in cutlass.range_constexpr(2):
            sKt = getattr(st, f"sKt{j}").get_tensor(sK_layout)
            sW = getattr(st, f"sW{j}").get_tensor(sK_layout)
            sQ = getattr(st, f"sQ{j}").get_tensor(sK_layout)
            slot = dict(Kt=operand(thr_mma, cA, sKt, True),
                        WT=operand(thr_mma, cAt, transpose_view(sW, C, K), True),
                        QT=operand(thr_mma, cAt, transpose_view(sQ, C, K), True),
                        tKt=gK.dest(sKt), tW=gK.dest(sW), tQ=gK.dest(sQ),
                        do=cute.make_rmem_tensor(thr_mma.partition_shape_C((C, BV)), ab),
                        scalars=chunk_scalars())
            if cutlass.const_expr(self.fuse_ddo):
                sP = getattr(st, f"sP{j}").get_tensor(sP_layout)
                slot.update(PT=operand(thr_mma, cAt, transpose_view(sP, C, C), True),
                            tP=gP.dest(sP))
            else:
                slot.update(ddo=make_acc(thr_mma, (C, BV)))
            slots.append(slot)

        args = (b, hv, do_vt, thr_mma, gK, gP, mKt, mW, mQg, mDdo, mDo, mDecay, mReset,
                mSeq, mLast)
        self._fetch(NC - 1, slots[0], *args)
        for i2 in cutlass.range(0, NC, 2, unroll=1):
            for h in cutlass.range_constexpr(2):
                cur, nxt = slots[h], slots[1 - h]
                i = i2 + h
                if i < NC:
                    c = NC - 1 - i
                    # the next chunk's loads (the first chunk loads itself again, unread)
                    self._fetch(NC - 2 - i + (i + 1) // NC, nxt, *args)
                    (si, sf) = cur["scalars"]
                    seq, reset, last, decay = si[0], si[1], si[2], sf[0]

                    # ---- gradient w.r.t. the chunk's end state
                    if last != 0:
                        gF = c_tile(thr_mma, mDfinal[seq, hv, None, None], (K, BV), (0, vt))
                        acc_S.store(acc_S.load() + gF.load())
                    if cutlass.const_expr(self.write_ds):
                        c_tile(thr_mma, mDsEnd[b, c, hv, None, None], (K, BV), (0, vt)).store(
                            acc_S.load().to(mDsEnd.element_type))
                    r.toS.store_split(acc_S.load(), r.tCsS, r.tCsSl, self.split)
                    do = cur["do"].load()
                    if cutlass.const_expr(self.do_cols != self.V):
                        do = (do.to(F32) * do_keep).to(ab)
                    r.toD.store(do, tCsO)
                    if cutlass.const_expr(not self.fuse_ddo):
                        ddo = cur["ddo"].load()
                        if cutlass.const_expr(self.do_cols != self.V):
                            ddo = ddo * do_keep
                    cute.arch.cp_async_wait_group(1)     # this chunk's group (not the next)
                    cute.arch.sync_threads()

                    # ---- dDelta = ddo + Kt dS   (kept negated in smem)
                    acc_D.fill(0.0)
                    if cutlass.const_expr(self.fuse_ddo):
                        mma_split_b(tiled_mma, C // MMA_K, [(acc_D, cur["PT"])], O, None, False)
                    mma_split_b(tiled_mma, K // MMA_K, [(acc_D, cur["Kt"])], r.S, r.Sl,
                                self.split)
                    if cutlass.const_expr(self.fuse_ddo):
                        r.toD.store_split(-acc_D.load(), r.tCsD, r.tCsDl, self.split)
                    else:
                        r.toD.store_split(-(ddo + acc_D.load()), r.tCsD, r.tCsDl, self.split)
                    cute.arch.sync_threads()

                    # ---- dS <- decay dS + qg^T dO + w^T (-dDelta)
                    acc_S.store(acc_S.load() * decay)
                    mma_split_b(tiled_mma, C // MMA_K, [(acc_S, cur["WT"])], r.D, r.Dl,
                                self.split, plain=[(acc_S, cur["QT"], O)])

                    if reset != 0:
                        c_tile(thr_mma, mDh0[seq, hv, None, None], (K, BV),
                               (0, vt)).store(acc_S.load())
                        acc_S.fill(0.0)
                    # this slot and the dS, dDelta, dO tiles are overwritten by later chunks
                    cute.arch.sync_threads()
        cute.arch.cp_async_wait_group(0)

    def _fetch(self, c, slot, b, hv, do_vt, thr_mma, gK, gP, mKt, mW, mQg, mDdo, mDo,
               mDecay, mReset, mSeq, mLast):
        """Start chunk c's loads into ``slot`` of :meth:`kernel_pipelined`: Kt, w, qg (P)
        by cp.async (one group), its dO (ddo) and scalars into the slot's registers."""
        K, BV = self.K, self.BV
        gK.load(mKt[b, c, hv, None, None], (C, K), slot["tKt"])
        gK.load(mW[b, c, hv, None, None], (C, K), slot["tW"])
        gK.load(mQg[b, c, hv, None, None], (C, K), slot["tQ"])
        if cutlass.const_expr(self.fuse_ddo):
            gP.load(mDdo[b, c, hv, None, None], (C, C), slot["tP"])
        cute.arch.cp_async_commit_group()
        load_chunk_scalars(slot["scalars"], mSeq, mReset, mLast, mDecay, b, c, hv)
        slot["do"].store(c_tile(thr_mma, mDo[b, c, hv, None, None], (C, BV),
                                (0, do_vt)).load())
        if cutlass.const_expr(not self.fuse_ddo):
            slot["ddo"].store(c_tile(thr_mma, mDdo[b, c, hv, None, None], (C, BV),
                                     (0, do_vt)).load().to(cutlass.Float32))


def _storage(ab, sK_layout, sS_layout, sD_layout, sP_layout, pairs, sQ_layout, sO_layout):
    """The kernel's shared memory (a ``cute.struct``): Kt, w, qg (``sQ_layout``); dS hi,
    lo; -dDelta hi, lo; dO (``sO_layout``; one of each per group: ``pairs``) - and P where
    ``sP_layout`` is given (``fuse_ddo``). (Fields are built as objects: this module's
    annotations are strings, which only a ``cute.jit`` body evaluates.)"""
    fields = {"sKt": smem_tile(ab, sK_layout), "sW": smem_tile(ab, sK_layout),
              "sQ": smem_tile(ab, sQ_layout), "sS": smem_tile(ab, sS_layout, pairs),
              "sSl": smem_tile(ab, sS_layout, pairs), "sD": smem_tile(ab, sD_layout, pairs),
              "sDl": smem_tile(ab, sD_layout, pairs), "sO": smem_tile(ab, sO_layout, pairs)}
    if sP_layout is not None:
        fields["sP"] = smem_tile(ab, sP_layout)
    return cute.struct(type("Storage", (), {"__annotations__": fields}))


def _storage_pipelined(ab, sK_layout, sS_layout, sD_layout, sP_layout, split):
    """:func:`_storage` with two sets of the chunk operand tiles (Kt, w, qg; P where
    ``sP_layout`` is given), and the lo parts only in ``split`` mode."""
    fields = {}
    for j in range(2):
        fields.update({f"sKt{j}": smem_tile(ab, sK_layout), f"sW{j}": smem_tile(ab, sK_layout),
                       f"sQ{j}": smem_tile(ab, sK_layout)})
        if sP_layout is not None:
            fields[f"sP{j}"] = smem_tile(ab, sP_layout)
    fields.update(sS=smem_tile(ab, sS_layout), sD=smem_tile(ab, sD_layout),
                  sO=smem_tile(ab, sD_layout))
    if split:
        fields.update(sSl=smem_tile(ab, sS_layout), sDl=smem_tile(ab, sD_layout))
    return cute.struct(type("Storage", (), {"__annotations__": fields}))


_KERNELS = {}


def get_kernel(K: int, V: int, BV: int, ab_name: str, split: bool,
               fuse_ddo: bool = False, do_cols: int = 0,
               write_ds: bool = True, stages: int = 1, pairs: int = 1,
               rows: int = C, gmma: bool = False) -> ChunkBwdDhSm90:
    key = (K, V, BV, ab_name, split, fuse_ddo, do_cols or V, write_ds, stages, pairs, rows,
           gmma)
    if key not in _KERNELS:
        _KERNELS[key] = ChunkBwdDhSm90(K, V, BV, ab_type(ab_name), split, fuse_ddo, do_cols,
                                       write_ds, stages, pairs, rows, gmma)
    return _KERNELS[key]
