"""The ``cutedsl`` backward: checkpointed chunk states + the reverse dS kernel + XLA.

Pipeline (one ``jax.jit``-able function, no host syncs, no atomics):

1. Chunk start states S0 [B, NC, HV, K, V]: the forward kernel kept the start state of
   every (N + 1)-th chunk (N = ``recompute_chunk_num``); XLA recomputes the N states after
   each checkpoint with a scan of N steps over all groups at once
   (:func:`gdp_jax.chunked.states_from_checkpoints`). N = 0 recomputes nothing.
2. CuTe DSL kernel (:mod:`gdp_jax.kernels.chunk_bwd_sm90`): the sequential reverse
   recursion of the state gradient, writing dS_end (gradient w.r.t. each chunk's end
   state, float32) and the initial-state gradients. XLA prepares its operands: Kt, w,
   qg (16 bit), dO (16 bit) and ddo = P^T dO (float32).
3. XLA, all chunks at once: the chunk-local map (o, S_end) = f(chunk inputs, S0) is
   differentiated with ``jax.vjp`` given (dO, dS_end): no sequential dependency left.
   This is the part that still runs in XLA (the WY backward, dq/dk/dw/dg).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gdp_jax import _vma, chunked
from gdp_jax.kernels import fwd


@functools.lru_cache(maxsize=None)
def _launcher():
    fwd.import_cutlass()
    import cutlass
    import cutlass.cute as cute
    from gdp_jax.kernels import chunk_bwd_sm90 as mod

    @cute.jit
    def launch(stream, kt, w, qg, ddo, do, decay, reset, seq, last, dfinal, ds_end, dh0, *,
               K: cutlass.Constexpr, V: cutlass.Constexpr, BV: cutlass.Constexpr,
               ab_name: cutlass.Constexpr, split: cutlass.Constexpr):
        mod.get_kernel(K, V, BV, ab_name, split)(stream, kt, w, qg, ddo, do, decay, reset, seq,
                                                 last, dfinal, ds_end, dh0)

    return launch, mod.KERNEL_VERSION


def dh_kernel_call(kt, w, qg, ddo, do, decay, reset, seq, last, dfinal, *, BV: int,
                   split: bool | None = None):
    """The reverse kernel (:func:`kernel_call`), ``jax.vmap``-able."""
    from gdp_jax.kernels._batching import fold_mapped_axis
    call = fold_mapped_axis(lambda *a: kernel_call(*a, BV=BV, split=split), seq_arg=7,
                            table_arg=9, out_kinds=("rows", "rows"))
    return call(kt, w, qg, ddo, do, decay, reset, seq, last, dfinal)


def kernel_call(kt, w, qg, ddo, do, decay, reset, seq, last, dfinal, *, BV: int,
                split: bool | None = None):
    """The raw reverse kernel -> (dS_end [B, NC, HV, K, V] float32, dh0 [N, HV, K, V] float32).

    kt, w, qg: [B, NC, HV, C, K] and do: [B, NC, HV, C, V] in one 16-bit dtype; ddo:
    [B, NC, HV, C, V] float32; decay: [B, NC, HV] float32; reset, seq, last: [B, NC] int32;
    dfinal: [N, HV, K, V] float32. Rows of dh0 for sequences without chunks stay unwritten.
    """
    launch, version = _launcher()
    import cutlass.jax as cjax

    B, NC, HV, C, K = kt.shape
    V = do.shape[-1]
    ab_name = jnp.dtype(kt.dtype).name
    split = fwd.default_split(kt.dtype) if split is None else bool(split)
    call = cjax.cutlass_call(
        launch,
        output_shape_dtype=(jax.ShapeDtypeStruct((B, NC, HV, K, V), jnp.float32),
                            jax.ShapeDtypeStruct(dfinal.shape, jnp.float32)),
        use_static_tensors=True,
        compile_key=("gdp_chunk_bwd_dh_sm90", version, B, NC, HV, K, V, BV, dfinal.shape[0],
                     ab_name, split),
        K=K, V=V, BV=BV, ab_name=ab_name, split=split,
    )
    return call(kt, w, qg, ddo, do, decay, reset, seq, last, dfinal)


def backward_operands(ch: chunked.ChunkInputs, it: chunked.Intra, doc, scale, ab_dtype,
                      mm_dtype=None):
    """XLA part: (kt, w, qg, ddo, do, decay) for :func:`dh_kernel_call`.

    doc: [B, NC, HV, C, V] output-row cotangents. ddo = P^T doc is what the chunk output
    sends to Delta directly (FLA's dv_local).
    """
    acc = fwd.acc_dtype(ab_dtype)
    p = fwd.readout_matrix(ch, it, scale, mm_dtype)
    ddo = chunked.mm(jnp.swapaxes(p, -1, -2), doc, mm_dtype)
    qg = scale * it.gam[..., None] * ch.q
    cast = lambda x: x.astype(ab_dtype)
    return (cast(it.Kt), cast(it.w), cast(qg), ddo.astype(acc), cast(doc),
            jnp.exp(it.G_last).astype(acc))


def shared_backward_work(ch: chunked.ChunkInputs, doc, scale, ab_dtype):
    """What the backward and the CP backward summary both need, computed once:
    (intra-chunk factors, their vjp, the reverse kernel's operands)."""
    mmd = fwd.matmul_dtype(ab_dtype)
    it, it_pull = jax.vjp(lambda c: fwd.intra_chunk(c, mmd), ch)
    return it, it_pull, backward_operands(ch, it, doc, scale, ab_dtype, mmd)


def chunk_backward(ch: chunked.ChunkInputs, layout: chunked.ChunkLayout, h0, states,
                   stride: int, doc, dfinal, scale, ab_dtype, shared=None):
    """Gradients of (output rows, final states) w.r.t. (chunk inputs, initial states).

    Same contract as :func:`gdp_jax.chunked.chunk_backward`, plus the forward kernel's
    checkpoints ``states`` [B, NG, HV, K, V] taken every ``stride`` chunks. ``shared``:
    :func:`shared_backward_work` of the same inputs if the caller has it already.
    """
    fwd.check_supported(ch, ab_dtype)
    B, _, HV = ch.k.shape[:3]
    acc = fwd.acc_dtype(ab_dtype)
    mmd = fwd.matmul_dtype(ab_dtype)
    if shared is None:
        shared = shared_backward_work(ch, doc, scale, ab_dtype)
    it, it_pull, (kt, w, qg, ddo, do, decay) = shared
    S0 = chunked.states_from_checkpoints(it, layout, h0, states, stride)
    ds_end, dh0 = dh_kernel_call(kt, w, qg, ddo, do, decay, *fwd.layout_flags(layout),
                                 dfinal.astype(acc), BV=fwd.pick_bv(B, HV, ch.v.shape[-1]))
    # The custom call's results carry no varying-axes type under shard_map: give them one.
    ds_end, dh0 = _vma.like((ds_end.astype(ch.k.dtype), dh0.astype(dfinal.dtype)), ch, S0,
                            dfinal)
    dch = chunked.local_grads(ch, it, it_pull, S0, doc, ds_end, scale, mmd)
    dh0 = jnp.where((layout.seq_len > 0)[:, None, None, None], dh0, dfinal)
    return dch, dh0


def backward_summaries(ch: chunked.ChunkInputs, layout: chunked.ChunkLayout, doc, dfinal,
                       scale, ab_dtype, shared=None):
    """(gamma, M^T) of every sequence on the reverse kernel: [N, HV, K, V], [N, HV, K, K]
    with dS_start = M^T dS_end + gamma (contract of
    :func:`gdp_jax.chunked.backward_summaries`).

    One reverse kernel pass over V + K gradient columns: the first V are the real backward
    with no gradient from beyond the sequence's end (their start-state gradient is gamma);
    the last K have dO = 0 and the identity as the end-state gradient (their start-state
    gradient is M^T I = M^T). ``shared``: as for :func:`chunk_backward`.
    """
    B, NC, HV, C, K = ch.k.shape
    V = ch.v.shape[-1]
    fwd.check_supported(ch, ab_dtype, extra_columns=K)
    acc = fwd.acc_dtype(ab_dtype)
    if shared is None:
        shared = shared_backward_work(ch, doc, scale, ab_dtype)
    kt, w, qg, ddo, do, decay = shared[2]
    df = fwd.identity_columns(dfinal.astype(acc), K)
    _, dh0 = dh_kernel_call(kt, w, qg, fwd.zero_columns(ddo, K), fwd.zero_columns(do, K),
                            decay, *fwd.layout_flags(layout), df, BV=fwd.pick_bv(B, HV, V + K))
    dh0 = jnp.where((layout.seq_len > 0)[:, None, None, None], dh0, df)
    return dh0[..., :V], dh0[..., V:]
