"""``gated_delta_product``: argument checks, backend dispatch and the custom_vjp glue."""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp

from gdp_jax import _checks, _guard, _vma, backends, chunked


@dataclasses.dataclass(frozen=True)
class OpConfig:
    """Static (hashable) part of one call: what the backward needs besides the tensors."""
    B: int
    T: int
    n: int
    H: int
    HV: int
    scale: float
    use_qk_l2norm: bool
    compute_dtype: str      # dtype name, so the dataclass stays hashable
    recompute_chunk_num: int = 0   # cutedsl: keep one chunk-state checkpoint per N + 1

    @classmethod
    def from_spec(cls, spec: _checks.OpSpec, use_qk_l2norm: bool,
                  recompute_chunk_num: int = 0) -> "OpConfig":
        return cls(spec.B, spec.T, spec.n, spec.H, spec.HV, spec.scale, bool(use_qk_l2norm),
                   jnp.dtype(spec.compute_dtype).name, recompute_chunk_num)

    @property
    def checkpoint_stride(self) -> int:
        """The cutedsl forward keeps the start state of every this-many-th chunk."""
        return self.recompute_chunk_num + 1

    @property
    def cdt(self):
        return jnp.dtype(self.compute_dtype)

    def chunk_inputs(self, layout, q, k, v, g, beta):
        return chunked.chunk_inputs(layout, q, k, v, g, beta, H=self.H, HV=self.HV,
                                    compute_dtype=self.cdt, use_qk_l2norm=self.use_qk_l2norm)

    def layout(self, cu_seqlens):
        return chunked.make_layout(self.B, self.T, self.n, cu_seqlens)


def readout_cotangent(layout, do, chunk_shape):
    """Transpose of :func:`chunked.from_chunks`: [B, T, HV, V] -> [B, NC, HV, C, V]."""
    zeros = _vma.like(jnp.zeros(chunk_shape, do.dtype), do, layout)
    _, pull = jax.vjp(lambda y: chunked.from_chunks(layout, y), zeros)
    return pull(do)[0]


def chunk_shape(cfg: OpConfig, layout, V):
    NC = layout.reset.shape[1]
    return (layout.reset.shape[0], NC, cfg.HV, chunked.CHUNK, V)


# --- the single-device xla op -----------------------------------------------------------
# Residuals are the op's own inputs (q, k, v, g, beta, initial_state, cu_seqlens): nothing
# is kept beyond what the caller already holds. The backward recomputes the chunk-local
# WY factors and the chunk start states, then runs the reverse state-gradient recursion.

def _start_states(h0, k, v, cu_seqlens, dtype):
    """h0 [N, HV, K, V] in ``dtype``, or zeros when the caller gave None: zeros are made
    here, inside the op, so they are never kept as a custom_vjp residual."""
    if h0 is not None:
        return h0.astype(dtype)
    N = k.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return jnp.zeros((N, v.shape[3], k.shape[-1], v.shape[-1]), dtype)


def _forward(cfg, local_forward, q, k, v, g, beta, h0, cu_seqlens):
    """((o, final states), extra) of one call; ``local_forward(ch, layout, h0) -> (output
    rows, final states, extra)`` runs on the chunk grid (extra: the cutedsl checkpoints)."""
    layout = cfg.layout(cu_seqlens)
    ch = cfg.chunk_inputs(layout, q, k, v, g, beta)
    oc, final, extra = local_forward(ch, layout, _start_states(h0, k, v, cu_seqlens, cfg.cdt))
    o = chunked.from_chunks(layout, oc).astype(q.dtype)
    return (o, final.astype(cfg.cdt)), extra


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _xla_op(cfg: OpConfig, q, k, v, g, beta, h0, cu_seqlens):
    return _forward(cfg, lambda ch, layout, h0: chunked.chunk_forward(ch, layout, h0, cfg.scale),
                    q, k, v, g, beta, h0, cu_seqlens)[0]


def _xla_fwd(cfg, *inputs):
    return _xla_op(cfg, *inputs), inputs


def _input_grads(cfg, inputs, cts, local_backward):
    """Cotangents of (o, final) -> gradients of (q, k, v, g, beta, h0, cu_seqlens).

    ``local_backward(ch, layout, h0, doc, dfinal) -> (dch, dh0)`` works on the chunk grid.
    """
    q, k, v, g, beta, h0, cu_seqlens = inputs
    do, dfinal = cts
    layout = cfg.layout(cu_seqlens)
    ch, pull_inputs = jax.vjp(lambda *a: cfg.chunk_inputs(layout, *a), q, k, v, g, beta)
    doc = readout_cotangent(layout, do.astype(cfg.cdt), chunk_shape(cfg, layout, v.shape[-1]))
    dch, dh0 = local_backward(ch, layout, _start_states(h0, k, v, cu_seqlens, cfg.cdt), doc,
                              dfinal.astype(cfg.cdt))
    dq, dk, dv, dg, dbeta = pull_inputs(dch)
    return dq, dk, dv, dg, dbeta, None if h0 is None else dh0.astype(h0.dtype), None


def _xla_bwd(cfg, res, cts):
    return _input_grads(cfg, res, cts, lambda ch, layout, h0, doc, dfinal: (
        chunked.chunk_backward(ch, layout, h0, doc, dfinal, cfg.scale)))


_xla_op.defvjp(_xla_fwd, _xla_bwd)


# Flags that choose code at trace time: under a bare ``jax.jit`` they arrive as tracers.
_STATIC_FLAGS = ("output_final_state", "use_qk_l2norm", "recompute_chunk_num")


def _require_static(name: str, value) -> None:
    """TypeError when a code-selecting flag is a tracer (``jax.jit`` without static_argnames)."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{name} is a traced value ({value.aval}): it selects code at trace time, so it "
            f"must be a Python value; pass it as a static argument: "
            f"jax.jit(f, static_argnames=({name!r},)), or close over it with "
            f"functools.partial before jitting")


def gated_delta_product(
        q: jax.Array, k: jax.Array, v: jax.Array, g: Optional[jax.Array], beta: jax.Array,
        *, scale: Union[float, jax.Array, None] = None,
        initial_state: Optional[jax.Array] = None, output_final_state: bool = False,
        cu_seqlens: Optional[jax.Array] = None, use_qk_l2norm: bool = False,
        cp_axis: Optional[str] = None, backend: str = "auto",
        recompute_chunk_num: Optional[int] = None,
) -> Union[jax.Array, Tuple[jax.Array, jax.Array]]:
    """Gated DeltaProduct linear attention (chunkwise), forward and backward.

    Args:
      q: [B, T, H, K] queries (bfloat16, float16, float32; float64 on the xla backend).
      k: [B, T, n, H, K] keys, n = number of Householder steps per token.
      v: [B, T, n, HV, V] values; HV a multiple of H (value head h reads key head
        h // (HV // H)).
      g: [B, T, HV] float32 log-decay (<= 0), applied once per token before its n
        updates, or None for no decay.
      beta: [B, T, n, HV] step sizes (beta in (0, 2) keeps eigenvalues in (-1, 1)).
      scale: readout scale, default K ** -0.5. A traced scalar (e.g. a ``jax.jit``
        argument) works too: o is linear in scale, so it multiplies the scale-1 output.
      initial_state: [N, HV, K, V] float32 start state per sequence, or None (zeros).
      output_final_state: also return the final states [N, HV, K, V] (float32).
      cu_seqlens: [N + 1] int32 offsets of packed sequences in the single row (B == 1).
      use_qk_l2norm: L2-normalise q and every key along K inside the op (eps 1e-6).
      cp_axis: name of a ``jax.shard_map`` mesh axis over which T is split contiguously:
        run context-parallel over it (see :mod:`gdp_jax.cp`).
      backend: "xla", "cutedsl" or "auto".
      recompute_chunk_num: N in [0, 64], default 0. The cutedsl forward keeps the state
        at the start of every (N + 1)-th chunk for the backward (N = 0: every chunk,
        [B, NC, HV, K, V], bfloat16 for bfloat16 inputs, else float32) and the backward
        recomputes the others: 1 / (N + 1) of the state memory for N extra chunk steps.
        The xla backend keeps no chunk states at all (it recomputes every one), so N
        changes nothing there.

    Returns:
      o [B, T, HV, V] in q.dtype, or (o, final_state) with ``output_final_state``.

    What cannot be checked at trace time (docs/ERRORS.md): ``cu_seqlens`` passed as a
    traced value is validated on device (starts at 0, ends at the global T, nondecreasing,
    the same on every CP rank); invalid offsets make every output, final state and
    gradient NaN, and ``jax.experimental.checkify.checkify`` of the call reports them as
    an error. A non-finite input at token t changes only that sequence's outputs at t and
    later. NumPy arrays are accepted wherever jax arrays are.

    Under ``jax.jit`` the flags ``output_final_state``, ``use_qk_l2norm``,
    ``recompute_chunk_num``, ``backend`` and ``cp_axis`` must be static (they select
    code): ``jax.jit(gated_delta_product, static_argnames=(...))`` or functools.partial.
    """
    for name, value in zip(_STATIC_FLAGS, (output_final_state, use_qk_l2norm,
                                           recompute_chunk_num)):
        _require_static(name, value)
    if isinstance(scale, jax.core.Tracer):
        if jnp.shape(scale) != ():
            raise TypeError(f"scale has shape {jnp.shape(scale)}; expected a scalar")
        out = gated_delta_product(
            q, k, v, g, beta, scale=1.0, initial_state=initial_state,
            output_final_state=output_final_state, cu_seqlens=cu_seqlens,
            use_qk_l2norm=use_qk_l2norm, cp_axis=cp_axis, backend=backend,
            recompute_chunk_num=recompute_chunk_num)
        o = out[0] if output_final_state else out
        wide = jnp.promote_types(o.dtype, jnp.float32)      # bf16 output: scale in f32
        o = (o.astype(wide) * scale.astype(wide)).astype(q.dtype)
        return (o, out[1]) if output_final_state else o
    # cu_seqlens stays as given: NumPy offsets are concrete, checked at trace time.
    q, k, v, g, beta, initial_state = _checks.as_arrays(q, k, v, g, beta, initial_state)
    cp_size = 1
    if cp_axis is not None:
        from gdp_jax.cp import driver
        cp_size = driver.axis_size(cp_axis)
    spec = _checks.check_inputs(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                cu_seqlens=cu_seqlens, backend=backend, cp_size=cp_size)
    backend = backends.resolve(backend, spec, q.dtype, cp=cp_axis is not None)
    N = 0 if recompute_chunk_num is None else _checks.check_recompute_chunk_num(
        recompute_chunk_num)
    cfg = OpConfig.from_spec(spec, use_qk_l2norm, N)
    ok = None
    if cu_seqlens is not None:
        traced = not _guard.is_concrete(cu_seqlens)     # concrete ones were checked above
        cu_seqlens = jnp.asarray(cu_seqlens, jnp.int32)
        if traced:
            ok = _guard.offsets_ok(cu_seqlens, spec.T * cp_size, cp_axis)
            q, k, v, g, beta, initial_state = _guard.poison_all(
                ok, q, k, v, g, beta, initial_state)
    if spec.T == 1 and cu_seqlens is None and cp_axis is None:
        from gdp_jax import step           # one token: the decoding step, not a chunk
        o, final = step.one_token_op(backend, spec, use_qk_l2norm, q, k, v, g, beta,
                                     initial_state)
    elif cp_axis is not None:
        o, final = driver.cp_gated_delta_product(
            cfg, q, k, v, g, beta, initial_state, cu_seqlens, cp_axis=cp_axis,
            backend=backend)
    else:
        o, final = _single_device_op(backend)(cfg, q, k, v, g, beta, initial_state,
                                              cu_seqlens)
    if ok is not None:
        o, final = _guard.poison_all(ok, o, final)
    if output_final_state:
        return o, final.astype(spec.state_dtype)
    return o


# --- the cutedsl op (gdp_jax/kernels) ----------------------------------------------------
# Forward: XLA intra-chunk factors + the fused CuTe DSL chunk kernel (state recursion,
# output, final states, and under differentiation the chunk-state checkpoints).
# Backward: checkpointed states + the reverse dS kernel + XLA (gdp_jax.kernels.bwd).
# Residuals: the op's inputs and the checkpoints [B, ceil(NC / (N + 1)), HV, K, V]
# (bf16 for bf16 inputs, else float32).

def _single_device_op(backend: str):
    """The custom_vjp op that runs a resolved backend on one device."""
    return _cutedsl_op if backend == "cutedsl" else _xla_op


def _cutedsl_forward(cfg, inputs, ckpt):
    from gdp_jax.kernels import fwd as kernel_fwd
    q_dtype = inputs[0].dtype
    return _forward(cfg, lambda ch, layout, h0: kernel_fwd.chunk_forward(
        ch, layout, h0, cfg.scale, q_dtype, ckpt=ckpt), *inputs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _cutedsl_op(cfg: OpConfig, q, k, v, g, beta, h0, cu_seqlens):
    return _cutedsl_forward(cfg, (q, k, v, g, beta, h0, cu_seqlens), ckpt=0)[0]


def _cutedsl_fwd(cfg, *inputs):
    out, states = _cutedsl_forward(cfg, inputs, ckpt=cfg.checkpoint_stride)
    return out, (inputs, states)


def _cutedsl_bwd(cfg, res, cts):
    from gdp_jax.kernels import bwd as kernel_bwd
    inputs, states = res
    return _input_grads(cfg, inputs, cts, lambda ch, layout, h0, doc, dfinal: (
        kernel_bwd.chunk_backward(ch, layout, h0, states, cfg.checkpoint_stride, doc, dfinal,
                                  cfg.scale, inputs[0].dtype)))


_cutedsl_op.defvjp(_cutedsl_fwd, _cutedsl_bwd)
