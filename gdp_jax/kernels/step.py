"""The ``cutedsl`` decoding step: XLA prepares the token's operands, one kernel reads and
writes the state once (:mod:`gdp_jax.kernels.step_sm90`).

Decode is bound by the state's bytes (B=64, HV=32, K=V=128: 134 MB read + 134 MB write);
the token's own operands are [B, HV, n, K] float32 vectors (a few MB at most), so the XLA
part (L2 norm, GVA head expansion, scale, exp of the gate, casts) is a small fusion.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

MAX_K = 128                 # K float32 registers per thread hold the state column
_MAX_ELEMS = 2 ** 31 - 1    # 32-bit offsets (static layouts)


def pick_bv(V: int) -> int:
    """Threads per CTA = value columns per CTA: the widest of 128, 64, 32 dividing V."""
    for bv in (128, 64, 32):
        if V % bv == 0:
            return bv
    raise ValueError(f"V={V} is not a multiple of 32")


def unsupported_reason(*, B: int, HV: int, K: int, V: int, dtype):
    """None if the step kernel runs this call, else a sentence saying why not."""
    name = jnp.dtype(dtype).name
    if name not in ("bfloat16", "float16", "float32"):
        return f"the cutedsl step takes bfloat16/float16/float32 inputs; got {name}"
    if K > MAX_K:
        return f"the cutedsl step holds a K-long state column per thread: K <= {MAX_K}, got {K}"
    if V % 32:
        return f"the cutedsl step needs V a multiple of 32, got V={V}"
    if B * HV * K * V > _MAX_ELEMS:
        return "the state is too large for the step kernel's 32-bit offsets"
    return None


@functools.lru_cache(maxsize=None)
def _launcher():
    from gdp_jax.kernels import fwd
    fwd.import_cutlass()
    import cutlass
    import cutlass.cute as cute
    from gdp_jax.kernels import step_sm90

    @cute.jit
    def launch(stream, q, k, v, beta, decay, S, o, *, K: cutlass.Constexpr,
               n: cutlass.Constexpr, BV: cutlass.Constexpr):
        # S is both the input state and the aliased output (updated in place)
        step_sm90.get_kernel(K, n, BV)(stream, q, k, v, beta, decay, S, o)

    return launch


def kernel_call(q, k, v, beta, decay, S):
    """The raw kernel (float32 everywhere): q [B, HV, K] (scaled), k [B, HV, n, K],
    v [B, HV, n, V], beta [B, HV, n], decay [B, HV] (= exp(g)), S [B, HV, K, V]
    -> (o [B, HV, V], next S [B, HV, K, V], written over S's buffer when S is donated)."""
    from gdp_jax.kernels import step_sm90
    import cutlass.jax as cjax

    B, HV, n, K = k.shape
    V = v.shape[-1]
    BV = pick_bv(V)
    call = cjax.cutlass_call(
        _launcher(),
        output_shape_dtype=(jax.ShapeDtypeStruct((B, HV, V), jnp.float32),
                            jax.ShapeDtypeStruct(S.shape, jnp.float32)),
        input_output_aliases={5: 1},
        use_static_tensors=True,
        compile_key=("gdp_step_sm90", step_sm90.KERNEL_VERSION, B, HV, n, K, V, BV),
        K=K, n=n, BV=BV,
    )
    return call(q, k, v, beta, decay, S)


def step_kernel_call(q, k, v, beta, decay, S):
    """:func:`kernel_call`, ``jax.vmap``-able (the mapped axis folds into B)."""
    from gdp_jax.kernels._batching import fold_mapped_axis
    call = fold_mapped_axis(lambda *a: kernel_call(*a), seq_arg=None, table_arg=None,
                            out_kinds=("rows", "rows"))
    return call(q, k, v, beta, decay, S)
