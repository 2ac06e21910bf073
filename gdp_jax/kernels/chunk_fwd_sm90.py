"""CuTe DSL kernel: the sequential chunk-state recursion fused with the chunk output.

One CTA per (value tile, value head, batch row) walks the chunks of its row in order and
keeps its [K, BV] slice of the state S in float32 registers (the accumulator of a
tensor-core MMA). Per chunk c (operands precomputed by XLA, see ``gdp_jax.kernels.fwd``):

    S      <- h0[seq[c]]                 if reset[c]           (a sequence starts here)
    Delta   = u_c - w_c S                                       [C, BV]
    o_c     = qg_c S + P_c Delta                                [C, BV]   qg = scale*gam*q,
                                                                          P = scale*tril(q k^T * Gam)
    S      <- decay_c S + Kt_c^T Delta                          decay = exp(G_last)
    final[seq[c]] <- S                   if is_last[c]
    states[c // ckpt] <- S (start of c)  if ckpt > 0 and c % ckpt == 0   (backward checkpoints,
                                                     in the states tensor's dtype)

Operands enter the MMAs in the 16-bit input dtype (bf16 or fp16) with float32
accumulation; u is read in float32. With ``split`` (the default for bfloat16), the two
recurrent operands S and Delta are split into hi + lo 16-bit parts (x = hi + lo up to
2^-16 relative) and every product with them is done twice, which removes their bf16
rounding from the recursion: with plain bf16 operands (FLA's choice) the relative RMS
error of o reached 5.8e-3 on ungated sequences with beta near 2 (H200, 2026-11-29); split
gives 4.1e-3 at ~20-25% more kernel time. The value axis of the state is independent per
column, so V is split into tiles of BV columns over the grid's x dimension (more CTAs at
small batch*heads).

MMAs: SM80-style warp MMA (mma.sync m16n8k16, 4 warps split the M dimension), operands
from swizzled shared memory through ldmatrix. This runs on sm_90a but does not use the
Hopper warpgroup MMA or TMA yet (see docs in ``gdp_jax/kernels/__init__.py``).

This module imports cutlass; import it only through ``gdp_jax.kernels.fwd`` (lazily).
"""
from __future__ import annotations

import cutlass
import cutlass.memory
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp

# Bump on ANY change to this file: it is part of the compile key (a stale key silently
# reuses the old binary inside one process).
KERNEL_VERSION = 4

C = 64            # chunk length (steps)
NUM_THREADS = 128  # 4 warps


def _smem_layout(rows: int, cols: int):
    """Swizzled row-major [rows, cols] 16-bit tile (cols a multiple of 32): conflict-free
    ldmatrix and 128-bit cp.async."""
    assert cols % 32 == 0 and rows % 8 == 0
    w = 64 if cols % 64 == 0 else 32
    atom = cute.make_composed_layout(
        cute.make_swizzle(3 if w == 64 else 2, 3, 3), 0,
        cute.make_layout((8, w), stride=(w, 1)))
    return cute.tile_to_shape(atom, (rows, cols), (0, 1))


def _transpose_view(t, rows: int, cols: int):
    """View of a [rows, cols] smem tensor as [cols, rows] (no data movement)."""
    return cute.composition(t, cute.make_layout((cols, rows), stride=(rows, 1)))


class ChunkFwdSm90:
    """Static configuration: head dims K, V, value tile BV, operand dtype."""

    def __init__(self, K: int, V: int, BV: int, ab_dtype, split: bool, ckpt: int = 0):
        assert K in (64, 128) and V % BV == 0 and BV in (32, 64, 128) and ckpt >= 0
        self.K, self.V, self.BV = K, V, BV
        self.ab = ab_dtype
        self.split = split
        self.ckpt = ckpt      # write the start state of every ckpt-th chunk (0: none)

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, stream, mW, mKt, mQg, mP, mU, mDecay, mReset, mSeq, mLast, mH0,
                 mO, mFinal, mStates):
        K, BV, ab = self.K, self.BV, self.ab
        sK_layout = _smem_layout(C, K)        # w, Kt, qg: [C, K]
        sP_layout = _smem_layout(C, C)        # P: [C, C]
        sS_layout = _smem_layout(K, BV)       # S (16-bit copy): [K, BV]
        sD_layout = _smem_layout(C, BV)       # Delta (16-bit): [C, BV]

        @cute.struct
        class Storage:
            sW: cute.struct.Align[cute.struct.MemRange[ab, cute.cosize(sK_layout)], 1024]
            sKt: cute.struct.Align[cute.struct.MemRange[ab, cute.cosize(sK_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[ab, cute.cosize(sK_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[ab, cute.cosize(sP_layout)], 1024]
            sS: cute.struct.Align[cute.struct.MemRange[ab, cute.cosize(sS_layout)], 1024]
            sD: cute.struct.Align[cute.struct.MemRange[ab, cute.cosize(sD_layout)], 1024]
            sSl: cute.struct.Align[cute.struct.MemRange[ab, cute.cosize(sS_layout)], 1024]
            sDl: cute.struct.Align[cute.struct.MemRange[ab, cute.cosize(sD_layout)], 1024]

        # gmem -> smem: 128-bit cp.async, one row of `cols` elements per cols/8 threads
        g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                  ab, num_bits_per_copy=128)

        def tiled_g2s(cols):
            tpr = cols // 8
            return cute.make_tiled_copy_tv(
                g2s, cute.make_layout((NUM_THREADS // tpr, tpr), stride=(tpr, 1)),
                cute.make_layout((1, 8)))

        copy_K = tiled_g2s(K)
        copy_P = tiled_g2s(C)

        tiled_mma = cute.make_tiled_mma(
            warp.MmaF16BF16Op(ab, cutlass.Float32, (16, 8, 16)),
            (NUM_THREADS // 32, 1, 1),
            permutation_mnk=(NUM_THREADS // 32 * 16, 16, 16),
        )
        B, HV = mW.shape[0], mW.shape[2]
        grid = (self.V // BV, HV, B)
        self.kernel(mW, mKt, mQg, mP, mU, mDecay, mReset, mSeq, mLast, mH0, mO, mFinal,
                    mStates, sK_layout, sP_layout, sS_layout, sD_layout, copy_K, copy_P, tiled_mma,
                    Storage).launch(grid=grid, block=[NUM_THREADS, 1, 1], stream=stream)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, mW, mKt, mQg, mP, mU, mDecay, mReset, mSeq, mLast, mH0, mO, mFinal,
               mStates, sK_layout: cute.ComposedLayout, sP_layout: cute.ComposedLayout,
               sS_layout: cute.ComposedLayout, sD_layout: cute.ComposedLayout,
               copy_K: cute.TiledCopy, copy_P: cute.TiledCopy, tiled_mma: cute.TiledMma,
               Storage: cutlass.Constexpr):
        K, BV, ab = self.K, self.BV, self.ab
        tidx, _, _ = cute.arch.thread_idx()
        vt, hv, b = cute.arch.block_idx()
        NC = mW.shape[1]

        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(Storage)
        sW = st.sW.get_tensor(sK_layout)
        sKt = st.sKt.get_tensor(sK_layout)
        sQ = st.sQ.get_tensor(sK_layout)
        sP = st.sP.get_tensor(sP_layout)
        sS = st.sS.get_tensor(sS_layout)        # S: [K, BV]
        sD = st.sD.get_tensor(sD_layout)        # Delta: [C, BV]
        sSl = st.sSl.get_tensor(sS_layout)      # low parts (split mode): S - S_hi
        sDl = st.sDl.get_tensor(sD_layout)      # Delta - Delta_hi
        sStl = _transpose_view(sSl, K, BV)
        sDtl = _transpose_view(sDl, C, BV)
        sKtT = _transpose_view(sKt, C, K)       # A operand Kt^T: [K, C]  (M-major)
        sSt = _transpose_view(sS, K, BV)        # B operand S as [BV, K]  (N-major)
        sDt = _transpose_view(sD, C, BV)        # B operand Delta as [BV, C]  (N-major)

        thr_mma = tiled_mma.get_slice(tidx)
        # accumulators
        acc_S = cute.make_rmem_tensor(thr_mma.partition_shape_C((K, BV)), cutlass.Float32)
        acc_D = cute.make_rmem_tensor(thr_mma.partition_shape_C((C, BV)), cutlass.Float32)
        acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((C, BV)), cutlass.Float32)
        acc_S.fill(0.0)

        # MMA operand fragments (registers)
        rW = thr_mma.make_fragment_A(thr_mma.partition_A(sW))
        rQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
        rS = thr_mma.make_fragment_B(thr_mma.partition_B(sSt))
        rKtT = thr_mma.make_fragment_A(thr_mma.partition_A(sKtT))
        rP = thr_mma.make_fragment_A(thr_mma.partition_A(sP))
        rD = thr_mma.make_fragment_B(thr_mma.partition_B(sDt))
        rSl = thr_mma.make_fragment_B(thr_mma.partition_B(sStl))
        rDl = thr_mma.make_fragment_B(thr_mma.partition_B(sDtl))

        # smem -> register copies (ldmatrix; Kt^T is M-major, hence transposed)
        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), ab)
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), ab)
        cA = cute.make_tiled_copy_A(ldsm, tiled_mma).get_slice(tidx)
        cAt = cute.make_tiled_copy_A(ldsm_t, tiled_mma).get_slice(tidx)
        cBt = cute.make_tiled_copy_B(ldsm_t, tiled_mma).get_slice(tidx)
        tsW, trW = cA.partition_S(sW), cA.retile(rW)
        tsQ, trQ = cA.partition_S(sQ), cA.retile(rQ)
        tsP, trP = cA.partition_S(sP), cA.retile(rP)
        tsKtT, trKtT = cAt.partition_S(sKtT), cAt.retile(rKtT)
        tsS, trS = cBt.partition_S(sSt), cBt.retile(rS)
        tsD, trD = cBt.partition_S(sDt), cBt.retile(rD)
        tsSl, trSl = cBt.partition_S(sStl), cBt.retile(rSl)
        tsDl, trDl = cBt.partition_S(sDtl), cBt.retile(rDl)

        # accumulators -> smem operands (16-bit staging in registers)
        rS16 = cute.make_fragment_like(acc_S, ab)
        rD16 = cute.make_fragment_like(acc_D, ab)
        st_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), ab)
        cC = cute.make_tiled_copy_C(st_atom, tiled_mma).get_slice(tidx)
        tCsS, trS16 = cC.partition_D(sS), cC.retile(rS16)
        tCsD, trD16 = cC.partition_D(sD), cC.retile(rD16)
        tCsSl, tCsDl = cC.partition_D(sSl), cC.partition_D(sDl)

        thr_cK = copy_K.get_slice(tidx)
        thr_cP = copy_P.get_slice(tidx)
        tKsW = thr_cK.partition_D(sW)
        tKsKt = thr_cK.partition_D(sKt)
        tKsQ = thr_cK.partition_D(sQ)
        tPsP = thr_cP.partition_D(sP)

        for c in cutlass.range(NC, unroll=1):
            # ---- operands of chunk c -> smem (async)
            gW = cute.local_tile(mW[b, c, hv, None, None], (C, K), (0, 0))
            gKt = cute.local_tile(mKt[b, c, hv, None, None], (C, K), (0, 0))
            gQ = cute.local_tile(mQg[b, c, hv, None, None], (C, K), (0, 0))
            gP = cute.local_tile(mP[b, c, hv, None, None], (C, C), (0, 0))
            cute.copy(copy_K, thr_cK.partition_S(gW), tKsW)
            cute.copy(copy_K, thr_cK.partition_S(gKt), tKsKt)
            cute.copy(copy_K, thr_cK.partition_S(gQ), tKsQ)
            cute.copy(copy_P, thr_cP.partition_S(gP), tPsP)
            cute.arch.cp_async_commit_group()

            # ---- chunk start state (reset -> the sequence's initial state)
            seq = mSeq[b, c]
            if mReset[b, c] != 0:
                gH0 = cute.local_tile(mH0[seq, hv, None, None], (K, BV), (0, vt))
                acc_S.store(thr_mma.partition_C(gH0).load())
            if cutlass.const_expr(self.ckpt > 0):
                # checkpoint for the backward (recompute_chunk_num = ckpt - 1)
                if c % self.ckpt == 0:
                    gSt = cute.local_tile(mStates[b, c // self.ckpt, hv, None, None], (K, BV),
                                          (0, vt))
                    thr_mma.partition_C(gSt).store(acc_S.load().to(mStates.element_type))
            s_hi = acc_S.load().to(ab)
            rS16.store(s_hi)
            cute.copy(st_atom, trS16, tCsS)
            if cutlass.const_expr(self.split):
                rS16.store((acc_S.load() - s_hi.to(cutlass.Float32)).to(ab))
                cute.copy(st_atom, trS16, tCsSl)
            gU = cute.local_tile(mU[b, c, hv, None, None], (C, BV), (0, vt))
            u = thr_mma.partition_C(gU).load().to(cutlass.Float32)
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()

            # ---- Delta = u - w S ;  o = qg S  (shared B operand S)
            acc_D.fill(0.0)
            acc_O.fill(0.0)
            for kb in cutlass.range_constexpr(K // 16):
                cute.copy(cA, tsW[None, None, kb], trW[None, None, kb])
                cute.copy(cA, tsQ[None, None, kb], trQ[None, None, kb])
                cute.copy(cBt, tsS[None, None, kb], trS[None, None, kb])
                cute.gemm(tiled_mma, acc_D, rW[None, None, kb], rS[None, None, kb], acc_D)
                cute.gemm(tiled_mma, acc_O, rQ[None, None, kb], rS[None, None, kb], acc_O)
                if cutlass.const_expr(self.split):
                    cute.copy(cBt, tsSl[None, None, kb], trSl[None, None, kb])
                    cute.gemm(tiled_mma, acc_D, rW[None, None, kb], rSl[None, None, kb], acc_D)
                    cute.gemm(tiled_mma, acc_O, rQ[None, None, kb], rSl[None, None, kb], acc_O)
            d = u - acc_D.load()
            d_hi = d.to(ab)
            rD16.store(d_hi)
            cute.copy(st_atom, trD16, tCsD)
            if cutlass.const_expr(self.split):
                rD16.store((d - d_hi.to(cutlass.Float32)).to(ab))
                cute.copy(st_atom, trD16, tCsDl)
            cute.arch.sync_threads()

            # ---- S <- decay S + Kt^T Delta ;  o += P Delta  (shared B operand Delta)
            decay = mDecay[b, c, hv]
            acc_S.store(acc_S.load() * decay)
            for kb in cutlass.range_constexpr(C // 16):
                cute.copy(cAt, tsKtT[None, None, kb], trKtT[None, None, kb])
                cute.copy(cA, tsP[None, None, kb], trP[None, None, kb])
                cute.copy(cBt, tsD[None, None, kb], trD[None, None, kb])
                cute.gemm(tiled_mma, acc_S, rKtT[None, None, kb], rD[None, None, kb], acc_S)
                cute.gemm(tiled_mma, acc_O, rP[None, None, kb], rD[None, None, kb], acc_O)
                if cutlass.const_expr(self.split):
                    cute.copy(cBt, tsDl[None, None, kb], trDl[None, None, kb])
                    cute.gemm(tiled_mma, acc_S, rKtT[None, None, kb], rDl[None, None, kb], acc_S)
                    cute.gemm(tiled_mma, acc_O, rP[None, None, kb], rDl[None, None, kb], acc_O)

            gO = cute.local_tile(mO[b, c, hv, None, None], (C, BV), (0, vt))
            thr_mma.partition_C(gO).store(acc_O.load().to(ab))
            if mLast[b, c] != 0:
                gF = cute.local_tile(mFinal[seq, hv, None, None], (K, BV), (0, vt))
                thr_mma.partition_C(gF).store(acc_S.load())
            # smem is overwritten by the next chunk's loads
            cute.arch.sync_threads()


_KERNELS = {}


def ab_type(ab_name: str):
    return {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[ab_name]


def get_kernel(K: int, V: int, BV: int, ab_name: str, split: bool,
               ckpt: int = 0) -> ChunkFwdSm90:
    key = (K, V, BV, ab_name, split, ckpt)
    if key not in _KERNELS:
        _KERNELS[key] = ChunkFwdSm90(K, V, BV, ab_type(ab_name), split, ckpt)
    return _KERNELS[key]
