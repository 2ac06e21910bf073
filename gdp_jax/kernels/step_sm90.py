"""CuTe DSL kernel: one decoding token of the GDP recurrence, state read and written once.

One CTA per (value tile, value head, batch row), one thread per value column ``c`` of the
state. The thread holds its column s = S[:, c] (K float32 values) in registers and runs

    s <- decay * s
    for j in 0..n-1:   s <- s + k_j * beta_j (v_j[c] - s . k_j)      (Householder update j)
    o[c]  = s . q                                                    (q already scaled)
    S[:, c] <- s

Columns of the state never mix, so the threads are independent; the token's q and keys
(float32, prepared by XLA: L2 norm, GVA head expansion, scale) are staged in shared memory
and read there as broadcasts. Every S access is a coalesced warp-wide row read/write
(consecutive threads = consecutive columns of one row), and the output state may alias the
input state buffer: the kernel writes the next state over S (each thread reads its whole
column before writing it back).

This module imports cutlass; import it only through ``gdp_jax.kernels.step`` (lazily).
"""
from __future__ import annotations

import cutlass
import cutlass.memory
import cutlass.cute as cute


NUM_PARTIAL = 4   # independent partial sums per dot product (instruction-level parallelism)


def _dot(s, vec, base: int):
    """sum_k s[k] * vec[base + k] with NUM_PARTIAL interleaved accumulators."""
    parts = [s[i] * vec[base + i] for i in range(min(NUM_PARTIAL, len(s)))]
    for i in range(len(parts), len(s)):
        parts[i % NUM_PARTIAL] = parts[i % NUM_PARTIAL] + s[i] * vec[base + i]
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


def _store_column(mS, b, hv, col, s):
    """S[b, hv, :, col] = s (a trace-time Python loop: fully unrolled)."""
    for i, x in enumerate(s):
        mS[b, hv, i, col] = x


class StepSm90:
    """Static configuration: key dim K, Householder steps n, value tile BV (threads)."""

    def __init__(self, K: int, n: int, BV: int):
        assert 1 <= K <= 128 and n >= 1 and BV in (32, 64, 128)
        self.K, self.n, self.BV = K, n, BV

    @cute.jit
    def __call__(self, stream, mQ, mK, mV, mBeta, mDecay, mS, mO):
        B, HV, V = mV.shape[0], mV.shape[1], mV.shape[3]
        grid = (V // self.BV, HV, B)
        self.kernel(mQ, mK, mV, mBeta, mDecay, mS, mO).launch(
            grid=grid, block=[self.BV, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQ, mK, mV, mBeta, mDecay, mS, mO):
        K, n, BV = self.K, self.n, self.BV
        tidx, _, _ = cute.arch.thread_idx()
        vt, hv, b = cute.arch.block_idx()
        col = vt * BV + tidx

        smem = cutlass.memory.SmemAllocator()
        sQ = smem.allocate_tensor(cutlass.Float32, cute.make_layout(K), 16)
        sK = smem.allocate_tensor(cutlass.Float32, cute.make_layout(n * K), 16)
        # the token's query and keys -> smem (BV threads, K elements per vector)
        for i in cutlass.range_constexpr((K + BV - 1) // BV):
            e = i * BV + tidx
            if e < K:
                sQ[e] = mQ[b, hv, e]
                for j in cutlass.range_constexpr(n):
                    sK[j * K + e] = mK[b, hv, j, e]

        # this thread's state column (coalesced across the warp), decayed once
        decay = mDecay[b, hv]
        s = [mS[b, hv, i, col] * decay for i in range(K)]
        cute.arch.sync_threads()

        for j in cutlass.range_constexpr(n):
            delta = mBeta[b, hv, j] * (mV[b, hv, j, col] - _dot(s, sK, j * K))
            s = [s[i] + sK[j * K + i] * delta for i in range(K)]

        mO[b, hv, col] = _dot(s, sQ, 0)
        _store_column(mS, b, hv, col, s)     # in place (S aliases the output)


_KERNELS = {}


def get_kernel(K: int, n: int, BV: int) -> StepSm90:
    key = (K, n, BV)
    if key not in _KERNELS:
        _KERNELS[key] = StepSm90(K, n, BV)
    return _KERNELS[key]
