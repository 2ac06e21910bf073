"""CuTe DSL kernel: the forward's per-chunk operands, every chunk in parallel.

One CTA (4 warps) per (chunk, value head, batch row) reads the chunk inputs q, k [C, K],
v [C, V], g, beta [C] (float32) and writes what the forward chunk kernel reads
(``gdp_jax.kernels.chunk_fwd_sm90``), already made causal-safe:

    seg_ij = g_{j+1} + ... + g_i (j <= i), Gam = exp(seg), G_i = g_0 + ... + g_i, gam = exp(G)
    A  = tril(beta K K^T * Gam, -1),   X = (I + A)^-1
    w  = X diag(beta gam) K,  u = X diag(beta) V,  Kt = exp(G_last - G) K
    qg = scale gam q,  P = scale tril(Q K^T * Gam),  decay = exp(G_last)

with the non-finite row rules of ``gdp_jax.kernels.pipeline.causal_operands`` (a row whose
w or u is not finite enters as zeros with a NaN Kt row, output rows from the first such row
on are flagged ``bad``; a non-finite readout row (qg, P) enters as zeros and is flagged).

Phases, separated by CTA barriers:
  0. gates: thread i < C sums its row's segment sums from the diagonal down (the XLA
     ``segment_sums`` order: never a difference of cumsums, safe for strong gates) into
     Gam (float32 smem); threads C.. sum G_last - G_i the same way.
  1. q, k (float32 global, a warp per row, one vector load a lane) -> hi + lo 16-bit
     smem tiles (x = hi + lo to ~2^-16).
  2. K K^T and Q K^T on warp MMAs (hi hi + lo hi + hi lo: float32-level products);
     epilogue A (in place of Gam, float32) and P (stored).
  3. warps 0-1: X = (I + A)^-1, one thread per column (forward substitution in float32,
     as ``wy_inverse_sm90``), X stored hi + lo; warps 2-3 meanwhile: the right-hand sides
     diag(beta gam) K and diag(beta) V as hi + lo tiles (non-finite entries as zeros and
     their rows flagged, as ``chunked.causal_mm`` does), Kt and qg stored.
  4. w = X Rw, u = X Ru on warp MMAs (3 products each: X's entries can be large when
     beta ~ 2, so neither factor is rounded to 16 bits); row flags; stores.

Row flags (is a row finite?) come without branches: each lane sums x * 0 over its
elements of the row (0, or NaN if one is inf or NaN) and the lanes holding the row (a warp
in the load phases, a quad of an MMA accumulator) sum it by shuffles; every lane then
stores the same flag.

This module imports cutlass; import it only through ``gdp_jax.kernels.chunk_prep`` (lazily).
"""
from __future__ import annotations

import cutlass
import cutlass.memory
import cutlass.cute as cute
from cutlass.cute.nvgpu import warp

from gdp_jax.kernels.sm90 import (C, MMA_K, NUM_THREADS, ab_type, c_tile, ldmatrix_copies,
                                  make_acc, mma_split_b, operand, smem_layout, smem_tile,
                                  transpose_view, warp_mma)

F32 = cutlass.Float32
I32 = cutlass.Int32
INF = float("inf")
HALF = NUM_THREADS // 2     # threads per half CTA (phase 3 splits the CTA in two)


def _finite(x):
    """x is neither inf nor NaN (a comparison: NaN < inf is false)."""
    return cute.math.absf(x) < F32(INF)


def _pick(cond, x, y):
    """float32 ``x if cond else y`` (a select: the unpicked value's inf or NaN never
    leaks, as it would through arithmetic masking)."""
    return F32(cutlass.select_(cond, x, y))


def _nonfinite(z, lanes: int):
    """Int32 1 if a row holds an inf or NaN, else 0. ``z``: this lane's sum of x * 0 over
    its elements of the row (0, or NaN if one is not finite), summed here over the row's
    ``lanes`` lanes (aligned groups); every lane of the group gets the answer, so all of
    them may store it."""
    z = cute.arch.warp_reduction_sum(z, threads_in_group=lanes)
    return I32(cutlass.select_(z == F32(0.0), I32(0), I32(1)))


def _lane_load(row, E: int, lane):
    """This lane's E consecutive float32 of the 1-D gmem tensor ``row`` (one vector load)
    -> an [E] float32 register tensor."""
    x = cute.make_rmem_tensor((E,), F32)
    x.store(cute.local_tile(row, (E,), (lane,)).load().to(F32))
    return x


def _split(x, ab):
    """float32 x -> (hi, lo) 16-bit with hi + lo = x to ~2^-16 relative."""
    hi = x.to(ab)
    return hi, (x - hi.to(F32)).to(ab)


class ChunkPrepSm90:
    """Static configuration: head dims K, V, operand dtype, the readout scale."""

    def __init__(self, K: int, V: int, ab_dtype, scale: float):
        assert K in (64, 128) and V in (64, 128)
        self.K, self.V, self.ab, self.scale = K, V, ab_dtype, float(scale)

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, stream, mQ, mK, mV, mG, mBeta, mW, mKt, mQg, mP, mU, mDecay, mBad):
        K, V, ab = self.K, self.V, self.ab
        KV = max(K, V)
        sK_layout = smem_layout(C, K)      # k hi/lo (phases 1-2), then diag(beta gam) k
        sQ_layout = smem_layout(C, K)      # q hi/lo (phases 1-2) ...
        sR_layout = smem_layout(C, V)      # ... then, same memory, diag(beta) v
        sX_layout = smem_layout(C, C)      # X hi/lo
        sA_layout = cute.make_layout((C, C), stride=(C + 1, 1))   # padded: no conflicts
        qv_words = cute.cosize(smem_layout(C, KV))

        @cute.struct
        class Storage:
            sKh: smem_tile(ab, sK_layout)
            sKl: smem_tile(ab, sK_layout)
            sQh: cute.struct.Align[cute.struct.MemRange[ab, qv_words], 1024]
            sQl: cute.struct.Align[cute.struct.MemRange[ab, qv_words], 1024]
            sXh: smem_tile(ab, sX_layout)
            sXl: smem_tile(ab, sX_layout)
            sA: cute.struct.Align[cute.struct.MemRange[F32, C * (C + 1)], 128]
            sg: cute.struct.MemRange[F32, C]        # g
            sb: cute.struct.MemRange[F32, C]        # beta
            sgam: cute.struct.MemRange[F32, C]      # exp(G)
            send: cute.struct.MemRange[F32, C]      # exp(G_last - G)
            # row flags (1 = set; written once per row, by the lanes holding the row)
            fA: cute.struct.MemRange[I32, C]        # A row not finite
            fR: cute.struct.MemRange[I32, C]        # right-hand-side row not finite
            fP: cute.struct.MemRange[I32, C]        # P row (16-bit) not finite
            fQ: cute.struct.MemRange[I32, C]        # qg row (16-bit) not finite
            fWU: cute.struct.MemRange[I32, C]       # w (16-bit) or u row not finite
            ok: cute.struct.MemRange[I32, C]        # state row enters (causal_operands)

        B, NC, HV = mK.shape[0], mK.shape[1], mK.shape[2]
        self.kernel(mQ, mK, mV, mG, mBeta, mW, mKt, mQg, mP, mU, mDecay, mBad,
                    sK_layout, sQ_layout, sR_layout, sX_layout, sA_layout, warp_mma(ab),
                    Storage).launch(grid=(NC, HV, B), block=[NUM_THREADS, 1, 1],
                                    stream=stream)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, mQ, mK, mV, mG, mBeta, mW, mKt, mQg, mP, mU, mDecay, mBad,
               sK_layout: cute.ComposedLayout, sQ_layout: cute.ComposedLayout,
               sR_layout: cute.ComposedLayout, sX_layout: cute.ComposedLayout,
               sA_layout: cute.Layout, tiled_mma: cute.TiledMma, Storage: cutlass.Constexpr):
        K, V, ab, scale = self.K, self.V, self.ab, self.scale
        tidx, _, _ = cute.arch.thread_idx()
        c, hv, b = cute.arch.block_idx()

        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(Storage)
        sKh = st.sKh.get_tensor(sK_layout)
        sKl = st.sKl.get_tensor(sK_layout)
        sQh = st.sQh.get_tensor(sQ_layout)
        sQl = st.sQl.get_tensor(sQ_layout)
        sRh = st.sQh.get_tensor(sR_layout)       # reuses q's memory from phase 3 on
        sRl = st.sQl.get_tensor(sR_layout)
        sXh = st.sXh.get_tensor(sX_layout)
        sXl = st.sXl.get_tensor(sX_layout)
        sA = st.sA.get_tensor(sA_layout)         # Gam, then A in place
        sg, sb = st.sg.get_tensor(cute.make_layout(C)), st.sb.get_tensor(cute.make_layout(C))
        sgam = st.sgam.get_tensor(cute.make_layout(C))
        send = st.send.get_tensor(cute.make_layout(C))
        fA, fR = st.fA.get_tensor(cute.make_layout(C)), st.fR.get_tensor(cute.make_layout(C))
        fP, fQ = st.fP.get_tensor(cute.make_layout(C)), st.fQ.get_tensor(cute.make_layout(C))
        fWU = st.fWU.get_tensor(cute.make_layout(C))
        ok = st.ok.get_tensor(cute.make_layout(C))

        gQ = mQ[b, c, hv, None, None]
        gK = mK[b, c, hv, None, None]
        gV = mV[b, c, hv, None, None]
        gKt = mKt[b, c, hv, None, None]
        gQg = mQg[b, c, hv, None, None]

        # ---- phase 0: gates
        if tidx < C:
            sg[tidx] = mG[b, c, hv, tidx].to(F32)
            sb[tidx] = mBeta[b, c, hv, tidx].to(F32)
        cute.arch.sync_threads()
        if tidx < C:
            i = tidx
            s = F32(0.0)                          # seg_ij, j from i down to 0
            for jj in cutlass.range(i + 1, unroll=1):
                j = i - jj
                sA[i, j] = cute.math.exp(s)
                s = s + sg[j]
            sgam[i] = cute.math.exp(s)            # s = G_i
            if i == C - 1:
                mDecay[b, c, hv] = cute.math.exp(s)
        else:
            i = tidx - C
            t = F32(0.0)                          # G_last - G_i = g_{i+1} + ... + g_{C-1}
            for jj in cutlass.range(C - 1 - i, unroll=1):
                t = t + sg[C - 1 - jj]
            send[i] = cute.math.exp(t)
        cute.arch.sync_threads()

        # ---- phase 1: q, k -> hi + lo smem, a warp per row (E floats a lane); qg's flags
        warp_i, lane = tidx // 32, tidx % 32
        EK, EV = K // 32, V // 32
        for rr in cutlass.range_constexpr(C // 4):
            r = warp_i * (C // 4) + rr
            kx = _lane_load(gK[r, None], EK, lane)
            qx = _lane_load(gQ[r, None], EK, lane)
            sc = scale * sgam[r]
            zq = F32(0.0)
            for m in cutlass.range_constexpr(EK):
                col = lane * EK + m
                kh, kl = _split(kx[m], ab)
                sKh[r, col] = kh
                sKl[r, col] = kl
                qh, ql = _split(qx[m], ab)
                sQh[r, col] = qh
                sQl[r, col] = ql
                zq = zq + (sc * qx[m]).to(ab).to(F32) * F32(0.0)
            fQ[r] = _nonfinite(zq, 32)
        cute.arch.sync_threads()

        # ---- phase 2: K K^T, Q K^T -> A (smem, in place of Gam), P
        thr_mma = tiled_mma.get_slice(tidx)
        cA, _, cBt = ldmatrix_copies(tiled_mma, ab, tidx)
        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), ab)
        cB = cute.make_tiled_copy_B(ldsm, tiled_mma).get_slice(tidx)   # B from [N, K] tiles
        acc_kk = make_acc(thr_mma, (C, C))
        acc_qk = make_acc(thr_mma, (C, C))
        acc_kk.fill(0.0)
        acc_qk.fill(0.0)
        KhA, KlA = operand(thr_mma, cA, sKh, True), operand(thr_mma, cA, sKl, True)
        QhA, QlA = operand(thr_mma, cA, sQh, True), operand(thr_mma, cA, sQl, True)
        KhB, KlB = operand(thr_mma, cB, sKh, False), operand(thr_mma, cB, sKl, False)
        mma_split_b(tiled_mma, K // MMA_K, [(acc_kk, KhA), (acc_qk, QhA)], KhB, KlB, True,
                    plain=[(acc_kk, KlA, KhB), (acc_qk, QlA, KhB)])
        # an accumulator row lives in one quad of lanes: this thread's rows r0 and r0 + 8
        crd = thr_mma.partition_C(cute.make_identity_tensor((C, C)))
        r0, _ = crd[0]
        r1 = r0 + 8
        za0, za1, zp0, zp1 = F32(0.0), F32(0.0), F32(0.0), F32(0.0)
        for e in cutlass.range_constexpr(cute.size(acc_kk)):
            i, j = crd[e]
            in0 = i == r0
            gm = sA[i, j]
            a = _pick(j < i, (sb[i] * acc_kk[e]) * gm, F32(0.0))
            sA[i, j] = a
            p = _pick(j <= i, (acc_qk[e] * gm) * scale, F32(0.0))
            acc_qk[e] = p
            za = a * F32(0.0)
            zp = p.to(ab).to(F32) * F32(0.0)
            za0, za1 = za0 + _pick(in0, za, F32(0.0)), za1 + _pick(in0, F32(0.0), za)
            zp0, zp1 = zp0 + _pick(in0, zp, F32(0.0)), zp1 + _pick(in0, F32(0.0), zp)
        fA[r0], fA[r1] = _nonfinite(za0, 4), _nonfinite(za1, 4)
        fP[r0], fP[r1] = _nonfinite(zp0, 4), _nonfinite(zp1, 4)
        cute.arch.sync_threads()
        rok0, rok1 = (fP[r0] | fQ[r0]) == 0, (fP[r1] | fQ[r1]) == 0
        for e in cutlass.range_constexpr(cute.size(acc_qk)):
            i, _ = crd[e]
            keep = cutlass.Boolean(cutlass.select_(i == r0, rok0, rok1))
            acc_qk[e] = _pick(keep, acc_qk[e], F32(0.0))
        c_tile(thr_mma, mP[b, c, hv, None, None], (C, C), (0, 0)).store(acc_qk.load().to(ab))

        # ---- phase 3: the inverse | right-hand sides, Kt, qg
        if tidx < C:
            j = tidx                                  # this thread's column of X
            x = cute.make_rmem_tensor((C,), F32)
            for i in cutlass.range_constexpr(C):
                # two partial sums: half the dependent FMA chain
                acc0 = _pick(j == i, F32(1.0), F32(0.0))
                acc1 = F32(0.0)
                for l in cutlass.range_constexpr(0, i, 2):
                    acc0 = acc0 - sA[i, l] * x[l]
                for l in cutlass.range_constexpr(1, i, 2):
                    acc1 = acc1 - sA[i, l] * x[l]
                x[i] = acc0 + acc1
            for i in cutlass.range_constexpr(C):
                xh, xl = _split(x[i], ab)
                sXh[i, j] = xh
                sXl[i, j] = xl
        else:
            for rr in cutlass.range_constexpr(C // 2):
                r = (warp_i - 2) * (C // 2) + rr
                kx = _lane_load(gK[r, None], EK, lane)
                qx = _lane_load(gQ[r, None], EK, lane)
                vx = _lane_load(gV[r, None], EV, lane)
                bg, be, en, sc = sb[r] * sgam[r], sb[r], send[r], scale * sgam[r]
                rok = (fP[r] | fQ[r]) == 0
                kt = cute.make_rmem_tensor((EK,), F32)
                qg = cute.make_rmem_tensor((EK,), F32)
                z = F32(0.0)
                for m in cutlass.range_constexpr(EK):
                    col = lane * EK + m
                    rw = bg * kx[m]
                    z = z + rw * F32(0.0)
                    rh, rl = _split(_pick(_finite(rw), rw, F32(0.0)), ab)
                    sKh[r, col] = rh
                    sKl[r, col] = rl
                    kt[m] = en * kx[m]                 # rows that do not enter: NaN below
                    qg[m] = _pick(rok, sc * qx[m], F32(0.0))
                for m in cutlass.range_constexpr(EV):
                    col = lane * EV + m
                    ru = be * vx[m]
                    z = z + ru * F32(0.0)
                    rh, rl = _split(_pick(_finite(ru), ru, F32(0.0)), ab)
                    sRh[r, col] = rh
                    sRl[r, col] = rl
                fR[r] = _nonfinite(z, 32)
                cute.local_tile(gKt[r, None], (EK,), (lane,)).store(kt.load().to(ab))
                cute.local_tile(gQg[r, None], (EK,), (lane,)).store(qg.load().to(ab))
        cute.arch.sync_threads()

        # ---- phase 4: w = X Rw, u = X Ru
        acc_w = make_acc(thr_mma, (C, K))
        acc_u = make_acc(thr_mma, (C, V))
        acc_w.fill(0.0)
        acc_u.fill(0.0)
        XhA, XlA = operand(thr_mma, cA, sXh, True), operand(thr_mma, cA, sXl, True)
        Rw = operand(thr_mma, cBt, transpose_view(sKh, C, K), False)
        Rwl = operand(thr_mma, cBt, transpose_view(sKl, C, K), False)
        Ru = operand(thr_mma, cBt, transpose_view(sRh, C, V), False)
        Rul = operand(thr_mma, cBt, transpose_view(sRl, C, V), False)
        mma_split_b(tiled_mma, C // MMA_K, [(acc_w, XhA)], Rw, Rwl, True,
                    plain=[(acc_w, XlA, Rw)])
        mma_split_b(tiled_mma, C // MMA_K, [(acc_u, XhA)], Ru, Rul, True,
                    plain=[(acc_u, XlA, Ru)])
        crd_w = thr_mma.partition_C(cute.make_identity_tensor((C, K)))
        crd_u = thr_mma.partition_C(cute.make_identity_tensor((C, V)))
        z0, z1 = F32(0.0), F32(0.0)
        for e in cutlass.range_constexpr(cute.size(acc_w)):
            i, _ = crd_w[e]
            zw = acc_w[e].to(ab).to(F32) * F32(0.0)
            z0, z1 = z0 + _pick(i == r0, zw, F32(0.0)), z1 + _pick(i == r0, F32(0.0), zw)
        for e in cutlass.range_constexpr(cute.size(acc_u)):
            i, _ = crd_u[e]
            zu = acc_u[e] * F32(0.0)
            z0, z1 = z0 + _pick(i == r0, zu, F32(0.0)), z1 + _pick(i == r0, F32(0.0), zu)
        fWU[r0], fWU[r1] = _nonfinite(z0, 4), _nonfinite(z1, 4)
        cute.arch.sync_threads()

        # ---- row rules: ok_i = no non-finite A / rhs row at or before i, finite w, u;
        # bad_i = some row <= i does not enter, or the readout row is not finite
        if tidx < C:
            i = tidx
            nan = I32(0)
            anybad = I32(0)
            row_ok = I32(1)
            for l in cutlass.range(i + 1, unroll=1):
                nan = nan | fA[l] | fR[l]
                row_ok = I32(cutlass.select_((nan | fWU[l]) == 0, I32(1), I32(0)))
                anybad = anybad | (1 - row_ok)
            ok[i] = row_ok
            mBad[b, c, hv, i] = anybad | fP[i] | fQ[i]
        cute.arch.sync_threads()

        ok0, ok1 = ok[r0] != 0, ok[r1] != 0
        for e in cutlass.range_constexpr(cute.size(acc_w)):
            i, _ = crd_w[e]
            keep = cutlass.Boolean(cutlass.select_(i == r0, ok0, ok1))
            acc_w[e] = _pick(keep, acc_w[e], F32(0.0))
        c_tile(thr_mma, mW[b, c, hv, None, None], (C, K), (0, 0)).store(acc_w.load().to(ab))
        for e in cutlass.range_constexpr(cute.size(acc_u)):
            i, _ = crd_u[e]
            keep = cutlass.Boolean(cutlass.select_(i == r0, ok0, ok1))
            acc_u[e] = _pick(keep, acc_u[e], F32(0.0))
        c_tile(thr_mma, mU[b, c, hv, None, None], (C, V), (0, 0)).store(acc_u.load())
        if tidx < C:
            if ok[tidx] == 0:                      # rare: a row that does not enter
                for col in cutlass.range(K, unroll=1):
                    gKt[tidx, col] = F32(float("nan")).to(ab)


_KERNELS = {}


def get_kernel(K: int, V: int, ab_name: str, scale: float) -> ChunkPrepSm90:
    key = (K, V, ab_name, float(scale))
    if key not in _KERNELS:
        _KERNELS[key] = ChunkPrepSm90(K, V, ab_type(ab_name), scale)
    return _KERNELS[key]
