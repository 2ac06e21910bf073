"""How fast can one SM pull bytes into shared memory? cp.async by every thread vs bulk copies.

s34's phase probes of the local-gradient kernel found its first phases (the loads of a
chunk's ~200 KB) as slow with 4 CTAs on an idle GPU as in a full launch: ~13 bytes a cycle
an SM (benchmarks/results/CURRENT.md, s34). This measures the two ways in isolation, on one
CTA an SM (``KB`` of shared memory each, 256 threads):

    cpasync   every thread copies 16-byte pieces (cp.async.cg, as the kernels' ``g2s``),
              one commit group, waited for by every thread
    bulk      one thread issues cp.async.bulk copies of ``--piece-kb`` each (the TMA unit;
              no tensor map), completion counted by one mbarrier

Each CTA copies its own contiguous ``KB`` slice of a bf16 buffer and writes the SM cycles
from its first copy to the last byte landing. With ``--ctas 4`` nothing contends (the
per-SM rate); with many waves of 132 the HBM is shared (the rate a kernel sees). Prints per
mode and CTA count: median cycles a CTA, bytes a cycle an SM, and the launch's TB/s.

    python -m benchmarks.load_rate --kb 192 --ctas 4,132,16896   # GPU (sm_90)
"""

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from gdp_jax.kernels import binding

THREADS = 256
MODES = ("cpasync", "bulk")


@functools.lru_cache(maxsize=None)
def _kernel_class():
    binding.import_cutlass()
    import cutlass
    import cutlass.cute as cute
    import cutlass.memory
    from cutlass.cute.nvgpu import cpasync

    F32 = cutlass.Float32

    class LoadRateSm90:
        """One CTA copies row ``block`` of src [ctas, N] (bf16) into smem; out[block] =
        (cycles, one element it read back)."""

        def __init__(self, mode: str, n: int, piece: int):
            assert mode in MODES and n % (8 * THREADS) == 0 and n % piece == 0
            self.mode, self.n, self.piece = mode, n, piece

        @cute.jit
        def __call__(self, stream, mSrc, mOut):
            n = self.n

            @cute.struct
            class Storage:
                buf: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, n], 1024]
                mbar: cute.struct.Align[cute.struct.MemRange[cutlass.Int64, 1], 8]

            self.kernel(mSrc, mOut, Storage).launch(grid=(mSrc.shape[0], 1, 1),
                                                    block=[THREADS, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, mSrc, mOut, Storage: cutlass.Constexpr):
            n, piece = self.n, self.piece
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            st = cutlass.memory.SmemAllocator().allocate(Storage)
            sBuf = st.buf.get_tensor(cute.make_layout(n))
            g = mSrc[bidx, None]
            mbar = st.mbar.data_ptr()
            if cutlass.const_expr(self.mode == "bulk"):
                if tidx == 0:
                    cute.arch.mbarrier_init(mbar, 1)
                cute.arch.mbarrier_init_fence()
                cute.arch.sync_threads()
            t0 = cute.arch.clock()
            if cutlass.const_expr(self.mode == "cpasync"):
                atom = cute.make_copy_atom(
                    cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                    cutlass.BFloat16, num_bits_per_copy=128)
                for m in cutlass.range_constexpr(n // 8 // THREADS):
                    p = tidx + THREADS * m
                    cute.copy(atom, cute.local_tile(g, (8,), (p,)),
                              cute.local_tile(sBuf, (8,), (p,)))
                cute.arch.cp_async_commit_group()
                cute.arch.cp_async_wait_group(0)
            else:
                atom = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), cutlass.BFloat16,
                                           num_bits_per_copy=16 * piece)
                if tidx == 0:
                    cute.arch.mbarrier_arrive_and_expect_tx(mbar, 2 * n)
                    for m in cutlass.range_constexpr(n // piece):
                        cute.copy(atom, cute.local_tile(g, (piece,), (m,)),
                                  cute.local_tile(sBuf, (piece,), (m,)), mbar_ptr=mbar)
                cute.arch.mbarrier_wait(mbar, 0)
            cute.arch.sync_threads()
            t1 = cute.arch.clock()
            if tidx == 0:
                mOut[bidx, 0] = (t1 - t0).to(F32)
                mOut[bidx, 1] = sBuf[(bidx * 8) % n].to(F32)   # the copy is not dead

    return LoadRateSm90


@functools.lru_cache(maxsize=None)
def _get(mode: str, n: int, piece: int):
    return _kernel_class()(mode, n, piece)


@functools.lru_cache(maxsize=None)
def _launcher():
    binding.import_cutlass()
    import cutlass
    import cutlass.cute as cute

    @cute.jit
    def launch(stream, src, out, *, mode: cutlass.Constexpr, n: cutlass.Constexpr,
               piece: cutlass.Constexpr):
        _get(mode, n, piece)(stream, src, out)

    return launch


def copy_cycles(src, mode: str, piece_kb: int = 16):
    """src [ctas, N] bf16 -> [ctas, 2] float32: (SM cycles of CTA i's copy of row i into
    shared memory, one element of it)."""
    if src.ndim != 2 or src.dtype != jnp.bfloat16:
        raise ValueError(f"src: bf16 [ctas, N]; got {src.dtype} {src.shape}")
    if mode not in MODES:
        raise ValueError(f"mode: one of {MODES}; got {mode!r}")
    return binding.custom_call(_launcher, f"gdp_load_rate_{mode}",
                               binding.out((src.shape[0], 2), jnp.float32), (src,),
                               tile_dims=(1, 1), mode=mode, n=int(src.shape[1]),
                               piece=piece_kb * 512)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kb", type=int, default=192, help="KB a CTA copies (its smem)")
    p.add_argument("--ctas", default="4,132,16896")
    p.add_argument("--piece-kb", type=int, default=16, help="KB a bulk copy")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args(argv)
    n = a.kb * 512
    for ctas in (int(x) for x in a.ctas.split(",")):
        src = jax.random.normal(jax.random.key(0), (ctas, n), jnp.bfloat16)
        for mode in a.modes.split(","):
            f = jax.jit(functools.partial(copy_cycles, mode=mode, piece_kb=a.piece_kb))
            out = np.asarray(f(src))
            if not np.array_equal(out[:, 1], np.asarray(
                    src[np.arange(ctas), (np.arange(ctas) * 8) % n], np.float32)):
                raise SystemExit(f"{mode}: the copied element does not match its source")
            times = []
            for _ in range(a.iters):
                t = time.perf_counter()
                f(src).block_until_ready()
                times.append(time.perf_counter() - t)
            cyc = float(np.median(out[:, 0]))
            ms = 1e3 * float(np.median(times))
            print(f"{mode:8s} ctas={ctas:6d} {a.kb} KB a CTA: median {cyc:8.0f} cycles a CTA "
                  f"({2 * n / cyc:5.1f} B/cycle an SM); launch {ms:.3f} ms "
                  f"({ctas * 2 * n / ms / 1e9:.2f} TB/s)", flush=True)


if __name__ == "__main__":
    main()
