"""The shard_map side of context parallelism: metadata, collectives, custom_vjp.

Rank r of P holds tokens [r*Tl, (r+1)*Tl) of every row. Per call:

    forward:  summary = prepare(local)  ->  all_gather (one, float32)  ->  fold the maps of
              ranks [a, r)  ->  apply with the composed incoming state
    backward: summary = prepare(do)     ->  all_gather (one more)      ->  fold the maps of
              ranks (r, f)  ->  apply with the composed outgoing-state gradient

or, for many ranks, the log-depth fold (:mod:`gdp_jax.cp.fold`): a segmented prefix scan
over ``lax.ppermute`` (1 + ceil(log2(P - 1)) rounds of ONE summary each) that hands apply
the already composed map as a one-entry :class:`SummarySlice`. Which fold runs is chosen
per call by a cost model (``fold.choose_fold``; override: ``fold=`` here or the
environment variable GDP_CP_FOLD = auto | gather | scan) and recorded in the saved
metadata (``GDPSavedMetadata.fold``), which the backward reads.

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

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from gdp_jax import _vma
from gdp_jax.cp import fold as scan_fold
from gdp_jax.cp.protocol import (CuTeDSLGatedDeltaProductCPBackend, GDPInputs, SummarySlice,
                                 XlaGatedDeltaProductCPBackend, summary_dtype)


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


def rank_metadata(cu_seqlens, rank, cp_size: int, local_len: int, batch: int = 1,
                  replicated=None):
    """Per-rank CP metadata from GLOBAL ``cu_seqlens`` [N + 1] (or None: batched rows).

    ``rank`` may be a Python int (for tests) or ``lax.axis_index``. Example: lengths
    [5, 4, 7] on 4 ranks of 4 tokens give (a, f - 1) = (0,1) (0,2) (1,3) (2,3).
    ``replicated`` ([] bool, or None: False): every rank holds the whole input
    (:func:`replicated_inputs`), so each computes it alone, as one device would: nothing
    crosses a rank border, every rank produces its own initial-state gradient, and the
    final states come from rank 0 (the same on every rank).
    """
    meta = _rank_metadata(cu_seqlens, rank, cp_size, local_len, batch)
    if replicated is None:
        return meta
    rep, rank = jnp.asarray(replicated, bool), jnp.asarray(rank, jnp.int32)
    return meta._replace(continues_in=meta.continues_in & ~rep,
                         continues_out=meta.continues_out & ~rep,
                         fwd_mask=meta.fwd_mask & ~rep, bwd_mask=meta.bwd_mask & ~rep,
                         owns_start=meta.owns_start | rep,
                         owns_end=jnp.where(rep, rank == 0, meta.owns_end))


def replicated_inputs(cp_axis, *tensors):
    """[] bool, the same on every rank: is every tensor bitwise the same on all ranks of
    ``cp_axis`` (inputs passed replicated, ``in_specs=P()``, under
    ``shard_map(check_vma=False)``, where the types cannot tell)? Compared by two
    fingerprints per tensor - wrapping uint32 sums of its bits times two hashes of each
    element's position: integer sums, so the same bits give the same fingerprint in any
    reduction order - so one small all_gather, not the tensors, crosses ranks. Shards of a
    sequence that are bitwise identical on every rank look replicated too (nothing can
    tell them apart)."""
    fps = []
    for x in tensors:
        if x is None:
            continue
        bits = _bits32(x)
        idx = lax.iota(jnp.uint32, x.size).reshape(x.shape)
        for mult in (2654435761, 2246822519):             # odd multiplicative hashes
            h = idx * jnp.uint32(mult)
            fps.append(jnp.sum(bits * (h ^ (h >> 15)), dtype=jnp.uint32))
    allfp = lax.all_gather(jnp.stack(fps), cp_axis)        # [P, 2 x tensors]
    return jnp.all(allfp == allfp[0])


def _bits32(x):
    """x's bits as uint32 (16-bit: zero-extended; 64-bit: the two halves xor-ed)."""
    size = jnp.dtype(x.dtype).itemsize
    if size == 8:
        u = lax.bitcast_convert_type(x, jnp.uint64)
        return (u ^ (u >> 32)).astype(jnp.uint32)
    u = lax.bitcast_convert_type(x, {2: jnp.uint16, 4: jnp.uint32}[size])
    return u.astype(jnp.uint32)


def _rank_metadata(cu_seqlens, rank, cp_size: int, local_len: int, batch: int = 1):
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


def backend_for(spec, backend: str):
    if backend == "cutedsl":
        return CuTeDSLGatedDeltaProductCPBackend(spec, spec.recompute_chunk_num)
    return XlaGatedDeltaProductCPBackend(spec)


def _mask_rows(x, keep):
    return jnp.where(keep.reshape(keep.shape + (1,) * (x.ndim - 1)), x, 0)


# --- the two folds ----------------------------------------------------------------------

def _gathered_slice(summary, mask, cp_axis, packed: bool):
    """All P summaries, [P, F, HV, K, V + K], and which of them this rank composes."""
    return gathered_slice(lax.all_gather(summary, cp_axis), mask, packed)


def gathered_slice(every, mask, packed: bool):
    """The :class:`SummarySlice` of all P ranks' summaries ``every`` [P, ...] (stacked as
    the ranks return them) and ``mask`` [P], which of them this rank composes."""
    return SummarySlice(every[:, None] if packed else every, mask)


def _scanned_slice(summary, meta, cu_seqlens, cp_axis, P: int, local_len: int,
                   backward: bool):
    """The composed map of the ranks this rank folds, as a one-entry [1, F, HV, K, V + K]
    slice (masked off where nothing crosses the boundary), by the segmented scan."""
    x = summary[None] if cu_seqlens is not None else summary      # [F, HV, K, V + K]
    every = jax.vmap(lambda j: rank_metadata(cu_seqlens, j, P, local_len, x.shape[0]))(
        jnp.arange(P, dtype=jnp.int32))
    fwd_resets, bwd_resets = scan_fold.fold_resets(every.continues_in, every.continues_out,
                                                   every.first_seq, every.last_seq)
    rank = lax.axis_index(cp_axis)
    resets, pos = (bwd_resets[::-1], P - 1 - rank) if backward else (fwd_resets, rank)
    composed = scan_fold.exclusive_segmented_scan(
        x, resets, pos, P, scan_fold.ppermute_shift(cp_axis, P, reverse=backward))
    crosses = meta.continues_out if backward else meta.continues_in
    return SummarySlice(composed[None], crosses[None])


def _fold_slice(fold, summary, meta, cu_seqlens, cp_axis, local_len, backward):
    P = axis_size(cp_axis)
    if fold == "scan":
        return _scanned_slice(summary, meta, cu_seqlens, cp_axis, P, local_len, backward)
    mask = meta.bwd_mask if backward else meta.fwd_mask
    return _gathered_slice(summary, mask, cp_axis, cu_seqlens is not None)


def summary_nbytes(spec) -> int:
    """Bytes of one rank's summary: [F, HV, K, V + K] float32 (float64 for float64)."""
    F = 1 if spec.packed else spec.B
    return (F * spec.HV * spec.K * (spec.V + spec.K)
            * jnp.dtype(summary_dtype(spec.cdt)).itemsize)


# --- the custom_vjp ---------------------------------------------------------------------
# Residuals: the backend's SavedContext (its tensors are custom_vjp residuals, its frozen
# metadata rides along as pytree aux data) and the rank metadata.

@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _cp_op(backend, cp_axis, fold, q, k, v, g, beta, h0, cu_seqlens, replicated):
    # the primal runs only where nothing differentiates the call: keep no chunk states
    return rank_forward(backend.for_inference(), cp_axis, fold, q, k, v, g, beta, h0,
                        cu_seqlens, replicated)[0]


def rank_forward(backend, cp_axis, fold, q, k, v, g, beta, h0, cu_seqlens, replicated=None):
    """One rank's forward: ((o, this rank's part of the final states), residuals); the
    custom_vjp's primal and (with ``backend.for_differentiation()``) its fwd.
    ``replicated``: :func:`rank_metadata`'s."""
    P = axis_size(cp_axis)
    summary, local_ctx, meta = rank_prepare(backend, lax.axis_index(cp_axis), P, q, k, v, g,
                                            beta, h0, cu_seqlens, replicated)
    preceding = _fold_slice(fold, summary, meta, cu_seqlens, cp_axis, q.shape[1], False)
    return rank_apply(backend, fold, local_ctx, meta, preceding, h0.dtype, cu_seqlens)


def rank_prepare(backend, rank, P: int, q, k, v, g, beta, h0, cu_seqlens, replicated=None):
    """The forward's first half on rank ``rank`` of ``P``: (summary, local context,
    :class:`CPRankMetadata`); also run under a vmap over segments by :mod:`gdp_jax.cp.split`
    (no collective in it)."""
    meta = rank_metadata(cu_seqlens, rank, P, q.shape[1], q.shape[0], replicated)
    inputs = GDPInputs(q, k, v, g, beta, h0, meta.cu_local, meta.first_seq, meta.last_seq,
                       meta.continues_in, meta.continues_out)
    summary, local_ctx = backend.cp_forward_prepare(inputs)
    return summary, local_ctx, meta


def rank_apply(backend, fold, local_ctx, meta, preceding, h0_dtype, cu_seqlens):
    """The forward's second half from the folded :class:`SummarySlice` ``preceding``:
    ((o, this rank's part of the final states), residuals)."""
    o, final_local, saved = backend.cp_forward_apply(local_ctx, preceding)
    saved = dataclasses.replace(saved, metadata=dataclasses.replace(saved.metadata, fold=fold))
    final = _mask_rows(final_local, meta.owns_end).astype(h0_dtype)   # this rank's part
    h0_dtype_tag = jnp.zeros((0,), h0_dtype)     # carries the primal dtype to the backward
    return (o, final), (saved, meta, cu_seqlens, h0_dtype_tag)


def rank_backward(backend, cp_axis, fold, res, cts):
    """One rank's backward: the cotangents of (q, k, v, g, beta, this rank's part of h0's,
    None for cu_seqlens) from those of (o, its final-state part)."""
    summary, bwd_ctx = rank_backward_prepare(backend, res, cts)
    saved, meta, cu_seqlens, _ = res
    following = _fold_slice(saved.metadata.fold, summary, meta, cu_seqlens, cp_axis,
                            cts[0].shape[1], True)
    return rank_backward_apply(backend, res, bwd_ctx, following)


def rank_backward_prepare(backend, res, cts):
    """The backward's first half: (summary, backward context); no collective in it."""
    saved, meta, _, _ = res
    do, dfinal = cts
    return backend.cp_backward_prepare((do, _mask_rows(dfinal, meta.owns_end)), saved)


def rank_backward_apply(backend, res, bwd_ctx, following):
    """The backward's second half from the folded :class:`SummarySlice` ``following``."""
    _, meta, _, h0_dtype_tag = res
    dq, dk, dv, dg, dbeta, dh0 = backend.cp_backward_apply(bwd_ctx, following)
    dh0 = _mask_rows(dh0, meta.owns_start)        # this rank's part; summed outside
    return dq, dk, dv, dg, dbeta, dh0.astype(h0_dtype_tag.dtype), None


def _rank_forward_differentiated(backend, cp_axis, fold, *args):
    """The custom_vjp's fwd: :func:`rank_forward` with the backward to follow."""
    return rank_forward(backend.for_differentiation(), cp_axis, fold, *args)


def _cp_op_backward(backend, cp_axis, fold, res, cts):
    return rank_backward(backend, cp_axis, fold, res, cts) + (None,)   # replicated: none


_cp_op.defvjp(_rank_forward_differentiated, _cp_op_backward)


def cp_gated_delta_product(spec, q, k, v, g, beta, initial_state, cu_seqlens, *, cp_axis,
                           backend="xla", fold=None):
    """Context-parallel GDP on this rank's shard; returns (o, final_states replicated).

    fold: 'auto' | 'gather' | 'scan', or None for the environment variable GDP_CP_FOLD
    (default 'auto': :func:`gdp_jax.cp.fold.choose_fold`, by P and the summary size).
    """
    check_split(cp_axis, q=q, k=k, v=v, g=g, beta=beta)
    P = axis_size(cp_axis)
    fold = scan_fold.choose_fold(P, summary_nbytes(spec), fold)
    if initial_state is None:
        initial_state = jnp.zeros((spec.N, spec.HV, spec.K, spec.V), spec.cdt)
    # Without check_vma a replicated input cannot be seen in the types: compare the ranks'
    # inputs on device, and where they are the same, let every rank compute alone (the
    # single-device answer, not wrong numbers: docs/ERRORS.md).
    replicated = (None if _vma.checks_vma(cp_axis) or P == 1
                  else lax.stop_gradient(replicated_inputs(cp_axis, q, k, v, g, beta)))
    # Rank-varying inside the custom_vjp: each rank returns its own part of the gradient
    # and the cast's transpose (check_vma=True) or shard_map's (check_vma=False) sums them.
    h0 = _vma.vary(initial_state, cp_axis)
    o, final_part = _cp_op(backend_for(spec, backend), cp_axis, fold, q, k, v, g, beta, h0,
                           cu_seqlens, replicated)
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
