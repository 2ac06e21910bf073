"""Packed-sequence offsets (``cu_seqlens``) from padding masks and segment ids.

The op runs packed sequences as one row with offsets; these helpers turn the two other
common encodings into that form with static shapes, so they work under ``jax.jit``.
Concrete (NumPy or committed) inputs are checked here; for traced inputs a violated
assumption yields offsets the op rejects on device (every output NaN), never a silent
wrong answer.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["cu_seqlens_from_mask", "cu_seqlens_from_segment_ids"]


def _concrete(x):
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _invalid_unless(ok, cu):
    """cu where ``ok``, else offsets that decrease (the op's on-device check fails)."""
    return jnp.where(ok, cu, jnp.arange(cu.shape[0], 0, -1, dtype=cu.dtype) - 2)


def cu_seqlens_from_mask(mask, *, shape=None):
    """Padding mask [B, T] -> cu_seqlens [3 B + 1] int32 of the rows laid end to end.

    Each row's valid tokens (mask true) must be ONE contiguous run [s_b, e_b) (right or
    left padding, or both). Row b contributes three sequences of the packed row of B * T
    tokens: the padding before the run, the run, the padding after it (either padding
    piece may be empty). Run the op on ``x.reshape(1, B * T, ...)`` with these offsets and
    ignore the outputs at padded tokens.

    Args:
      mask: [B, T] bool or int (nonzero = valid token).
      shape: (B, T) to check the mask against (e.g. x.shape[:2]), or None.
    Returns:
      cu_seqlens [3 B + 1] int32.
    """
    if not hasattr(mask, "shape") or len(mask.shape) != 2:
        raise ValueError(f"mask has shape {getattr(mask, 'shape', type(mask).__name__)}; "
                         "expected [B, T]")
    if shape is not None and tuple(mask.shape) != tuple(shape):
        raise ValueError(f"mask has shape {tuple(mask.shape)}; expected {tuple(shape)} "
                         "(x's [B, T])")
    B, T = mask.shape
    valid = jnp.asarray(mask) != 0
    count = jnp.sum(valid, axis=1, dtype=jnp.int32)
    first = jnp.where(count > 0, jnp.argmax(valid, axis=1).astype(jnp.int32), 0)
    t = jnp.arange(T, dtype=jnp.int32)
    contiguous = jnp.all(valid == ((t >= first[:, None]) & (t < (first + count)[:, None])))
    base = jnp.arange(B, dtype=jnp.int32) * T
    cu = jnp.concatenate([jnp.stack([base, base + first, base + first + count], 1).reshape(-1),
                          jnp.array([B * T], jnp.int32)])
    known = _concrete(contiguous)
    if known is not None:
        if not bool(known):
            bad = [b for b in range(B) if not bool(_concrete(jnp.all(
                valid[b] == ((t >= first[b]) & (t < first[b] + count[b])))))]
            raise ValueError(f"mask row(s) {bad[:8]} hold more than one run of valid tokens; "
                             "each row must be one contiguous run (use cu_seqlens for "
                             "several sequences per row)")
        return cu
    return _invalid_unless(contiguous, cu)


def cu_seqlens_from_segment_ids(segment_ids, num_segments: int):
    """Segment ids [T] of one packed row -> cu_seqlens [num_segments + 1] int32.

    ``segment_ids[t]`` in [0, num_segments) names the sequence of token t; ids must be
    non-decreasing (each sequence one contiguous run; ids with no token give empty
    sequences). ``num_segments`` is static (it fixes the shape).
    """
    if not hasattr(segment_ids, "shape") or len(segment_ids.shape) != 1:
        raise ValueError(f"segment_ids has shape "
                         f"{getattr(segment_ids, 'shape', type(segment_ids).__name__)}; "
                         "expected [T] (one packed row)")
    if not isinstance(num_segments, (int, np.integer)) or num_segments < 1:
        raise ValueError(f"num_segments={num_segments!r}; expected a positive int")
    ids = jnp.asarray(segment_ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"segment_ids has dtype {ids.dtype}; expected an integer dtype")
    ids = ids.astype(jnp.int32)
    ok = jnp.all(ids[1:] >= ids[:-1]) & jnp.all(ids >= 0) & jnp.all(ids < num_segments)
    cu = jnp.searchsorted(ids, jnp.arange(num_segments + 1, dtype=jnp.int32),
                          side="left").astype(jnp.int32)
    known = _concrete(ok)
    if known is not None:
        if not bool(known):
            raise ValueError(f"segment_ids must be non-decreasing ints in [0, {num_segments})"
                             f"; got values in [{int(ids.min())}, {int(ids.max())}]"
                             + ("" if bool(jnp.all(ids[1:] >= ids[:-1])) else
                                " that decrease somewhere"))
        return cu
    return _invalid_unless(ok, cu)
