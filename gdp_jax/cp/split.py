"""Context parallelism inside one device: each row's T cut into S contiguous segments that
run as the CP ranks of a ``jax.vmap`` axis.

A device walks each (row, head) chunk by chunk; with few rows x heads (one long sequence)
most of a GPU idles. Cutting T into S segments gives S x as many walks, joined by the CP
algebra of :mod:`gdp_jax.cp.driver`: every segment's summary, one fold, then every
segment's pass from its folded start state - forward and backward, packed sequences
crossing segments included (the offsets stay global, as under ``shard_map``). The
collectives are the vmap axis's, so nothing leaves the device; the kernels' vmap rule
folds the segment axis into their rows.

Results equal the unsplit op up to the fold's rounding (float64: ~1e-15). The summaries
cost a pass on V + K state columns per segment, so it pays only where the unsplit op
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

from gdp_jax.cp import driver
from gdp_jax.cp import fold as scan_fold
from gdp_jax.kernels.chunk_forward import ChunkForwardKernel

AXIS = "gdp_intra_device_cp"
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
                       segments: int, backend: str):
    """``intra_cp="auto"``: :func:`split_gated_delta_product` where nothing differentiates
    the call, ``unsplit`` (the plain op: (q, k, v, g, beta, initial_state, cu_seqlens) ->
    (o, final)) under differentiation - its forward and backward (a custom_vjp whose
    primal is the split and whose rules are the unsplit op's)."""
    def primal(*args):
        return split_gated_delta_product(spec, *args, segments=segments, backend=backend)

    def fwd(*args):
        return jax.vjp(unsplit, *args)

    def bwd(vjp, cts):
        return vjp(cts)[:-1] + (None,)           # no cotangent for the integer offsets

    op = jax.custom_vjp(primal)
    op.defvjp(fwd, bwd)
    return op(q, k, v, g, beta, initial_state, cu_seqlens)


def split_gated_delta_product(spec, q, k, v, g, beta, initial_state, cu_seqlens, *,
                              segments: int, backend: str, fold: Optional[str] = None):
    """The op on ``segments`` CP ranks of one device: (o [B, T, HV, V], final states
    [N, HV, K, V]); ``spec`` is the whole call's (checked) spec. ``fold``: 'gather' (None:
    the default) or 'scan' (GDP_CP_FOLD is for the cross-device CP and is not read here)."""
    S = segments
    local = dataclasses.replace(spec, T=spec.T // S)
    # the vmap axis's collectives are copies in one device's memory: the cross-device cost
    # model does not apply, and gathering the S summaries is one small copy
    fold = scan_fold.choose_fold(S, driver.summary_nbytes(local), fold or "gather")
    if initial_state is None:
        initial_state = jnp.zeros((spec.N, spec.HV, spec.K, spec.V), spec.cdt)

    def cut(x):             # [B, T, ...] -> [S, B, T / S, ...]
        if x is None:
            return None
        x = x.reshape((x.shape[0], S, x.shape[1] // S) + x.shape[2:])
        return jnp.moveaxis(x, 1, 0)

    o, final = _split_op(driver.backend_for(local, backend), fold, cut(q), cut(k), cut(v),
                         cut(g), cut(beta), initial_state, cu_seqlens)
    o = jnp.moveaxis(o, 0, 1)
    return o.reshape((o.shape[0], spec.T) + o.shape[3:]), final


# The custom_vjp sits OUTSIDE the vmap: JAX does not keep a vmap axis name bound while it
# transposes a custom_vjp inside the vmap (the rank's backward needs the axis for its
# fold), so the backward runs its own vmap over the segment axis. The collectives around
# the per-rank custom_vjp under shard_map (psum of the final-state parts, the sum of the
# initial-state gradient parts) are written out here, with their transposes.

@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _split_op(backend, fold, q, k, v, g, beta, h0, cu_seqlens):
    # the primal runs only where nothing differentiates the call: keep no chunk states
    return _split_fwd(backend.for_inference(), fold, q, k, v, g, beta, h0, cu_seqlens)[0]


def _split_fwd(backend, fold, q, k, v, g, beta, h0, cu_seqlens):
    def rank(q, k, v, g, beta):
        (o, final_part), res = driver.rank_forward(backend, AXIS, fold, q, k, v, g, beta, h0,
                                                   cu_seqlens)
        return (o, lax.psum(final_part, AXIS)), res

    (o, final), res = jax.vmap(rank, axis_name=AXIS)(q, k, v, g, beta)
    return (o, final[0]), res


def _split_bwd(backend, fold, res, cts):
    do, dfinal = cts            # dfinal reaches every segment (the transpose of the psum)

    def rank(res, do):
        return driver.rank_backward(backend, AXIS, fold, res, (do, dfinal))

    dq, dk, dv, dg, dbeta, dh0, _ = jax.vmap(rank, axis_name=AXIS)(res, do)
    return dq, dk, dv, dg, dbeta, dh0.sum(0), None


def _split_fwd_differentiated(backend, fold, *args):
    return _split_fwd(backend.for_differentiation(), fold, *args)


_split_op.defvjp(_split_fwd_differentiated, _split_bwd)
