"""CuTe DSL kernel: the reverse chunk-state-gradient recursion of the backward (FLA's "dhu").

The mirror of :mod:`gdp_jax.kernels.chunk_fwd_sm90`. One CTA per (value tile, value head,
batch row) walks the chunks of its row BACKWARDS with its [K, BV] slice of dS (the
gradient w.r.t. the state) in float32 registers. Per chunk c, in reverse (operands
precomputed by XLA, see ``gdp_jax.kernels.bwd``):

    dS     += dfinal[seq[c]]             if is_last[c]        (the sequence ends here)
    dS_end[c] <- dS                                            (written, float32)
    dDelta  = ddo_c + Kt_c dS                                  [C, BV]   ddo = P^T dO
    dS     <- decay_c dS + qg_c^T dO_c - w_c^T dDelta          [K, BV]
    dh0[seq[c]] <- dS;  dS <- 0          if reset[c]          (the sequence starts here)

Same MMA scheme as the forward (mma.sync m16n8k16, ldmatrix from swizzled smem, the two
recurrent operands dS and dDelta split into hi + lo 16-bit parts with ``split``). No
atomics: every output element is written by exactly one thread, so the kernel is
deterministic.

This module imports cutlass; import it only through ``gdp_jax.kernels.bwd`` (lazily).
"""
from __future__ import annotations

import cutlass
import cutlass.memory
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp

from gdp_jax.kernels.chunk_fwd_sm90 import (C, NUM_THREADS, _smem_layout, _transpose_view,
                                            ab_type)

# Bump on ANY change to this file (part of the compile key).
KERNEL_VERSION = 1


class ChunkBwdDhSm90:
    """Static configuration: head dims K, V, value tile BV, operand dtype, hi/lo split."""

    def __init__(self, K: int, V: int, BV: int, ab_dtype, split: bool):
        assert K in (64, 128) and V % BV == 0 and BV in (32, 64, 128)
        self.K, self.V, self.BV = K, V, BV
        self.ab = ab_dtype
        self.split = split

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, stream, mKt, mW, mQg, mDdo, mDo, mDecay, mReset, mSeq, mLast,
                 mDfinal, mDsEnd, mDh0):
        K, BV, ab = self.K, self.BV, self.ab
        sK_layout = _smem_layout(C, K)        # Kt, w, qg: [C, K]
        sS_layout = _smem_layout(K, BV)       # dS (16-bit copy): [K, BV]
        sD_layout = _smem_layout(C, BV)       # -dDelta, dO (16-bit): [C, BV]

        @cute.struct
        class Storage:
            sKt: cute.struct.Align[cute.struct.MemRange[ab, cute.cosize(sK_layout)], 1024]
            sW: cute.struct.Align[cute.struct.MemRange[ab, cute.cosize(sK_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[ab, cute.cosize(sK_layout)], 1024]
            sS: cute.struct.Align[cute.struct.MemRange[ab, cute.cosize(sS_layout)], 1024]
            sSl: cute.struct.Align[cute.struct.MemRange[ab, cute.cosize(sS_layout)], 1024]
            sD: cute.struct.Align[cute.struct.MemRange[ab, cute.cosize(sD_layout)], 1024]
            sDl: cute.struct.Align[cute.struct.MemRange[ab, cute.cosize(sD_layout)], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[ab, cute.cosize(sD_layout)], 1024]

        g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                  ab, num_bits_per_copy=128)
        tpr = K // 8
        copy_K = cute.make_tiled_copy_tv(
            g2s, cute.make_layout((NUM_THREADS // tpr, tpr), stride=(tpr, 1)),
            cute.make_layout((1, 8)))
        tiled_mma = cute.make_tiled_mma(
            warp.MmaF16BF16Op(ab, cutlass.Float32, (16, 8, 16)),
            (NUM_THREADS // 32, 1, 1),
            permutation_mnk=(NUM_THREADS // 32 * 16, 16, 16),
        )
        B, HV = mKt.shape[0], mKt.shape[2]
        grid = (self.V // BV, HV, B)
        self.kernel(mKt, mW, mQg, mDdo, mDo, mDecay, mReset, mSeq, mLast, mDfinal, mDsEnd,
                    mDh0, sK_layout, sS_layout, sD_layout, copy_K, tiled_mma,
                    Storage).launch(grid=grid, block=[NUM_THREADS, 1, 1], stream=stream)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, mKt, mW, mQg, mDdo, mDo, mDecay, mReset, mSeq, mLast, mDfinal, mDsEnd,
               mDh0, sK_layout: cute.ComposedLayout, sS_layout: cute.ComposedLayout,
               sD_layout: cute.ComposedLayout, copy_K: cute.TiledCopy,
               tiled_mma: cute.TiledMma, Storage: cutlass.Constexpr):
        K, BV, ab = self.K, self.BV, self.ab
        tidx, _, _ = cute.arch.thread_idx()
        vt, hv, b = cute.arch.block_idx()
        NC = mKt.shape[1]

        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(Storage)
        sKt = st.sKt.get_tensor(sK_layout)
        sW = st.sW.get_tensor(sK_layout)
        sQ = st.sQ.get_tensor(sK_layout)
        sS = st.sS.get_tensor(sS_layout)        # dS hi: [K, BV]
        sSl = st.sSl.get_tensor(sS_layout)      # dS lo
        sD = st.sD.get_tensor(sD_layout)        # -dDelta hi: [C, BV]
        sDl = st.sDl.get_tensor(sD_layout)      # -dDelta lo
        sO = st.sO.get_tensor(sD_layout)        # dO: [C, BV]
        sWT = _transpose_view(sW, C, K)         # A operand w^T: [K, C] (M-major)
        sQT = _transpose_view(sQ, C, K)         # A operand qg^T: [K, C]
        sSt = _transpose_view(sS, K, BV)        # B operand dS as [BV, K]
        sStl = _transpose_view(sSl, K, BV)
        sDt = _transpose_view(sD, C, BV)        # B operand -dDelta as [BV, C]
        sDtl = _transpose_view(sDl, C, BV)
        sOt = _transpose_view(sO, C, BV)        # B operand dO as [BV, C]

        thr_mma = tiled_mma.get_slice(tidx)
        acc_S = cute.make_rmem_tensor(thr_mma.partition_shape_C((K, BV)), cutlass.Float32)
        acc_D = cute.make_rmem_tensor(thr_mma.partition_shape_C((C, BV)), cutlass.Float32)
        acc_S.fill(0.0)

        rKt = thr_mma.make_fragment_A(thr_mma.partition_A(sKt))
        rWT = thr_mma.make_fragment_A(thr_mma.partition_A(sWT))
        rQT = thr_mma.make_fragment_A(thr_mma.partition_A(sQT))
        rS = thr_mma.make_fragment_B(thr_mma.partition_B(sSt))
        rSl = thr_mma.make_fragment_B(thr_mma.partition_B(sStl))
        rD = thr_mma.make_fragment_B(thr_mma.partition_B(sDt))
        rDl = thr_mma.make_fragment_B(thr_mma.partition_B(sDtl))
        rO = thr_mma.make_fragment_B(thr_mma.partition_B(sOt))

        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), ab)
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), ab)
        cA = cute.make_tiled_copy_A(ldsm, tiled_mma).get_slice(tidx)
        cAt = cute.make_tiled_copy_A(ldsm_t, tiled_mma).get_slice(tidx)
        cBt = cute.make_tiled_copy_B(ldsm_t, tiled_mma).get_slice(tidx)
        tsKt, trKt = cA.partition_S(sKt), cA.retile(rKt)
        tsWT, trWT = cAt.partition_S(sWT), cAt.retile(rWT)
        tsQT, trQT = cAt.partition_S(sQT), cAt.retile(rQT)
        tsS, trS = cBt.partition_S(sSt), cBt.retile(rS)
        tsSl, trSl = cBt.partition_S(sStl), cBt.retile(rSl)
        tsD, trD = cBt.partition_S(sDt), cBt.retile(rD)
        tsDl, trDl = cBt.partition_S(sDtl), cBt.retile(rDl)
        tsO, trO = cBt.partition_S(sOt), cBt.retile(rO)

        rS16 = cute.make_fragment_like(acc_S, ab)
        rD16 = cute.make_fragment_like(acc_D, ab)
        st_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), ab)
        cC = cute.make_tiled_copy_C(st_atom, tiled_mma).get_slice(tidx)
        tCsS, trS16 = cC.partition_D(sS), cC.retile(rS16)
        tCsD, trD16 = cC.partition_D(sD), cC.retile(rD16)
        tCsSl, tCsDl, tCsO = cC.partition_D(sSl), cC.partition_D(sDl), cC.partition_D(sO)

        thr_cK = copy_K.get_slice(tidx)
        tKsKt = thr_cK.partition_D(sKt)
        tKsW = thr_cK.partition_D(sW)
        tKsQ = thr_cK.partition_D(sQ)

        for i in cutlass.range(NC, unroll=1):
            c = NC - 1 - i
            # ---- operands of chunk c -> smem (async)
            gKt = cute.local_tile(mKt[b, c, hv, None, None], (C, K), (0, 0))
            gW = cute.local_tile(mW[b, c, hv, None, None], (C, K), (0, 0))
            gQ = cute.local_tile(mQg[b, c, hv, None, None], (C, K), (0, 0))
            cute.copy(copy_K, thr_cK.partition_S(gKt), tKsKt)
            cute.copy(copy_K, thr_cK.partition_S(gW), tKsW)
            cute.copy(copy_K, thr_cK.partition_S(gQ), tKsQ)
            cute.arch.cp_async_commit_group()

            # ---- gradient w.r.t. the chunk's end state
            seq = mSeq[b, c]
            if mLast[b, c] != 0:
                gF = cute.local_tile(mDfinal[seq, hv, None, None], (K, BV), (0, vt))
                acc_S.store(acc_S.load() + thr_mma.partition_C(gF).load())
            gE = cute.local_tile(mDsEnd[b, c, hv, None, None], (K, BV), (0, vt))
            thr_mma.partition_C(gE).store(acc_S.load())
            s_hi = acc_S.load().to(ab)
            rS16.store(s_hi)
            cute.copy(st_atom, trS16, tCsS)
            if cutlass.const_expr(self.split):
                rS16.store((acc_S.load() - s_hi.to(cutlass.Float32)).to(ab))
                cute.copy(st_atom, trS16, tCsSl)
            gDo = cute.local_tile(mDo[b, c, hv, None, None], (C, BV), (0, vt))
            rD16.store(thr_mma.partition_C(gDo).load())
            cute.copy(st_atom, trD16, tCsO)
            gDdo = cute.local_tile(mDdo[b, c, hv, None, None], (C, BV), (0, vt))
            ddo = thr_mma.partition_C(gDdo).load().to(cutlass.Float32)
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()

            # ---- dDelta = ddo + Kt dS   (kept negated in smem: the next MMA subtracts it)
            acc_D.fill(0.0)
            for kb in cutlass.range_constexpr(K // 16):
                cute.copy(cA, tsKt[None, None, kb], trKt[None, None, kb])
                cute.copy(cBt, tsS[None, None, kb], trS[None, None, kb])
                cute.gemm(tiled_mma, acc_D, rKt[None, None, kb], rS[None, None, kb], acc_D)
                if cutlass.const_expr(self.split):
                    cute.copy(cBt, tsSl[None, None, kb], trSl[None, None, kb])
                    cute.gemm(tiled_mma, acc_D, rKt[None, None, kb], rSl[None, None, kb], acc_D)
            nd = -(ddo + acc_D.load())
            nd_hi = nd.to(ab)
            rD16.store(nd_hi)
            cute.copy(st_atom, trD16, tCsD)
            if cutlass.const_expr(self.split):
                rD16.store((nd - nd_hi.to(cutlass.Float32)).to(ab))
                cute.copy(st_atom, trD16, tCsDl)
            cute.arch.sync_threads()

            # ---- dS <- decay dS + qg^T dO + w^T (-dDelta)
            decay = mDecay[b, c, hv]
            acc_S.store(acc_S.load() * decay)
            for kb in cutlass.range_constexpr(C // 16):
                cute.copy(cAt, tsQT[None, None, kb], trQT[None, None, kb])
                cute.copy(cAt, tsWT[None, None, kb], trWT[None, None, kb])
                cute.copy(cBt, tsO[None, None, kb], trO[None, None, kb])
                cute.copy(cBt, tsD[None, None, kb], trD[None, None, kb])
                cute.gemm(tiled_mma, acc_S, rQT[None, None, kb], rO[None, None, kb], acc_S)
                cute.gemm(tiled_mma, acc_S, rWT[None, None, kb], rD[None, None, kb], acc_S)
                if cutlass.const_expr(self.split):
                    cute.copy(cBt, tsDl[None, None, kb], trDl[None, None, kb])
                    cute.gemm(tiled_mma, acc_S, rWT[None, None, kb], rDl[None, None, kb], acc_S)

            if mReset[b, c] != 0:
                gH = cute.local_tile(mDh0[seq, hv, None, None], (K, BV), (0, vt))
                thr_mma.partition_C(gH).store(acc_S.load())
                acc_S.fill(0.0)
            # smem is overwritten by the next chunk's loads
            cute.arch.sync_threads()


_KERNELS = {}


def get_kernel(K: int, V: int, BV: int, ab_name: str, split: bool) -> ChunkBwdDhSm90:
    key = (K, V, BV, ab_name, split)
    if key not in _KERNELS:
        _KERNELS[key] = ChunkBwdDhSm90(K, V, BV, ab_type(ab_name), split)
    return _KERNELS[key]
