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
    size = x.shape[axis]
    shift = 1
    while shift < size:
        zeros = jnp.zeros(x.shape[:axis] + (shift,) + x.shape[axis + 1:], x.dtype)
        if reverse:
            moved = jnp.concatenate([lax.slice_in_dim(x, shift, size, axis=axis), zeros], axis)
        else:
            moved = jnp.concatenate([zeros, lax.slice_in_dim(x, 0, size - shift, axis=axis)],
                                    axis)
        x = x + moved
        shift *= 2
    return x


