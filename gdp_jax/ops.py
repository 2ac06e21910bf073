"""``gated_delta_product``: argument checks, backend dispatch and the custom_vjp glue."""
from __future__ import annotations

import functools
from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp

from gdp_jax import _checks, _guard, backends, engine, grid, heads
from gdp_jax.cp import driver, split


# --- the single-device op, on any engine ------------------------------------------------
# Residuals: the op's own inputs (nothing beyond what the caller already holds) plus what
# the engine keeps for its backward (cutedsl: the chunk-state checkpoints
# [B, ceil(NC / (N + 1)), HV, K, V]; xla: the same on its blocked grid, see gdp_jax.recurrence).

def _forward(eng, spec, inputs, keep_states):
    q, k, v, g, beta, h0, cu_seqlens = inputs
    layout, ch = engine.forward_problem(spec, q, k, v, g, beta, cu_seqlens,
                                        eng.input_dtypes(spec))
    tokens = engine.OpTokens((q, k, v), grid.tokens_of(spec, q, k, v, g, beta))
    oc, final, states = eng.forward(spec, ch, layout, engine.start_states(spec, h0),
                                    keep_states=keep_states, tokens=tokens)
    return (engine.outputs(layout, oc, q.dtype), final.astype(spec.cdt)), states


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _op(eng, spec, q, k, v, g, beta, h0, cu_seqlens):
    return _forward(eng, spec, (q, k, v, g, beta, h0, cu_seqlens), keep_states=False)[0]


def _op_fwd(eng, spec, *inputs):
    out, states = _forward(eng, spec, inputs, keep_states=True)
    return out, (inputs, states)


def _op_bwd(eng, spec, res, cts):
    inputs, states = res
    q, k, v, g, beta, h0, cu_seqlens = inputs
    p = engine.backward_problem(spec, q, k, v, g, beta, cu_seqlens, *cts,
                                eng.input_dtypes(spec))
    dch, dh0 = eng.backward(spec, p.ch, p.layout, engine.start_states(spec, h0), p.doc,
                            p.dfinal, states, tokens=p.tokens)
    dq, dk, dv, dg, dbeta = p.pull_inputs(dch)
    return dq, dk, dv, dg, dbeta, None if h0 is None else dh0.astype(h0.dtype), None


_op.defvjp(_op_fwd, _op_bwd)


# Flags that choose code at trace time: under a bare ``jax.jit`` they arrive as tracers.
_STATIC_FLAGS = ("output_final_state", "use_qk_l2norm", "recompute_chunk_num", "intra_cp",
                 "batch_invariant")


_require_static = _checks.require_static


def gated_delta_product(
        q: jax.Array, k: jax.Array, v: jax.Array, g: Optional[jax.Array], beta: jax.Array,
        *, scale: Union[float, jax.Array, None] = None,
        initial_state: Optional[jax.Array] = None, output_final_state: bool = False,
        cu_seqlens: Optional[jax.Array] = None, use_qk_l2norm: bool = False,
        cp_axis: Optional[str] = None, backend: str = "auto",
        recompute_chunk_num: Optional[int] = None,
        intra_cp: Union[None, int, str] = None,
        batch_invariant: bool = False,
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
      backend: "xla", "cutedsl" or "auto". "cutedsl" runs a call too large for its
        kernels' 32-bit offsets in groups of heads, one after another
        (:mod:`gdp_jax.heads`; the same results).
      recompute_chunk_num: N in [0, 64], default 0. The forward (both backends) keeps
        the state at the start of every (N + 1)-th chunk for the backward (N = 0: every
        chunk, [B, NC, HV, K, V], bfloat16 for bfloat16 inputs, else the compute dtype)
        and the backward recomputes the others: 1 / (N + 1) of the state memory for N
        extra chunk steps.
      intra_cp: None (default), an int S or "auto": cut each row's T into S equal
        segments and run them as context-parallel ranks inside this device (a
        ``jax.vmap`` axis; :mod:`gdp_jax.cp.split`), so a call of few rows x heads walks
        S x as many in parallel. "auto" picks S from B x HV x V and T (1 = no split:
        where the unsplit kernels launch more than one CTA an SM) and splits only
        a call that nothing differentiates (under ``jax.grad`` it runs the unsplit
        forward and backward, which measured faster). Same results up to rounding. With
        ``cp_axis`` each rank splits its shard (needs ``shard_map(check_vma=True)``).
      batch_invariant: make each sequence's outputs, final state and gradients the same
        bits whatever else is in the batch or the pack: the XLA glue's sums (the L2 norm
        and its backward) in an order that does not depend on the tensors' shapes
        (:mod:`gdp_jax.norm`; the kernels already work per (row, chunk, head) in a fixed
        order). Not with ``cp_axis`` or ``intra_cp`` (where a sequence is cut depends on
        its company). Off by default: its GPU cost is not measured yet.

    Returns:
      o [B, T, HV, V] in q.dtype, or (o, final_state) with ``output_final_state``.

    What cannot be checked at trace time (docs/ERRORS.md): ``cu_seqlens`` passed as a
    traced value is validated on device (starts at 0, ends at the global T, nondecreasing,
    the same on every CP rank); invalid offsets make every output, final state and
    gradient NaN, and ``jax.experimental.checkify.checkify`` of the call reports them as
    an error. A non-finite input at token t changes only that sequence's outputs at t and
    later. NumPy arrays are accepted wherever jax arrays are.

    Under ``jax.jit`` the flags ``output_final_state``, ``use_qk_l2norm``,
    ``recompute_chunk_num``, ``intra_cp``, ``batch_invariant``, ``backend`` and
    ``cp_axis`` must be static (they select
    code): ``jax.jit(gated_delta_product, static_argnames=(...))`` or functools.partial.
    """
    for name, value in zip(_STATIC_FLAGS, (output_final_state, use_qk_l2norm,
                                           recompute_chunk_num, intra_cp, batch_invariant)):
        _require_static(name, value)
    kw = dict(initial_state=initial_state, output_final_state=output_final_state,
              cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm, cp_axis=cp_axis,
              backend=backend, recompute_chunk_num=recompute_chunk_num, intra_cp=intra_cp,
              batch_invariant=batch_invariant)
    if _checks.is_traced_scale(scale):        # o is linear in scale: run at 1, scale o
        o, final = _run(q, k, v, g, beta, 1.0, **kw)
        o = _checks.scale_output(o, scale, q.dtype)
    else:
        o, final = _run(q, k, v, g, beta, scale, **kw)
    return (o, final) if output_final_state else o


def _run(q, k, v, g, beta, scale, *, initial_state, cu_seqlens, use_qk_l2norm, cp_axis,
         backend, recompute_chunk_num, intra_cp=None, batch_invariant=False,
         output_final_state=True):
    """Checks, backend choice, the offsets guard and dispatch: (o, final states)."""
    del output_final_state          # the final states are always computed (and cheap)
    # cu_seqlens stays as given: NumPy offsets are concrete, checked at trace time.
    q, k, v, g, beta, initial_state = _checks.as_arrays(q, k, v, g, beta, initial_state)
    cp_size = 1
    if cp_axis is not None:
        cp_size = driver.axis_size(cp_axis)
    spec = _checks.check_inputs(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                cu_seqlens=cu_seqlens, backend=backend, cp_size=cp_size,
                                use_qk_l2norm=use_qk_l2norm,
                                recompute_chunk_num=recompute_chunk_num,
                                batch_invariant=batch_invariant)
    one_token = spec.T == 1 and cu_seqlens is None and cp_axis is None
    if batch_invariant and (cp_axis is not None or intra_cp not in (None, 1)):
        raise ValueError(f"batch_invariant=True with cp_axis={cp_axis!r}, "
                         f"intra_cp={intra_cp!r}: where a sequence is cut depends on what "
                         f"else is in the batch; pass cp_axis=None and intra_cp=None")
    if one_token:
        split.check(intra_cp)          # checked, then run unsplit
    else:
        split.num_segments(spec, intra_cp)      # a bad intra_cp fails before the backend
    backend = backends.resolve(backend, spec, cp=cp_axis is not None,
                               available=backends.step_available if one_token else None)
    groups = 1
    if backend == "cutedsl" and not one_token:
        from gdp_jax.kernels.pipeline import CuTeDSLEngine
        groups = CuTeDSLEngine.head_groups(spec)   # > 1: too large for the kernels' offsets
    ok = None
    if cu_seqlens is not None:
        traced = not _guard.is_concrete(cu_seqlens)     # concrete ones were checked above
        cu_seqlens = jnp.asarray(cu_seqlens, jnp.int32)
        if traced:
            ok = _guard.offsets_ok(cu_seqlens, spec.T * cp_size, cp_axis)
            q, k, v, g, beta, initial_state = _guard.poison_all(
                ok, q, k, v, g, beta, initial_state)
    if one_token:
        from gdp_jax import step           # one token: the decoding step, not a chunk
        o, final = step.one_token_op(backend, spec, q, k, v, g, beta, initial_state)
    elif groups > 1:
        spec_g = heads.group_spec(spec, groups)
        o, final = heads.in_groups(groups, lambda *x: _dispatch(
            spec_g, backend, intra_cp, cp_axis, *x, cu_seqlens), q, k, v, g, beta,
            initial_state)
    else:
        o, final = _dispatch(spec, backend, intra_cp, cp_axis, q, k, v, g, beta,
                             initial_state, cu_seqlens)
    if ok is not None:
        o, final = _guard.poison_all(ok, o, final)
    return o, final.astype(spec.state_dtype)


def _dispatch(spec, backend, intra_cp, cp_axis, q, k, v, g, beta, initial_state, cu_seqlens):
    """(o, final states) of a chunked call (T > 1 or packed or CP) on ``backend``: split
    inside the device (``intra_cp``), CP across ``cp_axis``, both, or neither."""
    segments = split.num_segments(spec, intra_cp)
    if segments > 1 and intra_cp == "auto":
        if cp_axis is not None:
            unsplit = functools.partial(driver.cp_gated_delta_product, spec, cp_axis=cp_axis,
                                        backend=backend)
        else:
            unsplit = functools.partial(_op, backends.engine(backend), spec)
        o, final = split.forward_only_split(unsplit, spec, q, k, v, g, beta, initial_state,
                                            cu_seqlens, segments=segments, backend=backend,
                                            cp_axis=cp_axis)
    elif segments > 1:
        o, final = split.split_gated_delta_product(
            spec, q, k, v, g, beta, initial_state, cu_seqlens, segments=segments,
            backend=backend, cp_axis=cp_axis)
    elif cp_axis is not None:
        o, final = driver.cp_gated_delta_product(spec, q, k, v, g, beta, initial_state,
                                                 cu_seqlens, cp_axis=cp_axis,
                                                 backend=backend)
    else:
        o, final = _op(backends.engine(backend), spec, q, k, v, g, beta, initial_state,
                       cu_seqlens)
    return o, final
