"""Compile every CuTe DSL kernel for sm_90a on a host without a GPU (CPU CI).

Lowering for "cuda" runs the whole CuTe DSL pipeline (trace -> MLIR -> PTX -> sm_90a
cubin -> host launcher object) and embeds the object in the HLO; nothing executes.
Needs ``nvidia-cutlass-dsl[cu13]==4.8.1`` (Python >= 3.11, x86-64); the module is skipped
only when that package cannot be imported.
"""
import os
import re

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")   # must precede `import cutlass`

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (the 'kernels' extra; "
                                       "its wheels exist for Linux x86-64 only)")

from gdp_jax import _checks, grid, ops  # noqa: E402
from gdp_jax.kernels import chunk_prep, wy_inverse  # noqa: E402
from gdp_jax.kernels.chunk_forward import ChunkForwardKernel  # noqa: E402
from gdp_jax.kernels.chunk_prep import ChunkPrepKernel  # noqa: E402
from gdp_jax.kernels.pipeline import CUTEDSL, CuTeDSLEngine  # noqa: E402
from gdp_jax.kernels.state_grad import StateGradKernel  # noqa: E402
from gdp_jax.kernels.step import StepKernel  # noqa: E402

S = jax.ShapeDtypeStruct
CUDA = ("cuda",)


@pytest.fixture(autouse=True)
def _compile_here(monkeypatch, tmp_path):
    """Compile every kernel in this process: prebuilt objects in the checkout
    (ffi/build/kernels) must not stand in for the compile under test."""
    from gdp_jax.kernels import aot
    monkeypatch.setenv(aot.ENV_DIR, str(tmp_path / "no-prebuilt"))
    aot._stores.clear()


@pytest.fixture
def prebuilt(every_kernel_variant, monkeypatch):
    """The op-level lowerings below check the XLA glue around the kernels: they lower on
    the shape-generic objects of the session's full build (tests/conftest.py; checked by
    test_aot.py::test_build_every_variant) instead of compiling every kernel again per
    shape (each of these tests compiled 3-6 kernels, 20-40 s). The per-shape ("static")
    compile of every kernel stays covered by the kernel-level tests above and by
    test_cutedsl_op_forward_and_grad_lower[static]. Variants the build does not list
    (checkpoints of recompute_chunk_num = 1) compile here, shape-generic."""
    from gdp_jax.kernels import aot
    out, r = every_kernel_variant
    assert r["returncode"] == 0, r["stdout"][-3000:] + r["stderr"][-3000:]
    monkeypatch.setenv(aot.ENV_DIR, str(out))
    monkeypatch.setenv("GDP_JAX_KERNEL_SHAPES", "generic")
    aot._stores.clear()
    jax.clear_caches()              # no trace of the other mode may stand in
    yield out
    aot._stores.clear()
    jax.clear_caches()


def _lower(fn, *avals):
    return jax.jit(fn).trace(*avals).lower(lowering_platforms=CUDA).as_text()


def test_arch_is_sm90a():
    # A CPU-only host silently builds for sm_100a unless CUTE_DSL_ARCH is set first.
    from cutlass.cutlass_dsl.cutlass import CuTeDSL
    assert CuTeDSL._get_dsl().envar.arch == "sm_90a"


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("K,V,BV", [(128, 128, 64), (64, 64, 32), (64, 128, 32), (128, 64, 64),
                                    (128, 128, 16)])               # NARROW_TILES
def test_chunk_kernel_compiles(dtype, K, V, BV, split):
    B, NC, HV, C, N = 2, 3, 4, grid.CHUNK, 2
    avals = (S((B, NC, HV, C, K), dtype), S((B, NC, HV, C, K), dtype),
             S((B, NC, HV, C, K), dtype), S((B, NC, HV, C, C), dtype),
             S((B, NC, HV, C, V), jnp.float32), S((B, NC, HV), jnp.float32),
             S((B, NC), jnp.int32), S((B, NC), jnp.int32), S((B, NC), jnp.int32),
             S((N, HV, K, V), jnp.float32))
    txt = _lower(lambda *a: ChunkForwardKernel.call(*a, BV=BV, split=split), *avals)
    assert "CuteDSLRT_NvJaxCutlassCall" in txt


@pytest.mark.parametrize("ckpt", [1, 3])
def test_chunk_kernel_with_checkpoints_compiles(ckpt):
    B, NC, HV, C, N, K, V = 1, 4, 2, grid.CHUNK, 1, 128, 128
    dtype = jnp.bfloat16
    avals = (S((B, NC, HV, C, K), dtype),) * 3 + (
        S((B, NC, HV, C, C), dtype), S((B, NC, HV, C, V), jnp.float32),
        S((B, NC, HV), jnp.float32)) + (S((B, NC), jnp.int32),) * 3 + (
        S((N, HV, K, V), jnp.float32),)
    out = jax.eval_shape(lambda *a: ChunkForwardKernel.call(*a, BV=32, ckpt=ckpt), *avals)
    assert out[2].shape == (B, -(-NC // ckpt), HV, K, V)
    txt = _lower(lambda *a: ChunkForwardKernel.call(*a, BV=32, ckpt=ckpt), *avals)
    assert "CuteDSLRT_NvJaxCutlassCall" in txt


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("K,V,BV", [(128, 128, 32), (64, 128, 64), (128, 128, 16)])
def test_summary_walk_kernel_compiles(K, V, BV, split):
    """The CP summary walk (``readout=False``, the CP prepare's pass): V + K
    state columns, u on the first V only, no output rows (o a [1] placeholder) and no
    checkpoints - only the final states."""
    B, NC, HV, C, N = 2, 3, 4, grid.CHUNK, 2
    dtype = jnp.bfloat16
    avals = (S((B, NC, HV, C, K), dtype),) * 3 + (
        S((B, NC, HV, C, C), dtype), S((B, NC, HV, C, V), jnp.float32),
        S((B, NC, HV), jnp.float32)) + (S((B, NC), jnp.int32),) * 3 + (
        S((N, HV, K, V + K), jnp.float32),)
    walk = lambda *a: ChunkForwardKernel.call(*a, BV=BV, split=split, readout=False)
    o, final, states = jax.eval_shape(walk, *avals)
    assert o.shape == (1,) and states.shape == (1,) and final.shape == (N, HV, K, V + K)
    assert "CuteDSLRT_NvJaxCutlassCall" in _lower(walk, *avals)


@pytest.mark.parametrize("BV,split,readout,ckpt,dtype", [
    (16, False, True, 0, jnp.bfloat16), (32, True, True, 3, jnp.bfloat16),
    (16, False, False, 0, jnp.float16), (32, False, True, 1, jnp.float16)])
def test_pipelined_walk_compiles(BV, split, readout, ckpt, dtype):
    """The forward walk with its operands one chunk ahead (``stages=2``): the plain walk,
    with checkpoints, and the CP summary walk (V + K columns, u on the first V)."""
    B, NC, HV, C, N, K, V = 2, 3, 4, grid.CHUNK, 2, 128, 128
    Vs = V if readout else V + K
    avals = (S((B, NC, HV, C, K), dtype),) * 3 + (
        S((B, NC, HV, C, C), dtype), S((B, NC, HV, C, V), jnp.float32),
        S((B, NC, HV), jnp.float32)) + (S((B, NC), jnp.int32),) * 3 + (
        S((N, HV, K, Vs), jnp.float32),)
    walk = lambda *a: ChunkForwardKernel.raw_call(*a, BV=BV, split=split, readout=readout,
                                                  ckpt=ckpt, stages=2)
    assert "CuteDSLRT_NvJaxCutlassCall" in _lower(walk, *avals)


def _reverse_walk_avals(fused, extra, rows=grid.CHUNK):
    """StateGradKernel.raw_call's operands (bf16, B, NC, HV = 2, 3, 4, K = V = 128, two
    sequences): Kt, w [.., C, K]; qg [.., rows, K]; P [.., rows, C] (``fused``) or
    ddo [.., C, V] float32; dO [.., rows, V]; decay; reset, seq, last; dfinal with
    ``extra`` state columns (the CP summary walk)."""
    B, NC, HV, C, N, K, V = 2, 3, 4, grid.CHUNK, 2, 128, 128
    dt = jnp.bfloat16
    ddo = S((B, NC, HV, rows, C), dt) if fused else S((B, NC, HV, C, V), jnp.float32)
    return ((S((B, NC, HV, C, K), dt),) * 2 + (S((B, NC, HV, rows, K), dt), ddo,
            S((B, NC, HV, rows, V), dt), S((B, NC, HV), jnp.float32))
            + (S((B, NC), jnp.int32),) * 3 + (S((N, HV, K, V + extra), jnp.float32),))


@pytest.mark.parametrize("BV,split,fused,ds,extra", [
    (16, False, True, jnp.bfloat16, 0), (32, True, False, None, 0),
    (16, False, True, None, 128), (32, False, False, jnp.float32, 0)])
def test_pipelined_reverse_walk_compiles(BV, split, fused, ds, extra):
    """The reverse walk with its operands one chunk ahead (``stages=2``): dS_end written
    (16-bit or float32) or not (the start-state gradients alone), ddo read or formed from
    P, and the CP summary walk (``extra`` state columns, dO on the first V)."""
    avals = _reverse_walk_avals(fused, extra)
    walk = lambda *a: StateGradKernel.raw_call(*a, BV=BV, split=split, fuse_ddo=fused,
                                               ds_dtype=ds, write_ds=ds is not None,
                                               stages=2)
    assert "CuteDSLRT_NvJaxCutlassCall" in _lower(walk, *avals)


@pytest.mark.parametrize("BV,fused,ds,extra", [
    (64, True, jnp.bfloat16, 0), (32, False, jnp.float32, 0), (16, True, None, 128)])
def test_pair_tiles_reverse_walk_compiles(BV, fused, ds, extra):
    """The reverse walk with two value tiles a CTA (``chunk_forward.PAIR_TILES``): dS_end
    written or not, ddo read or formed from P, the CP summary walk."""
    avals = _reverse_walk_avals(fused, extra)
    walk = lambda *a: StateGradKernel.raw_call(*a, BV=BV, fuse_ddo=fused, ds_dtype=ds,
                                               write_ds=ds is not None, pairs=2)
    assert "CuteDSLRT_NvJaxCutlassCall" in _lower(walk, *avals)
    with pytest.raises(ValueError, match="pairs=2: 1, or 2 for a one-set walk"):
        jax.eval_shape(lambda *a: StateGradKernel.raw_call(*a, BV=BV, fuse_ddo=fused,
                                                           pairs=2, stages=2), *avals)


def test_pair_tiles_only_for_one_set_walks_of_even_tiles(monkeypatch):
    """``PAIR_TILES``: two value tiles a CTA only for one-set walks (stages 1) of an even
    number of tiles; off by default; anything but a bool refused."""
    from gdp_jax.kernels import chunk_forward
    pick = chunk_forward.ChunkForwardKernel.pick_pairs
    assert chunk_forward.PAIR_TILES is False and pick(128, 64, 1) == 1
    monkeypatch.setattr(chunk_forward, "PAIR_TILES", True)
    assert pick(128, 64, 1) == 2 and pick(128, 32, 1) == 2 and pick(256, 64, 1) == 2
    assert pick(128, 128, 1) == 1 and pick(64, 64, 1) == 1 and pick(128, 32, 2) == 1
    monkeypatch.setattr(chunk_forward, "PAIR_TILES", "auto")
    with pytest.raises(ValueError, match="PAIR_TILES='auto'"):
        pick(128, 64, 1)


@pytest.mark.parametrize("BV,fused,extra", [(64, True, 0), (32, False, 0), (16, True, 128)])
def test_readout_rows_reverse_walk_compiles(BV, fused, extra):
    """The reverse walk on the read-out rows (``pipeline.READOUT_ONLY_BWD``): qg, P, dO
    with grid.READOUT_ROWS rows; ddo read or formed from P; the CP summary walk (dO on
    the first V columns); refused with two operand sets or two tiles a CTA."""
    avals = _reverse_walk_avals(fused, extra, rows=grid.READOUT_ROWS)
    walk = lambda *a: StateGradKernel.raw_call(*a, BV=BV, fuse_ddo=fused,
                                               ds_dtype=jnp.bfloat16)
    assert "CuteDSLRT_NvJaxCutlassCall" in _lower(walk, *avals)
    with pytest.raises(ValueError, match="one operand set and one value tile"):
        jax.eval_shape(lambda *a: StateGradKernel.raw_call(*a, BV=BV, fuse_ddo=fused,
                                                           stages=2), *avals)
    do = avals[4]                               # dO on all C rows, qg on the read-out ones
    bad = avals[:4] + (S(do.shape[:-2] + (grid.CHUNK, do.shape[-1]), do.dtype),) + avals[5:]
    with pytest.raises(ValueError, match="the same for both"):
        jax.eval_shape(lambda *a: StateGradKernel.raw_call(*a, BV=BV, fuse_ddo=fused), *bad)


def test_pipelined_walk_only_where_one_cta_an_sm(monkeypatch):
    """``PIPELINE="auto"``: two operand sets (twice the shared memory) only for launches of
    at most SMS CTAs and value tiles <= 32; True: every tile <= 32; False (the default
    until measured on a GPU): never. The prebuilt variants hold both stage counts of the
    16- and 32-wide tiles where "auto" is set, only one set of tiles by default."""
    from gdp_jax.kernels import chunk_forward
    pick, SMS = ChunkForwardKernel.pick_stages, ChunkForwardKernel.SMS
    assert chunk_forward.PIPELINE is False and pick(1, 16, 128, 16) == 1
    assert not any("stages=2" in v.what for v in ChunkForwardKernel.variants())
    monkeypatch.setattr(chunk_forward, "PIPELINE", "auto")
    assert pick(1, 16, 128, 16) == 2                 # (1, T, 16, n): 128 CTAs
    assert pick(1, SMS, 16, 16) == 2 and pick(1, SMS + 1, 16, 16) == 1
    assert pick(4, 16, 128, 32) == 1                 # 256 CTAs: two an SM pay more
    assert pick(1, 1, 128, 64) == 1                  # BV = 64: registers full
    monkeypatch.setattr(chunk_forward, "PIPELINE", True)
    assert pick(64, 16, 128, 32) == 2 and pick(1, 1, 128, 64) == 1
    monkeypatch.setattr(chunk_forward, "PIPELINE", False)
    assert pick(1, 16, 128, 16) == 1
    monkeypatch.setattr(chunk_forward, "PIPELINE", "yes")
    with pytest.raises(ValueError, match="PIPELINE"):
        pick(1, 16, 128, 16)
    monkeypatch.setattr(chunk_forward, "PIPELINE", "auto")
    for kernel in (ChunkForwardKernel, StateGradKernel):
        names = [v.what for v in kernel.variants()]
        for BV in (16, 32):
            assert any(n.endswith(f" BV={BV} stages=2") for n in names), kernel
            assert any(n.endswith(f" BV={BV}") for n in names), kernel
        assert not any(n.endswith(" BV=64 stages=2") for n in names), kernel


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("K,V,BV", [(128, 128, 32), (64, 64, 32), (64, 128, 64), (128, 64, 32),
                                    (64, 128, 16)])                # NARROW_TILES
def test_dh_kernel_compiles(dtype, K, V, BV, split):
    B, NC, HV, C, N = 2, 3, 4, grid.CHUNK, 2
    avals = ((S((B, NC, HV, C, K), dtype),) * 3
             + (S((B, NC, HV, C, V), jnp.float32), S((B, NC, HV, C, V), dtype),
                S((B, NC, HV), jnp.float32)) + (S((B, NC), jnp.int32),) * 3
             + (S((N, HV, K, V), jnp.float32),))
    # dS_end in float32 (split: the CP summary's) or 16-bit (the local-gradient kernel's)
    ds = jnp.float32 if split else dtype
    call = lambda *a: StateGradKernel.call(*a, BV=BV, split=split, ds_dtype=ds)
    assert jax.eval_shape(call, *avals)[0].dtype == jnp.dtype(ds)
    assert "CuteDSLRT_NvJaxCutlassCall" in _lower(call, *avals)
    with pytest.raises(ValueError, match="ds_dtype: float32 or the operands'"):
        StateGradKernel.raw_call(*(jnp.zeros(a.shape, a.dtype) for a in avals), BV=BV,
                                 ds_dtype=jnp.float64)
    # ddo = P^T dO in the kernel (pipeline.FUSED_DDO): P [.., C, C] 16-bit in ddo's place
    pav = avals[:3] + (S((B, NC, HV, C, C), dtype),) + avals[4:]
    fused = lambda *a: StateGradKernel.call(*a, BV=BV, split=split, ds_dtype=ds,
                                            fuse_ddo=True)
    assert "CuteDSLRT_NvJaxCutlassCall" in _lower(fused, *pav)
    with pytest.raises(ValueError, match=r"^P: expected .* \(2, 3, 4, 64, 64\); got float32"):
        jax.eval_shape(fused, *avals)


@pytest.mark.parametrize("shape", [(3, 64, 64), (2, 5, 3, 64, 64)])
def test_inverse_kernel_compiles(shape):
    """The WY inverse kernel (odd matrix counts: a tail CTA), its vjp and a vmap of it."""
    txt = _lower(wy_inverse.unit_lower_inverse, S(shape, jnp.float32))
    assert "CuteDSLRT_NvJaxCutlassCall" in txt
    grad = lambda A: jax.grad(lambda a: jnp.sum(wy_inverse.unit_lower_inverse(a) ** 2))(A)
    assert "CuteDSLRT_NvJaxCutlassCall" in _lower(grad, S(shape, jnp.float32))
    # the vmap over the leading axis: the kernel sees the same matrices (so the per-shape
    # compile of the plain call serves it; another count would only compile it again)
    vm = _lower(jax.vmap(wy_inverse.unit_lower_inverse), S(shape, jnp.float32))
    assert "CuteDSLRT_NvJaxCutlassCall" in vm


@pytest.mark.parametrize("BV,K,V,dtype,R,ckpt,readout,u_cols",
                         [(64, 128, 128, jnp.bfloat16, grid.CHUNK, 0, True, 0),
                          (32, 64, 128, jnp.float16, grid.CHUNK, 2, True, 0),
                          (16, 128, 64, jnp.bfloat16, grid.READOUT_ROWS, 0, True, 0),
                          (64, 128, 256, jnp.bfloat16, grid.CHUNK, 0, False, 128)])
def test_pair_tiles_walk_compiles(BV, K, V, dtype, R, ckpt, readout, u_cols):
    """The forward walk with two value tiles a CTA (``chunk_forward.PAIR_TILES``): all rows
    or the read-out rows, checkpoints, the CP summary walk (u on the first columns)."""
    B, NC, HV, C, N = 2, 3, 4, grid.CHUNK, 2
    avals = (S((B, NC, HV, C, K), dtype),) * 2 + (
        S((B, NC, HV, R, K), dtype), S((B, NC, HV, R, C), dtype),
        S((B, NC, HV, C, u_cols or V), jnp.float32), S((B, NC, HV), jnp.float32)) + (
        S((B, NC), jnp.int32),) * 3 + (S((N, HV, K, V), jnp.float32),)
    walk = lambda *a: ChunkForwardKernel.raw_call(*a, BV=BV, ckpt=ckpt, readout=readout,
                                                  pairs=2)
    o, final, states = jax.eval_shape(walk, *avals)
    assert final.shape == (N, HV, K, V)
    assert o.shape == ((B, NC, HV, R, V) if readout else (1,))
    assert "CuteDSLRT_NvJaxCutlassCall" in _lower(walk, *avals)
    with pytest.raises(ValueError, match="pairs=2: 1, or 2 for a one-set walk"):
        jax.eval_shape(lambda *a: ChunkForwardKernel.raw_call(*a, BV=V, pairs=2), *avals)


@pytest.mark.parametrize("BV,K,V,dtype,stages", [(64, 128, 128, jnp.bfloat16, 1),
                                                  (32, 64, 128, jnp.float16, 1),
                                                  (16, 128, 64, jnp.bfloat16, 1),
                                                  (16, 128, 128, jnp.bfloat16, 2),
                                                  (32, 64, 64, jnp.float16, 2)])
def test_readout_rows_walk_compiles(BV, K, V, dtype, stages):
    """The forward walk on the read-out rows (``pipeline.READOUT_ONLY``): qg, p with
    grid.READOUT_ROWS rows, o with as many; its 2 x 2-warp products at every value tile
    (a warp's 8 columns at BV = 16 take ldmatrix x2), with one or two operand sets."""
    B, NC, HV, C, N, R = 2, 3, 4, grid.CHUNK, 2, grid.READOUT_ROWS
    avals = (S((B, NC, HV, C, K), dtype),) * 2 + (
        S((B, NC, HV, R, K), dtype), S((B, NC, HV, R, C), dtype),
        S((B, NC, HV, C, V), jnp.float32), S((B, NC, HV), jnp.float32)) + (
        S((B, NC), jnp.int32),) * 3 + (S((N, HV, K, V), jnp.float32),)
    walk = lambda *a: ChunkForwardKernel.raw_call(*a, BV=BV, stages=stages)
    o, final, _ = jax.eval_shape(walk, *avals)
    assert o.shape == (B, NC, HV, R, V) and final.shape == (N, HV, K, V)
    assert "CuteDSLRT_NvJaxCutlassCall" in _lower(walk, *avals)
    # with checkpoints (the differentiated forward, pipeline.READOUT_ONLY_GRAD)
    walk = lambda *a: ChunkForwardKernel.raw_call(*a, BV=BV, stages=stages, ckpt=2,
                                                  states_dtype=dtype)
    o, final, states = jax.eval_shape(walk, *avals)
    assert o.shape == (B, NC, HV, R, V) and states.shape == (B, 2, HV, K, V)
    assert "CuteDSLRT_NvJaxCutlassCall" in _lower(walk, *avals)
    bad = avals[:2] + (S((B, NC, HV, 48, K), dtype), S((B, NC, HV, 48, C), dtype)) + avals[4:]
    with pytest.raises(ValueError, match="or 32 read-out rows"):
        jax.eval_shape(lambda *a: ChunkForwardKernel.raw_call(*a, BV=BV), *bad)


@pytest.mark.parametrize("dtype,K,V", [(jnp.bfloat16, 128, 128), (jnp.float16, 64, 128)])
def test_chunk_major_readout_rows_operands_kernel_compiles(dtype, K, V):
    """The chunk-major operands kernel (the differentiated forward's,
    ``pipeline.READOUT_ONLY_GRAD``) reading q's read-out rows compact and writing qg, p
    on them; its argument checks."""
    B, NC, HV, C, R = 2, 3, 2, grid.CHUNK, grid.READOUT_ROWS
    f32, i32 = jnp.float32, jnp.int32
    avals = (S((B, NC, HV, R, K), f32), S((B, NC, HV, C, K), f32), S((B, NC, HV, C, V), f32),
             S((B, NC, HV, C), f32), S((B, NC, HV, C), f32), S((B,), f32), S((B, NC, 4), i32))
    f = lambda *a: ChunkPrepKernel.raw_call(*a, ab_dtype=dtype, readout_rows=True)
    w, kt, qg, p, u, decay, bad, _ = jax.eval_shape(f, *avals)
    assert w.shape == kt.shape == (B, NC, HV, C, K) and u.shape == (B, NC, HV, C, V)
    assert qg.shape == (B, NC, HV, R, K) and p.shape == (B, NC, HV, R, C)
    assert "CuteDSLRT_NvJaxCutlassCall" in _lower(f, *avals)
    full_q = (S((B, NC, HV, C, K), f32),) + avals[1:]
    with pytest.raises(ValueError, match="q: the read-out rows"):
        jax.eval_shape(f, *full_q)
    with pytest.raises(ValueError, match="rows: int32"):
        jax.eval_shape(f, *avals[:6])
    with pytest.raises(ValueError, match="rows: only with readout_rows"):
        jax.eval_shape(lambda *a: ChunkPrepKernel.raw_call(*a, ab_dtype=dtype), *full_q)
    # with X (the backward's, pipeline.READOUT_ONLY_BWD)
    fx = lambda *a: ChunkPrepKernel.raw_call(*a, ab_dtype=dtype, readout_rows=True,
                                             inverse=True)
    *_, X = jax.eval_shape(fx, *avals)
    assert X.shape == (B, NC, HV, C, C)
    assert "CuteDSLRT_NvJaxCutlassCall" in _lower(fx, *avals)


@pytest.mark.parametrize("dtype,K,V,l2norm", [(jnp.bfloat16, 128, 128, True),
                                              (jnp.float16, 64, 64, False)])
def test_readout_rows_operands_kernel_compiles(dtype, K, V, l2norm):
    """The token-major operands kernel writing qg, p on the read-out rows only, and its
    probe variant."""
    B, T, n, H, HV, NC, C, R = 1, 100, 2, 1, 2, 4, grid.CHUNK, grid.READOUT_ROWS
    f32, i32 = jnp.float32, jnp.int32
    avals = (S((B, T, H, K), dtype), S((B, n * T, H, K), dtype), S((B, n * T, HV, V), dtype),
             S((B, NC, HV, C), f32), S((B, NC, HV, C), f32), S((B,), f32),
             S((B, NC, 4), i32))
    f = lambda *a: ChunkPrepKernel.raw_call_tokens(*a, ab_dtype=dtype, l2norm=l2norm,
                                                   readout_rows=True)
    w, kt, qg, p, u, decay, bad, _ = jax.eval_shape(f, *avals)
    assert w.shape == kt.shape == (B, NC, HV, C, K) and u.shape == (B, NC, HV, C, V)
    assert qg.shape == (B, NC, HV, R, K) and p.shape == (B, NC, HV, R, C)
    assert bad.shape == (B, NC, HV, C)
    assert "CuteDSLRT_NvJaxCutlassCall" in _lower(f, *avals)
    # its probe variant (benchmarks/prep_probe.py: the phases' SM cycles in bad[..., :7])
    fp = lambda *a: ChunkPrepKernel.raw_call_tokens(*a, ab_dtype=dtype, l2norm=l2norm,
                                                    readout_rows=True, probe=True)
    assert [x.shape for x in jax.eval_shape(fp, *avals)] == [
        x.shape for x in (w, kt, qg, p, u, decay, bad, _)]
    assert "CuteDSLRT_NvJaxCutlassCall" in _lower(fp, *avals)


def test_readout_rows_operands_kernel_with_inverse_compiles():
    """The backward's token-major operands kernel (TOKEN_BACKWARD) with X and qg, p on the
    read-out rows (READOUT_ONLY_BWD)."""
    B, T, n, H, HV, NC, C, R, K, V = 1, 100, 3, 1, 3, 5, grid.CHUNK, grid.READOUT_ROWS, 64, 128
    f32, i32, ab = jnp.float32, jnp.int32, jnp.bfloat16
    avals = (S((B, T, H, K), ab), S((B, n * T, H, K), ab), S((B, n * T, HV, V), ab),
             S((B, NC, HV, C), f32), S((B, NC, HV, C), f32), S((B,), f32),
             S((B, NC, 4), i32))
    f = lambda *a: ChunkPrepKernel.raw_call_tokens(*a, ab_dtype=ab, l2norm=False,
                                                   readout_rows=True, inverse=True)
    w, kt, qg, p, u, decay, bad, X = jax.eval_shape(f, *avals)
    assert qg.shape == (B, NC, HV, R, K) and p.shape == (B, NC, HV, R, C)
    assert X.shape == (B, NC, HV, C, C) and u.shape == (B, NC, HV, C, V)
    assert "CuteDSLRT_NvJaxCutlassCall" in _lower(f, *avals)


def _chunk_avals(B, NC, HV, K, V, dtype=jnp.float32):
    C = grid.CHUNK
    return grid.ChunkInputs(S((B, NC, HV, C, K), dtype), S((B, NC, HV, C, K), dtype),
                            S((B, NC, HV, C, V), dtype), S((B, NC, HV, C), dtype),
                            S((B, NC, HV, C), dtype))


@pytest.mark.parametrize("dtype,K,V,inverse", [(jnp.bfloat16, 128, 128, False),
                                               (jnp.float16, 64, 64, False),
                                               (jnp.bfloat16, 64, 128, True),
                                               (jnp.float16, 128, 64, True)])
def test_chunk_prep_kernel_compiles(dtype, K, V, inverse):
    """The forward-operands kernel: outputs typed as the forward kernel's operands (and,
    for the backward, X = (I + A)^-1 in float32)."""
    B, NC, HV, C = 2, 3, 4, grid.CHUNK
    f = lambda c: ChunkPrepKernel.call(c, scale=K ** -0.5, ab_dtype=dtype, inverse=inverse)
    ch = _chunk_avals(B, NC, HV, K, V)
    out = jax.eval_shape(f, ch)
    assert len(out) == (3 if inverse else 2)
    (w, kt, qg, p, u, decay), bad = out[:2]
    if inverse:
        assert (out[2].shape, out[2].dtype) == ((B, NC, HV, C, C), jnp.float32)
    for x in (w, kt, qg):
        assert (x.shape, x.dtype) == ((B, NC, HV, C, K), jnp.dtype(dtype))
    assert (p.shape, p.dtype) == ((B, NC, HV, C, C), jnp.dtype(dtype))
    # u: bfloat16 with bfloat16 operands (chunk_prep.U16 True; the chunk-major call is not
    # the plain forward's token-major one "forward" means), float32 with float16 ones
    u_dt = jnp.bfloat16 if chunk_prep.U16 is True and dtype == jnp.bfloat16 else jnp.float32
    assert (u.shape, u.dtype) == ((B, NC, HV, C, V), jnp.dtype(u_dt))
    assert (decay.shape, bad.shape, bad.dtype) == ((B, NC, HV), (B, NC, HV, C), jnp.bool_)
    assert "CuteDSLRT_NvJaxCutlassCall" in _lower(f, ch)


def test_chunk_prep_kernel_vmap_lowers_and_limits():
    f = lambda c: ChunkPrepKernel.call(c, scale=0.1, ab_dtype=jnp.bfloat16)
    ch = _chunk_avals(1, 2, 2, 64, 64)
    batched = grid.ChunkInputs(*(S((3,) + a.shape, a.dtype) for a in ch))
    out = jax.eval_shape(jax.vmap(f), batched)
    assert out[0][0].shape == (3, 1, 2, 2, grid.CHUNK, 64)
    assert "CuteDSLRT_NvJaxCutlassCall" in _lower(jax.vmap(f), batched)
    ok = dict(ab_dtype=jnp.bfloat16, cdt=jnp.float32, K=128, V=64, rows=1, NC=4, HV=2)
    assert ChunkPrepKernel.can_implement(**ok) is None
    assert "float32 chunk inputs" in ChunkPrepKernel.can_implement(**{**ok, "cdt": jnp.float64})
    assert "16-bit" in ChunkPrepKernel.can_implement(**{**ok, "ab_dtype": jnp.float32})
    assert "K, V in" in ChunkPrepKernel.can_implement(**{**ok, "V": 32})
    assert "32-bit" in ChunkPrepKernel.can_implement(**{**ok, "NC": 300000})
    with pytest.raises(ValueError, match="K, V in"):
        ChunkPrepKernel.raw_call(*(jnp.zeros(a.shape, a.dtype) for a in
                                   _chunk_avals(1, 1, 1, 32, 64)), jnp.ones((1,)),
                                 ab_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match=r"scale: one float32 per row, shape \(1,\)"):
        ChunkPrepKernel.raw_call(*(jnp.zeros(a.shape, a.dtype) for a in
                                   _chunk_avals(1, 1, 1, 64, 64)), jnp.ones((2,)),
                                 ab_dtype=jnp.bfloat16)


def test_inverse_kernel_rejects_other_shapes():
    with pytest.raises(ValueError, match="float32"):
        wy_inverse.WYInverseKernel.raw_call(jnp.zeros((2, 32, 32), jnp.float32))
    with pytest.raises(ValueError, match="float32"):
        wy_inverse.WYInverseKernel.raw_call(jnp.zeros((2, 64, 64), jnp.float64))


def _op_avals(B, T, n, H, HV, K, V, dtype):
    return (S((B, T, H, K), dtype), S((B, T, n, H, K), dtype), S((B, T, n, HV, V), dtype),
            S((B, T, HV), jnp.float32), S((B, T, n, HV), dtype), S((B, HV, K, V), jnp.float32))


@pytest.mark.parametrize("n,shapes", [(1, "static"), (3, "generic")])
def test_cutedsl_op_forward_and_grad_lower(n, shapes, request):
    """The whole cutedsl op (XLA parts + kernels) and its backward lower for cuda: the
    backward holds the forward kernel (with checkpoints) and the reverse dS kernel. Once
    with every kernel compiled for the shape (the default without prebuilt kernels), once
    on the prebuilt shape-generic objects."""
    if shapes == "generic":
        request.getfixturevalue("prebuilt")
    else:
        jax.clear_caches()
        from gdp_jax.kernels import binding
        assert binding.kernel_shapes() == "static"
    B, T, H, HV, K, V = 1, 100, 1, 2, 64, 64
    dtype = jnp.bfloat16
    avals = _op_avals(B, T, n, H, HV, K, V, dtype)
    spec = _checks.check_inputs(*[jnp.zeros(a.shape, a.dtype) for a in avals[:5]],
                                use_qk_l2norm=True)

    def f(q, k, v, g, beta, h0):
        o, final = ops._op(CUTEDSL, spec, q, k, v, g, beta, h0, None)
        return o, final

    txt = _lower(f, *avals)
    assert "CuteDSLRT_NvJaxCutlassCall" in txt

    def loss(q, k, v, g, beta, h0):
        o, final = f(q, k, v, g, beta, h0)
        return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(final)

    txt = _lower(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)), *avals)
    assert txt.count("CuteDSLRT_NvJaxCutlassCall") >= 2


def test_cutedsl_op_packed_lowers(prebuilt):
    B, T, n, H, HV, K, V = 1, 200, 2, 2, 4, 128, 128
    avals = _op_avals(B, T, n, H, HV, K, V, jnp.bfloat16)[:5] + (
        S((3, HV, K, V), jnp.float32), S((4,), jnp.int32))
    spec = _checks.check_inputs(*[jnp.zeros(a.shape, a.dtype) for a in avals[:5]],
                                cu_seqlens=jnp.array([0, 50, 50, 200], jnp.int32),
                                use_qk_l2norm=True)
    txt = _lower(lambda *a: ops._op(CUTEDSL, spec, *a), *avals)
    assert "CuteDSLRT_NvJaxCutlassCall" in txt


@pytest.mark.parametrize("K,V", [(128, 128), (64, 128), (128, 64)])
def test_cp_summary_kernels_lower(K, V, prebuilt):
    """The CP summaries run the forward / reverse kernels on V + K state columns."""
    B, T, n, HV = 1, 200, 2, 2
    layout = grid.make_layout(B, T, n, None)
    NC = layout.reset.shape[1]
    ch = grid.ChunkInputs(*(S((B, NC, HV, grid.CHUNK, d), jnp.float32)
                               for d in (K, K, V)),
                             S((B, NC, HV, grid.CHUNK), jnp.float32),
                             S((B, NC, HV, grid.CHUNK), jnp.float32))
    spec = _checks.check_inputs(jnp.zeros((B, T, 1, K), jnp.bfloat16),
                                jnp.zeros((B, T, n, 1, K), jnp.bfloat16),
                                jnp.zeros((B, T, n, HV, V), jnp.bfloat16), None,
                                jnp.zeros((B, T, n, HV), jnp.bfloat16), scale=0.1)
    txt = _lower(lambda c: CUTEDSL.forward_summaries(spec, c, layout)[0], ch)
    assert txt.count("CuteDSLRT_NvJaxCutlassCall") >= 2          # operands + forward
    doc = S((B, NC, HV, grid.CHUNK, V), jnp.float32)
    dfinal = S((B, HV, K, V), jnp.float32)
    txt = _lower(lambda c, d, f: CUTEDSL.backward_summaries(spec, c, layout, d, f)[0],
                 ch, doc, dfinal)
    assert txt.count("CuteDSLRT_NvJaxCutlassCall") >= 2          # inverse + reverse


@pytest.mark.parametrize("packed", [False, True])
def test_cp_rank_kernel_passes(packed, prebuilt):
    """One CP rank (the four protocol functions, lowered for cuda): per direction a V + K
    summary walk that writes only the final states / start-state gradients (placeholders
    for the rest), then apply's plain walk on V columns (o rows, checkpoints, dS_end in
    16 bits)."""
    from gdp_jax import cp as gcp
    B, T, n, H, HV, K, V = 1, 200, 2, 1, 2, 128, 64
    bf, f32 = jnp.bfloat16, jnp.float32
    N = 3 if packed else B
    avals = _op_avals(B, T, n, H, HV, K, V, bf)[:5] + (S((N, HV, K, V), f32),)
    cu = jnp.array([0, 20, 20, 200], jnp.int32) if packed else None
    spec = _checks.check_inputs(*[jnp.zeros(a.shape, a.dtype) for a in avals[:5]],
                                cu_seqlens=cu)

    class Backend(gcp.XlaGatedDeltaProductCPBackend):
        engine = CUTEDSL            # the cutedsl backend minus its device check

    be = Backend(spec.replace(recompute_chunk_num=1))
    pre = S((2, 1 if packed else B, HV, K, V + K), f32)
    seqs = jnp.array([2 if packed else 0]), jnp.array([2 if packed else 0])

    def fwd(q, k, v, g, beta, h0, packed_summaries):
        inputs = gcp.GDPInputs(q, k, v, g, beta, h0, cu, jnp.array([0]), seqs[1],
                               jnp.array(True), jnp.array(True))
        summary, ctx = be.cp_forward_prepare(inputs)
        mask = jnp.ones((2,), bool)
        o, final, saved = be.cp_forward_apply(ctx, gcp.SummarySlice(packed_summaries, mask))
        return summary, o, final, saved

    def fwd_bwd(q, k, v, g, beta, h0, packed_summaries, do, dfinal):
        summary, o, final, saved = fwd(q, k, v, g, beta, h0, packed_summaries)
        bsummary, ctx = be.cp_backward_prepare((do, dfinal), saved)
        mask = jnp.ones((2,), bool)
        return summary, o, final, bsummary, be.cp_backward_apply(
            ctx, gcp.SummarySlice(packed_summaries, mask))

    flags = re.compile(r"tensor<\d+x\d+xi32>")

    def recursions(txt):
        # the recursion kernels take the [B, NC] int32 chunk flags (the others take none,
        # or a [B, NC, 4] row table). The LAST "->" parts the argument types from the
        # results: the binary kernel key in the backend config may hold one too.
        return [line for line in txt.splitlines()
                if "CuteDSLRT_NvJaxCutlassCall" in line
                and flags.search(line.rsplit("->", 1)[0])]

    def chunk_kernels(txt):
        return [line.rsplit("->", 1)[-1] for line in recursions(txt)]

    txt = _lower(fwd, *avals, pre)
    out = chunk_kernels(txt)
    # u enters on its V columns (the kernel takes the response columns' u as 0), in
    # bfloat16 (chunk_prep.U16) or float32
    u_t = "bf16" if chunk_prep.U16 else "f32"
    args = [line.rsplit("->", 1)[0] for line in recursions(txt)]
    assert all(f"x64x{V}x{u_t}>" in a and f"x64x{V + K}x{u_t}>" not in a for a in args), args
    final_wide = f"x{HV}x{K}x{V + K}xf32>"
    summary = [o for o in out if final_wide in o]
    plain = [o for o in out if final_wide not in o]
    assert len(summary) == 1 and len(plain) == 1, out
    # [1] placeholders for o and the states: no o rows, no checkpoints
    assert summary[0].startswith(" (tensor<1xbf16>,") and "tensor<1xf32>)" in summary[0]
    assert f"x64x{V}xbf16>" in plain[0] and f"x{K}x{V}xbf16>" in plain[0], out
    out = chunk_kernels(_lower(fwd_bwd, *avals, pre, S((B, T, HV, V), bf),
                               S((N, HV, K, V), f32)))
    assert len(out) == 4, out
    reverse = [o for o in out if o.startswith(" (tensor<1xf32>,") and final_wide in o]
    assert len(reverse) == 1, out                              # no dS_end written
    assert sum(f"x{K}x{V}xbf16>, tensor<{N}x{HV}x{K}x{V}xf32>" in o for o in out) == 1


def test_forward_call_rejects_u_wider_than_the_state():
    """u may hold fewer state columns than h0 (a multiple of BV: the rest are 0), never
    more."""
    f32, bf = jnp.float32, jnp.bfloat16
    ops = [jnp.zeros((1, 1, 1, 64, 64), bf)] * 3 + [jnp.zeros((1, 1, 1, 64, 64), bf)]
    flags = [jnp.zeros((1, 1), jnp.int32)] * 3
    for u_cols, h0_cols in ((128, 64), (48, 128)):
        with pytest.raises(ValueError, match="u has shape"):
            ChunkForwardKernel.raw_call(*ops, jnp.zeros((1, 1, 1, 64, u_cols), f32),
                                        jnp.zeros((1, 1, 1), f32), *flags,
                                        jnp.zeros((1, 1, 64, h0_cols), f32), BV=32)


def test_can_implement():
    ok = dict(K=128, V=128, dtype=jnp.bfloat16, rows=1, NC=4, HV=2)
    assert ChunkForwardKernel.can_implement(**ok) is None
    assert "bfloat16/float16" in ChunkForwardKernel.can_implement(**{**ok, "dtype": jnp.float32})
    assert "K, V" in ChunkForwardKernel.can_implement(**{**ok, "K": 256})
    assert "32-bit" in ChunkForwardKernel.can_implement(**{**ok, "rows": 64, "NC": 8192,
                                                           "HV": 64})
    # rows [C, V] fit (200000 * 64 * 128 < 2^31) but the [K, V] chunk states do not
    assert "32-bit" in ChunkForwardKernel.can_implement(**{**ok, "NC": 200000, "HV": 1})
    # a CTA per (.., head, row): at most 65535 rows (grid z) and heads (grid y)
    many = {**ok, "rows": 70000, "NC": 1, "HV": 1, "K": 64, "V": 64}
    assert "70000 rows x 1 heads" in ChunkForwardKernel.can_implement(**many)
    assert "65535" in StepKernel.can_implement(dtype=jnp.bfloat16, B=70000, HV=1, K=64, V=64)
    # the CP summary walks run V + K state columns but write only per-sequence final
    # states: the per-chunk extents stay V wide
    big = {**ok, "NC": 100000, "HV": 1}
    assert StateGradKernel.can_implement(**big) is None
    assert StateGradKernel.can_implement(**big, extra_columns=128, sequences=5) is None
    # sequences not given: up to rows x NC of [K, V + K] each
    assert "CP summary states" in StateGradKernel.can_implement(**big, extra_columns=128)
    assert "CP summary states" in StateGradKernel.can_implement(**big, extra_columns=128,
                                                                sequences=70000)
    # the engine's statement is the kernels': (1, 262144, 16, 1) fits (s27 on the GPU
    # refused it while the summaries' columns counted per chunk)
    T, bf = 262144, jnp.bfloat16
    spec = _checks.check_inputs(S((1, T, 16, 128), bf), S((1, T, 1, 16, 128), bf),
                                S((1, T, 1, 16, 128), bf), None, S((1, T, 1, 16), bf))
    assert CuTeDSLEngine.can_implement(spec) is None
    # twice that overflows one launch: the call runs in two head groups (gdp_jax.heads)
    assert "32-bit" in CuTeDSLEngine.launch_limits(spec.replace(T=2 * T))
    assert CuTeDSLEngine.head_groups(spec.replace(T=2 * T)) == 2
    assert CuTeDSLEngine.can_implement(spec.replace(T=2 * T)) is None
    # one key head (of 16 value heads) that overflows: refused
    assert "32-bit" in CuTeDSLEngine.can_implement(spec.replace(T=2 * T, H=1))
    assert CuTeDSLEngine.can_implement(spec.replace(T=64)) is None
    assert "bfloat16/float16" in CuTeDSLEngine.can_implement(spec.replace(
        T=64, input_dtype="float32"))


def test_token_major_call_rejects_bad_inputs():
    """``ChunkPrepKernel.raw_call_tokens`` names the argument, its shape or dtype and what
    it expected, before anything reaches XLA."""
    B, T, n, H, HV, NC, K = 1, 100, 2, 1, 2, 4, 64
    bf, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32
    ok = dict(q=S((B, T, H, K), bf), k=S((B, n * T, H, K), bf), v=S((B, n * T, HV, K), bf),
              g=S((B, NC, HV, grid.CHUNK), f32), beta=S((B, NC, HV, grid.CHUNK), f32),
              scale=S((B,), f32), rows=S((B, NC, 4), i32))

    def check(match, **bad):
        a = {**ok, **bad}
        with pytest.raises(ValueError, match=match):
            jax.eval_shape(lambda *x: ChunkPrepKernel.raw_call_tokens(
                *x, ab_dtype="bfloat16", l2norm=True), *a.values())

    check("^q: .*bfloat16; got float16", q=S((B, T, H, K), jnp.float16))
    check(r"^rows: int32 \(1, 4, 4\)", rows=S((B, NC, 3), i32))
    check("^scale: one float32 per row", scale=S((2,), f32))
    check("^heads: q 2, k 1, v 2", q=S((B, T, 2, K), bf))
    check("^g: chunks of 64 rows", g=S((B, NC, HV, 32), f32))
    check("K, V in", q=S((B, T, H, 96), bf), k=S((B, n * T, H, 96), bf))


def test_cutedsl_op_vmap_and_grad_lower(prebuilt):
    """jax.vmap of the cutedsl op and of its gradient lowers (the kernels' batching rule
    folds the mapped axis into the batch rows; cutlass_call has no rule of its own)."""
    B, T, n, H, HV, K, V = 1, 100, 2, 1, 2, 64, 64
    avals = tuple(S((3,) + a.shape, a.dtype) for a in _op_avals(B, T, n, H, HV, K, V,
                                                                 jnp.bfloat16))
    spec = _checks.check_inputs(*[jnp.zeros(a.shape[1:], a.dtype) for a in avals[:5]],
                                use_qk_l2norm=True, recompute_chunk_num=1)

    def loss(q, k, v, g, beta, h0):
        o, final = ops._op(CUTEDSL, spec, q, k, v, g, beta, h0, None)
        return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(final)

    txt = _lower(jax.vmap(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5))), *avals)
    assert txt.count("CuteDSLRT_NvJaxCutlassCall") >= 2


# --- the decoding step kernel (gdp_jax.kernels.step) -------------------------------------

def _step_kernel_avals(B, HV, n, K, V):
    f32 = jnp.float32
    return (S((B, HV, K), f32), S((B, HV, n, K), f32), S((B, HV, n, V), f32),
            S((B, HV, n), f32), S((B, HV), f32), S((B, HV, K, V), f32))


@pytest.mark.parametrize("n,K,V", [(1, 128, 128), (2, 128, 128), (3, 64, 128), (2, 128, 64),
                                   (2, 96, 32), (2, 16, 96)])
def test_step_kernel_compiles(n, K, V):
    txt = _lower(StepKernel.call, *_step_kernel_avals(2, 3, n, K, V))
    assert "CuteDSLRT_NvJaxCutlassCall" in txt
    assert "output_operand_aliases" in txt          # the state is updated in place


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_cutedsl_step_grad_vmap_and_one_token_op_lower(dtype):
    """The public step's cutedsl path (operands + kernel), its gradient (XLA only), a vmap
    of it, and the cutedsl op at T = 1 (which runs the step kernel) lower for cuda."""
    from gdp_jax import step
    B, n, H, HV, K, V = 4, 2, 2, 4, 128, 128
    avals = (S((B, H, K), dtype), S((B, n, H, K), dtype), S((B, n, HV, V), dtype),
             S((B, HV), jnp.float32), S((B, n, HV), dtype), S((B, HV, K, V), jnp.float32))
    cfg = _checks.check_step_inputs(*[jnp.zeros(a.shape, a.dtype) for a in avals],
                                    use_qk_l2norm=True)
    run = lambda *a: step.cutedsl_step(cfg, *a)
    assert "CuteDSLRT_NvJaxCutlassCall" in _lower(run, *avals)
    assert "CuteDSLRT_NvJaxCutlassCall" in _lower(jax.vmap(run), *(
        S((2,) + a.shape, a.dtype) for a in avals))

    def loss(*a):
        o, s = run(*a)
        return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(s)

    _lower(jax.grad(loss, argnums=tuple(range(6))), *avals)
    if dtype == jnp.bfloat16:
        op_avals = _op_avals(B, 1, n, H, HV, K, V, dtype)
        spec = _checks.check_inputs(*[jnp.zeros(a.shape, a.dtype) for a in op_avals[:5]],
                                    use_qk_l2norm=True)
        txt = _lower(lambda q, k, v, g, beta, h0: step.one_token_op(
            "cutedsl", spec, q, k, v, g, beta, h0), *op_avals)
        assert "CuteDSLRT_NvJaxCutlassCall" in txt


def test_step_unsupported_reasons():
    ok = dict(B=64, HV=32, K=128, V=128, dtype=jnp.bfloat16)
    assert StepKernel.can_implement(**ok) is None
    assert StepKernel.can_implement(**{**ok, "dtype": jnp.float32}) is None
    assert "K <= 128" in StepKernel.can_implement(**{**ok, "K": 256})
    assert "multiple of 32" in StepKernel.can_implement(**{**ok, "V": 48})
    assert "float64" in StepKernel.can_implement(**{**ok, "dtype": jnp.float64})
    assert "32-bit" in StepKernel.can_implement(**{**ok, "B": 4096})


@pytest.mark.parametrize("dtype,K,V", [(jnp.bfloat16, 128, 128), (jnp.float16, 64, 64),
                                       (jnp.bfloat16, 64, 128), (jnp.float16, 128, 64)])
def test_local_grad_kernel_compiles(dtype, K, V):
    """The chunk-local gradient kernel (its vmap too), from float32 chunk tensors; dS_end
    float32 (CP) or 16-bit (one device)."""
    from gdp_jax.kernels.local_grad import LocalGradKernel
    B, NC, HV, C = 2, 3, 4, grid.CHUNK
    f32 = jnp.float32
    ds = f32 if K == V else dtype
    avals = (S((B, NC, HV, C, K), f32), S((B, NC, HV, C, K), f32), S((B, NC, HV, C, V), f32),
             S((B, NC, HV, C), f32), S((B, NC, HV, C), f32), S((B, NC, HV, C, K), dtype),
             S((B, NC, HV, C, V), f32), S((B, NC, HV, C, C), f32), S((B, NC, HV, K, V), dtype),
             S((B, NC, HV, C, V), dtype), S((B, NC, HV, K, V), ds))
    call = lambda *a: LocalGradKernel.call(*a, scale=0.1, ab_dtype=dtype)
    out = jax.eval_shape(call, *avals)
    assert [o.shape for o in out] == [(B, NC, HV, C, K)] * 2 + [(B, NC, HV, C, V)] + [
        (B, NC, HV, C)] * 2
    assert "CuteDSLRT_NvJaxCutlassCall" in _lower(call, *avals)
    # vmap over 2 problems of B / 2 rows: the folded call has the unbatched shapes, so the
    # per-shape compile above serves it (the rule is what is under test, not another shape)
    batched = jax.vmap(call)
    out_b = jax.eval_shape(batched, *(S((2, B // 2) + a.shape[1:], a.dtype) for a in avals))
    assert [o.shape for o in out_b] == [(2, B // 2) + o.shape[1:] for o in out]
    assert "CuteDSLRT_NvJaxCutlassCall" in _lower(batched, *(S((2, B // 2) + a.shape[1:],
                                                               a.dtype) for a in avals))
    # the token-major results (the single-device op's backward: dS_end 16-bit)
    n, T = 2, 70
    rows = S((B, NC, 4), jnp.int32)
    tok = lambda *a: LocalGradKernel.call_tokens(*a, n=n, T=T, scale=0.1, ab_dtype=dtype)
    avals_t = avals[:-1] + (S((B, NC, HV, K, V), dtype), rows)
    out_t = jax.eval_shape(tok, *avals_t)
    assert [(o.shape, o.dtype) for o in out_t] == [
        ((B, T, HV, K), dtype), ((B, T, n, HV, K), dtype), ((B, T, n, HV, V), dtype),
        ((B, NC, HV, C), f32), ((B, NC, HV, C), f32)]
    assert "CuteDSLRT_NvJaxCutlassCall" in _lower(tok, *avals_t)


@pytest.mark.parametrize("dtype,K,V", [(jnp.bfloat16, 128, 128), (jnp.float16, 64, 128)])
def test_local_grad_kernel_with_norm_backward_compiles(dtype, K, V):
    """The token-major local-gradient kernel applying the L2 norm's backward to dq, dk
    (``pipeline.FUSED_NORM_BWD``): row norms of 2 key heads for 4 value heads (GVA), its
    vmap too; the variant differs from the one without (its own machine code)."""
    from gdp_jax.kernels.local_grad import LocalGradKernel
    B, NC, HV, H, C, n, T = 2, 3, 4, 2, grid.CHUNK, 2, 70
    f32 = jnp.float32
    avals = (S((B, NC, HV, C, K), f32), S((B, NC, HV, C, K), f32), S((B, NC, HV, C, V), f32),
             S((B, NC, HV, C), f32), S((B, NC, HV, C), f32), S((B, NC, HV, C, K), dtype),
             S((B, NC, HV, C, V), f32), S((B, NC, HV, C, C), f32), S((B, NC, HV, K, V), dtype),
             S((B, NC, HV, C, V), dtype), S((B, NC, HV, K, V), dtype), S((B, NC, 4), jnp.int32),
             S((B, T, H), f32), S((B, T, n, H), f32))
    tok = lambda *a: LocalGradKernel.call_tokens(*a[:12], n=n, T=T, scale=0.1,
                                                 ab_dtype=dtype, rho=a[12:])
    out = jax.eval_shape(tok, *avals)
    assert [(o.shape, o.dtype) for o in out] == [
        ((B, T, HV, K), dtype), ((B, T, n, HV, K), dtype), ((B, T, n, HV, V), dtype),
        ((B, NC, HV, C), f32), ((B, NC, HV, C), f32)]
    text = _lower(tok, *avals)
    assert "CuteDSLRT_NvJaxCutlassCall" in text
    plain = lambda *a: LocalGradKernel.call_tokens(*a[:12], n=n, T=T, scale=0.1,
                                                   ab_dtype=dtype)
    assert _lower(plain, *avals) != text
    # and dO read token-major (pipeline.DO_TOKENS): doc [B, T, HV, V]
    do_t = list(avals)
    do_t[9] = S((B, T, HV, V), dtype)
    dot = lambda *a: LocalGradKernel.call_tokens(*a[:12], n=n, T=T, scale=0.1,
                                                 ab_dtype=dtype, rho=a[12:], do_tokens=True)
    assert [o.shape for o in jax.eval_shape(dot, *do_t)] == [o.shape for o in out]
    assert "CuteDSLRT_NvJaxCutlassCall" in _lower(dot, *do_t)
    with pytest.raises(ValueError, match=r"^doc: token-major"):
        jax.eval_shape(dot, *avals)
    batched = jax.vmap(tok)
    assert "CuteDSLRT_NvJaxCutlassCall" in _lower(
        batched, *(S((2, B // 2) + a.shape[1:], a.dtype) for a in avals))


def test_local_grad_kernel_normalising_raw_rows_compiles():
    """The token-major local-gradient kernel reading raw q, k token-major and normalising
    them itself, the norm's backward on its own factors (``pipeline.NORM_IN_KERNELS``):
    GVA (2 key heads, 4 value heads), its vmap; l2norm needs tokens_in and no rho."""
    from gdp_jax.kernels.local_grad import LocalGradKernel
    B, NC, HV, H, C, n, T, K, V = 2, 3, 4, 2, grid.CHUNK, 2, 70, 128, 64
    f32, ab = jnp.float32, jnp.bfloat16
    avals = (S((B, T, H, K), ab), S((B, T, n, H, K), ab), S((B, T, n, HV, V), ab),
             S((B, NC, HV, C), f32), S((B, NC, HV, C), f32), S((B, NC, HV, C, K), ab),
             S((B, NC, HV, C, V), f32), S((B, NC, HV, C, C), f32), S((B, NC, HV, K, V), ab),
             S((B, NC, HV, C, V), ab), S((B, NC, HV, K, V), ab), S((B, NC, 4), jnp.int32))
    tok = lambda *a: LocalGradKernel.call_tokens(*a, n=n, T=T, scale=0.1, ab_dtype=ab,
                                                 tokens_in=True, l2norm=True)
    out = jax.eval_shape(tok, *avals)
    assert [(o.shape, o.dtype) for o in out] == [
        ((B, T, HV, K), ab), ((B, T, n, HV, K), ab), ((B, T, n, HV, V), ab),
        ((B, NC, HV, C), f32), ((B, NC, HV, C), f32)]
    assert "CuteDSLRT_NvJaxCutlassCall" in _lower(tok, *avals)
    assert "CuteDSLRT_NvJaxCutlassCall" in _lower(
        jax.vmap(tok), *(S((2, B // 2) + a.shape[1:], a.dtype) for a in avals))
    with pytest.raises(ValueError, match="l2norm: q, k token-major"):
        jax.eval_shape(lambda *a: LocalGradKernel.call_tokens(
            *a, n=n, T=T, scale=0.1, ab_dtype=ab, l2norm=True), *avals)


def test_token_major_local_grad_call_rejects_bad_inputs():
    """``LocalGradKernel.raw_call_tokens`` names the argument, its shape and what it
    expected, before anything reaches XLA."""
    from gdp_jax.kernels.local_grad import LocalGradKernel
    B, NC, HV, C, K = 1, 3, 2, grid.CHUNK, 64
    bf, f32 = jnp.bfloat16, jnp.float32
    ok = dict(q=S((B, NC, HV, C, K), bf), k=S((B, NC, HV, C, K), bf),
              w=S((B, NC, HV, C, K), bf), doc=S((B, NC, HV, C, K), bf),
              v=S((B, NC, HV, C, K), bf), g=S((B, NC, HV, C), f32),
              beta=S((B, NC, HV, C), f32), scale=S((B,), f32), X=S((B, NC, HV, C, C), f32),
              u=S((B, NC, HV, C, K), f32), S0=S((B, NC, HV, K, K), bf),
              ds_end=S((B, NC, HV, K, K), bf), rows=S((B, NC, 4), jnp.int32))

    def check(match, n=2, T=90, **bad):
        a = {**ok, **bad}
        with pytest.raises(ValueError, match=match):
            jax.eval_shape(lambda *x: LocalGradKernel.raw_call_tokens(
                *x, n=n, T=T, ab_dtype="bfloat16"), *a.values())

    check(r"^rows: int32 \(1, 3, 4\)", rows=S((B, NC, 4), f32))
    check("^scale: one float32 per row", scale=S((2,), f32))
    check("^k: chunks of 64 rows", k=S((B, NC, HV, 32, K), bf))
    check("^n=65, T=90: expected 1 <= n <= 64", n=65)
    check("K, V in", k=S((B, NC, HV, C, 96), bf))

    # tokens_in: q [B, T, H, K], k [B, n T, H, K], v [B, n T, HV, V] in the operand dtype
    n, T = 2, 90
    tok = dict(ok, q=S((B, T, 1, K), bf), k=S((B, n * T, 1, K), bf), v=S((B, n * T, HV, K), bf))

    def check_tokens(match, **bad):
        a = {**tok, **bad}
        with pytest.raises(ValueError, match=match):
            jax.eval_shape(lambda *x: LocalGradKernel.raw_call_tokens(
                *x, n=n, T=T, ab_dtype="bfloat16", tokens_in=True), *a.values())

    jax.eval_shape(lambda *x: LocalGradKernel.raw_call_tokens(
        *x, n=n, T=T, ab_dtype="bfloat16", tokens_in=True), *tok.values())
    check_tokens(r"^k: token-major bfloat16 \(1, 180, 1, 64\)", k=S((B, T, 1, K), bf))
    check_tokens(r"^q: token-major bfloat16", q=S((B, T, 1, K), f32))
    check_tokens("^q, k have 3 heads, v 2", q=S((B, T, 3, K), bf), k=S((B, n * T, 3, K), bf))


def test_value_tile_fills_the_gpu(monkeypatch):
    """The recursion kernels' value tile: 64 when rows x heads x V / 64 gives every SM a
    CTA, else 32 (twice the CTAs); the prebuilt variants carry both tiles (here with
    ``NARROW_TILES`` off)."""
    from gdp_jax.kernels import chunk_forward
    monkeypatch.setattr(chunk_forward, "NARROW_TILES", False)
    pick = ChunkForwardKernel.pick_bv
    assert pick(8, 16, 128) == 64 and pick(1, 66, 128) == 64 and pick(1, 132, 64) == 64
    assert pick(1, 16, 128) == 32 and pick(1, 65, 128) == 32 and pick(2, 2, 64) == 32
    assert pick(1, 33, 256) == 64 and pick(1, 33, 192) == 32       # CP: V + K columns
    names = [v.what for v in ChunkForwardKernel.variants()]
    assert names and all(" ckpt=" in n for n in names)
    assert ChunkForwardKernel.value_tiles(128) == [32, 64]
    for kernel in (ChunkForwardKernel, StateGradKernel):
        tiles = _listed_tiles(kernel)
        assert tiles and all(t == {32, 64} for t in tiles.values()), kernel


def test_narrow_tiles_only_when_32_leaves_sms_idle():
    """``NARROW_TILES`` (the default): 16-wide tiles where 32-wide ones give fewer CTAs
    than SMs; the listed (prebuilt) tiles then cover all three widths."""
    from gdp_jax.kernels import chunk_forward
    assert chunk_forward.NARROW_TILES
    pick = ChunkForwardKernel.pick_bv
    assert pick(8, 16, 128) == 64 and pick(1, 33, 128) == 32 and pick(1, 32, 128) == 16
    assert pick(1, 16, 128) == 16 and pick(1, 8, 128) == 16 and pick(1, 2, 64) == 16
    assert ChunkForwardKernel.value_tiles(128) == [16, 32, 64]
    for kernel in (ChunkForwardKernel, StateGradKernel):
        tiles = _listed_tiles(kernel)
        assert tiles and all(t == {16, 32, 64} for t in tiles.values()), kernel


def _listed_tiles(kernel) -> dict:
    """{variant name without its tile: the value tiles listed} of ``kernel``'s prebuilt
    variants, but the token-row walks (``chunk_forward.O_TOKENS``), which under the default
    "auto" are listed on the one tile they run on - checked here: 64 columns."""
    tiles = {}
    for v in kernel.variants():
        tiles.setdefault(v.what.rsplit(" BV=", 1)[0], set()).add(v.fn.keywords["BV"])
    o_rows = {k: t for k, t in tiles.items() if k.startswith("gdp_chunk_fwd_sm90_rows ")}
    assert all(t == {64} for t in o_rows.values()), o_rows
    return {k: t for k, t in tiles.items() if k not in o_rows}


def _built_resources(every_kernel_variant, prefix: str) -> dict:
    """{label: (registers, frame bytes, threads, code KB)} of the session's kernel build
    (tests/conftest.py) for the variants at K = V = 128 whose label starts with
    ``prefix`` - read from the cubins inside the built objects
    (``benchmarks.kernel_resources.store_resources``), no compile of their own."""
    from benchmarks.kernel_resources import store_resources
    out, r = every_kernel_variant
    assert r["returncode"] == 0, r["stdout"][-3000:] + r["stderr"][-3000:]
    return {k: v for k, v in store_resources(out).items()
            if k.startswith(prefix) and " K=128 V=128 " in f"{k} "}


def test_operands_kernel_holds_three_ctas_per_sm(every_kernel_variant):
    """The operands kernel caps its registers so that 3 CTAs share an SM (its ~70 KB of
    shared memory allow 3; uncapped, the assembler took ~190 registers: 2), chunk-major and
    token-major, with and without X / the in-kernel L2 norm / the read-out rows only (11 at
    K = V = 128 a dtype). Read from the cubins of the session's build."""
    from benchmarks.kernel_resources import ctas_by_registers
    res = _built_resources(every_kernel_variant, "gdp_chunk_prep_sm90")
    assert len(res) >= 11, sorted(res)
    for label, (regs, _, threads, _) in res.items():
        assert regs <= 168 and ctas_by_registers(regs, threads) == 3, (label, regs, threads)


def test_largest_kernels_stay_below_128_kib(every_kernel_variant):
    """The two largest kernels (the operands kernel reading tokens, the chunk-local
    gradients) stay below 128 KiB of machine code: s20-5 saw the operands kernel run 1.9x
    slower at ~140 KiB with the same registers (docs/KERNELS.md: an instruction-cache
    limit is suspected). Grow one past it only with a GPU measurement. Read from the
    cubins of the session's build."""
    sizes = {k: v[3] for k, v in _built_resources(
        every_kernel_variant, "gdp_chunk_prep_sm90_tokens").items()}
    sizes.update({k: v[3] for k, v in _built_resources(
        every_kernel_variant, "gdp_chunk_grad_sm90_tokens").items()})
    assert len(sizes) >= 3, sizes
    assert max(sizes.values()) < 128, sizes


def test_probe_variants_compile():
    """The measurement-only probes (benchmarks/prep_probe.py): the operands kernel's
    (``probe=True``) and the local-gradient kernel's (``ablate="probe"``) compile."""
    from gdp_jax.kernels.local_grad import LocalGradKernel
    B, NC, HV, C, K, V = 1, 2, 2, grid.CHUNK, 64, 64
    f32, bf = jnp.float32, jnp.bfloat16
    ch = _chunk_avals(B, NC, HV, K, V)
    prep = lambda *a: ChunkPrepKernel.raw_call(*a, ab_dtype=bf, probe=True)
    assert "CuteDSLRT_NvJaxCutlassCall" in _lower(prep, *ch, S((B,), f32))
    avals = (S((B, NC, HV, C, K), f32), S((B, NC, HV, C, K), f32), S((B, NC, HV, C, K), bf),
             S((B, NC, HV, C, V), bf), S((B, NC, HV, C, V), f32), S((B, NC, HV, C), f32),
             S((B, NC, HV, C), f32), S((B,), f32), S((B, NC, HV, C, C), f32),
             S((B, NC, HV, C, V), f32), S((B, NC, HV, K, V), bf), S((B, NC, HV, K, V), bf))
    lg = lambda *a: LocalGradKernel.raw_call(*a, ab_dtype=bf, ablate="probe")
    assert "CuteDSLRT_NvJaxCutlassCall" in _lower(lg, *avals)


def test_mma_rate_kernels_compile():
    """benchmarks/mma_rate.py's product kernels (mma.sync + ldmatrix; wgmma with both
    operands from the smem tiles through pointer-swizzled views; wgmma with A from
    registers) lower to a custom call for sm_90a; bad operands are refused by name."""
    import functools
    from benchmarks.mma_rate import MODES, product_cycles
    a, b = S((2, 64, 64), jnp.bfloat16), S((2, 64, 128), jnp.bfloat16)
    for mode in MODES:
        f = functools.partial(product_cycles, mode=mode, reps=2)
        assert "CuteDSLRT_NvJaxCutlassCall" in _lower(f, a, b), mode
    with pytest.raises(ValueError, match="^b: bf16"):
        jax.eval_shape(functools.partial(product_cycles, mode="sync"), a,
                       S((2, 32, 128), jnp.bfloat16))


def test_load_rate_kernels_compile():
    """benchmarks/load_rate.py's two copy kernels (every thread's cp.async, one thread's
    bulk copies with an mbarrier) lower to a custom call for sm_90a."""
    import functools
    from benchmarks.load_rate import copy_cycles
    src = S((4, 64 * 512), jnp.bfloat16)
    for mode in ("cpasync", "bulk"):
        f = functools.partial(copy_cycles, mode=mode, piece_kb=16)
        assert "CuteDSLRT_NvJaxCutlassCall" in _lower(f, src), mode
    with pytest.raises(ValueError, match="mode"):
        copy_cycles(jnp.zeros((4, 8 * 256), jnp.bfloat16), mode="ldg")


def _assert_switch_changes_object(monkeypatch, module, switch, value, v):
    """Variant ``v`` lowers for cuda with ``module.switch`` False and ``value`` (a fresh
    trace each: the switch is read at trace time), to two different kernel objects."""
    texts = []
    for on in (False, value):
        monkeypatch.setattr(module, switch, on)
        jax.clear_caches()
        texts.append(_lower(v.fn, *v.avals))
        assert "CuteDSLRT_NvJaxCutlassCall" in texts[-1]
    assert texts[0] != texts[1]


@pytest.mark.parametrize("match,mode", [
    ("gdp_chunk_grad_sm90_tokens bfloat16 K=128 V=128 tokens in l2norm", True),  # the op's
    ("gdp_chunk_grad_sm90_tokens bfloat16 K=128 V=128 tokens in l2norm", "all"),
    ("gdp_chunk_grad_sm90 bfloat16 K=64 V=128 dS_end float32", "overlap"),      # CP
])
def test_gmma_local_grad_kernel_compiles(monkeypatch, match, mode):
    """``local_grad.GMMA``: the local-gradient kernel with its products as warpgroup MMAs
    (wgmma descriptors on the kernel's own smem tiles, register A operands; "overlap":
    independent products issued together; "all": phases 9, 10 too) compiles to sm_90a -
    another object than the warp-MMA kernel's; with warps_n other than 2 or an unknown
    mode the call refuses."""
    from gdp_jax.kernels import local_grad
    from gdp_jax.kernels.local_grad import LocalGradKernel
    (v,) = [v for v in LocalGradKernel.variants() if v.what == match]
    _assert_switch_changes_object(monkeypatch, local_grad, "GMMA", mode, v)
    with pytest.raises(ValueError, match="gmma .* needs warps_n=2"):
        jax.eval_shape(lambda *a: v.fn(*a, warps_n=1, gmma=True), *v.avals)
    with pytest.raises(ValueError, match="gmma='all' needs one 16-bit rounding"):
        jax.eval_shape(lambda *a: v.fn(*a, split=True, gmma="all"), *v.avals)
    with pytest.raises(ValueError, match="gmma: False, True, 'overlap' or 'all'"):
        jax.eval_shape(lambda *a: v.fn(*a, gmma="async"), *v.avals)


def test_gmma_default_steps_down(monkeypatch):
    """``local_grad.GMMA`` (the default, "all") applies where the other settings allow it:
    with ``split`` the kernel takes True's products (phases 9, 10 as warp MMAs), with
    ``warps_n`` != 2 warp MMAs throughout (an explicit ``gmma`` is kept); only the
    constexprs of what is on reach the launchers (so the warp-MMA variants keep their
    keys)."""
    from gdp_jax.kernels import local_grad
    monkeypatch.setattr(local_grad, "SPLIT", False)
    monkeypatch.setattr(local_grad, "WARPS_N", 2)
    kind = local_grad._mma_kind
    assert local_grad.GMMA == "all"
    assert kind(None, None, None) == dict(split=False, warps_n=2, gmma=True, overlap=True,
                                          gmma_all=True)
    assert kind(None, None, True) == dict(split=True, warps_n=2, gmma=True)
    assert kind(1, None, None) == dict(split=False, warps_n=1)
    assert kind(None, False, None) == dict(split=False, warps_n=2)
    assert kind(None, "overlap", True) == dict(split=True, warps_n=2, gmma=True, overlap=True)
    assert kind(None, "all", None) == dict(split=False, warps_n=2, gmma=True, overlap=True,
                                          gmma_all=True)
    monkeypatch.setattr(local_grad, "SPLIT", True)
    assert kind(None, None, None) == dict(split=True, warps_n=2, gmma=True)
    monkeypatch.setattr(local_grad, "GMMA", False)
    assert kind(None, None, None) == dict(split=True, warps_n=2)
    with pytest.raises(ValueError, match="needs warps_n=2"):
        kind(4, True, None)
    with pytest.raises(ValueError, match="needs one 16-bit rounding"):
        kind(None, "all", None)


def _walk(walk: str):
    """(module with the walk's GMMA switch, its kernel class) of "forward" (or
    "forward-all") / "reverse"."""
    from gdp_jax.kernels import chunk_forward, state_grad
    return ((chunk_forward, chunk_forward.ChunkForwardKernel) if walk.startswith("forward")
            else (state_grad, state_grad.StateGradKernel))


@pytest.mark.parametrize("walk,match", [
    ("forward", "gdp_chunk_fwd_sm90 bfloat16 K=128 V=128 ckpt=0 BV=64 rows=32"),  # the op's
    ("forward", "gdp_chunk_fwd_sm90 bfloat16 K=128 V=128 ckpt=1 BV=16"),    # checkpoints
    ("forward", "gdp_chunk_fwd_sm90 float16 K=64 V=192 ckpt=0 summary BV=32"),    # CP summary
    ("forward-all", "gdp_chunk_fwd_sm90 bfloat16 K=128 V=128 ckpt=0 BV=64 rows=32"),
    ("forward-all", "gdp_chunk_fwd_sm90 float16 K=64 V=128 ckpt=1 BV=16 rows=32"),
    ("reverse", "gdp_chunk_bwd_dh_sm90 bfloat16 K=128 V=128 dS_end bfloat16 fused ddo BV=64 "
                "rows=32"),
    ("reverse", "gdp_chunk_bwd_dh_sm90 bfloat16 K=64 V=64 dS_end bfloat16 fused ddo BV=16"),
    ("reverse", "gdp_chunk_bwd_dh_sm90 float16 K=128 V=192 summary BV=32"),   # CP, ddo read
])
def test_walk_gmma_compiles(monkeypatch, walk, match):
    """``chunk_forward.GMMA`` / ``state_grad.GMMA`` (on since s39): a walk with its
    recursion products as warpgroup MMAs (wgmma descriptors on the walk's own 128 / 64 /
    32-byte swizzled tiles) compiles to sm_90a - another object than the warp-MMA walk's -
    on all rows and the read-out rows, the CP summary walks included, and with
    ``chunk_forward.GMMA = "all"`` the forward's read-out rows' o products too; an
    explicit ``gmma`` on a walk that cannot take it (two operand sets, the hi + lo split)
    or an unknown value is refused."""
    module, kernel = _walk(walk)
    (v,) = [v for v in kernel.variants() if v.what == match]
    _assert_switch_changes_object(monkeypatch, module, "GMMA",
                                  "all" if walk == "forward-all" else True, v)
    if walk == "forward-all":
        with pytest.raises(ValueError,
                           match=r"gmma: one of \(False, True, 'all'\); got 'rows'"):
            jax.eval_shape(lambda *a: v.fn(*a, gmma="rows"), *v.avals)
    # (the reverse walk's read-out rows refuse two operand sets for their own reason first)
    for bad in (dict(split=True),) + (() if "rows=" in match and walk == "reverse"
                                      else (dict(stages=2),)):
        with pytest.raises(ValueError, match="gmma .*needs stages=1, pairs=1, split=False"):
            jax.eval_shape(lambda *a: v.fn(*a, gmma=True, **bad), *v.avals)


def _operands_switch_compiles(monkeypatch, switch, match, bad_values, expected, pins=()):
    """The operands kernel's variant named ``match`` with ``chunk_prep.<switch>`` True
    lowers to another object than with it False (``pins``: other switches set first);
    each of ``bad_values`` is refused by a ValueError naming the switch, the value and
    ``expected``."""
    from gdp_jax.kernels import chunk_prep
    from gdp_jax.kernels.chunk_prep import ChunkPrepKernel
    for name, value in pins:
        monkeypatch.setattr(chunk_prep, name, value)
    (v,) = [v for v in ChunkPrepKernel.variants() if v.what == match]
    _assert_switch_changes_object(monkeypatch, chunk_prep, switch, True, v)
    for bad in bad_values:
        monkeypatch.setattr(chunk_prep, switch, bad)
        jax.clear_caches()
        with pytest.raises(ValueError,
                           match=re.escape(f"chunk_prep.{switch}={bad!r}; expected {expected}")):
            jax.eval_shape(v.fn, *v.avals)


@pytest.mark.parametrize("match", [
    "gdp_chunk_prep_sm90_tokens bfloat16 K=128 V=128 l2norm readout_rows",   # the forward's
    "gdp_chunk_prep_sm90_tokens bfloat16 K=128 V=128 l2norm inverse readout_rows",  # bwd
    "gdp_chunk_prep_sm90 float16 K=64 V=128 inverse",                       # chunk-major
])
def test_operands_gmma_compiles(monkeypatch, match):
    """``chunk_prep.GMMA`` (on since s40): the operands kernel with its products as
    warpgroup MMAs (K K^T, Q K^T from the smem tiles; w, u with X's parts from registers)
    compiles to sm_90a - another object than the warp-MMA kernel's; a value other than True /
    False is refused."""
    _operands_switch_compiles(monkeypatch, "GMMA", match, ["all"], "True or False")


@pytest.mark.parametrize("match,u16", [
    ("gdp_chunk_prep_sm90_tokens bfloat16 K=128 V=128 l2norm readout_rows", False),
    ("gdp_chunk_prep_sm90_tokens bfloat16 K=128 V=128 l2norm readout_rows", True),
    ("gdp_chunk_prep_sm90_tokens float16 K=64 V=64 l2norm inverse readout_rows", False),
    ("gdp_chunk_prep_sm90 bfloat16 K=64 V=128", False),                     # P on all rows
])
def test_operands_staged_stores_compiles(monkeypatch, match, u16):
    """``chunk_prep.STAGED_STORES`` (opt-in): the operands kernel writing P, w (and a 16-bit
    u) through shared memory in 16-byte row pieces compiles to sm_90a - another object than
    the direct stores' (the forward's, with u in float32 and bfloat16; the backward's with
    X; the chunk-major kernel's P on all rows); a value other than True / False is
    refused."""
    _operands_switch_compiles(monkeypatch, "STAGED_STORES", match, ["yes"], "True or False",
                              pins=[("U16", u16)])


@pytest.mark.parametrize("match,staged", [
    ("gdp_chunk_prep_sm90_tokens bfloat16 K=128 V=128 l2norm readout_rows", True),
    ("gdp_chunk_prep_sm90 bfloat16 K=64 V=64", False),                       # chunk-major
])
def test_operands_late_v_compiles(monkeypatch, match, staged):
    """``chunk_prep.LATE_V`` (opt-in): the operands kernel with v's tile in a cp.async
    group of its own, waited for before phase 4, compiles to sm_90a - another object than
    the default's (alone and with STAGED_STORES; token-major and chunk-major loads); a
    value other than True / False is refused."""
    _operands_switch_compiles(monkeypatch, "LATE_V", match, [1.5], "True or False",
                              pins=[("STAGED_STORES", staged)])


@pytest.mark.parametrize("match,staged", [
    ("gdp_chunk_prep_sm90_tokens bfloat16 K=128 V=128 l2norm readout_rows", True),
    ("gdp_chunk_prep_sm90_tokens float16 K=64 V=128 l2norm inverse readout_rows", False),
    ("gdp_chunk_prep_sm90 bfloat16 K=64 V=64", False),                       # chunk-major
])
def test_operands_pipelined_compiles(monkeypatch, match, staged):
    """``chunk_prep.PIPELINED`` (opt-in): the persistent operands kernel (two smem stages
    of k, q; 2 CTAs an SM) compiles to sm_90a - another object than the default's (the
    op's forward variant with staged stores too; the backward's with X; chunk-major
    loads); values other than True / False / an int >= 1 are refused; True takes 2 CTAs
    an SM on every SM, an int n n CTAs (the same code on a grid of n)."""
    from gdp_jax.kernels import binding, chunk_prep
    _operands_switch_compiles(monkeypatch, "PIPELINED", match, [-1, 2.0, "yes"],
                              "True, False or an int >= 1", pins=[("STAGED_STORES", staged)])
    for value, ctas in ((True, 2 * binding.SMS), (5, 5)):
        monkeypatch.setattr(chunk_prep, "PIPELINED", value)
        assert chunk_prep._ctas() == {"ctas": 2, "pipelined": ctas}


def test_operands_two_ctas_an_sm_compiles(monkeypatch):
    """``chunk_prep.CTAS_PER_SM = 2`` (a measurement): the op's operands kernel compiled
    for 2 CTAs an SM is another object than the default's (3); other values are refused."""
    from gdp_jax.kernels import chunk_prep
    from gdp_jax.kernels.chunk_prep import ChunkPrepKernel
    (v,) = [v for v in ChunkPrepKernel.variants()
            if v.what == "gdp_chunk_prep_sm90_tokens bfloat16 K=128 V=128 l2norm readout_rows"]
    texts = []
    for ctas in (3, 2):
        monkeypatch.setattr(chunk_prep, "CTAS_PER_SM", ctas)
        jax.clear_caches()
        texts.append(_lower(v.fn, *v.avals))
    assert texts[0] != texts[1]
    for bad in (4, True):
        monkeypatch.setattr(chunk_prep, "CTAS_PER_SM", bad)
        jax.clear_caches()
        with pytest.raises(ValueError, match=f"chunk_prep.CTAS_PER_SM={bad!r}; expected 2 or 3"):
            jax.eval_shape(v.fn, *v.avals)


@pytest.mark.parametrize("match", [
    "gdp_chunk_prep_sm90_tokens bfloat16 K=128 V=128 l2norm readout_rows",   # the forward's
    "gdp_chunk_prep_sm90_tokens float16 K=64 V=128 l2norm",                 # all rows
])
def test_gram_norm_compiles(monkeypatch, match):
    """``chunk_prep.GRAM_NORM`` (on since s40): the token-major operands kernel taking k's
    norms from K K^T's diagonal compiles to sm_90a - another object than the normalise-first
    kernel's; a kernel that does not normalise is the same object either way; a value
    other than True / False is refused."""
    from gdp_jax.kernels import chunk_prep
    from gdp_jax.kernels.chunk_prep import ChunkPrepKernel
    variants = {v.what: v for v in ChunkPrepKernel.variants()}
    _assert_switch_changes_object(monkeypatch, chunk_prep, "GRAM_NORM", True, variants[match])
    plain = variants[match.replace(" l2norm", "")]
    texts = []
    for on in (False, True):
        monkeypatch.setattr(chunk_prep, "GRAM_NORM", on)
        jax.clear_caches()
        texts.append(_lower(plain.fn, *plain.avals))
    assert texts[0] == texts[1]
    monkeypatch.setattr(chunk_prep, "GRAM_NORM", "on")
    jax.clear_caches()
    with pytest.raises(ValueError, match="chunk_prep.GRAM_NORM=.on.; expected True or False"):
        jax.eval_shape(variants[match].fn, *variants[match].avals)


@pytest.mark.parametrize("walk", ["forward", "reverse"])
def test_walk_gmma_default_steps_down(monkeypatch, walk):
    """``chunk_forward.GMMA`` / ``state_grad.GMMA`` (on since s39; the forward's "all"
    since s40) reach the launcher as ``gmma=True`` only for walks that can take warpgroup
    MMAs (one operand set, one value tile a CTA, no hi + lo split; all rows or the read-out
    rows); two operand sets, tile pairs and the split keep warp MMAs (and the warp-MMA
    variants their keys: no ``gmma`` constexpr at all); with the switch off no walk gets
    it."""
    from gdp_jax.kernels import binding
    module, kernel = _walk(walk)
    name = ("gdp_chunk_fwd_sm90 bfloat16 K=128 V=128 ckpt=0 BV=32" if walk == "forward"
            else "gdp_chunk_bwd_dh_sm90 bfloat16 K=128 V=128 dS_end bfloat16 fused ddo BV=32")
    (v,) = [v for v in kernel.variants() if v.what == name]
    seen = []
    monkeypatch.setattr(binding, "custom_call", lambda *a, **k: seen.append(
        k.get("gmma", False)) or tuple(jax.ShapeDtypeStruct(o.shape, o.dtype) for o in a[2]))

    def gmma(**kw):
        seen.clear()
        jax.eval_shape(lambda *a: v.fn(*a, **kw), *v.avals)
        return seen[-1]

    assert module.GMMA == ("all" if walk == "forward" else True)   # (forward: since s40)
    assert gmma() is True           # (on all rows "all" is True: no read-out rows' tiles)
    assert gmma(stages=2) is False and gmma(split=True) is False
    assert gmma(pairs=2) is False
    monkeypatch.setattr(module, "GMMA", False)
    assert gmma() is False
    assert gmma(gmma=True) is True                    # an explicit request is kept


def test_walk_writes_o_tokens_compiles(monkeypatch):
    """``chunk_forward.O_TOKENS``: the forward walk writing o token-major (all rows and the
    read-out rows, warpgroup MMAs as the default walk) compiles to sm_90a; its variants
    are listed for the value tiles the switch applies to ("auto": 64 columns, where
    ``pick_bv`` fills the GPU with them; none while off); other values are refused."""
    from gdp_jax.kernels import chunk_forward
    V = 128
    monkeypatch.setattr(chunk_forward, "O_TOKENS", False)
    assert not [v for v in ChunkForwardKernel.variants() if "_rows " in v.what]
    assert not chunk_forward.writes_o_tokens(64, 16, V)
    monkeypatch.setattr(chunk_forward, "O_TOKENS", "auto")
    auto = [v.what for v in ChunkForwardKernel.variants() if "_rows " in v.what]
    assert auto and all(" BV=64" in w for w in auto)
    SMS = ChunkForwardKernel.SMS
    assert chunk_forward.writes_o_tokens(SMS // 2, 1, V)          # 132 CTAs of 64 columns
    assert not chunk_forward.writes_o_tokens(SMS // 2 - 1, 1, V)  # 32-column tiles there
    assert not chunk_forward.writes_o_tokens(SMS, 1, 32)
    monkeypatch.setattr(chunk_forward, "O_TOKENS", "yes")
    with pytest.raises(ValueError, match="chunk_forward.O_TOKENS='yes'; expected True"):
        ChunkForwardKernel.variants()
    monkeypatch.setattr(chunk_forward, "O_TOKENS", True)
    walks = [v for v in ChunkForwardKernel.variants()
             if v.what.startswith("gdp_chunk_fwd_sm90_rows bfloat16 K=128 V=128")]
    assert sorted(v.what for v in walks) == sorted(
        f"gdp_chunk_fwd_sm90_rows bfloat16 K=128 V=128 ckpt=0 BV={bv}{r} o_tokens"
        for bv in ChunkForwardKernel.value_tiles(V) for r in ("", " rows=32"))
    for v in walks:
        if "BV=64" in v.what:
            assert "CuteDSLRT_NvJaxCutlassCall" in _lower(v.fn, *v.avals), v.what
