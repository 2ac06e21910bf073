"""``CallSpec``: the static facts of one call, built once by the argument checks.

Every layer below the public entry points (chunk grid, engines, kernels, context
parallelism) takes a :class:`CallSpec` instead of loose shape and flag arguments. It is
frozen and hashable (it rides as a ``custom_vjp`` static argument and as the CP saved
metadata) and validates its own invariants, so a spec that exists is consistent.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

MAX_RECOMPUTE_CHUNK_NUM = 64


@dataclasses.dataclass(frozen=True)
class CallSpec:
    """Shapes, dtypes and flags of one call of the op (or of one CP rank's shard).

    B, T: rows and tokens (under CP: the LOCAL shard's T); n: Householder steps per token;
    H: query/key heads; HV: value heads (a multiple of H); K, V: head dims; N: sequences
    (B, or len(cu_seqlens) - 1 when packed); input_dtype: q/k/v dtype name; compute_dtype:
    "float32", or "float64" for float64 inputs; recompute_chunk_num: the cutedsl forward
    keeps one chunk-state checkpoint per recompute_chunk_num + 1 chunks; batch_invariant:
    the XLA glue's sums in shape-independent orders (the op's flag).
    """
    B: int
    T: int
    n: int
    H: int
    HV: int
    K: int
    V: int
    N: int
    scale: float
    input_dtype: str
    compute_dtype: str
    has_gate: bool
    packed: bool
    use_qk_l2norm: bool = False
    recompute_chunk_num: int = 0
    batch_invariant: bool = False

    def __post_init__(self):
        dims = (self.B, self.T, self.n, self.H, self.HV, self.K, self.V)
        if min(dims) < 1 or self.N < 1:
            raise ValueError(f"CallSpec: every dimension must be >= 1, got {self}")
        if self.HV % self.H:
            raise ValueError(f"CallSpec: HV={self.HV} is not a multiple of H={self.H}")
        if self.packed and self.B != 1:
            raise ValueError(f"CallSpec: packed sequences need B == 1, got B={self.B}")
        if not self.packed and self.N != self.B:
            raise ValueError(f"CallSpec: N={self.N} sequences for B={self.B} unpacked rows")
        if self.compute_dtype not in ("float32", "float64"):
            raise ValueError(f"CallSpec: compute_dtype={self.compute_dtype!r}")
        if not 0 <= self.recompute_chunk_num <= MAX_RECOMPUTE_CHUNK_NUM:
            raise ValueError(f"CallSpec: recompute_chunk_num={self.recompute_chunk_num}")

    @property
    def cdt(self):
        """The compute (and state) dtype: float32, or float64 for float64 inputs."""
        return jnp.dtype(self.compute_dtype)

    @property
    def state_dtype(self):
        return self.cdt

    @property
    def ab_dtype(self):
        """The inputs' dtype: the 16-bit tensor-core operand dtype of the kernels."""
        return jnp.dtype(self.input_dtype)

    @property
    def checkpoint_dtype(self):
        """dtype of the chunk-state checkpoints the forward keeps: :func:`checkpoint_dtype`."""
        return checkpoint_dtype(self.ab_dtype)

    @property
    def checkpoint_stride(self) -> int:
        """The cutedsl forward keeps the start state of every this-many-th chunk."""
        return self.recompute_chunk_num + 1

    def replace(self, **changes) -> "CallSpec":
        return dataclasses.replace(self, **changes)


# a static pytree node (no leaves): contexts holding a spec can pass through jax.vmap
jax.tree_util.register_static(CallSpec)


def checkpoint_dtype(input_dtype):
    """dtype of the chunk-state checkpoints for inputs of ``input_dtype``: bfloat16 for
    bfloat16 inputs (half the memory; what FLA and Megatron keep), else float32 (float16's
    range, 65504, is too small for states), float64 for float64 inputs."""
    if jnp.dtype(input_dtype) == jnp.dtype(jnp.bfloat16):
        return jnp.dtype(jnp.bfloat16)
    return jnp.promote_types(jnp.float32, input_dtype)


class Unsupported(str):
    """Why a kernel cannot run a call (a sentence), and which error a user who asked for
    that kernel gets: TypeError for an input no kernel takes (float64), else ValueError.
    ``can_implement`` methods return one of these, or None."""

    error: type

    def __new__(cls, message: str, error: type = ValueError):
        obj = super().__new__(cls, message)
        obj.error = error
        return obj
