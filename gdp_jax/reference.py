"""Token-by-token Gated DeltaProduct recurrence: the ground truth of every test.

This is deliberately the most literal transcription of the recurrence in
``docs/API.md``: one ``lax.scan`` step per token, ``n`` Householder updates inside it.
It is slow (sequential in T) but obviously right, runs in float64, and is
differentiated by plain autodiff.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp
from jax import lax

from gdp_jax import _checks

L2_EPS = 1e-6


def l2_normalize(x, axis=-1):
    """``x / sqrt(sum(x**2) + 1e-6)`` along ``axis`` (FLA's in-kernel L2 norm).

    Overflow-safe: the sum of squares is taken of ``x / m``, m = max |x| (when m > 1), and
    the epsilon scaled to match, so |x| up to the dtype's maximum normalises instead of
    overflowing to inf (and returning zeros). For m <= 1 no scaling is applied (the
    formula is exactly FLA's).
    """
    xs, s, _ = _scaled_squares(x, axis)
    return xs * lax.rsqrt(s)


def l2_norm_scale(x, axis=-1):
    """``1 / sqrt(sum(x**2) + 1e-6)`` along ``axis`` (keepdims): the factor
    :func:`l2_normalize` multiplies a row by, from the same overflow-safe sums (XLA shares
    them). The norm's backward is ``rho (dy - y sum(y dy))`` with y the normalised row."""
    _, s, m = _scaled_squares(x, axis)
    return lax.rsqrt(s) / m


def _scaled_squares(x, axis):
    """(x / m, sum((x / m)**2) + 1e-6 / m**2, m) with m = max |x| where it exceeds 1."""
    m = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
    # Only scale down (m > 1); lax.stop_gradient: m is a constant factor of the formula,
    # its derivative cancels exactly, and max's gradient would be a tie-breaking mess.
    m = lax.stop_gradient(jnp.where(m > 1, m, jnp.ones_like(m)))
    xs = x / m
    return xs, jnp.sum(xs * xs, axis=axis, keepdims=True) + L2_EPS / (m * m), m


def gated_delta_product_reference(
        q: jax.Array, k: jax.Array, v: jax.Array, g: Optional[jax.Array], beta: jax.Array,
        *, scale: Optional[float] = None, initial_state: Optional[jax.Array] = None,
        output_final_state: bool = False, cu_seqlens: Optional[jax.Array] = None,
        use_qk_l2norm: bool = False,
) -> Union[jax.Array, Tuple[jax.Array, jax.Array]]:
    """The GDP recurrence, token by token.

    Args (shapes as in docs/API.md; n = number of Householder steps):
      q: [B, T, H, K]; k: [B, T, n, H, K]; v: [B, T, n, HV, V]; g: [B, T, HV] or None;
      beta: [B, T, n, HV]; initial_state: [N, HV, K, V] or None;
      cu_seqlens: [N + 1] int offsets of packed sequences (B == 1) or None.
    Returns:
      o [B, T, HV, V] in q.dtype, and with ``output_final_state`` the final states
      [N, HV, K, V] (float32, or float64 when the inputs are float64).
    """
    q, k, v, g, beta, initial_state = _checks.as_arrays(q, k, v, g, beta, initial_state)
    spec = _checks.check_inputs(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                cu_seqlens=cu_seqlens, backend="xla")
    B, T, n, H, HV, K, V, N = spec.B, spec.T, spec.n, spec.H, spec.HV, spec.K, spec.V, spec.N
    cdt = spec.compute_dtype
    group = HV // H

    qf = q.astype(cdt)
    kf = k.astype(cdt)
    if use_qk_l2norm:
        qf, kf = l2_normalize(qf), l2_normalize(kf)
    # Key head kh serves value heads kh*group ... (kh+1)*group - 1.
    qf = jnp.repeat(qf, group, axis=2)                      # [B, T, HV, K]
    kf = jnp.repeat(kf, group, axis=3)                      # [B, T, n, HV, K]
    vf = v.astype(cdt)
    bf = beta.astype(cdt)
    gf = jnp.zeros((B, T, HV), cdt) if g is None else g.astype(cdt)

    h0 = (jnp.zeros((N, HV, K, V), cdt) if initial_state is None
          else initial_state.astype(cdt))
    # Per (b, t): which sequence the token belongs to, and whether it starts / ends it.
    if cu_seqlens is None:
        seq_id = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
        t = jnp.arange(T)
        is_start = jnp.broadcast_to(t == 0, (B, T))
        is_end = jnp.broadcast_to(t == T - 1, (B, T))
    else:
        cu = cu_seqlens.astype(jnp.int32)
        t = jnp.arange(T)
        sid = jnp.searchsorted(cu, t, side="right") - 1     # sequence holding token t
        sid = jnp.clip(sid, 0, N - 1)
        is_start = t == cu[sid]
        is_end = t == cu[sid + 1] - 1
        seq_id, is_start, is_end = sid[None], is_start[None], is_end[None]

    def step(carry, xs):
        S, final = carry                                    # [B, HV, K, V], [N, HV, K, V]
        q_t, k_t, v_t, g_t, b_t, sid_t, start_t, end_t = xs
        S = jnp.where(start_t[:, None, None, None], h0[sid_t], S)
        S = jnp.exp(g_t)[..., None, None] * S
        for j in range(n):
            kj, vj, bj = k_t[:, j], v_t[:, j], b_t[:, j]    # [B, HV, K], [B, HV, V], [B, HV]
            pred = jnp.einsum("bhk,bhkv->bhv", kj, S)
            S = S + bj[..., None, None] * kj[..., :, None] * (vj - pred)[..., None, :]
        o_t = scale_ * jnp.einsum("bhk,bhkv->bhv", q_t, S)
        # Record final states of sequences that end at this token.
        upd = jnp.where(end_t[:, None, None, None], S, final[sid_t])
        final = final.at[sid_t].set(upd)
        return (S, final), o_t

    scale_ = spec.scale
    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (qf, kf, vf, gf, bf, seq_id, is_start, is_end))
    S0 = jnp.zeros((B, HV, K, V), cdt)
    (_, final), o = lax.scan(step, (S0, h0), xs)
    o = jnp.moveaxis(o, 0, 1).astype(q.dtype)
    if output_final_state:
        return o, final.astype(spec.state_dtype)
    return o
