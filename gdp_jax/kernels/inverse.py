"""The WY inverse (I + A)^-1 of every chunk on a CuTe DSL kernel (cutedsl backend).

Drop-in for :data:`gdp_jax.chunked.unit_lower_inverse` (pass it as ``intra_chunk``'s
``inverse``): same contract, same closed-form vjp (two batched matmuls in XLA); only the
forward runs on :mod:`gdp_jax.kernels.wy_inverse_sm90`. ``jax.vmap``-able (the mapped
axis is more matrices) and usable under ``shard_map``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import custom_batching

from gdp_jax import _vma, chunked
from gdp_jax.kernels import fwd

SIZE = 64


@functools.lru_cache(maxsize=None)
def _launcher():
    fwd.import_cutlass()
    import cutlass.cute as cute
    from gdp_jax.kernels import wy_inverse_sm90 as mod

    @cute.jit
    def launch(stream, a, x):
        mod.get_kernel()(stream, a, x)

    return launch, mod.KERNEL_VERSION


def kernel_call(A):
    """The raw kernel: A [num, 64, 64] float32 strictly lower -> (I + A)^-1, same shape.

    Entries of A on and above the diagonal are ignored (never read into the result)."""
    if A.ndim != 3 or A.shape[1:] != (SIZE, SIZE) or A.dtype != jnp.float32:
        raise ValueError(f"the cutedsl WY inverse kernel takes float32 [num, {SIZE}, {SIZE}] "
                         f"matrices; got {A.dtype} {A.shape}")
    launch, version = _launcher()
    import cutlass.jax as cjax

    call = cjax.cutlass_call(
        launch,
        output_shape_dtype=jax.ShapeDtypeStruct(A.shape, jnp.float32),
        use_static_tensors=True,
        compile_key=("gdp_wy_inverse_sm90", version, A.shape[0]),
    )
    return call(A)


@custom_batching.custom_vmap
def _inverse(A):
    if A.size == 0:
        return A
    X = kernel_call(A.reshape((-1, SIZE, SIZE))).reshape(A.shape)
    # The custom call's result carries no varying-axes type under shard_map: give it A's.
    return _vma.like(X, A)


@_inverse.def_vmap
def _inverse_vmap(axis_size, in_batched, A):
    del axis_size               # a mapped axis is just more leading matrices
    return _inverse(A), in_batched[0]


unit_lower_inverse = chunked.with_closed_form_vjp(lambda A: chunked.causal_rows(_inverse, A))
"""(I + A)^-1 for strictly lower-triangular float32 A [..., 64, 64], forward on the kernel
(a non-finite row of A reaches only the rows after it: :func:`chunked.causal_rows`)."""
