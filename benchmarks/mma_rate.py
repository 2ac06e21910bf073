"""What does warpgroup MMA (wgmma) buy the chunk kernels' products? SM cycles of one product.

The local-gradient kernel is latency-bound (docs/KERNELS.md): ~49K SM cycles a CTA where its
MMAs alone would take ~11K. Its products are warp MMAs (mma.sync m16n8k16) fed by ldmatrix,
8 warps, 4 along M x 2 along N (``sm90.warp_mma``). This times one product of the kernel's
shape in isolation, out = A B with A [64, Kd] (K-major, as the [C, C] factors) and B
[Kd, N] (N-major, as ddelta, k, q in dv = X^T ddelta, dqk k), 16-bit operands in shared
memory, float32 accumulators, 256 threads, by

    sync       the kernels' path: ldmatrix + mma.sync per k-block of 16 (``sm90`` helpers)
    wgmma      two warpgroups, each wgmma m64n(N/2)k16 with both operands read from shared
               memory (SS) through descriptors; the operand tiles are the kernels' own
               (``sm90.smem_layout``), seen through a pointer swizzle (``gmma_view``)
    wgmma_rs   the same with A from registers (RS; loaded before the clock starts), as
               the kernels' register-resident [C, C] factors would enter

``reps`` products accumulate into one accumulator between two clock reads (every thread
waits for all at a CTA barrier); out = reps A B checks the result against float32 numpy.
Prints per mode and reps: median cycles a CTA and per product, the result's error.

    python -m benchmarks.mma_rate --kd 64 --n 128 --reps 1,4 --ctas 132   # GPU (sm_90a)
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from gdp_jax.kernels import binding

M = 64               # rows of a product: the chunk length C
THREADS = 256        # 8 warps, as the local-gradient kernel
MODES = ("sync", "wgmma", "wgmma_rs")


@functools.lru_cache(maxsize=None)
def _kernel_class():
    binding.import_cutlass()
    import cutlass
    import cutlass.cute as cute
    import cutlass.memory
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

    from gdp_jax.kernels import sm90

    F32, AB = cutlass.Float32, cutlass.BFloat16

    def gmma_view(field, kind, shape, order):
        """The smem ``field`` (an ``sm90.smem_layout`` tile) as a wgmma operand tensor of
        ``shape``: the same bytes, the swizzle moved onto the pointer as wgmma's
        descriptors need (128-byte rows of 8 16-byte units, XORed with the row mod 8)."""
        lay = cute.tile_to_shape(warpgroup.make_smem_layout_atom(kind, AB), shape, order)
        return cute.make_tensor(cute.recast_ptr(field.data_ptr(), lay.inner, AB), lay.outer)

    class MmaRateSm90:
        """CTA i: out[i] = reps A[i] B[i] and cyc[i] = (SM cycles of the products, 0)."""

        def __init__(self, mode: str, kd: int, n: int, reps: int):
            assert mode in MODES and kd % 64 == 0 and n % 64 == 0
            self.mode, self.kd, self.n, self.reps = mode, kd, n, reps

        @cute.jit
        def __call__(self, stream, mA, mB, mOut, mCyc):
            kd, n = self.kd, self.n
            la, lb = sm90.smem_layout(M, kd), sm90.smem_layout(kd, n)

            @cute.struct
            class Storage:
                a: sm90.smem_tile(AB, la)
                b: sm90.smem_tile(AB, lb)

            if cutlass.const_expr(self.mode == "sync"):
                tiled = sm90.warp_mma(AB, warps_n=2)
            else:
                src = (warpgroup.OperandSource.RMEM if self.mode == "wgmma_rs"
                       else warpgroup.OperandSource.SMEM)
                tiled = sm90_utils.make_trivial_tiled_mma(
                    AB, AB, OperandMajorMode.K, OperandMajorMode.MN, F32, (1, 2, 1),
                    tiler_mn=(M, n // 2), a_source=src)
            self.kernel(mA, mB, mOut, mCyc, tiled, sm90.g2s_copy(AB, kd, THREADS),
                        sm90.g2s_copy(AB, n, THREADS), Storage).launch(
                grid=(mA.shape[0], 1, 1), block=[THREADS, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, mA, mB, mOut, mCyc, tiled, copy_a, copy_b,
                   Storage: cutlass.Constexpr):
            kd, n, reps = self.kd, self.n, self.reps
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            st = cutlass.memory.SmemAllocator().allocate(Storage)
            sA = st.a.get_tensor(sm90.smem_layout(M, kd))
            sB = st.b.get_tensor(sm90.smem_layout(kd, n))
            ga, gb = sm90.g2s(copy_a, tidx), sm90.g2s(copy_b, tidx)
            ga.load(mA[bidx, None, None], (M, kd), ga.dest(sA))
            gb.load(mB[bidx, None, None], (kd, n), gb.dest(sB))
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
            thr = tiled.get_slice(tidx)
            acc = sm90.make_acc(thr, (M, n))
            k_blocks = kd // sm90.MMA_K
            if cutlass.const_expr(self.mode == "sync"):
                cA, _, cBt = sm90.ldmatrix_copies(tiled, AB, tidx)
                a = sm90.operand(thr, cA, sA, True)
                b = sm90.operand(thr, cBt, sm90.transpose_view(sB, kd, n), False)
                acc.fill(0.0)
                cute.arch.sync_threads()
                t0 = cute.arch.clock()
                for _ in cutlass.range_constexpr(reps):
                    for kb in cutlass.range_constexpr(k_blocks):
                        a.load(kb)
                        b.load(kb)
                        cute.gemm(tiled, acc, a[kb], b[kb], acc)
                cute.arch.sync_threads()
                t1 = cute.arch.clock()
            else:
                wA = gmma_view(st.a, warpgroup.SmemLayoutAtomKind.K_SW128, (M, kd), (0, 1))
                wB = gmma_view(st.b, warpgroup.SmemLayoutAtomKind.MN_SW128, (n, kd), (1, 0))
                tB = tiled.make_fragment_B(thr.partition_B(wB))
                if cutlass.const_expr(self.mode == "wgmma_rs"):
                    tA = tiled.make_fragment_A(thr.partition_shape_A((M, kd)))
                    # element by element through the layout-swizzled view, as the
                    # local-gradient kernel fills its register A operands (s38-1 read the
                    # pointer-swizzled view, s39-1 vector copies of the swizzled one: both
                    # wrong on the GPU, max rel error ~0.9)
                    src = thr.partition_A(sA)
                    for e in cutlass.range_constexpr(cute.size(tA)):
                        tA[e] = src[e]
                else:
                    tA = tiled.make_fragment_A(thr.partition_A(wA))
                # cp.async wrote the tiles through the generic proxy; wgmma reads them
                # through the async one
                cute.arch.fence_view_async_shared()
                cute.arch.sync_threads()
                t0 = cute.arch.clock()
                tiled.set(warpgroup.Field.ACCUMULATE, False)
                warpgroup.fence()
                for _ in cutlass.range_constexpr(reps):
                    for kb in cutlass.range_constexpr(k_blocks):
                        cute.gemm(tiled, acc, tA[None, None, kb], tB[None, None, kb], acc)
                        tiled.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                cute.arch.sync_threads()
                t1 = cute.arch.clock()
            sm90.c_tile(thr, mOut[bidx, None, None], (M, n), (0, 0)).store(acc.load())
            if tidx == 0:
                mCyc[bidx, 0] = (t1 - t0).to(F32)
                mCyc[bidx, 1] = F32(0.0)

    return MmaRateSm90


@functools.lru_cache(maxsize=None)
def _get(mode: str, kd: int, n: int, reps: int):
    return _kernel_class()(mode, kd, n, reps)


@functools.lru_cache(maxsize=None)
def _launcher():
    binding.import_cutlass()
    import cutlass
    import cutlass.cute as cute

    @cute.jit
    def launch(stream, a, b, out, cyc, *, mode: cutlass.Constexpr, kd: cutlass.Constexpr,
               n: cutlass.Constexpr, reps: cutlass.Constexpr):
        _get(mode, kd, n, reps)(stream, a, b, out, cyc)

    return launch


def product_cycles(a, b, mode: str, reps: int = 1):
    """a [ctas, 64, Kd], b [ctas, Kd, N] bf16 -> (out [ctas, 64, N] float32 = reps a b,
    cyc [ctas, 2] float32: SM cycles of CTA i's products, 0)."""
    if a.ndim != 3 or a.shape[1] != M or a.dtype != jnp.bfloat16:
        raise ValueError(f"a: bf16 [ctas, {M}, Kd]; got {a.dtype} {a.shape}")
    if b.ndim != 3 or b.shape[:2] != (a.shape[0], a.shape[2]) or b.dtype != jnp.bfloat16:
        raise ValueError(f"b: bf16 [{a.shape[0]}, {a.shape[2]}, N]; got {b.dtype} {b.shape}")
    if mode not in MODES:
        raise ValueError(f"mode: one of {MODES}; got {mode!r}")
    ctas, kd, n = a.shape[0], a.shape[2], b.shape[2]
    return binding.custom_call(
        _launcher, f"gdp_mma_rate_{mode}",
        (binding.out((ctas, M, n), jnp.float32), binding.out((ctas, 2), jnp.float32)),
        (a, b), tile_dims=(2, 2, 2, 1), mode=mode, kd=int(kd), n=int(n), reps=int(reps))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kd", type=int, default=64, help="the products' inner extent")
    p.add_argument("--n", type=int, default=128, help="columns of the result")
    p.add_argument("--reps", default="1,4", help="products between the clock reads")
    p.add_argument("--ctas", type=int, default=132)
    p.add_argument("--modes", default=",".join(MODES))
    a = p.parse_args(argv)
    ka, kb = jax.random.split(jax.random.key(0))
    A = jax.random.normal(ka, (a.ctas, M, a.kd), jnp.bfloat16)
    B = jax.random.normal(kb, (a.ctas, a.kd, a.n), jnp.bfloat16)
    want = np.einsum("cmk,ckn->cmn", np.asarray(A, np.float32), np.asarray(B, np.float32))
    flops = 2 * M * a.kd * a.n
    for reps in (int(r) for r in a.reps.split(",")):
        for mode in a.modes.split(","):
            f = jax.jit(functools.partial(product_cycles, mode=mode, reps=reps))
            out, cyc = (np.asarray(x) for x in f(A, B))
            err = float(np.max(np.abs(out - reps * want)) / (reps * np.max(np.abs(want))))
            c = float(np.median(cyc[:, 0]))
            print(f"{mode:8s} Kd={a.kd} N={a.n} reps={reps}: median {c:7.0f} cycles a CTA, "
                  f"{c / reps:6.0f} a product ({flops * reps / c:6.0f} FLOP/cycle an SM); "
                  f"max rel error {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
