"""On-device validation of what trace-time checks cannot see: traced ``cu_seqlens``.

Concrete offsets are checked at trace time (:mod:`gdp_jax._checks`). Traced ones (under
``jit`` / ``shard_map``) are checked here on device: an invalid call makes every output,
final state and gradient NaN (:func:`poison`), never finite garbage, and reports through
``jax.experimental.checkify`` when the caller functionalises the call with
``checkify.checkify`` (a no-op otherwise). See docs/ERRORS.md.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import checkify

from gdp_jax import _vma

OFFSETS_MESSAGE = ("gated_delta_product: invalid traced cu_seqlens (expected nondecreasing "
                   "GLOBAL offsets from 0 to T={T}, the same on every rank of the CP axis); "
                   "first offset {first}, last {last}")


def is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def offsets_ok(cu, T_global: int, cp_axis=None):
    """[] bool: ``cu`` [N + 1] int32 starts at 0, ends at ``T_global``, never decreases and
    (under CP) is the same on every rank of ``cp_axis``; the verdict is the same on every
    rank. Also raises through checkify (``debug_check``) when it is False."""
    ok = (cu[0] == 0) & (cu[-1] == T_global) & jnp.all(cu[1:] >= cu[:-1])
    if cp_axis is not None:
        # one small pmax: max(cu) == -max(-cu) iff every rank has the same cu; and
        # max(not ok) == 0 iff every rank's verdict is ok
        n = cu.shape[0]
        mine = jnp.concatenate([cu, -cu, (~ok).astype(cu.dtype)[None]])
        top = lax.pmax(_vma.vary(mine, cp_axis), cp_axis)
        ok = jnp.all(top[:n] == -top[n:2 * n]) & (top[-1] == 0)
    checkify.debug_check(ok, OFFSETS_MESSAGE, T=jnp.int32(T_global), first=cu[0], last=cu[-1])
    return ok


@jax.custom_vjp
def poison(x, ok):
    """``x`` where ``ok`` else NaN, and the same for its cotangent (so an invalid call's
    gradients are NaN too, not the zeros a plain ``where`` would send back)."""
    return jnp.where(ok, x, jnp.asarray(jnp.nan, x.dtype))


def _poison_fwd(x, ok):
    return poison(x, ok), ok


def _poison_bwd(ok, ct):
    return jnp.where(ok, ct, jnp.asarray(jnp.nan, ct.dtype)), None


poison.defvjp(_poison_fwd, _poison_bwd)


def poison_all(ok, *xs):
    """:func:`poison` on every array of ``xs`` (None passes through)."""
    return tuple(None if x is None else poison(x, ok) for x in xs)
