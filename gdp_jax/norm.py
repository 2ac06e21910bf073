"""The op's XLA-glue reductions in a form that does not depend on the tensor around a row:
the L2 norm of q and k rows (:func:`l2_normalize`) and the GVA head sum, the transpose of
repeating key heads to value heads (:func:`repeat_heads`).

Same formula as :func:`gdp_jax.reference.l2_normalize` (FLA's ``x / sqrt(sum(x**2) +
1e-6)``, overflow-safe), but every sum over a row is exact in integers
(:func:`exact_row_sum`) and the backward is written out (:func:`l2_normalize`'s custom
vjp) instead of autodiff's broadcast transpose. XLA picks a float reduction's order by the
whole tensor's shape (on the H200 a sequence's dk came out with other bits alone than in a
batch or a pack: s21-1, s22-1 in benchmarks/results/CURRENT.md); an integer sum has no
order, so a row's result depends only on that row. The head sum is a written chain of adds.

The op uses them with ``batch_invariant=True``; otherwise the reference formula and
``jnp.repeat``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from gdp_jax.reference import L2_EPS


def _limbs(dtype):
    """(integer dtype, top): a sum of D limbs each below 2**s, s = top - ceil(log2 D),
    stays below 2**top. float64 (x64 on) sums in int64, everything else in int32."""
    if jnp.dtype(dtype) == jnp.dtype(jnp.float64):
        return jnp.int64, 62
    return jnp.int32, 30


def _pow2(e, dtype):
    """2.0 ** e for an integer array e [..., 1], exact (two factors, so neither overflows)."""
    h = e // 2
    one = jnp.ones(e.shape, dtype)
    return jnp.ldexp(one, h), jnp.ldexp(one, e - h)


def exact_row_sum(t, bound_exp):
    """Sum over the last axis of t [..., D] (float32 or float64) given integers
    ``bound_exp`` [..., 1] with every |t| < 2**bound_exp in the row: [..., 1].

    Each term is cut into two integer limbs on the grid 2**(bound_exp - s) and 2**(bound_exp
    - 2 s) (s = 30 - ceil(log2 D) bits for float32); the limb sums are exact, so their order
    does not matter, and the result is rounded once from them. The error is at most
    D 2**(bound_exp - 2 s - 1) (2**-40 of the bound at D = 128: below float32's own sum's)."""
    idt, top = _limbs(t.dtype)
    D = t.shape[-1]
    s = top - max(D - 1, 0).bit_length()
    f1, f2 = _pow2(s - bound_exp, t.dtype)
    u = (t * f1) * f2                       # |u| < 2**s, exact but where it underflows
    hi = jnp.round(u)
    lo = jnp.round((u - hi) * (2.0 ** s))   # u - hi is exact, |.| <= 1/2
    sh = jnp.sum(hi.astype(idt), axis=-1, keepdims=True)
    sl = jnp.sum(lo.astype(idt), axis=-1, keepdims=True)
    total = sh.astype(t.dtype) + sl.astype(t.dtype) * (2.0 ** -s)
    g1, g2 = _pow2(bound_exp - s, t.dtype)
    return (total * g1) * g2


def _exponent_above(a):
    """e with a < 2**e for a >= 0 (float [..., 1]): frexp's exponent, one bit of headroom
    for the rounding of the products the bound is for."""
    return jnp.frexp(a)[1].astype(jnp.int32) + 1


def _finite_or_nan(total, a):
    # a non-finite bound (an inf or NaN in the row) must not reach the integer casts' result
    return jnp.where(jnp.isfinite(a), total, jnp.nan)


@jax.custom_vjp
def l2_normalize(x):
    """x [..., D] (float32 or float64) -> x / sqrt(sum(x**2) + 1e-6) along the last axis
    (overflow-safe as :func:`gdp_jax.reference.l2_normalize`); row sums by
    :func:`exact_row_sum`."""
    return _forward(x)[0]


def _forward(x):
    mx = jnp.max(jnp.abs(x), axis=-1, keepdims=True)      # a max is exact in any order
    m = lax.stop_gradient(jnp.where(mx > 1, mx, jnp.ones_like(mx)))
    xs = x / m
    a = mx / m                                             # = max |xs| (rounding is monotone)
    ss = _finite_or_nan(exact_row_sum(xs * xs, 2 * _exponent_above(a)), a)
    r = lax.rsqrt(ss + L2_EPS / (m * m))
    y = xs * r
    return y, (y, r, m)


def _backward(res, dy):
    # y = xs r, r = (sum xs^2 + c)^(-1/2), c and m constants:
    # d xs = r (dy - y sum(dy y)),  dx = d xs / m;  |y| <= 1, so |dy y| <= max |dy|
    y, r, m = res
    dy = dy.astype(y.dtype)
    a = jnp.max(jnp.abs(dy), axis=-1, keepdims=True)
    sdy = _finite_or_nan(exact_row_sum(dy * y, _exponent_above(a)), a)
    return (r * (dy - y * sdy) / m,)


l2_normalize.defvjp(_forward, _backward)


def repeat_heads(x, group: int, axis: int):
    """``jnp.repeat(x, group, axis)`` (each key head to its ``group`` value heads) whose
    transpose adds a head's ``group`` cotangents in a written order (g0 + g1) + g2 + ...
    instead of a reduction whose order XLA picks by shape."""
    if group == 1:
        return x
    axis = axis % x.ndim

    @jax.custom_vjp
    def rep(x):
        return jnp.repeat(x, group, axis=axis)

    def bwd(_, dy):
        d = dy.reshape(dy.shape[:axis] + (x.shape[axis], group) + dy.shape[axis + 1:])
        take = lambda j: lax.index_in_dim(d, j, axis + 1, keepdims=False)
        acc = take(0)
        for j in range(1, group):
            acc = acc + take(j)
        return (acc.astype(x.dtype),)

    rep.defvjp(lambda x: (rep(x), None), bwd)
    return rep(x)
