"""``gated_delta_product_step``: one decoding token of the recurrence (docs/API.md, "Decoding").

Per row b and value head h (state S [K, V], a = exp(g)):

    S_0 = a S;  S_j = S_{j-1} + k_j d_j^T,  d_j = beta_j (v_j - S_{j-1}^T k_j);  o = scale S_n^T q

Decode is bound by the state's bytes, so both backends read S once for the products:

* ``xla``: every product the recurrence needs comes from ONE matvec of S with the n + 1
  vectors X = [k_0 .. k_{n-1}, q]: S_{j-1}^T k_j = a S^T k_j + sum_{i<j} d_i (k_i . k_j)
  and S_n^T q = a S^T q + sum_j d_j (k_j . q); then S_n = a S + K^T D is one rank-n update
  (XLA reads S a second time there: 2 reads + 1 write). float64-capable; plain autodiff.
* ``cutedsl``: :mod:`gdp_jax.kernels.step` (one read + one write of S, in place when the
  state is donated); its gradient is the autodiff of the xla step (a ``custom_vjp``).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from gdp_jax import _checks, backends
from gdp_jax.norm import l2_normalize as invariant_l2_normalize, repeat_heads
from gdp_jax.reference import l2_normalize
from gdp_jax.spec import CallSpec

_HI = lax.Precision.HIGHEST     # small matvecs: full float32 (no TF32) costs nothing here


def step_operands(cfg: CallSpec, q, k, v, g, beta):
    """The token's operands in the compute dtype, heads expanded to HV (GVA).

    q [B, H, K], k [B, n, H, K], v [B, n, HV, V], g [B, HV] or None, beta [B, n, HV] ->
    (scale * q [B, HV, K], k [B, HV, n, K], v [B, HV, n, V], beta [B, HV, n], a [B, HV]).
    """
    cdt = jnp.dtype(cfg.compute_dtype)
    group = cfg.HV // cfg.H
    qf, kf = q.astype(cdt), k.astype(cdt)
    if cfg.use_qk_l2norm:
        norm = invariant_l2_normalize if cfg.batch_invariant else l2_normalize
        qf, kf = norm(qf), norm(kf)
    rep = ((lambda x, a: repeat_heads(x, group, a)) if cfg.batch_invariant
           else (lambda x, a: jnp.repeat(x, group, axis=a)))
    qf = cfg.scale * rep(qf, 1)                                          # [B, HV, K]
    kf = jnp.swapaxes(rep(kf, 2), 1, 2)                                  # [B, HV, n, K]
    vf = jnp.swapaxes(v.astype(cdt), 1, 2)                               # [B, HV, n, V]
    bf = jnp.swapaxes(beta.astype(cdt), 1, 2)                            # [B, HV, n]
    a = jnp.ones(bf.shape[:2], cdt) if g is None else jnp.exp(g.astype(cdt))
    return qf, kf, vf, bf, a


def step_math(qs, ks, vs, bs, a, S):
    """The step on prepared operands (:func:`step_operands`), S [B, HV, K, V] in their
    dtype -> (o [B, HV, V], next S). S's products come from one matvec (module docstring)."""
    n = ks.shape[2]
    X = jnp.concatenate([ks, qs[:, :, None]], axis=2)                    # [B, HV, n+1, K]
    P = a[..., None, None] * jnp.einsum("bhmk,bhkv->bhmv", X, S, precision=_HI)
    G = jnp.einsum("bhik,bhmk->bhim", ks, X, precision=_HI)              # k_i . X_m
    d = []
    for j in range(n):
        pred = P[:, :, j]
        for i in range(j):
            pred = pred + G[:, :, i, j, None] * d[i]
        d.append(bs[:, :, j, None] * (vs[:, :, j] - pred))
    D = jnp.stack(d, axis=2)                                             # [B, HV, n, V]
    o = P[:, :, n] + jnp.einsum("bhi,bhiv->bhv", G[:, :, :, n], D, precision=_HI)
    S_next = a[..., None, None] * S + jnp.einsum("bhik,bhiv->bhkv", ks, D, precision=_HI)
    return o, S_next


def xla_step(cfg: CallSpec, q, k, v, g, beta, state):
    """(o [B, HV, V] in q.dtype, next state in state.dtype) on XLA."""
    cdt = cfg.cdt
    o, S = step_math(*step_operands(cfg, q, k, v, g, beta), state.astype(cdt))
    return o.astype(q.dtype), S.astype(state.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def cutedsl_step(cfg: CallSpec, q, k, v, g, beta, state):
    """(o, next state) with the step kernel; gradient = autodiff of :func:`xla_step`."""
    from gdp_jax.kernels.step import StepKernel
    # float32 (the kernel's only dtype; float64 only in the emulated CPU tests)
    o, S = StepKernel.call(*step_operands(cfg, q, k, v, g, beta), state.astype(cfg.cdt))
    return o.astype(q.dtype), S.astype(state.dtype)


def _cutedsl_fwd(cfg, q, k, v, g, beta, state):
    return cutedsl_step(cfg, q, k, v, g, beta, state), (q, k, v, g, beta, state)


def _cutedsl_bwd(cfg, res, cts):
    _, pull = jax.vjp(functools.partial(xla_step, cfg), *res)
    return pull(cts)


cutedsl_step.defvjp(_cutedsl_fwd, _cutedsl_bwd)


def one_token_op(backend: str, spec: CallSpec, q, k, v, g, beta, initial_state):
    """The op on T = 1 unpacked rows (already checked) through the step: 1/62 of a chunk's
    work. Returns (o [B, 1, HV, V], final [B, HV, K, V] in the compute dtype)."""
    cdt = spec.cdt
    state = (jnp.zeros((spec.B, spec.HV, spec.K, spec.V), cdt) if initial_state is None
             else initial_state.astype(cdt))
    run = cutedsl_step if backend == "cutedsl" else xla_step
    o, final = run(spec, q[:, 0], k[:, 0], v[:, 0], None if g is None else g[:, 0],
                   beta[:, 0], state)
    return o[:, None], final


def gated_delta_product_step(q, k, v, g, beta, state, *, scale=None, use_qk_l2norm=False,
                             backend="auto"):
    """One decoding token of Gated DeltaProduct for each of B rows.

    The same numbers as ``gated_delta_product(q[:, None], k[:, None], v[:, None],
    g[:, None], beta[:, None], initial_state=state, output_final_state=True)`` (up to
    rounding), at the cost of one pass over the state.

    Args:
      q: [B, H, K] the token's query (bfloat16, float16, float32; float64 on xla).
      k: [B, n, H, K] its n keys; v: [B, n, HV, V] its n values (HV a multiple of H).
      g: [B, HV] float32 log-decay of this token, or None (no decay).
      beta: [B, n, HV] step sizes.
      state: [B, HV, K, V] float32 (float64 with float64 inputs on xla): the recurrent
        state before this token (zeros for a fresh sequence). Donate it
        (``jax.jit(..., donate_argnums=...)``): the cutedsl kernel then updates it in place.
      scale: readout scale, default K ** -0.5 (a float, a 0-d array, or traced: o is
        linear in it, and jax.grad reaches it).
      use_qk_l2norm: L2-normalise q and every key along K (eps 1e-6), as the op does.
      backend: "xla", "cutedsl" (sm_90 GPU, K <= 128, V a multiple of 32) or "auto".

    Returns:
      (o [B, HV, V] in q.dtype, next state [B, HV, K, V] in state.dtype).
    """
    _checks.check_backend_name(backend)
    _checks.require_static("use_qk_l2norm", use_qk_l2norm)
    traced_scale = _checks.is_traced_scale(scale)
    spec = _checks.check_step_inputs(q, k, v, g, beta, state,
                                     scale=1.0 if traced_scale else scale, backend=backend,
                                     use_qk_l2norm=use_qk_l2norm)
    backend = backends.resolve(backend, spec, available=backends.step_available)
    run = cutedsl_step if backend == "cutedsl" else xla_step
    o, S = run(spec, q, k, v, g, beta, state)
    if traced_scale:       # o is linear in scale (the state is not touched by it)
        o = _checks.scale_output(o, scale, o.dtype)
    return o, S
