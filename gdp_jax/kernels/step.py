"""The decoding-step kernel (:mod:`gdp_jax.kernels.step_sm90`): its limits and its call.

Decode is bound by the state's bytes (B=64, HV=32, K=V=128: 134 MB read + 134 MB write);
the token's own operands are [B, HV, n, K] float32 vectors, so XLA prepares them (L2
norm, GVA head expansion, scale, exp of the gate) and the kernel reads and writes the
state once: one thread per state column, the n Householder updates and the readout in
registers, in place when the state is donated.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax.numpy as jnp

from gdp_jax.kernels import binding
from gdp_jax.spec import Unsupported


class StepKernel:
    """Limits and the (vmappable) call of the decoding-step kernel."""

    MAX_K = 128                 # K float32 registers per thread hold the state column

    @staticmethod
    def can_implement(*, dtype, B: int, HV: int, K: int, V: int) -> Optional[Unsupported]:
        """None if the step kernel runs this call, else why not."""
        name = jnp.dtype(dtype).name
        if name == "float64":   # no kernel takes it (no float64 tensor cores): argument error
            return Unsupported("q has dtype float64 (k, v too); the cutedsl step takes 16-bit "
                               "inputs (bfloat16/float16)", TypeError)
        if K > StepKernel.MAX_K:
            return Unsupported(f"the cutedsl step holds a K-long state column per thread: "
                               f"K <= {StepKernel.MAX_K}, got K={K}")
        if V % 32:
            return Unsupported(f"the cutedsl step needs V a multiple of 32, got V={V}")
        if name not in ("bfloat16", "float16", "float32"):
            return Unsupported(f"q has dtype {name} (k, v too); the cutedsl step takes "
                               f"bfloat16/float16/float32 inputs")
        if binding.grid_limit(B, HV):
            return Unsupported(binding.grid_limit(B, HV))
        if B * HV * K * V > binding.MAX_ELEMS:
            return Unsupported(f"the state [{B}, {HV}, {K}, {V}] is too large for the step "
                               f"kernel's 32-bit offsets")
        return None

    @staticmethod
    def pick_bv(V: int) -> int:
        """Threads per CTA = value columns per CTA: the widest of 128, 64, 32 dividing V."""
        for bv in (128, 64, 32):
            if V % bv == 0:
                return bv
        raise ValueError(f"V={V} is not a multiple of 32")

    @classmethod
    def call(cls, q, k, v, beta, decay, S):
        """:meth:`raw_call`, ``jax.vmap``-able (the mapped axis folds into B)."""
        f = binding.vmappable(lambda *a: cls.raw_call(*a), out_kinds=("rows", "rows"))
        return f(q, k, v, beta, decay, S)

    @staticmethod
    def raw_call(q, k, v, beta, decay, S):
        """float32 everywhere: q [B, HV, K] (scaled), k [B, HV, n, K], v [B, HV, n, V],
        beta [B, HV, n], decay [B, HV] (= exp(g)), S [B, HV, K, V] -> (o [B, HV, V],
        next S [B, HV, K, V], written over S's buffer when S is donated)."""
        B, HV, n, K = k.shape
        V = v.shape[-1]
        outputs = (binding.out((B, HV, V), jnp.float32), binding.out(S.shape, jnp.float32))
        return binding.custom_call(_launcher, "gdp_step_sm90", outputs,
                                   (q, k, v, beta, decay, S), aliases={5: 1},
                                   tile_dims=(1, 2, 2, 1, 0, 2, 1, 2), K=K, n=n,
                                   BV=StepKernel.pick_bv(V))

    @classmethod
    def variants(cls, householder=(1, 2, 3)):
        """Variants to prebuild: the kernels' head dims and ``householder`` steps n (the
        step runs any K <= 128, V % 32 == 0; others compile at trace time)."""
        import jax
        from gdp_jax.kernels import aot
        from gdp_jax.kernels.chunk_forward import ChunkForwardKernel
        f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
        out = []
        for K in ChunkForwardKernel.HEAD_DIMS:
            for V in ChunkForwardKernel.HEAD_DIMS:
                for n in householder:
                    avals = (f32(1, 1, K), f32(1, 1, n, K), f32(1, 1, n, V), f32(1, 1, n),
                             f32(1, 1), f32(1, 1, K, V))
                    out.append(aot.Variant(f"gdp_step_sm90 K={K} V={V} n={n}", cls.raw_call,
                                           avals))
        return out


@functools.lru_cache(maxsize=None)
def _launcher():
    binding.import_cutlass()
    import cutlass
    import cutlass.cute as cute
    from gdp_jax.kernels import step_sm90

    @cute.jit
    def launch(stream, q, k, v, beta, decay, S, o, *, K: cutlass.Constexpr,
               n: cutlass.Constexpr, BV: cutlass.Constexpr):
        # S is both the input state and the aliased output (updated in place)
        step_sm90.get_kernel(K, n, BV)(stream, q, k, v, beta, decay, S, o)

    return launch
