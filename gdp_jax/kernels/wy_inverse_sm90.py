"""CuTe DSL kernel: X = (I + A)^-1 for a batch of strictly lower-triangular 64 x 64 matrices.

The WY factors of every chunk need this inverse (``gdp_jax.chunked.intra_chunk``). In XLA
it is a chain of tiny batched matmuls (16 x 16 blocks, then merges) whose launch and
small-GEMM overheads dominated the cutedsl forward, for work that is only ~2 GFLOP
(profile: benchmarks/results/history/2026-11-29/NOTES.md).

Scheme: forward substitution by COLUMNS. Column j of X solves (I + A) x = e_j, i.e.

    x_i = [i == j] - sum_{l < i} A[i, l] x_l,        i = 0 .. 63,

which needs only row i of A and the thread's own earlier x_l: one thread per column keeps
its column in 64 float32 registers; the CTA stages A in shared memory (every thread of a
warp reads the same A[i, l]: a broadcast, no bank conflicts). Loads and stores are
coalesced along j. Full float32 FMAs (more accurate than the TF32 matmuls XLA uses for the
blocked inverse). No atomics; deterministic.

Grid: one CTA per MATS matrices, 64 * MATS threads; a tail CTA masks the missing ones.
This module imports cutlass; import it only through ``gdp_jax.kernels.wy_inverse`` (lazily).
"""
from __future__ import annotations

import cutlass
import cutlass.memory
import cutlass.cute as cute


M = 64            # matrix size (the chunk length)
MATS = 2          # matrices per CTA (128 threads)


class UnitLowerInverseSm90:
    @cute.jit
    def __call__(self, stream, mA, mX):
        smem_layout = cute.make_layout((MATS, M, M), stride=(M * M, M, 1))

        @cute.struct
        class Storage:
            sA: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, MATS * M * M], 128]

        num = mA.shape[0]
        grid = ((num + MATS - 1) // MATS, 1, 1)
        self.kernel(mA, mX, smem_layout, Storage).launch(
            grid=grid, block=[M * MATS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mA, mX, smem_layout: cute.Layout, Storage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        num = mA.shape[0]
        local = tidx // M               # which matrix of the CTA
        j = tidx % M                    # the column this thread solves
        mat = bidx * MATS + local
        valid = mat < num
        src = cutlass.select_(valid, mat, num - 1)   # tail threads re-read a valid matrix

        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(Storage)
        sA = st.sA.get_tensor(smem_layout)
        for r in cutlass.range_constexpr(M):
            sA[local, r, j] = mA[src, r, j]
        cute.arch.sync_threads()

        x = cute.make_rmem_tensor((M,), cutlass.Float32)
        for i in cutlass.range_constexpr(M):
            acc = cutlass.Float32(cutlass.select_(j == i, cutlass.Float32(1.0),
                                                  cutlass.Float32(0.0)))
            for l in cutlass.range_constexpr(i):
                acc = acc - sA[local, i, l] * x[l]
            x[i] = acc
        if valid:
            for i in cutlass.range_constexpr(M):
                mX[mat, i, j] = x[i]


_KERNEL = []


def get_kernel() -> UnitLowerInverseSm90:
    if not _KERNEL:
        _KERNEL.append(UnitLowerInverseSm90())
    return _KERNEL[0]
