"""``prefix_sum``: an inclusive cumulative sum that lowers to plain elementwise code."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def prefix_sum(x, axis=-1, reverse=False):
    """Inclusive cumulative sum along ``axis`` (reverse: from the end), by doubling.

    log2(size) shifted adds instead of ``jnp.cumsum``: on the GPU, XLA lowers cumsum to a
    ``reduce_window`` whose fused emitter crashed for some tiny shapes (a T = 1 call, H200,
    "RET_CHECK failure ... mlir_kernel_emitter.cc"). Shifts and adds lower to plain
    elementwise fusions on every platform, and their transposes do too.
    """
    axis = axis % x.ndim
    shift = 1
    while shift < x.shape[axis]:
        x = x + _shifted(x, shift, axis, reverse)
        shift *= 2
    return x


def compensated_prefix_sum(x, axis=-1):
    """Inclusive prefix sum along ``axis`` as (hi, lo), hi + lo the sum with every
    addition's rounding error carried in lo (TwoSum), by the same doubling."""
    axis = axis % x.ndim
    hi, lo = x, jnp.zeros_like(x)
    shift = 1
    while shift < x.shape[axis]:
        hi, err = _two_sum(hi, _shifted(hi, shift, axis, False))
        lo = lo + _shifted(lo, shift, axis, False) + err
        shift *= 2
    return hi, lo


def _shifted(x, shift, axis, reverse):
    """x moved ``shift`` places along ``axis`` (towards the end, or the start with
    ``reverse``), zeros filling in."""
    size = x.shape[axis]
    zeros = jnp.zeros(x.shape[:axis] + (shift,) + x.shape[axis + 1:], x.dtype)
    if reverse:
        return jnp.concatenate([lax.slice_in_dim(x, shift, size, axis=axis), zeros], axis)
    return jnp.concatenate([zeros, lax.slice_in_dim(x, 0, size - shift, axis=axis)], axis)


def _two_sum(a, b):
    """(s, e) with s = fl(a + b) and a + b = s + e exactly (Knuth's TwoSum)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


