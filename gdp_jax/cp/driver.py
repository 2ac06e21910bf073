"""The shard_map side of context parallelism: metadata, collectives, custom_vjp.

Rank r of P holds tokens [r*Tl, (r+1)*Tl) of every row. Per call:

    forward:  summary = prepare(local)  ->  all_gather (one, float32)  ->  fold the maps of
              ranks [a, r)  ->  apply with the composed incoming state
    backward: summary = prepare(do)     ->  all_gather (one more)      ->  fold the maps of
              ranks (r, f)  ->  apply with the composed outgoing-state gradient

a = ``preceding_rank_start`` (first rank holding a piece of this rank's first sequence),
f = ``following_rank_stop`` (one past the last rank holding a piece of its last sequence).
Everything is derived on device from the GLOBAL ``cu_seqlens`` and ``lax.axis_index``:
static shapes, no host sync, nothing that assumes a single process.

Initial and final states (beyond Megatron and FLA): the fold starts from the sequence's
initial state instead of zero; final states and initial-state gradients are produced on
the rank where a sequence ends / starts. The collectives that make them replicated (a
``psum`` of the final states, and the cast of the initial state to rank-varying whose
transpose sums its gradient) sit OUTSIDE the custom_vjp, so JAX's own transposes apply:
the gradients are right whether or not shard_map tracks varying axes (``check_vma``),
and the custom_vjp never assumes how a cotangent is replicated.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from gdp_jax import _vma
from gdp_jax.cp.protocol import (CuTeDSLGatedDeltaProductCPBackend, GDPInputs, SummarySlice,
                                 XlaGatedDeltaProductCPBackend)


class CPRankMetadata(NamedTuple):
    """Where this rank's shard sits among the sequences (all on-device arrays).

    cu_local: [N + 1] local offsets (global offsets clipped to the shard), or None.
    first_seq, last_seq: [F] sequence holding the first / last local token.
    continues_in / continues_out: [] bool.
    preceding_rank_start (a), following_rank_stop (f): [] int32.
    fwd_mask: [P] ranks a <= j < r;  bwd_mask: [P] ranks r < j < f.
    owns_start / owns_end: [N] bool, this rank produces the sequence's initial-state
      gradient / final state (empty sequences: rank 0).
    """
    cu_local: jax.Array | None
    first_seq: jax.Array
    last_seq: jax.Array
    continues_in: jax.Array
    continues_out: jax.Array
    preceding_rank_start: jax.Array
    following_rank_stop: jax.Array
    fwd_mask: jax.Array
    bwd_mask: jax.Array
    owns_start: jax.Array
    owns_end: jax.Array


def rank_metadata(cu_seqlens, rank, cp_size: int, local_len: int, batch: int = 1):
    """Per-rank CP metadata from GLOBAL ``cu_seqlens`` [N + 1] (or None: batched rows).

    ``rank`` may be a Python int (for tests) or ``lax.axis_index``. Example: lengths
    [5, 4, 7] on 4 ranks of 4 tokens give (a, f - 1) = (0,1) (0,2) (1,3) (2,3).
    """
    rank = jnp.asarray(rank, jnp.int32)
    j = jnp.arange(cp_size, dtype=jnp.int32)
    if cu_seqlens is None:
        cin, cout = rank > 0, rank < cp_size - 1
        a, f = jnp.int32(0), jnp.int32(cp_size)
        seqs = jnp.arange(batch, dtype=jnp.int32)
        return CPRankMetadata(None, seqs, seqs, cin, cout, a, f, j < rank, j > rank,
                              jnp.broadcast_to(rank == 0, (batch,)),
                              jnp.broadcast_to(rank == cp_size - 1, (batch,)))
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    N = cu.shape[0] - 1
    start, end = rank * local_len, (rank + 1) * local_len
    s_first = jnp.clip(jnp.searchsorted(cu, start, side="right") - 1, 0, N - 1)
    s_last = jnp.clip(jnp.searchsorted(cu, end - 1, side="right") - 1, 0, N - 1)
    cin = cu[s_first] < start
    cout = cu[s_last + 1] > end
    a = (cu[s_first] // local_len).astype(jnp.int32)
    f = ((cu[s_last + 1] - 1) // local_len + 1).astype(jnp.int32)
    nonempty = cu[1:] > cu[:-1]
    owns_start = jnp.where(nonempty, (cu[:-1] >= start) & (cu[:-1] < end), rank == 0)
    owns_end = jnp.where(nonempty, (cu[1:] > start) & (cu[1:] <= end), rank == 0)
    return CPRankMetadata(jnp.clip(cu - start, 0, local_len), s_first[None], s_last[None],
                          cin, cout, a, f, (j >= a) & (j < rank), (j > rank) & (j < f),
                          owns_start, owns_end)


def axis_size(cp_axis) -> int:
    """Static size of a bound mesh axis; ValueError when called outside shard_map."""
    try:
        return int(lax.axis_size(cp_axis))
    except (NameError, KeyError, ValueError, TypeError) as e:
        raise ValueError(f"cp_axis={cp_axis!r} is not a mesh axis bound here: call the op "
                         f"inside jax.shard_map over a mesh with that axis ({e})") from None


def _backend_for(cfg, backend: str):
    if backend == "cutedsl":
        return CuTeDSLGatedDeltaProductCPBackend(cfg, cfg.recompute_chunk_num)
    return XlaGatedDeltaProductCPBackend(cfg)


def _mask_rows(x, keep):
    return jnp.where(keep.reshape(keep.shape + (1,) * (x.ndim - 1)), x, 0)


# --- the custom_vjp ---------------------------------------------------------------------
# Residuals: the backend's SavedContext (its tensors are custom_vjp residuals, its frozen
# metadata rides along as pytree aux data) and the rank metadata.

@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _cp_op(backend, cp_axis, q, k, v, g, beta, h0, cu_seqlens):
    return _cp_fwd(backend, cp_axis, q, k, v, g, beta, h0, cu_seqlens)[0]


def _cp_fwd(backend, cp_axis, q, k, v, g, beta, h0, cu_seqlens):
    P = axis_size(cp_axis)
    rank = lax.axis_index(cp_axis)
    meta = rank_metadata(cu_seqlens, rank, P, q.shape[1], q.shape[0])
    inputs = GDPInputs(q, k, v, g, beta, h0, meta.cu_local, meta.first_seq, meta.last_seq,
                       meta.continues_in, meta.continues_out)
    summary, local_ctx = backend.cp_forward_prepare(inputs)
    gathered = lax.all_gather(summary, cp_axis)
    if cu_seqlens is not None:
        gathered = gathered[:, None]                 # [P, 1, HV, K, V + K]
    o, final_local, saved = backend.cp_forward_apply(local_ctx,
                                                     SummarySlice(gathered, meta.fwd_mask))
    final = _mask_rows(final_local, meta.owns_end).astype(h0.dtype)   # this rank's part
    h0_dtype_tag = jnp.zeros((0,), h0.dtype)     # carries the primal dtype to the backward
    return (o, final), (saved, meta, cu_seqlens, h0_dtype_tag)


def _cp_bwd(backend, cp_axis, res, cts):
    saved, meta, cu_seqlens, h0_dtype_tag = res
    do, dfinal = cts
    dfinal_local = _mask_rows(dfinal, meta.owns_end)
    summary, bwd_ctx = backend.cp_backward_prepare((do, dfinal_local), saved)
    gathered = lax.all_gather(summary, cp_axis)
    if cu_seqlens is not None:
        gathered = gathered[:, None]
    dq, dk, dv, dg, dbeta, dh0 = backend.cp_backward_apply(
        bwd_ctx, SummarySlice(gathered, meta.bwd_mask))
    dh0 = _mask_rows(dh0, meta.owns_start)        # this rank's part; summed outside
    return dq, dk, dv, dg, dbeta, dh0.astype(h0_dtype_tag.dtype), None


_cp_op.defvjp(_cp_fwd, _cp_bwd)


def cp_gated_delta_product(cfg, q, k, v, g, beta, initial_state, cu_seqlens, *, cp_axis,
                           backend="xla"):
    """Context-parallel GDP on this rank's shard; returns (o, final_states replicated)."""
    check_split(cp_axis, q=q, k=k, v=v, g=g, beta=beta)
    if initial_state is None:
        N = cfg.B if cu_seqlens is None else cu_seqlens.shape[0] - 1
        initial_state = jnp.zeros((N, cfg.HV, q.shape[-1], v.shape[-1]), cfg.cdt)
    # Rank-varying inside the custom_vjp: each rank returns its own part of the gradient
    # and the cast's transpose (check_vma=True) or shard_map's (check_vma=False) sums them.
    h0 = _vma.vary(initial_state, cp_axis)
    o, final_part = _cp_op(_backend_for(cfg, backend), cp_axis, q, k, v, g, beta, h0,
                           cu_seqlens)
    return o, lax.psum(final_part, cp_axis)


def check_split(cp_axis, **tensors):
    """ValueError when shard_map tracks varying axes and a [B, T, ...] input does not vary
    over ``cp_axis`` (passed replicated, e.g. ``in_specs=P()``): every rank would then
    treat the whole sequence as its shard. Without check_vma this cannot be seen."""
    if not _vma.checks_vma(cp_axis):
        return
    for name, x in tensors.items():
        if x is not None and cp_axis not in _vma.vma_of(x):
            raise ValueError(
                f"{name} (shape {tuple(x.shape)}) does not vary over cp_axis={cp_axis!r}: "
                f"under context parallelism every [B, T, ...] input must be this rank's "
                f"shard of T (shard_map in_specs P(None, {cp_axis!r})), not replicated")
