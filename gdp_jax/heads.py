"""Head groups: a call too large for the kernels' 32-bit offsets, run as G calls on groups of
heads, one after another (``jax.lax.map``).

Heads never mix in GDP: value head h reads key head h // (HV / H) and nothing else, so
the op on heads [j H / G, (j + 1) H / G) (key) and [j HV / G, (j + 1) HV / G) (value) is
exactly the op's slice of those heads. The kernels' offsets grow with rows x chunks x
value heads; cutting the heads into G equal groups divides them by G, so one long
sequence (T = 1M tokens, n = 2, 16 heads of 128: G = 8) runs on the kernels where the whole
call cannot. The groups run in sequence: each group's temporaries are freed before the
next, and each step slices its group's heads out of the inputs.
"""
from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp


def group_spec(spec, groups: int):
    """The :class:`gdp_jax.spec.CallSpec` of one of ``groups`` equal head groups."""
    return spec.replace(H=spec.H // groups, HV=spec.HV // groups)


def num_groups(spec, fits: Callable) -> Optional[int]:
    """The fewest equal head groups G (G divides H) whose per-group spec ``fits`` (a
    predicate on a CallSpec), or None where even one key head per group does not fit."""
    for G in range(1, spec.H + 1):
        if spec.H % G == 0 and fits(group_spec(spec, G)):
            return G
    return None


def _group(x, axis: int, j, groups: int):
    """Group j of ``groups`` equal slices of x along ``axis`` (None stays None)."""
    if x is None:
        return None
    size = x.shape[axis] // groups
    return jax.lax.dynamic_slice_in_dim(x, j * size, size, axis=axis % x.ndim)


def _from_groups(x, axis: int):
    """[G, .., X / G, ..] -> [.., X, ..] (the groups' results side by side along ``axis``,
    an axis of the result)."""
    axis %= x.ndim - 1
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],)
                     + x.shape[axis + 2:])


def in_groups(groups: int, fn: Callable, q, k, v, g, beta, initial_state):
    """(o [B, T, HV, V], final [N, HV, K, V]) of ``fn(q, k, v, g, beta, initial_state)``
    run on each of ``groups`` head groups in turn. Shapes as the op's: q [B, T, H, K],
    k [B, T, n, H, K], v [B, T, n, HV, V], g [B, T, HV] or None, beta [B, T, n, HV],
    initial_state [N, HV, K, V] or None; ``fn`` takes and returns one group's. Each step
    slices its group out of the inputs (no group-major copy of them all)."""
    def one(j):
        return fn(_group(q, -2, j, groups), _group(k, -2, j, groups),
                  _group(v, -2, j, groups), _group(g, -1, j, groups),
                  _group(beta, -1, j, groups), _group(initial_state, -3, j, groups))

    o, final = jax.lax.map(one, jnp.arange(groups))
    return _from_groups(o, -2), _from_groups(final, -3)
