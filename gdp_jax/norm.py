"""The op's in-graph L2 norm of q and k rows, with sums in a fixed order.

Same formula as :func:`gdp_jax.reference.l2_normalize` (FLA's ``x / sqrt(sum(x**2) +
1e-6)``, overflow-safe), but every sum over a row is a fixed tree of adds written out as
slices (:func:`row_sum`), and the backward is written out too (:func:`l2_normalize`'s
custom vjp) instead of autodiff's broadcast transpose, which XLA lowers to a reduction.
XLA picks a reduction's order by the whole tensor's shape (on the H200 a sequence's dk
came out with other bits when it sat in a pack with others than alone: s21-1,
benchmarks/results/CURRENT.md); elementwise adds of slices keep their order, so a row's
result depends only on that row.

The op uses it with ``batch_invariant=True`` (its cost on the GPU is not measured yet: the
slices may fuse into a loop that walks each row on one thread); otherwise the reference
formula, whose sums XLA orders.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from gdp_jax.reference import L2_EPS


def row_sum(x):
    """Sum over the last axis as a fixed binary tree of elementwise adds (halves added,
    an odd width's last column carried): [..., D] -> [..., 1]; the order does not depend
    on the leading dims."""
    while x.shape[-1] > 1:
        d = x.shape[-1]
        h = d // 2
        pair = x[..., :h] + x[..., h:2 * h]
        x = pair if d % 2 == 0 else jnp.concatenate([pair, x[..., 2 * h:]], axis=-1)
    return x


def _scale(x):
    """m = max |x| over the row where > 1, else 1 (a max is exact in any order)."""
    m = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    return lax.stop_gradient(jnp.where(m > 1, m, jnp.ones_like(m)))


@jax.custom_vjp
def l2_normalize(x):
    """x [..., D] -> x / sqrt(sum(x**2) + 1e-6) along the last axis (overflow-safe as
    :func:`gdp_jax.reference.l2_normalize`); row sums by :func:`row_sum`."""
    return _forward(x)[0]


def _forward(x):
    m = _scale(x)
    xs = x / m
    r = lax.rsqrt(row_sum(xs * xs) + L2_EPS / (m * m))
    y = xs * r
    return y, (y, r, m)


def _backward(res, dy):
    # y = xs r, r = (sum xs^2 + c)^(-1/2), c and m constants:
    # d xs = r (dy - y sum(dy y)),  dx = d xs / m
    y, r, m = res
    return (r * (dy - y * row_sum(dy * y)) / m,)


l2_normalize.defvjp(_forward, _backward)

