"""Context parallelism inside one device: each row's T cut into S contiguous segments that
run as CP ranks along a ``jax.vmap`` axis.

A device walks each (row, head) chunk by chunk; with few rows x heads (one long sequence)
most of a GPU idles. Cutting T into S segments gives S x as many walks, joined by the CP
algebra of :mod:`gdp_jax.cp.driver`: every segment's summary, one fold, then every
segment's pass from its folded start state - forward and backward, packed sequences
crossing segments included (the offsets stay global, as under ``shard_map``). The
summaries come out of the vmap stacked, so the fold needs no collective; the kernels'
vmap rule folds the segment axis into their rows. Under ``shard_map`` CP a rank may split
its shard too: the P x S segments fold as one CP of P x S ranks (one all_gather).

Results equal the unsplit op up to the fold's rounding (float64: ~1e-15). The summaries
cost a walk on V + K state columns per segment, so it pays only where the unsplit op
cannot fill the device.
"""
from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Optional, Union

import jax
import jax.numpy as jnp
from jax import lax

from gdp_jax import _vma
from gdp_jax.cp import driver
from gdp_jax.kernels.chunk_forward import ChunkForwardKernel

# "auto", modeled on the cutedsl recursion kernels (one CTA per row x head x value tile,
# their narrowest tiles 16 columns; ``ChunkForwardKernel.SMS``): split only where the
# unsplit walks launch at most one CTA an SM (B x HV x V / 16 <= SMS), into the fewest
# segments (a power of two) that give more than 2 x SMS CTAs, each of at least
# MIN_SEGMENT_TOKENS tokens; and only a call that nothing differentiates (training runs
# unsplit). Measured (H100, s27, the re-walk CP pass): at 128 such CTAs,
# (1, 65536, 16, 2), the forward split in 4 took 6.25 ms against 7.06 unsplit (FLA 7.32);
# fwd+bwd 28.2 against 24.8, hence unsplit under differentiation.
MIN_SEGMENT_TOKENS = 4096


def check(intra_cp) -> None:
    """ValueError unless ``intra_cp`` is None, "auto" or an int >= 1 (any T; the decoding
    path (T = 1) checks it too, then runs unsplit)."""
    if intra_cp is None or (isinstance(intra_cp, str) and intra_cp == "auto"):
        return
    if (isinstance(intra_cp, bool) or not isinstance(intra_cp, numbers.Integral)
            or intra_cp < 1):
        raise ValueError(f"intra_cp={intra_cp!r}; expected None, 'auto' or an int >= 1")


def num_segments(spec, intra_cp: Union[None, int, str]) -> int:
    """S for this call: 1 (no split) for None; ``intra_cp`` itself for an int (it must
    divide T); for "auto", 1 unless B x HV x V / 16 <= SMS, then the smallest power of
    two S with S x B x HV x V / 16 > 2 x SMS, T / S >= MIN_SEGMENT_TOKENS and S | T (the
    largest such power below it where none reaches 2 x SMS)."""
    check(intra_cp)
    if intra_cp is None:
        return 1
    if intra_cp == "auto":
        SMS = ChunkForwardKernel.SMS
        ctas = spec.B * spec.HV * spec.V // min(ChunkForwardKernel.value_tiles(spec.V))
        S = 1
        if ctas > SMS:
            return S
        while (S * ctas <= 2 * SMS and spec.T % (2 * S) == 0
               and spec.T // (2 * S) >= MIN_SEGMENT_TOKENS):
            S *= 2
        return S
    intra_cp = int(intra_cp)
    if spec.T % intra_cp:
        raise ValueError(f"intra_cp={intra_cp} does not divide T={spec.T} (q has shape "
                         f"[{spec.B}, {spec.T}, {spec.H}, {spec.K}]): the segments must be "
                         f"equal")
    return intra_cp


def forward_only_split(unsplit, spec, q, k, v, g, beta, initial_state, cu_seqlens, *,
                       segments: int, backend: str, cp_axis: Optional[str] = None):
    """``intra_cp="auto"``: :func:`split_gated_delta_product` where nothing differentiates
    the call, ``unsplit`` (the plain op: (q, k, v, g, beta, initial_state, cu_seqlens) ->
    (o, final)) under differentiation - its forward and backward (a custom_vjp whose
    primal is the split and whose rules are the unsplit op's)."""
    def primal(*args):
        return split_gated_delta_product(spec, *args, segments=segments, backend=backend,
                                         cp_axis=cp_axis)

    def fwd(*args):
        return jax.vjp(unsplit, *args)

    def bwd(vjp, cts):
        return vjp(cts)[:-1] + (None,)           # no cotangent for the integer offsets

    op = jax.custom_vjp(primal)
    op.defvjp(fwd, bwd)
    return op(q, k, v, g, beta, initial_state, cu_seqlens)


def split_gated_delta_product(spec, q, k, v, g, beta, initial_state, cu_seqlens, *,
                              segments: int, backend: str, cp_axis: Optional[str] = None):
    """The op on ``segments`` CP ranks of one device: (o [B, T, HV, V], final states
    [N, HV, K, V]); ``spec`` is the whole call's (checked) spec. With ``cp_axis`` (inside
    ``jax.shard_map``, which must track varying axes): this rank's shard of T is cut, and
    the P x S segments fold as one CP over P x S ranks (rank r's segment s is number
    r S + s; ``cu_seqlens`` global, as under plain CP)."""
    S = segments
    local = dataclasses.replace(spec, T=spec.T // S)
    if initial_state is None:
        initial_state = jnp.zeros((spec.N, spec.HV, spec.K, spec.V), spec.cdt)
    if cp_axis is not None:
        if not _vma.checks_vma(cp_axis):
            raise ValueError(f"intra_cp={S} with cp_axis={cp_axis!r} needs "
                             f"jax.shard_map(check_vma=True) (the default), where inputs "
                             f"passed replicated can be told from shards of T")
        driver.check_split(cp_axis, q=q, k=k, v=v, g=g, beta=beta)
        initial_state = _vma.vary(initial_state, cp_axis)   # rank parts of dh0 summed

    def cut(x):             # [B, T, ...] -> [S, B, T / S, ...]
        if x is None:
            return None
        x = x.reshape((x.shape[0], S, x.shape[1] // S) + x.shape[2:])
        return jnp.moveaxis(x, 1, 0)

    o, final = _split_op(driver.backend_for(local, backend), cp_axis, cut(q), cut(k), cut(v),
                         cut(g), cut(beta), initial_state, cu_seqlens)
    if cp_axis is not None:
        final = lax.psum(final, cp_axis)
    o = jnp.moveaxis(o, 0, 1)
    return o.reshape((o.shape[0], spec.T) + o.shape[3:]), final


# Two vmaps over the segment axis a direction, the fold between them OUTSIDE the vmaps:
# every segment's summary comes out of the first as one stacked array (all of them, with
# no collective), and under shard_map one all_gather over cp_axis adds the other ranks'
# (a collective over a vmap axis inside shard_map(check_vma=True) fails in jax 0.10).
# The custom_vjp sits outside the vmaps too: JAX does not keep a vmap axis bound while it
# transposes a custom_vjp inside one.

@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _split_op(backend, cp_axis, q, k, v, g, beta, h0, cu_seqlens):
    # the primal runs only where nothing differentiates the call: keep no chunk states
    return _split_fwd(backend.for_inference(), cp_axis, q, k, v, g, beta, h0, cu_seqlens)[0]


def _all_summaries(summary, cp_axis):
    """Every segment's summary [P S, ...] from this rank's stacked ones [S, ...]."""
    if cp_axis is None:
        return summary
    every = lax.all_gather(summary, cp_axis)                   # [P, S, ...]
    return every.reshape((-1,) + summary.shape[1:])


def _split_fwd(backend, cp_axis, q, k, v, g, beta, h0, cu_seqlens):
    S = q.shape[0]
    P = 1 if cp_axis is None else driver.axis_size(cp_axis)
    first = 0 if cp_axis is None else lax.axis_index(cp_axis) * S
    summary, ctx, meta = jax.vmap(lambda s, *x: driver.rank_prepare(
        backend, first + s, P * S, *x, h0, cu_seqlens))(
        jnp.arange(S, dtype=jnp.int32), q, k, v, g, beta)
    every = _all_summaries(summary, cp_axis)
    packed = cu_seqlens is not None
    (o, final), res = jax.vmap(lambda c, m: driver.rank_apply(
        backend, "gather", c, m, driver.gathered_slice(every, m.fwd_mask, packed), h0.dtype,
        cu_seqlens))(ctx, meta)
    return (o, final.sum(0)), res


def _split_bwd(backend, cp_axis, res, cts):
    do, dfinal = cts            # dfinal reaches every segment (the transpose of the sum)
    summary, bwd_ctx = jax.vmap(lambda r, d: driver.rank_backward_prepare(
        backend, r, (d, dfinal)))(res, do)
    every = _all_summaries(summary, cp_axis)
    packed = res[2] is not None
    dq, dk, dv, dg, dbeta, dh0, _ = jax.vmap(lambda r, b: driver.rank_backward_apply(
        backend, r, b, driver.gathered_slice(every, r[1].bwd_mask, packed)))(res, bwd_ctx)
    return dq, dk, dv, dg, dbeta, dh0.sum(0), None


def _split_fwd_differentiated(backend, cp_axis, *args):
    return _split_fwd(backend.for_differentiation(), cp_axis, *args)


_split_op.defvjp(_split_fwd_differentiated, _split_bwd)
