"""CuTe DSL kernel: the backward's chunk-local gradients, every chunk in parallel.

One CTA (8 warps; 4 with warps_n = 1) per (chunk, value head, batch row) computes what
:func:`gdp_jax.chunked.local_grads_direct` does for one chunk - the cotangents dq, dk [C, K],
dv [C, V], dg, dbeta [C] of the chunk inputs - from

    q, k, w [C, K], doc [C, V], S0 [K, V] (16-bit), u [C, V] (16-bit or float32),
    X [C, C], g, beta [C] (float32), dS_end [K, V] (float32 or 16-bit), the row's readout
    scale,

with X = (I + A)^-1, w = X diag(beta gam) k, u = X diag(beta) v (the forward's WY
factors, from the operands kernel: ``gdp_jax.kernels.pipeline.BackwardWork``); v itself enters
only ddelta v^T, so it is loaded late, into the space dS_end leaves. In the notation of
``local_grads_direct`` (Gam = exp(seg) lower, gam = exp(G), et = exp(G_last - G),
QG = tril(q k^T Gam), KG = tril(k k^T Gam, -1), all unscaled):

    Delta  = u - w S0                                  [C, V]
    ddelta = scale QG^T doc + diag(et) k dS_end        [C, V]
    dKt    = Delta dS_end^T,  dW = -ddelta S0^T,  doS0 = doc S0^T      [C, K]
    dX     = (dW k^T) diag(beta gam) + (ddelta v^T) diag(beta)          [C, C]
    dA     = -tril(X^T dX X^T, -1),  dP = scale tril(doc Delta^T)
    dqk    = dP Gam,  dkk = diag(beta) dA Gam,  dseg = diag(beta) dA KG + dP QG
    dq     = diag(scale gam) doS0 + dqk k
    dk     = diag(et) dKt + diag(beta gam) X^T dW + dqk^T q + (dkk + dkk^T) k
    dv     = diag(beta) X^T ddelta
    dbeta  = rows(dA KG) + gam rows(X^T dW, k) + rows(X^T ddelta, v)

and dg from the row vectors (a reverse cumsum of dG = gam (scale rows(q, doS0) +
beta rows(X^T dW, k)), an exclusive cumsum of et rows(dKt, k), the rectangle sum of dseg
from its row and column sums, exp(G_last) sum(dS_end S0)). The row sums of products with
X^T come as column sums: rows(X^T Y, Z) = colsum(X o (Y Z^T)), and Y Z^T is what dX is
made of.

Precision: the 16-bit operands and the float32 accumulation of the forward kernels. Delta,
ddelta, dW and dS_end enter the MMAs rounded to 16 bits (as FLA's kernels keep them); the
[C, C] factors (X, QG, dX, X^T dX, dqk, dkk + dkk^T) are float32 in shared memory and enter
the MMAs in one 16-bit rounding, or split hi + lo with ``split`` (a third more MMAs; X's
entries reach ~1e2 when beta ~ 2). The gate exps are ex2.approx (2^-22 relative).

Inputs are finite (the forward's non-finite rows give NaN gradients for their chunk, as in
XLA). Phases are separated by CTA barriers; the [C, C] float32 scratch tiles live where
dS_end and S0 were once those are dead (~218 KB of shared memory at K = V = 128: one CTA
an SM). The loads come in two cp.async groups, q and k first, so that QG runs while w,
doc, S0 and a 16-bit dS_end (straight into shared memory) land.

Results: dq, dk, dv as float32 chunk tiles [B, NC, HV, C, K or V], or with ``tokens``
16-bit straight into the op's token-major layout - dk, dv [B, n T, HV, K or V] (chunk row
i < count is step base + i), dq [B, T, HV, K] from the read-out rows (token tok + i // n),
by the row table mRows [B, NC, 4] = (base, count, tok, n). Those tiles wait in shared
memory (where Delta, dW and q were) and leave in 128-bit row pieces; with ``head_major``
the CTAs run in (head, chunk, row) order, so the CTAs resident at once write every head's
piece of their token rows (a first version, 32-bit stores straight from the accumulators
in chunk order, made the kernel 36% slower; staged stores in chunk order cost the op's
fwd+bwd 0.4 ms: benchmarks/results/CURRENT.md, s19-2 / s19-3). dg, dbeta are float32
[B, NC, HV, C] either way. With ``norm_bwd`` (tokens only) dq, dk leave as the cotangents
of the raw q, k rows of an op with the in-op L2 norm: d_raw = rho (d - y rows(y, d)) in
float32 per row before the 16-bit rounding, y the q, k tiles (the normalised rows, 16-bit),
rho = 1 / |raw row| read through the row table - XLA's two passes over dq and dk for the
norm's backward are gone. With ``l2norm`` (tokens_in and norm_bwd) q, k arrive raw and are
normalised here, after their loads land (``sm90.l2_normalize_rows``, the token-major
operands kernel's norm: the same bits), and rho is this kernel's own factor per row.

This module imports cutlass; import it only through ``gdp_jax.kernels.local_grad``
(lazily).
"""
from __future__ import annotations

import dataclasses

import cutlass
import cutlass.memory
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp, warpgroup

from gdp_jax.kernels.sm90 import (C, MMA_K, NUM_THREADS, RegOperand, ab_type, acc_to_smem,
                                  c_tile, g2s, g2s_copy, l2_normalize_rows,
                                  ldmatrix_copies, make_acc, offsets32,
                                  mma_split_b, operand, pick, smem_layout, smem_tile,
                                  transpose_view, warp_mma, barrier, gmma_view, wg_tiled)

F32 = cutlass.Float32
PAD = C * (C + 1)          # elements of a padded float32 [C, C] tile (row stride C + 1)


def _region(n_bytes: int):
    """A 1024-byte aligned smem region of ``n_bytes`` (as 16-bit elements)."""
    return cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, (n_bytes + 1) // 2], 1024]


class ChunkGradSm90:
    """Static configuration: head dims K, V, the 16-bit operand dtype, hi/lo split of the
    float32 [C, C] factors."""

    def __init__(self, K: int, V: int, ab_dtype, split: bool, ablate: str = "",
                 warps_n: int = 2, tokens: bool = False, head_major: bool = False,
                 tokens_in: bool = False, norm_bwd: bool = False, do_tokens: bool = False,
                 l2norm: bool = False, gmma: bool = False, overlap: bool = False,
                 gmma_all: bool = False):
        assert K in (64, 128) and V in (64, 128) and warps_n in (1, 2, 4)
        self.K, self.V, self.ab, self.split = K, V, ab_dtype, split
        # warps along N (4 along M): 8 warps hide twice the latency of 4
        self.warps_n = warps_n
        self.threads = NUM_THREADS * warps_n
        # ablate (measurements only; results are wrong): "nomma" skips every MMA,
        # "nogates" the gate loops of phase 0, "notail" phase 14; "roundtrip" (results
        # right) parks the partial dk, dq in their global outputs between phases instead
        # of registers; "probe" (results right but dbeta) writes the SM clock cycles of the
        # phases (PROBE_PHASES) into dbeta[..., :len(PROBE_PHASES)] (benchmarks/prep_probe.py);
        # "serial" (results right) drops ``overlap`` (gmma="all" without it: each product
        # waited for at once - s38-1 saw "overlap" alone no faster than True)
        self.ablate = set(filter(None, ablate.split(",")))
        # dq, dk, dv written into the op's token-major layout (16-bit, through shared
        # memory in 128-bit row pieces: ``_copy_rows``)
        self.tokens = tokens
        assert not (tokens and "roundtrip" in self.ablate)
        # CTAs in (head, chunk, row) order: the CTAs resident at once cover every head of
        # a few chunks, so token-major rows [.., HV, K] are written whole
        self.head_major = head_major
        # q, k, v read from the op's token-major tensors by the row table too (no chunk
        # grid of them in XLA): ``_load_rows``
        self.tokens_in = tokens_in
        assert tokens or not tokens_in
        # dq, dk leave as the cotangents of the raw (un-normalised) q, k rows: the L2
        # norm's backward d_raw = rho (d - y (y . d)) applied in float32 before the
        # 16-bit rounding (y: the kernel's normalised q, k rows; rho = 1 / |raw row|
        # from mRhoQ [B, T, H], mRhoK [B, n T, H], read through the row table)
        self.norm_bwd = norm_bwd
        assert tokens or not norm_bwd
        # doc read from the op's token-major dO [B, T, HV, V] by the row table (read-out
        # rows; zeros elsewhere), as q with ``tokens_in``
        self.do_tokens = do_tokens
        assert tokens or not do_tokens
        # q, k read raw (token-major) and L2-normalised here, as the token-major operands
        # kernel does (``sm90.l2_normalize_rows``: the same bits), with the norm's backward
        # on this kernel's own row factors rho (mRhoQ, mRhoK unread)
        self.l2norm = l2norm
        assert not l2norm or (tokens_in and norm_bwd)
        # the products of phases 1-8 and 11-13 as warpgroup MMAs (wgmma: the two 4-warp
        # groups split N; 16-bit operands read from the smem tiles through descriptors, the
        # [C, C] factors from registers) instead of ldmatrix + mma.sync; phases 9 and 10
        # (a B operand from float32 registers) stay warp MMAs unless ``gmma_all``
        self.gmma = gmma
        assert not gmma or (warps_n == 2 and "roundtrip" not in self.ablate)
        # with gmma: independent products issued together and their results taken as they
        # land (wgmma runs asynchronously): QG beside the sum(dS_end S0) loads, w S0 beside
        # K dS_end, the three [C, K] products of phases 4-6 at once, phase 7's two at once
        self.overlap = overlap and "serial" not in self.ablate
        assert gmma or not overlap
        # and phases 9, 10 as wgmma too, on 16-bit copies of X and dX in smem (where v
        # was); only with one 16-bit rounding of the [C, C] factors (split gives their B
        # operand hi + lo from registers: warp MMAs)
        self.gmma_all = gmma_all
        assert not gmma_all or (gmma and not split)

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, stream, mQ, mK, mW, mDo, mV, mG, mBeta, mScale, mX, mU, mS0, mDS,
                 mRows, mRhoQ, mRhoK, mDq, mDk, mDv, mDg, mDbeta):
        K, V, ab = self.K, self.V, self.ab
        WN, NT = self.warps_n, self.threads
        sKl = smem_layout(C, K)
        sVl = smem_layout(C, V)
        sSl = smem_layout(K, V)
        pad = cute.make_layout((C, C), stride=(C + 1, 1))     # float32, no bank conflicts
        # region 1: dS_end, later v (then the 16-bit X and dX of gmma_all) and one float32
        # [C, C]; region 2: S0, later two
        r1 = max(2 * K * V, 2 * self._f1_at() + 4 * PAD)
        r2 = max(2 * K * V, 8 * PAD)

        @cute.struct
        class Storage:
            sQ: smem_tile(ab, sKl)
            sK: smem_tile(ab, sKl)
            sW: smem_tile(ab, sKl)         # w, then dW
            sDo: smem_tile(ab, sVl)
            sDelta: smem_tile(ab, sVl)
            sDD: smem_tile(ab, sVl)        # ddelta
            R1: _region(r1)
            R2: _region(r2)
            sGam: cute.struct.Align[cute.struct.MemRange[F32, PAD], 128]
            sX: cute.struct.Align[cute.struct.MemRange[F32, PAD], 128]
            sQG: cute.struct.Align[cute.struct.MemRange[F32, PAD], 128]   # QG, then X^T dX
            sg: cute.struct.MemRange[F32, C]
            sb: cute.struct.MemRange[F32, C]       # beta
            sgam: cute.struct.MemRange[F32, C]     # exp(G)
            set_: cute.struct.MemRange[F32, C]     # exp(G_last - G)
            srq: cute.struct.MemRange[F32, C * WN]      # rows(q, doS0)
            sdto: cute.struct.MemRange[F32, C * WN]     # et rows(dKt, k)
            scs1: cute.struct.MemRange[F32, C]     # rows(X^T dW, k)
            scs2: cute.struct.MemRange[F32, C]     # rows(X^T ddelta, v)
            sdba: cute.struct.MemRange[F32, C * WN]     # rows(dA KG)
            srs: cute.struct.MemRange[F32, C * WN]      # row sums of dseg: dP QG
            srs2: cute.struct.MemRange[F32, C * WN]     # row sums of dseg: diag(beta) dA KG
            sy: cute.struct.MemRange[F32, C]           # phase 14's row vector
            snq: cute.struct.MemRange[F32, C * WN]      # rows(q, dq) (norm_bwd)
            snk: cute.struct.MemRange[F32, C * WN]      # rows(k, dk) (norm_bwd)
            shq: cute.struct.MemRange[F32, C]          # rho of the q rows (l2norm)
            shk: cute.struct.MemRange[F32, C]          # rho of the k rows (l2norm)
            sred: cute.struct.MemRange[F32, NT // 32]

        (mQ, mK, mW, mDo, mV, mG, mBeta, mX, mU, mS0, mDS, mRows, mRhoQ, mRhoK, mDq, mDk,
         mDv, mDg, mDbeta) = (offsets32(t) for t in (
             mQ, mK, mW, mDo, mV, mG, mBeta, mX, mU, mS0, mDS, mRows, mRhoQ, mRhoK, mDq, mDk,
             mDv, mDg, mDbeta))
        B, NC, HV = mW.shape[0], mW.shape[1], mW.shape[2]
        self.kernel(mQ, mK, mW, mDo, mV, mG, mBeta, mScale, mX, mU, mS0, mDS, mRows, mRhoQ,
                    mRhoK, mDq, mDk, mDv, mDg, mDbeta, sKl, sVl, sSl, pad, g2s_copy(ab, K, NT),
                    g2s_copy(ab, V, NT), warp_mma(ab, WN),
                    Storage).launch(grid=(HV, NC, B) if self.head_major else (NC, HV, B),
                                    block=[NT, 1, 1], stream=stream)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, mQ, mK, mW, mDo, mV, mG, mBeta, mScale, mX, mU, mS0, mDS, mRows, mRhoQ,
               mRhoK, mDq, mDk, mDv, mDg, mDbeta, sKl: cute.ComposedLayout, sVl: cute.ComposedLayout,
               sSl: cute.ComposedLayout, pad: cute.Layout, copy_K: cute.TiledCopy,
               copy_V: cute.TiledCopy, tiled_mma: cute.TiledMma, Storage: cutlass.Constexpr):
        K, V, ab, split = self.K, self.V, self.ab, self.split
        tidx, _, _ = cute.arch.thread_idx()
        c, hv, b = cute.arch.block_idx()
        if cutlass.const_expr(self.head_major):
            hv, c, b = cute.arch.block_idx()
        on = "nomma" not in self.ablate
        roundtrip = "roundtrip" in self.ablate
        probe = "probe" in self.ablate
        # a CTA barrier; with wgmma also a proxy fence: smem the threads wrote (cp.async,
        # stores) becomes visible to the wgmma descriptors' (async proxy) reads
        bar = lambda: barrier(self.gmma)
        marks = [cute.arch.clock()] if cutlass.const_expr(probe) else []
        mma_split_b_ = mma_split_b if on else _skip
        # acc += A B over k-blocks of ldmatrix operands, unrolled (as a dynamic k-loop,
        # the kernel's code shrank 5% and it ran 1% slower: s20-3)
        mma_ = lambda tm, kb, acc, a, b_: mma_split_b_(tm, kb, [(acc, a)], b_, None, False)
        _mma_reg_a_ = _mma_reg_a if on else _skip

        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(Storage)
        sQ, sK, sW = st.sQ.get_tensor(sKl), st.sK.get_tensor(sKl), st.sW.get_tensor(sKl)
        sDo, sDelta = st.sDo.get_tensor(sVl), st.sDelta.get_tensor(sVl)
        sDD = st.sDD.get_tensor(sVl)
        sDS = st.R1.get_tensor(sSl, dtype=ab)
        sV = st.R1.get_tensor(sVl, dtype=ab)
        sS0 = st.R2.get_tensor(sSl, dtype=ab)
        f32_at = lambda region, elems: cute.make_tensor(
            cute.recast_ptr(region.data_ptr() + elems, dtype=F32), pad)
        F1 = f32_at(st.R1, self._f1_at())     # dX, then dkk
        # gmma_all: X, dX in the operand dtype (the regions are typed bfloat16: a float16
        # kernel must not store through that type, s38-2)
        sX16 = cute.make_tensor(cute.recast_ptr(st.R1.data_ptr(), dtype=ab), smem_layout(C, C))
        sDX16 = cute.make_tensor(cute.recast_ptr(st.R1.data_ptr() + C * C, dtype=ab),
                                 smem_layout(C, C))
        F2 = f32_at(st.R2, 0)                 # X o (dW k^T), then dqk
        F3 = f32_at(st.R2, 2 * PAD)           # X o (ddelta v^T), then dseg
        sGam, sX, sQG = st.sGam.get_tensor(pad), st.sX.get_tensor(pad), st.sQG.get_tensor(pad)
        vec = lambda f: f.get_tensor(cute.make_layout(C))
        sg, sb, sgam, set_ = vec(st.sg), vec(st.sb), vec(st.sgam), vec(st.set_)
        scs1, scs2 = vec(st.scs1), vec(st.scs2)
        WN, NT = self.warps_n, self.threads
        rvec = lambda f: f.get_tensor(cute.make_layout((WN, C), stride=(C, 1)))
        srq, sdto, sdba, srs, srs2 = (rvec(st.srq), rvec(st.sdto), rvec(st.sdba),
                                      rvec(st.srs), rvec(st.srs2))
        snq, snk = rvec(st.snq), rvec(st.snk)
        shq, shk = vec(st.shq), vec(st.shk)
        sy = vec(st.sy)
        sred = st.sred.get_tensor(cute.make_layout(NT // 32))
        wn = tidx // NUM_THREADS               # this warp's N index (sm90.warp_mma)
        rsum = lambda t, i: _sum_n(t, i, WN)

        gW = mW[b, c, hv, None, None]
        if cutlass.const_expr(not self.do_tokens):
            gDo = mDo[b, c, hv, None, None]
        if cutlass.const_expr(not self.tokens_in):
            gQ, gK, gV = (mQ[b, c, hv, None, None], mK[b, c, hv, None, None],
                          mV[b, c, hv, None, None])
        if cutlass.const_expr(roundtrip):
            gDq, gDk = mDq[b, c, hv, None, None], mDk[b, c, hv, None, None]

        # ---- phase 0: q, k | w, doc, S0 (16-bit dS_end) -> smem (async, two groups) |
        # gates | X (float32 dS_end) -> registers
        # A 16-bit dS_end goes to smem as it is and lands during phase 1 with the second
        # group; a float32 one (CP) is rounded on its way through registers.
        ds16 = cutlass.const_expr(mDS.element_type == ab)
        cpK, cpV = g2s(copy_K, tidx), g2s(copy_V, tidx)
        if cutlass.const_expr(self.tokens_in):
            hk = hv // (mV.shape[2] // mK.shape[2])          # the key head (GVA)
            self._load_rows(cpK, sQ, mQ, mRows, b, c, hk, K, True)
            self._load_rows(cpK, sK, mK, mRows, b, c, hk, K, False)
        else:
            cpK.load(gQ, (C, K), cpK.dest(sQ))
            cpK.load(gK, (C, K), cpK.dest(sK))
        cute.arch.cp_async_commit_group()
        cpK.load(gW, (C, K), cpK.dest(sW))
        if cutlass.const_expr(self.do_tokens):
            self._load_rows(cpV, sDo, mDo, mRows, b, c, hv, V, True)
        else:
            cpV.load(gDo, (C, V), cpV.dest(sDo))
        cpV.load(mS0[b, c, hv, None, None], (K, V), cpV.dest(sS0))     # [K, V] rows of V
        if cutlass.const_expr(ds16):
            cpV.load(mDS[b, c, hv, None, None], (K, V), cpV.dest(sDS))
        cute.arch.cp_async_commit_group()
        scale = mScale[b]
        if tidx < C:
            sg[tidx] = mG[b, c, hv, tidx].to(F32)
            sb[tidx] = mBeta[b, c, hv, tidx].to(F32)
        # X (and a float32 dS_end) into registers now: their loads fly during the gate sums
        thr_mma = tiled_mma.get_slice(tidx)
        crd_x = thr_mma.partition_C(cute.make_identity_tensor((C, C)))
        acc_x = make_acc(thr_mma, (C, C))
        acc_x.store(c_tile(thr_mma, mX[b, c, hv, None, None], (C, C), (0, 0)).load())
        if cutlass.const_expr(not ds16):
            acc_s = make_acc(thr_mma, (K, V))
            acc_s.store(c_tile(thr_mma, mDS[b, c, hv, None, None], (K, V),
                               (0, 0)).load().to(F32))
        bar()
        if cutlass.const_expr("nogates" not in self.ablate):
            # sums from the diagonal outwards (never a difference of cumsums: strong gates
            # stay exact), unrolled without branches so the loads of g and the exps of
            # successive entries overlap: past the row's first entry (jj > i) the store
            # goes to the row's padding column C, which nothing reads. exp as ex2.approx
            # (2^-22 relative; below ~1e-38 it flushes to 0)
            if tidx < C:
                i = tidx
                s = F32(0.0)                       # seg_ij, j from i down to 0
                for jj in cutlass.range_constexpr(C):
                    sGam[i, cutlass.select_(jj <= i, i - jj, C)] = cute.math.exp(
                        s, fastmath=True)
                    s = s + pick(jj < i, sg[cutlass.select_(jj < i, i - jj, 0)], F32(0.0))
                s = s + sg[0]
                sgam[i] = cute.math.exp(s, fastmath=True)          # s = G_i
            elif tidx < 2 * C:
                i = tidx - C
                t = F32(0.0)                       # G_last - G_i = g_{i+1} + ... + g_{C-1}
                for l in cutlass.range_constexpr(1, C):
                    t = t + pick(l > i, sg[l], F32(0.0))
                set_[i] = cute.math.exp(t, fastmath=True)
        tXc = thr_mma.partition_C(sX)
        for e in cutlass.range_constexpr(cute.size(acc_x)):
            tXc[e] = acc_x[e]
        cute.arch.cp_async_wait_group(1 if ds16 else 0)
        bar()
        if cutlass.const_expr(self.l2norm):
            # the raw q, k rows -> normalised in place (this thread's cp.async pieces),
            # their factors rho for the norm's backward; the second load group still flies
            self._normalize_tile(cpK, sQ, shq)
            self._normalize_tile(cpK, sK, shk)
            bar()
        if cutlass.const_expr(probe):
            marks.append(cute.arch.clock())
        if cutlass.const_expr(not ds16):
            # dS_end -> 16-bit smem in accumulator layout, with sum(dS_end S0)
            dlast = F32(0.0)                   # sum(dS_end S0), this thread's part
            tS0c = thr_mma.partition_C(sS0)
            for e in cutlass.range_constexpr(cute.size(acc_s)):
                dlast = dlast + acc_s[e] * tS0c[e].to(F32)
            toS = acc_to_smem(tiled_mma, tidx, acc_s, ab)
            toS.store(acc_s.load().to(ab), toS.dest(sDS))
            _warp_partials(dlast, sred, tidx)

        # ---- phase 1: QG = tril(Q K^T Gam) (float32, unscaled); u flies to registers
        # (phase 2 reads it)
        # the products' machinery: operands SA (a K-major [C, cols] smem tile), SB (B from
        # an [N, K] tile), SBt (B from a [K, N] tile), RA (A from a float32 [C, C] view
        # through registers, value(x, i, j) applied); pm.products(acc, N, K, [(a, b)..]).
        # thr_c, thr_k, thr_v: the accumulator partitions of [C, C], [C, K], [C, V] results
        # (with wgmma not those of thr_mma, which phases 0, 9, 10 keep)
        if cutlass.const_expr(self.gmma):
            pm = _Gmma(ab, tidx, split, on)
            SA = lambda s, cols: _SmemOp(s, C, cols, True)
            SB = lambda s, rows, cols: _SmemOp(s, rows, cols, True)
            SBt = lambda s, rows, cols: _SmemOp(s, rows, cols, False)
            thr_c, thr_k, thr_v = pm.thr(C), pm.thr(K), pm.thr(V)
            tiled_k, tiled_v = pm.tiled(K), pm.tiled(V)
        else:
            cA, cAt, cBt = ldmatrix_copies(tiled_mma, ab, tidx)
            ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False,
                                                              num_matrices=4), ab)
            cB = cute.make_tiled_copy_B(ldsm, tiled_mma).get_slice(tidx)  # B from [N, K] tiles
            pm = _Sync(tiled_mma, thr_mma, ab, split, mma_, _mma_reg_a_)
            SA = lambda s, cols: operand(thr_mma, cA, s, True)
            SB = lambda s, rows, cols: operand(thr_mma, cB, s, False)
            SBt = lambda s, rows, cols: operand(thr_mma, cBt, transpose_view(s, rows, cols),
                                                False)
            thr_c, thr_k, thr_v = thr_mma, thr_mma, thr_mma
            tiled_k, tiled_v = tiled_mma, tiled_mma
        RA = lambda view, value=None, plus_transpose=None: _RegA(view, value, plus_transpose)
        u = c_tile(thr_v, mU[b, c, hv, None, None], (C, V), (0, 0)).load().to(F32)
        crd_c = thr_c.partition_C(cute.make_identity_tensor((C, C)))
        r0, _ = crd_c[0]                       # this thread's accumulator rows r0, r0 + 8
        acc_cc = make_acc(thr_c, (C, C))
        acc_cc.fill(0.0)
        pm.issue(acc_cc, C, K, [(SA(sQ, K), SB(sK, C, K))])
        pm.commit()
        if cutlass.const_expr(ds16 and self.overlap):
            self._sum_ds_s0(cpV, sDS, sS0, sred, tidx)
        pm.wait(0)
        tQGc = thr_c.partition_C(sQG)
        tGc = thr_c.partition_C(sGam)
        for e in cutlass.range_constexpr(cute.size(acc_cc)):
            i, j = crd_c[e]
            tQGc[e] = pick(j <= i, acc_cc[e] * tGc[e], F32(0.0))
        if cutlass.const_expr(ds16 and not self.overlap):
            self._sum_ds_s0(cpV, sDS, sS0, sred, tidx)
        bar()
        if cutlass.const_expr(probe):
            marks.append(cute.arch.clock())

        # ---- phase 2: Delta = u - w S0 -> smem (16-bit)
        crd_v = thr_v.partition_C(cute.make_identity_tensor((C, V)))
        crd_k = thr_k.partition_C(cute.make_identity_tensor((C, K)))
        acc_v = make_acc(thr_v, (C, V))
        acc_v.fill(0.0)
        pm.issue(acc_v, V, K, [(SA(sW, K), SBt(sS0, K, V))])
        pm.commit()
        if cutlass.const_expr(self.overlap):
            acc_v3 = make_acc(thr_v, (C, V))      # phase 3's first product, issued now
            acc_v3.fill(0.0)
            pm.issue(acc_v3, V, K, [(SA(sK, K), SBt(sDS, K, V))])
            pm.commit()
        pm.wait(1 if self.overlap else 0)
        toV = acc_to_smem(tiled_v, tidx, acc_v, ab)
        toV.store((u - acc_v.load()).to(ab), toV.dest(sDelta))

        # ---- phase 3: ddelta = diag(et) K dS_end + scale QG^T doc -> smem (16-bit)
        if cutlass.const_expr(self.overlap):
            pm.wait(0)
            acc_v = acc_v3
        else:
            acc_v.fill(0.0)
            pm.products(acc_v, V, K, [(SA(sK, K), SBt(sDS, K, V))])
        for e in cutlass.range_constexpr(cute.size(acc_v)):
            i, _ = crd_v[e]
            acc_v[e] = acc_v[e] * set_[i]
        R = lambda view, is_a, value=None, plus_transpose=None: _reg(
            thr_mma, view, is_a, ab, split, value, plus_transpose)
        pm.products(acc_v, V, C, [(RA(transpose_view(sQG, C, C), lambda x, i, j: x * scale),
                                   SBt(sDo, C, V))])
        toV.store(acc_v.load().to(ab), toV.dest(sDD))
        bar()
        if cutlass.const_expr(probe):
            marks.append(cute.arch.clock())

        # ---- phase 4: diag(et) dKt = diag(et) Delta dS_end^T -> dk (partial, registers);
        # dto = et rows(dKt, k)
        # dk and dq accumulate in registers from here to phases 12, 13 (``roundtrip``:
        # through their global outputs instead, the first version, for A/B timing)
        acc_dk = make_acc(thr_k, (C, K))
        acc_dk.fill(0.0)
        pm.issue(acc_dk, K, V, [(SA(sDelta, V), SB(sDS, K, V))])
        pm.commit()
        if cutlass.const_expr(self.overlap):
            # phases 5 and 6's products now, each its own group (taken in turn below)
            acc_k = make_acc(thr_k, (C, K))
            acc_k.fill(0.0)
            pm.issue(acc_k, K, V, [(SA(sDD, V), SB(sS0, K, V))])
            pm.commit()
            acc_dq = make_acc(thr_k, (C, K))
            acc_dq.fill(0.0)
            pm.issue(acc_dq, K, V, [(SA(sDo, V), SB(sS0, K, V))])
            pm.commit()
        pm.wait(2 if self.overlap else 0)
        tKc = thr_k.partition_C(sK)
        for e in cutlass.range_constexpr(cute.size(acc_dk)):
            i, _ = crd_k[e]
            acc_dk[e] = acc_dk[e] * set_[i]
        _row_sums(acc_dk, crd_k, r0, lambda e: acc_dk[e] * tKc[e].to(F32), sdto, wn)
        if cutlass.const_expr(roundtrip):
            c_tile(thr_mma, gDk, (C, K), (0, 0)).store(acc_dk.load())
        bar()               # dS_end is dead: v takes its place
        if cutlass.const_expr(probe):
            marks.append(cute.arch.clock())
        if cutlass.const_expr(self.tokens_in):
            self._load_rows(cpV, sV, mV, mRows, b, c, hv, V, False)
        else:
            cpV.load(gV, (C, V), cpV.dest(sV))
        cute.arch.cp_async_commit_group()

        # ---- phase 5: dW = -ddelta S0^T -> smem (16-bit, where w was)
        if cutlass.const_expr(self.overlap):
            pm.wait(1)
        else:
            acc_k = make_acc(thr_k, (C, K))
            acc_k.fill(0.0)
            pm.products(acc_k, K, V, [(SA(sDD, V), SB(sS0, K, V))])
        toK = acc_to_smem(tiled_k, tidx, acc_k, ab)
        toK.store((acc_k.load() * -1.0).to(ab), toK.dest(sW))

        # ---- phase 6: diag(scale gam) doS0 -> dq (partial, registers); rq = rows(q, doS0)
        if cutlass.const_expr(self.overlap):
            pm.wait(0)
        else:
            acc_dq = make_acc(thr_k, (C, K))
            acc_dq.fill(0.0)
            pm.products(acc_dq, K, V, [(SA(sDo, V), SB(sS0, K, V))])
        tQc = thr_k.partition_C(sQ)
        _row_sums(acc_dq, crd_k, r0, lambda e: acc_dq[e] * tQc[e].to(F32), srq, wn)
        for e in cutlass.range_constexpr(cute.size(acc_dq)):
            i, _ = crd_k[e]
            acc_dq[e] = acc_dq[e] * (scale * sgam[i])
        if cutlass.const_expr(roundtrip):
            c_tile(thr_mma, gDq, (C, K), (0, 0)).store(acc_dq.load())
        cute.arch.cp_async_wait_group(0)
        bar()               # S0 is dead: F2, F3 take its place
        if cutlass.const_expr(probe):
            marks.append(cute.arch.clock())

        # ---- phase 7: WK = dW k^T, DV = ddelta v^T; dX -> F1; X o WK -> F2, X o DV -> F3
        acc_cc.fill(0.0)
        acc_c2 = make_acc(thr_c, (C, C))
        acc_c2.fill(0.0)
        pm.issue(acc_cc, C, K, [(SA(sW, K), SB(sK, C, K))])
        if cutlass.const_expr(not self.overlap):
            pm.commit()
            pm.wait(0)
        pm.issue(acc_c2, C, V, [(SA(sDD, V), SB(sV, C, V))])
        pm.commit()
        pm.wait(0)
        t1 = thr_c.partition_C(F1)
        t2 = thr_c.partition_C(F2)
        t3 = thr_c.partition_C(F3)
        tXc_c = thr_c.partition_C(sX)
        for e in cutlass.range_constexpr(cute.size(acc_cc)):
            _, j = crd_c[e]
            x = tXc_c[e]
            t1[e] = acc_cc[e] * (sb[j] * sgam[j]) + acc_c2[e] * sb[j]
            t2[e] = x * acc_cc[e]
            t3[e] = x * acc_c2[e]
        bar()
        if tidx < C:
            scs1[tidx] = _col_sum(F2, tidx)
        elif tidx < 2 * C:
            scs2[tidx - C] = _col_sum(F3, tidx - C)
        elif cutlass.const_expr(self.gmma_all):
            # v is dead: X and dX as 16-bit wgmma operands where it was (the same
            # rounding the register operands get)
            t_ = tidx - 2 * C
            for m in cutlass.range_constexpr(C * C // (NT - 2 * C)):
                i, j = (t_ + m * (NT - 2 * C)) // C, (t_ + m * (NT - 2 * C)) % C
                sX16[i, j] = sX[i, j].to(ab)
                sDX16[i, j] = F1[i, j].to(ab)
        bar()
        if cutlass.const_expr(probe):
            marks.append(cute.arch.clock())

        # ---- phase 8: dP = scale tril(doc Delta^T); dqk = dP Gam -> F2; dseg = dP QG -> F3
        acc_cc.fill(0.0)
        pm.products(acc_cc, C, V, [(SA(sDo, V), SB(sDelta, C, V))])
        tQGc2 = thr_c.partition_C(sQG)
        for e in cutlass.range_constexpr(cute.size(acc_cc)):
            i, j = crd_c[e]
            dp = pick(j <= i, acc_cc[e] * scale, F32(0.0))
            t2[e] = pick(j <= i, dp * tGc[e], F32(0.0))      # Gam above the diagonal: unset
            acc_cc[e] = dp * tQGc2[e]
            t3[e] = acc_cc[e]
        _row_sums(acc_cc, crd_c, r0, lambda e: acc_cc[e], srs, wn)
        bar()
        if cutlass.const_expr(probe):
            marks.append(cute.arch.clock())

        # ---- phase 9: T = X^T dX -> sQG (QG is dead). With gmma but not gmma_all, phases
        # 9, 10 are warp MMAs (a B operand from registers), in thr_mma's partitions
        crd_10 = crd_c
        if cutlass.const_expr(self.gmma and not self.gmma_all):
            acc_cc = make_acc(thr_mma, (C, C))
            acc_c2 = make_acc(thr_mma, (C, C))
            tGc, t1, t3 = (thr_mma.partition_C(t) for t in (sGam, F1, F3))
            tQGc2 = thr_mma.partition_C(sQG)
            crd_10 = crd_x
        acc_cc.fill(0.0)
        if cutlass.const_expr(self.gmma_all):
            pm.products(acc_cc, C, C, [(RA(transpose_view(sX, C, C)), SBt(sDX16, C, C))])
        else:
            _mma_reg_a_(tiled_mma, C // MMA_K, acc_cc, R(transpose_view(sX, C, C), True),
                       None, R(transpose_view(F1, C, C), False))
        bar()
        for e in cutlass.range_constexpr(cute.size(acc_cc)):
            tQGc2[e] = acc_cc[e]
        bar()
        if cutlass.const_expr(probe):
            marks.append(cute.arch.clock())

        # ---- phase 10: dA = -tril(T X^T, -1), kk = K K^T (again), KG = tril(kk Gam, -1):
        # dkk = diag(beta) dA Gam -> F1; dseg += diag(beta) dA KG; dba = rows(dA KG)
        acc_cc.fill(0.0)
        acc_c2.fill(0.0)
        if cutlass.const_expr(self.gmma_all):
            pm.issue(acc_cc, C, C, [(RA(sQG), SB(sX16, C, C))])
            pm.issue(acc_c2, C, K, [(SA(sK, K), SB(sK, C, K))])
            pm.commit()
            pm.wait(0)
        elif cutlass.const_expr(self.gmma):
            _mma_reg_a_(tiled_mma, C // MMA_K, acc_cc, R(sQG, True), None, R(sX, False))
            cA10, _, _ = ldmatrix_copies(tiled_mma, ab, tidx)
            ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False,
                                                              num_matrices=4), ab)
            cB10 = cute.make_tiled_copy_B(ldsm, tiled_mma).get_slice(tidx)
            mma_(tiled_mma, K // MMA_K, acc_c2, operand(thr_mma, cA10, sK, True),
                 operand(thr_mma, cB10, sK, False))
        else:
            _mma_reg_a_(tiled_mma, C // MMA_K, acc_cc, R(sQG, True), None, R(sX, False))
            mma_(tiled_mma, K // MMA_K, acc_c2, SA(sK, K), SB(sK, C, K))
        for e in cutlass.range_constexpr(cute.size(acc_cc)):
            i, j = crd_10[e]
            strict = j < i                    # dA = -T X^T below the diagonal, else 0
            da, gm = -acc_cc[e], tGc[e]       # (Gam above the diagonal: unset)
            t = pick(strict, da * (acc_c2[e] * gm), F32(0.0))   # dA KG
            t1[e] = pick(strict, sb[i] * da * gm, F32(0.0))      # dkk
            acc_c2[e] = t
            acc_cc[e] = sb[i] * t                          # dseg's second term
            t3[e] = t3[e] + acc_cc[e]
        _row_sums(acc_c2, crd_10, r0, lambda e: acc_c2[e], sdba, wn)
        _row_sums(acc_cc, crd_10, r0, lambda e: acc_cc[e], srs2, wn)
        bar()
        if cutlass.const_expr(probe):
            marks.append(cute.arch.clock())

        # ---- phase 11: dv = diag(beta) X^T ddelta
        if cutlass.const_expr(self.norm_bwd):
            # this thread's rows' 1 / |raw row| now: the loads fly during phases 11-13
            if cutlass.const_expr(self.l2norm):
                rho_q, rho_k = [shq[r0], shq[r0 + 8]], [shk[r0], shk[r0 + 8]]
            else:
                rho_q, rho_k = self._row_norms(mRows, mRhoQ, mRhoK, b, c, hv, r0,
                                               mDq.shape[2])
        acc_v.fill(0.0)
        pm.products(acc_v, V, C, [(RA(transpose_view(sX, C, C), lambda x, i, j: x * sb[i]),
                                   SBt(sDD, C, V))])
        if cutlass.const_expr(self.tokens):
            toV.store(acc_v.load().to(ab), toV.dest(sDelta))    # Delta is dead
        else:
            c_tile(thr_v, mDv[b, c, hv, None, None], (C, V), (0, 0)).store(acc_v.load())

        # ---- phase 12: dk = partial + diag(beta gam) X^T dW + dqk^T q + (dkk + dkk^T) k
        if cutlass.const_expr(roundtrip):
            acc_dk.store(c_tile(thr_mma, gDk, (C, K), (0, 0)).load())
        pm.products(acc_dk, K, C, [
            (RA(transpose_view(sX, C, C), lambda x, i, j: x * (sb[i] * sgam[i])),
             SBt(sW, C, K)),
            (RA(transpose_view(F2, C, C)), SBt(sQ, C, K)),
            (RA(F1, None, F1), SBt(sK, C, K))])
        if cutlass.const_expr(not self.tokens):
            c_tile(thr_k, mDk[b, c, hv, None, None], (C, K), (0, 0)).store(acc_dk.load())

        # ---- phase 13: dq = partial + dqk k
        if cutlass.const_expr(roundtrip):
            acc_dq.store(c_tile(thr_mma, gDq, (C, K), (0, 0)).load())
        pm.products(acc_dq, K, C, [(RA(F2), SBt(sK, C, K))])
        if cutlass.const_expr(self.norm_bwd):
            # the L2 norm's backward: d_raw = rho (d - y rows(y, d)), y = q, k (16-bit)
            _row_sums(acc_dk, crd_k, r0, lambda e: acc_dk[e] * tKc[e].to(F32), snk, wn)
            _row_sums(acc_dq, crd_k, r0, lambda e: acc_dq[e] * tQc[e].to(F32), snq, wn)
            bar()
            for e in cutlass.range_constexpr(cute.size(acc_dk)):
                i, _ = crd_k[e]
                hi = i == r0
                acc_dk[e] = pick(hi, rho_k[0], rho_k[1]) * (
                    acc_dk[e] - tKc[e].to(F32) * rsum(snk, i))
                acc_dq[e] = pick(hi, rho_q[0], rho_q[1]) * (
                    acc_dq[e] - tQc[e].to(F32) * rsum(snq, i))
        if cutlass.const_expr(self.tokens):
            bar()           # q and dW are dead: dq, dk take their place
            toK.store(acc_dk.load().to(ab), toK.dest(sW))
            toK.store(acc_dq.load().to(ab), toK.dest(sQ))
            bar()
            self._copy_rows(cpV, sDelta, mDv, mRows, b, c, hv, V, False)
            self._copy_rows(cpK, sW, mDk, mRows, b, c, hv, K, False)
            self._copy_rows(cpK, sQ, mDq, mRows, b, c, hv, K, True)
        else:
            c_tile(thr_k, mDq[b, c, hv, None, None], (C, K), (0, 0)).store(acc_dq.load())
        if cutlass.const_expr(probe):
            bar()
            marks.append(cute.arch.clock())

        # ---- phase 14: the row vectors -> dbeta, dg. First y_l = dG_l + rowsum(dseg)_l -
        # colsum(dseg)_l (into sy) and dbeta_l; then dg_l = sum_{i >= l} y_i +
        # sum_{i < l} dto_i + dG_last (the cumsums of ``local_grads_direct``).
        if cutlass.const_expr("notail" not in self.ablate):
            if tidx < C:
                l = tidx
                dG = sgam[l] * (scale * rsum(srq, l) + sb[l] * scs1[l])
                sy[l] = dG + rsum(srs, l) + rsum(srs2, l) - _col_sum(F3, l)
                mDbeta[b, c, hv, l] = rsum(sdba, l) + sgam[l] * scs1[l] + scs2[l]
        bar()
        if cutlass.const_expr("notail" not in self.ablate):
            if tidx < C:
                l = tidx
                dG_last = F32(0.0)
                for w_ in cutlass.range_constexpr(NT // 32):
                    dG_last = dG_last + sred[w_]
                acc_g = dG_last * sgam[C - 1]      # exp(G_last) sum(dS_end S0)
                for i in cutlass.range_constexpr(C):
                    acc_g = acc_g + pick(i >= l, sy[i], rsum(sdto, i))   # unrolled: loads run ahead
                mDg[b, c, hv, l] = acc_g
        if cutlass.const_expr(probe):
            bar()
            marks.append(cute.arch.clock())
            if tidx == 0:
                for m in cutlass.range_constexpr(len(marks) - 1):
                    mDbeta[b, c, hv, m] = (marks[m + 1] - marks[m]).to(F32)

    def _f1_at(self) -> int:
        """Where the float32 tile F1 starts in region 1, in 16-bit elements: after v
        [C, V] (and with ``gmma_all`` after the 16-bit X and dX [C, C] that replace it)."""
        return max(C * self.V, 2 * C * C) if self.gmma_all else C * self.V

    def _sum_ds_s0(self, cpV, sDS, sS0, sred, tidx):
        """sum(dS_end S0) of the 16-bit tiles into ``sred`` (per warp) once their copies
        landed: over this thread's copy elements (the same in both tiles). Runs at trace
        time (plain Python)."""
        cute.arch.cp_async_wait_group(0)   # w, doc, S0, dS_end: their own copies
        dS16, S016 = cpV.dest(sDS), cpV.dest(sS0)
        rD, rS = cute.make_fragment_like(dS16), cute.make_fragment_like(S016)
        cute.autovec_copy(dS16, rD)
        cute.autovec_copy(S016, rS)
        dlast = F32(0.0)
        for e in range(cute.size(rD)):
            dlast = dlast + rD[e].to(F32) * rS[e].to(F32)
        _warp_partials(dlast, sred, tidx)

    def _normalize_tile(self, cp, s, row_scale):
        """The rows of a 16-bit [C, K] smem tile L2-normalised in place, this thread's
        ``cp`` (``g2s``) pieces, with each row's factor rho into ``row_scale`` [C]. Runs at
        trace time (plain Python)."""
        t = cp.dest(s)
        r = cute.make_fragment_like(t)
        cute.autovec_copy(t, r)
        crd = cp.thr.partition_D(cute.make_identity_tensor((C, self.K)))
        l2_normalize_rows(r, t, self.K // 8, cute.size(t) // 8, self.ab, row_scale, crd)

    def _row_norms(self, mRows, mRhoQ, mRhoK, b, c, hv, r0, HV):
        """([rho_q(r0), rho_q(r0 + 8)], [rho_k(r0), rho_k(r0 + 8)]): 1 / |raw row| of the
        q, k rows behind chunk rows r0, r0 + 8 (key head of value head ``hv``); rows
        without a token (or, for q, not read out) read row 0, their results unwritten.
        Runs at trace time (plain Python, as the module's helpers)."""
        base, count, tok, n = mRows[b, c, 0], mRows[b, c, 1], mRows[b, c, 2], mRows[b, c, 3]
        hk = hv // (HV // mRhoK.shape[2])
        rq, rk = [], []
        for i in (r0, r0 + 8):
            ok = i < count
            rk.append(mRhoK[b, cutlass.select_(ok, base + i, 0), hk])
            okq = ok & (i % n == n - 1)
            rq.append(mRhoQ[b, cutlass.select_(okq, tok + i // n, 0), hk])
        return rq, rk

    @cute.jit
    def _load_rows(self, cp, s, mIn, mRows, b, c, h, N: cutlass.Constexpr,
                   readout: cutlass.Constexpr):
        """The mirror of ``_copy_rows``: a 16-bit [C, N] smem operand tile from its
        token-major rows of ``mIn`` (head ``h``) by cp.async, 128 bits a piece (the caller
        commits the group); chunk rows without a token row (i >= count; with ``readout``,
        the rows i != n - 1 (mod n)) are zeros, as on the chunk grid."""
        atom = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), self.ab,
            num_bits_per_copy=128)
        t = cp.dest(s)
        crd = cp.thr.partition_D(cute.make_identity_tensor((C, N)))
        count, n = mRows[b, c, 1], mRows[b, c, 3]
        zero = F32(0.0).to(self.ab)
        for m in cutlass.range_constexpr(cute.size(t) // 8):
            i, col = crd[8 * m]
            ok, row = i < count, mRows[b, c, 0] + i
            if cutlass.const_expr(readout):
                ok, row = ok & (i % n == n - 1), mRows[b, c, 2] + i // n
            if ok:
                cute.copy(atom, cute.local_tile(mIn[b, row, h, None], (8,), (col // 8,)),
                          t[None, m, 0])
            else:
                for e in cutlass.range_constexpr(8 * m, 8 * m + 8):
                    t[e] = zero

    @cute.jit
    def _copy_rows(self, cp, s, mOut, mRows, b, c, hv, N: cutlass.Constexpr,
                   readout: cutlass.Constexpr):
        """A 16-bit [C, N] smem result tile to its token-major rows: chunk row i < count
        to row base + i of [B, L, HV, N] (dk, dv), and with ``readout`` (dq) only the
        read-out rows i = n - 1 (mod n), to token tok + i // n of [B, T, HV, N];
        mRows[b, c] = (base, count, tok, n). Each thread moves 8 consecutive columns of a
        row at a time (``cp``: the tile's ``g2s`` partition): one 128-bit load from smem,
        one 128-bit store."""
        t = cp.dest(s)
        crd = cp.thr.partition_D(cute.make_identity_tensor((C, N)))
        r16 = cute.make_fragment_like(t)
        cute.autovec_copy(t, r16)
        count, n = mRows[b, c, 1], mRows[b, c, 3]
        piece = cute.make_rmem_tensor((8,), self.ab)
        for m in cutlass.range_constexpr(cute.size(t) // 8):
            i, col = crd[8 * m]
            ok, row = i < count, mRows[b, c, 0] + i
            if cutlass.const_expr(readout):
                ok, row = ok & (i % n == n - 1), mRows[b, c, 2] + i // n
            if ok:
                for e in cutlass.range_constexpr(8):
                    piece[e] = r16[8 * m + e]
                cute.local_tile(mOut[b, row, hv, None], (8,), (col // 8,)).store(piece.load())


# ------------------------------------------------------------ device-side pieces
# Plain functions run at trace time inside the kernel (as sm90's helpers): their loops are
# unrolled Python loops and they hold no dynamic control flow.

@dataclasses.dataclass(frozen=True)
class _SmemOp:
    """A 16-bit smem tile ``t`` stored [rows, cols] row-major (``sm90.smem_layout``) as an
    MMA operand: A [M = rows, K = cols] or B [N = rows, K = cols] with ``k_major``, else
    B [N = cols, K = rows] (the tile read transposed)."""
    t: object
    rows: int
    cols: int
    k_major: bool


@dataclasses.dataclass(frozen=True)
class _RegA:
    """An A operand [C, C] from the float32 smem ``view`` through registers (``_reg``:
    value(x, i, j) applied, + the transposed tile with ``plus_transpose``)."""
    view: object
    value: object = None
    plus_transpose: object = None


class _Sync:
    """The products as warp MMAs (ldmatrix + mma.sync, ``tiled_mma`` = ``sm90.warp_mma``):
    ``products(acc, n, kd, pairs)`` does acc += A B for each (A, B) in turn (``issue``
    the same; ``commit``, ``wait``: nothing to do)."""

    def __init__(self, tiled_mma, thr_mma, ab, split, mma_, mma_reg_a_):
        self.tiled, self.thr, self.ab, self.split = tiled_mma, thr_mma, ab, split
        self.mma_, self.mma_reg_a_ = mma_, mma_reg_a_

    def issue(self, acc, n, kd, pairs):
        self.products(acc, n, kd, pairs)

    def commit(self):
        pass

    def wait(self, pending: int):
        pass

    def products(self, acc, n, kd, pairs):
        for a, b in pairs:
            if isinstance(a, _RegA):
                ops = _reg(self.thr, a.view, True, self.ab, self.split, a.value,
                           a.plus_transpose)
                self.mma_reg_a_(self.tiled, kd // MMA_K, acc, ops, b)
            else:
                self.mma_(self.tiled, kd // MMA_K, acc, a, b)


def _view(op: _SmemOp, ab):
    """The tile of ``op`` as a wgmma operand tensor (``sm90.gmma_view``; every tile of
    this kernel is a multiple of 64 columns: the 128-byte swizzle)."""
    return gmma_view(op.t, op.rows, op.cols, op.k_major, ab)


class _Gmma:
    """The products as warpgroup MMAs of the CTA's two 4-warp groups, each taking half of
    N (m64 n(N/2) k16, float32 accumulators): ``products(acc, n, kd, pairs)`` issues
    acc += A B for every pair (A: ``_SmemOp`` K-major or ``_RegA``; B: ``_SmemOp``) and
    waits for them; ``issue`` / ``commit`` / ``wait`` do it in steps (a committed group
    runs while the threads do other work). ``tiled(n)`` / ``thr(n)``: the tiled MMA (its
    slice) whose accumulator partition a [C, n] result has - the same for every operand
    source and major mode."""

    def __init__(self, ab, tidx, split: bool, on: bool = True):
        self.ab, self.tidx, self.split, self.on = ab, tidx, split, on
        self._tiled = {}

    def tiled(self, n: int, reg_a: bool = False, a_k: bool = True, b_k: bool = True):
        key = (n, reg_a, a_k, b_k)
        if key not in self._tiled:
            self._tiled[key] = wg_tiled(self.ab, n, a_k, b_k, reg_a, warpgroups=2)
        return self._tiled[key]

    def thr(self, n: int):
        return self.tiled(n).get_slice(self.tidx)

    def products(self, acc, n, kd, pairs):
        self.issue(acc, n, kd, pairs)
        self.commit()
        self.wait(0)

    def commit(self):
        if self.on:
            warpgroup.commit_group()

    def wait(self, pending: int):
        """Until at most ``pending`` of the committed groups are still running (they
        complete in order)."""
        if self.on:
            warpgroup.wait_group(pending)

    def issue(self, acc, n, kd, pairs):
        """Start acc += A B for every pair (no commit, no wait)."""
        if not self.on:
            return
        for a, b in pairs:
            reg = isinstance(a, _RegA)
            tiled = self.tiled(n, reg, True if reg else a.k_major, b.k_major)
            thr = tiled.get_slice(self.tidx)
            fb = tiled.make_fragment_B(thr.partition_B(_view(b, self.ab)))
            if reg:
                fas = [o.frag for o in _reg(thr, a.view, True, self.ab, self.split, a.value,
                                            a.plus_transpose)]
            else:
                fas = [tiled.make_fragment_A(thr.partition_A(_view(a, self.ab)))]
            # after the registers (accumulator, A) were last written by other instructions
            warpgroup.fence()
            for fa in fas:
                for kb in range(kd // MMA_K):
                    cute.gemm(tiled, acc, fa[None, None, kb], fb[None, None, kb], acc)


def _reg(thr_mma, view, is_a: bool, ab, split: bool, value=None, plus_transpose=None):
    """The [C, C] float32 smem ``view`` (A: [M, K]; B: [N, K]) as register MMA operands:
    [hi, lo] in split mode (x = hi + lo to ~2^-16 relative), else [hi]; elements
    value(x, i, j) at view coordinates (i, j) of x = view[i, j] (+ view[j, i] with
    ``plus_transpose``, the same tile)."""
    shape = (C, C)
    if is_a:
        src = thr_mma.partition_A(view)
        crd = thr_mma.partition_A(cute.make_identity_tensor(shape))
        frags = [thr_mma.make_fragment_A(thr_mma.partition_shape_A(shape))
                 for _ in range(2 if split else 1)]
        srcT = (thr_mma.partition_A(transpose_view(plus_transpose, C, C))
                if plus_transpose is not None else None)
    else:
        assert plus_transpose is None
        src = thr_mma.partition_B(view)
        crd = thr_mma.partition_B(cute.make_identity_tensor(shape))
        frags = [thr_mma.make_fragment_B(thr_mma.partition_shape_B(shape))
                 for _ in range(2 if split else 1)]
        srcT = None
    for e in range(cute.size(frags[0])):
        x = src[e]
        if srcT is not None:
            x = x + srcT[e]
        if value is not None:
            i, j = crd[e]
            x = value(x, i, j)
        h = x.to(ab)
        frags[0][e] = h
        if split:
            frags[1][e] = (x - h.to(F32)).to(ab)
    return [RegOperand(f) for f in frags]


def _skip(*args):
    """An MMA left out (``ablate="nomma"``)."""


def _mma_reg_a(tiled_mma, k_blocks, acc, a_ops, b, b_ops=None):
    """acc += A B with A given as register operands ``a_ops`` (hi[, lo]) and B either an
    ldmatrix ``Operand`` ``b`` or register operands ``b_ops`` (hi[, lo])."""
    products = [(acc, a) for a in a_ops]
    if b_ops is not None:
        mma_split_b(tiled_mma, k_blocks, products, b_ops[0],
                    b_ops[1] if len(b_ops) > 1 else None, len(b_ops) > 1)
    else:
        mma_split_b(tiled_mma, k_blocks, products, b, None, False)


def _row_sums(acc, crd, r0, term, out, wn):
    """out[wn, i] = sum_j term(e) over the accumulator elements e of this thread's rows
    r0, r0 + 8 (this warp's columns: ``wn`` its N index); the quad of lanes holding a row
    sums it and every lane of it stores the same value (no branch)."""
    z0, z1 = F32(0.0), F32(0.0)
    for e in range(cute.size(acc)):
        i, _ = crd[e]
        x = term(e)
        z0 = z0 + pick(i == r0, x, F32(0.0))
        z1 = z1 + pick(i == r0, F32(0.0), x)
    out[wn, r0] = cute.arch.warp_reduction_sum(z0, threads_in_group=4)
    out[wn, r0 + 8] = cute.arch.warp_reduction_sum(z1, threads_in_group=4)


def _warp_partials(x, out, tidx):
    """out[warp] = the sum of ``x`` over this thread's warp (every lane holds it after the
    butterfly reduction and stores it: no branch)."""
    out[tidx // 32] = cute.arch.warp_reduction_sum(x)


def _sum_n(t, i, warps_n):
    """sum over the warps along N of a [warps_n, C] partial row-sum vector at row i."""
    s = t[0, i]
    for w in range(1, warps_n):
        s = s + t[w, i]
    return s


def _col_sum(F, j):
    """sum_i F[i, j] of a float32 [C, C] smem tile (two partial sums)."""
    s0, s1 = F32(0.0), F32(0.0)
    for i in range(0, C, 2):
        s0 = s0 + F[i, j]
        s1 = s1 + F[i + 1, j]
    return s0 + s1


# the phases ``ablate="probe"`` times, in order (each ends at a CTA barrier)
PROBE_PHASES = ("loads+gates", "QG", "Delta, ddelta", "dKt", "dW, doS0", "dX, col sums",
                "dP, dqk, dseg", "X^T dX", "dA, KG", "dv, dk, dq", "dbeta, dg")

_KERNELS = {}


def get_kernel(K: int, V: int, ab_name: str, split: bool, ablate: str = "",
               warps_n: int = 2, tokens: bool = False,
               head_major: bool = False, tokens_in: bool = False,
               norm_bwd: bool = False, do_tokens: bool = False,
               l2norm: bool = False, gmma: bool = False,
               overlap: bool = False, gmma_all: bool = False) -> ChunkGradSm90:
    key = (K, V, ab_name, split, ablate, warps_n, tokens, head_major, tokens_in, norm_bwd,
           do_tokens, l2norm, gmma, overlap, gmma_all)
    if key not in _KERNELS:
        _KERNELS[key] = ChunkGradSm90(K, V, ab_type(ab_name), split, ablate, warps_n,
                                      tokens, head_major, tokens_in, norm_bwd, do_tokens,
                                      l2norm, gmma, overlap, gmma_all)
    return _KERNELS[key]
