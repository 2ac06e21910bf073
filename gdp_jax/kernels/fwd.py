"""The ``cutedsl`` forward: XLA intra-chunk factors + the fused CuTe DSL chunk kernel.

Hybrid pipeline (one ``jax.jit``-able function, no host syncs):

1. XLA, all chunks at once (batched matmuls, float32): chunk-local cumsum, the WY factors
   w, u (the inverse (I + A)^-1 on its own kernel, :mod:`gdp_jax.kernels.inverse`),
   Kt = exp(G_last - G) k, and the readout operands qg = scale * exp(G) q and
   P = scale * tril(q k^T * Gam). Cast to the 16-bit input dtype.
2. CuTe DSL kernel (:mod:`gdp_jax.kernels.chunk_fwd_sm90`): the sequential state
   recursion over chunks with the state in registers, fused with the chunk output
   o = qg S0 + P Delta, and the final state of each sequence. The per-chunk start states
   are never written to HBM.

The kernel is compiled at JAX lowering time through ``cutlass.jax.cutlass_call`` (static
shapes, stable compile key). It needs ``nvidia-cutlass-dsl`` (4.8.1 tested) and, to run,
an sm_90 GPU; compiling works on any x86-64 host with ``CUTE_DSL_ARCH=sm_90a``.
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp

from gdp_jax import chunked

SUPPORTED_DTYPES = ("bfloat16", "float16")
SUPPORTED_HEAD_DIMS = (64, 128)
_MAX_ELEMS = 2 ** 31 - 1      # the kernel indexes with 32-bit offsets (static layouts)


def unsupported_reason(*, K: int, V: int, dtype, B: int, NC: int, HV: int):
    """None if the kernel supports this call, else a sentence saying why not."""
    name = jnp.dtype(dtype).name
    if name not in SUPPORTED_DTYPES:
        return (f"the cutedsl kernels take bfloat16/float16 inputs (16-bit tensor-core "
                f"operands); got {name}")
    if K not in SUPPORTED_HEAD_DIMS or V not in SUPPORTED_HEAD_DIMS:
        return f"the cutedsl kernels support K, V in {SUPPORTED_HEAD_DIMS}; got K={K}, V={V}"
    return size_reason(B=B, NC=NC, HV=HV, K=K, V=V)


def size_reason(*, B: int, NC: int, HV: int, K: int, V: int):
    """None if every per-chunk tensor of a kernel call (rows [C, max(K, V, C)], states
    [K, V]) fits the kernels' 32-bit offsets, else why not."""
    C = chunked.CHUNK
    if B * NC * HV * max(C * max(K, V, C), K * V) > _MAX_ELEMS:
        return "the problem is too large for the kernel's 32-bit offsets"
    return None


@functools.lru_cache(maxsize=None)
def import_cutlass():
    """Import the CuTe DSL (once). Without a GPU, compile for sm_90a (the only target)."""
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import cutlass  # noqa: F401
    import cutlass.cute  # noqa: F401
    import cutlass.jax  # noqa: F401
    from gdp_jax.kernels import chunk_fwd_sm90
    return chunk_fwd_sm90


def cutlass_importable() -> tuple[bool, str]:
    try:
        import_cutlass()
    except Exception as e:  # ImportError, or the DSL's own load errors
        return False, f"nvidia-cutlass-dsl cannot be imported ({type(e).__name__}: {e})"
    return True, "ok"


def pick_bv(B: int, HV: int, V: int) -> int:
    """Value-tile width (columns of the state per CTA).

    32 is the configuration verified on the H200 (tests and benchmarks, 2026-11-29). BV = 64
    compiles (tests/test_kernels_compile.py) but has not run on a GPU yet; it halves the
    re-reads of w/Kt/qg/P when B*HV fills the GPU on its own.
    """
    del B, HV, V
    return 32


@functools.lru_cache(maxsize=None)
def _launcher():
    mod = import_cutlass()
    import cutlass
    import cutlass.cute as cute

    @cute.jit
    def launch(stream, w, kt, qg, p, u, decay, reset, seq, last, h0, o, final, states, *,
               K: cutlass.Constexpr, V: cutlass.Constexpr, BV: cutlass.Constexpr,
               ab_name: cutlass.Constexpr, split: cutlass.Constexpr,
               ckpt: cutlass.Constexpr):
        mod.get_kernel(K, V, BV, ab_name, split, ckpt)(
            stream, w, kt, qg, p, u, decay, reset, seq, last, h0, o, final, states)

    return launch


def default_split(dtype) -> bool:
    """Split the recurrent operands into hi+lo parts for bfloat16 (8-bit mantissa); float16
    (11-bit) is accurate enough without (relative RMS ~6e-4 measured on the H200)."""
    return jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16)


def num_checkpoints(NC: int, ckpt: int) -> int:
    """Chunk-state checkpoints kept for ``ckpt`` = recompute_chunk_num + 1 (0: none)."""
    return -(-NC // ckpt) if ckpt > 0 else 0


def chunk_kernel_call(w, kt, qg, p, u, decay, reset, seq, last, h0, *, BV: int,
                      split: bool | None = None, ckpt: int = 0, states_dtype=jnp.float32):
    """The forward kernel (:func:`kernel_call`), ``jax.vmap``-able."""
    from gdp_jax.kernels._batching import fold_mapped_axis
    call = fold_mapped_axis(
        lambda *a: kernel_call(*a, BV=BV, split=split, ckpt=ckpt, states_dtype=states_dtype),
        seq_arg=7, table_arg=9,
        out_kinds=("rows", "rows", "rows" if ckpt else "dummy"))
    return call(w, kt, qg, p, u, decay, reset, seq, last, h0)


def kernel_call(w, kt, qg, p, u, decay, reset, seq, last, h0, *, BV: int,
                split: bool | None = None, ckpt: int = 0, states_dtype=jnp.float32):
    """The raw kernel: per-chunk operands -> (o rows [B, NC, HV, C, V], final [N, HV, K, V],
    states [B, ceil(NC / ckpt), HV, K, V] in ``states_dtype`` (float32 or the 16-bit
    operand dtype: written straight from the float32 state), or [1] float32 when ckpt = 0).

    w, kt, qg: [B, NC, HV, C, K]; p: [B, NC, HV, C, C] (16-bit, one dtype); u:
    [B, NC, HV, C, V] float32; decay: [B, NC, HV] float32; reset, seq, last: [B, NC] int32; h0:
    [N, HV, K, V] float32. Final rows of sequences without a last chunk are left unwritten.
    ``states`` holds the start state of chunks 0, ckpt, 2 ckpt, ... (the backward's
    checkpoints).
    """
    mod = import_cutlass()
    import cutlass.jax as cjax

    B, NC, HV, C, K = w.shape
    V = u.shape[-1]
    ab_name = jnp.dtype(w.dtype).name
    split = default_split(w.dtype) if split is None else bool(split)
    states_shape = (B, num_checkpoints(NC, ckpt), HV, K, V) if ckpt else (1,)
    states_dtype = jnp.dtype(states_dtype) if ckpt else jnp.dtype(jnp.float32)
    if states_dtype.name not in ("float32", ab_name):
        raise ValueError(f"states_dtype must be float32 or {ab_name}; got {states_dtype}")
    call = cjax.cutlass_call(
        _launcher(),
        output_shape_dtype=(jax.ShapeDtypeStruct((B, NC, HV, C, V), w.dtype),
                            jax.ShapeDtypeStruct(h0.shape, jnp.float32),
                            jax.ShapeDtypeStruct(states_shape, states_dtype)),
        use_static_tensors=True,
        compile_key=("gdp_chunk_fwd_sm90", mod.KERNEL_VERSION, B, NC, HV, K, V, BV,
                     h0.shape[0], ab_name, split, ckpt, states_dtype.name),
        K=K, V=V, BV=BV, ab_name=ab_name, split=split, ckpt=ckpt,
    )
    return call(w, kt, qg, p, u, decay, reset, seq, last, h0)


def acc_dtype(ab_dtype):
    """Accumulator / state dtype of the kernels: float32 (float64 only in emulated tests)."""
    return jnp.promote_types(jnp.float32, ab_dtype)


def readout_matrix(ch: chunked.ChunkInputs, it: chunked.Intra, scale: float, mm_dtype=None):
    """P = scale * tril(q k^T * Gam): [B, NC, HV, C, C] (Gam is 0 above the diagonal)."""
    return scale * chunked.causal_scores(ch.q, ch.k, it.Gam, mm_dtype)


MATMUL_DTYPE = None
"""Operand dtype of the cutedsl path's XLA matmuls (:func:`gdp_jax.chunked.mm`). None:
float32 operands (XLA runs them as TF32 on the GPU). "bfloat16": bf16 operands with
float32 accumulation, for bfloat16 inputs only (FLA's choice in every kernel). Measured on
the H200 at (8, 4096, 16, n=2), 2026-11-29: fwd+bwd 23.2 -> 23.0 ms, forward 4.72 ->
4.55 ms, but 1.5-2x the error (output rel RMS 2.5e-3 -> 3.8e-3, worst gradient 6.5e-3 ->
8.9e-3 vs the float64 reference): not worth it while the time is memory traffic, so off."""


def matmul_dtype(ab_dtype):
    """:data:`MATMUL_DTYPE` if it applies to ``ab_dtype`` (bfloat16 inputs), else None."""
    if MATMUL_DTYPE is not None and jnp.dtype(ab_dtype) == jnp.dtype(jnp.bfloat16):
        return jnp.dtype(MATMUL_DTYPE)
    return None


def intra_chunk(ch: chunked.ChunkInputs, mm_dtype=None) -> chunked.Intra:
    """:func:`gdp_jax.chunked.intra_chunk` with the WY inverse on its kernel
    (:mod:`gdp_jax.kernels.inverse`)."""
    from gdp_jax.kernels import inverse
    return chunked.intra_chunk(ch, inverse=inverse.unit_lower_inverse, mm_dtype=mm_dtype)


def chunk_operands(ch: chunked.ChunkInputs, scale: float, ab_dtype):
    """XLA part: per-chunk kernel operands in the 16-bit dtype (u and decay float32)."""
    mmd = matmul_dtype(ab_dtype)
    it = intra_chunk(ch, mmd)
    acc = acc_dtype(ab_dtype)
    p = readout_matrix(ch, it, scale, mmd).astype(ab_dtype)
    qg = (scale * it.gam[..., None] * ch.q).astype(ab_dtype)
    return (it.w.astype(ab_dtype), it.Kt.astype(ab_dtype), qg, p, it.u.astype(acc),
            jnp.exp(it.G_last).astype(acc))


def check_supported(ch: chunked.ChunkInputs, ab_dtype, extra_columns: int = 0):
    """ValueError unless the kernels run this call (``extra_columns``: state columns
    beyond V, as the CP summaries use)."""
    B, NC, HV, C, K = ch.k.shape
    V = ch.v.shape[-1]
    why = (unsupported_reason(K=K, V=V, dtype=ab_dtype, B=B, NC=NC, HV=HV)
           or size_reason(B=B, NC=NC, HV=HV, K=K, V=V + extra_columns))
    if why is not None:
        raise ValueError(f"backend='cutedsl' cannot run this call: {why}")


def layout_flags(layout: chunked.ChunkLayout):
    """(reset, seq, last) as the kernels' int32 [B, NC] flags."""
    i32 = lambda x: x.astype(jnp.int32)
    return i32(layout.reset), i32(layout.seq_of_chunk), i32(layout.is_last)


def chunk_forward(ch: chunked.ChunkInputs, layout: chunked.ChunkLayout, h0, scale, ab_dtype,
                  ckpt: int = 0, operands=None):
    """(o rows [B, NC, HV, C, V], final states [N, HV, K, V], checkpoints).

    Same first two results as ``chunked.chunk_forward``. ``ckpt`` > 0 also keeps the start
    state of every ckpt-th chunk (see :func:`chunk_kernel_call`) for the backward.
    ``operands``: :func:`chunk_operands` of the same inputs if the caller has them already.
    """
    check_supported(ch, ab_dtype)
    B, NC, HV = ch.k.shape[:3]
    if operands is None:
        operands = chunk_operands(ch, scale, ab_dtype)
    (w, kt, qg, p, u, decay), bad = causal_operands(operands)
    h0 = h0.astype(acc_dtype(ab_dtype))
    oc, final, states = chunk_kernel_call(w, kt, qg, p, u, decay, *layout_flags(layout), h0,
                                          BV=pick_bv(B, HV, ch.v.shape[-1]), ckpt=ckpt,
                                          states_dtype=checkpoint_dtype(ab_dtype))
    oc = jnp.where(bad[..., None], jnp.asarray(jnp.nan, oc.dtype), oc)
    final = jnp.where((layout.seq_len > 0)[:, None, None, None], final, h0)
    return oc, final, states


def causal_operands(operands):
    """The chunk kernel's operands made safe for its plain MMAs (``P @ Delta`` multiplies
    P's zeros above the diagonal by later rows of Delta = u - w S): a row i with a
    non-finite entry in w or u enters as zeros and its Kt row as NaN (so the chunk's end
    state, and everything after it, is NaN); a non-finite readout row (qg, P) enters as
    zeros. ``bad`` [B, NC, HV, C] marks the output rows to set to NaN: from the first
    non-finite w/u row on, and every non-finite readout row. Exact when all is finite."""
    w, kt, qg, p, u, decay = operands
    rows = lambda x: jnp.all(jnp.isfinite(x), axis=-1)
    state_ok, bad = chunked.nonfinite_rows(None, finite=rows(w) & rows(u))
    read_ok = rows(qg) & rows(p)
    keep = lambda x, ok, fill: jnp.where(ok[..., None], x, jnp.asarray(fill, x.dtype))
    operands = (keep(w, state_ok, 0), keep(kt, state_ok, jnp.nan), keep(qg, read_ok, 0),
                keep(p, read_ok, 0), keep(u, state_ok, 0), decay)
    return operands, bad | ~read_ok


CHECKPOINT_DTYPE = None
"""dtype of the chunk-state checkpoints kept for the backward. None: bfloat16 for bfloat16
inputs (half the memory; what FLA and Megatron keep for h; +0..6% gradient error measured
with the emulated kernels), float32 for float16 inputs (states can exceed float16's range,
65504, and float16 users get float16-level gradients), the accumulator dtype otherwise.
Or a dtype name, e.g. "float32", for every call."""


def checkpoint_dtype(ab_dtype):
    if CHECKPOINT_DTYPE is not None:
        return jnp.dtype(CHECKPOINT_DTYPE)
    if jnp.dtype(ab_dtype) == jnp.dtype(jnp.bfloat16):
        return jnp.dtype(jnp.bfloat16)
    return acc_dtype(ab_dtype)


def zero_columns(x, K: int):
    """[..., V] -> [..., V + K]: x next to K zero columns (the summaries' extra columns)."""
    return jnp.concatenate([x, jnp.zeros(x.shape[:-1] + (K,), x.dtype)], axis=-1)


def identity_columns(x, K: int):
    """[..., K, V] -> [..., K, V + K]: x next to an identity (the summaries' M columns)."""
    eye = jnp.broadcast_to(jnp.eye(K, dtype=x.dtype), x.shape[:-1] + (K,))
    return jnp.concatenate([x, eye], axis=-1)


def forward_summaries(ch: chunked.ChunkInputs, layout: chunked.ChunkLayout, scale, ab_dtype,
                      operands=None):
    """(E, M) of every sequence on the forward kernel: [N, HV, K, V] and [N, HV, K, K] with
    S_end = M S_start + E (same contract as :func:`gdp_jax.chunked.forward_summaries`).

    One kernel pass over V + K state columns: the first V run from a zero start state
    (their final state is E), the last K start from the identity with u = 0 (their final
    state is M I = M). Columns of the state never mix, so this is exact and costs one
    forward kernel on (V + K) / V times the columns, instead of XLA's K x K transition per
    chunk and their parallel composition. ``operands``: as for :func:`chunk_forward`.
    """
    B, NC, HV, C, K = ch.k.shape
    V = ch.v.shape[-1]
    check_supported(ch, ab_dtype, extra_columns=K)
    if operands is None:
        operands = chunk_operands(ch, scale, ab_dtype)
    (w, kt, qg, p, u, decay), _ = causal_operands(operands)   # non-finite: NaN summaries
    N = layout.seq_len.shape[0]
    h0 = identity_columns(jnp.zeros((N, HV, K, V), acc_dtype(ab_dtype)), K)
    _, final, _ = chunk_kernel_call(w, kt, qg, p, zero_columns(u, K), decay,
                                    *layout_flags(layout), h0, BV=pick_bv(B, HV, V + K))
    final = jnp.where((layout.seq_len > 0)[:, None, None, None], final, h0)
    return final[..., :V], final[..., V:]
