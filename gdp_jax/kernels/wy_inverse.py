"""The WY inverse kernel (:mod:`gdp_jax.kernels.wy_inverse_sm90`): (I + A)^-1 of every chunk.

Drop-in for :data:`gdp_jax.chunked.unit_lower_inverse` (pass it as ``intra_chunk``'s
``inverse``): same contract, same closed-form vjp (two batched matmuls in XLA); only the
forward runs on the kernel (column forward substitution, one thread per column, float32).
``jax.vmap``-able (a mapped axis is just more matrices) and typed under ``shard_map``.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax.numpy as jnp
from jax import custom_batching

from gdp_jax import chunked
from gdp_jax.kernels import binding


class WYInverseKernel:
    """Limits and call of the 64 x 64 unit-lower-triangular inverse kernel."""

    SIZE = 64

    @staticmethod
    def can_implement(*, shape, dtype) -> Optional[str]:
        """None for float32 [num, 64, 64] matrices, else why not."""
        s = WYInverseKernel.SIZE
        if len(shape) != 3 or tuple(shape[1:]) != (s, s) or jnp.dtype(dtype) != jnp.float32:
            return (f"the cutedsl WY inverse kernel takes float32 [num, {s}, {s}] matrices; "
                    f"got {jnp.dtype(dtype).name} {tuple(shape)}")
        return None

    @staticmethod
    def raw_call(A):
        """A [num, 64, 64] float32 strictly lower -> (I + A)^-1, same shape. Entries of A
        on and above the diagonal are never read."""
        why = WYInverseKernel.can_implement(shape=A.shape, dtype=A.dtype)
        if why:
            raise ValueError(why)
        return binding.custom_call(_launcher, "gdp_wy_inverse_sm90",
                                   binding.out(A.shape, jnp.float32), (A,), tile_dims=(2, 2))

    @classmethod
    def variants(cls):
        """Its one variant (float32 [num, 64, 64])."""
        import jax
        from gdp_jax.kernels import aot
        s = cls.SIZE
        return [aot.Variant("gdp_wy_inverse_sm90", cls.raw_call,
                            (jax.ShapeDtypeStruct((1, s, s), jnp.float32),))]


@functools.lru_cache(maxsize=None)
def _launcher():
    binding.import_cutlass()
    import cutlass.cute as cute
    from gdp_jax.kernels import wy_inverse_sm90 as mod

    @cute.jit
    def launch(stream, a, x):
        mod.get_kernel()(stream, a, x)

    return launch


@custom_batching.custom_vmap
def _inverse(A):
    if A.size == 0:
        return A
    s = WYInverseKernel.SIZE
    return WYInverseKernel.raw_call(A.reshape((-1, s, s))).reshape(A.shape)


@_inverse.def_vmap
def _inverse_vmap(axis_size, in_batched, A):
    del axis_size               # a mapped axis is just more leading matrices
    return _inverse(A), in_batched[0]


unit_lower_inverse = chunked.with_closed_form_vjp(lambda A: chunked.causal_rows(_inverse, A))
"""(I + A)^-1 for strictly lower-triangular float32 A [..., 64, 64], forward on the kernel
(a non-finite row of A reaches only the rows after it: :func:`chunked.causal_rows`)."""
