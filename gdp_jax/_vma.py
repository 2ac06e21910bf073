"""Varying-manual-axes bookkeeping for scans inside ``jax.shard_map``.

Under ``shard_map(check_vma=True)`` a scan's initial carry must carry the same set of
varying mesh axes as the values the body produces. Fresh ``jnp.zeros`` are invariant, so
initial carries are cast to the union of the axes their inputs vary over.
"""
from __future__ import annotations

import jax
from jax import lax


def vma_of(x) -> frozenset:
    try:
        aval = jax.typeof(x)
    except Exception:  # pragma: no cover - non-array leaves
        return frozenset()
    mat = getattr(aval, "manual_axis_type", None)     # jax >= 0.10
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", frozenset()))


def like(init, *refs):
    """``init`` cast to vary over every mesh axis that any leaf of ``refs`` varies over."""
    axes = frozenset()
    for leaf in jax.tree_util.tree_leaves(refs):
        axes |= vma_of(leaf)

    def cast(x):
        missing = tuple(sorted(axes - vma_of(x)))
        if not missing:
            return x
        if hasattr(lax, "pcast"):
            return lax.pcast(x, missing, to="varying")
        return lax.pvary(x, missing)  # pragma: no cover - older jax

    return jax.tree_util.tree_map(cast, init)


def vary(x, axis):
    """``x`` cast to vary over mesh axis ``axis`` (no-op when it already does, or when the
    enclosing shard_map does not track varying axes)."""
    if axis in vma_of(x) or not checks_vma(axis):
        return x
    if hasattr(lax, "pcast"):
        return lax.pcast(x, (axis,), to="varying")
    return lax.pvary(x, (axis,))  # pragma: no cover - older jax


def checks_vma(axis) -> bool:
    """Whether the enclosing shard_map tracks varying manual axes (check_vma=True): then
    ``lax.axis_index`` itself varies over ``axis``."""
    return axis in vma_of(lax.axis_index(axis))


def cotangent_like(ct, primal):
    """The cotangent ``ct`` of ``primal`` with ``primal``'s varying axes: summed over the
    axes only ``ct`` varies over (a value replicated over an axis gets the sum of every
    rank's gradient, as autodiff's transpose of the implicit broadcast gives)."""
    def fix(c, p):
        extra = tuple(sorted(vma_of(c) - vma_of(p)))
        c = lax.psum(c, extra) if extra else c
        return like(c, p)

    return jax.tree_util.tree_map(fix, ct, primal)
