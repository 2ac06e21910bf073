"""Argument checking shared by every entry point (trace time, shapes and dtypes only).

Every malformed call raises ``ValueError`` (wrong shape/value) or ``TypeError`` (wrong
dtype/type) naming the argument, what it got and what was expected.
"""
from __future__ import annotations

import numbers
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from gdp_jax.spec import MAX_RECOMPUTE_CHUNK_NUM, CallSpec

BACKENDS = ("auto", "xla", "cutedsl")
INPUT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64)
STATE_DTYPES = (jnp.float32, jnp.float64)


MAX_INT32 = 2 ** 31 - 1


def check_recompute_chunk_num(n) -> int:
    """``recompute_chunk_num`` must be an integer (Python or NumPy) in [0, 64]."""
    if (not isinstance(n, numbers.Integral) or isinstance(n, (bool, np.bool_))
            or not 0 <= n <= MAX_RECOMPUTE_CHUNK_NUM):
        raise ValueError(f"recompute_chunk_num={n!r}; expected an int in "
                         f"[0, {MAX_RECOMPUTE_CHUNK_NUM}]")
    return int(n)


def as_arrays(*xs):
    """NumPy arrays (and NumPy scalars) -> jax arrays; everything else unchanged.

    Done before any check, so that a NumPy float64 input without x64 becomes float32 like
    every jax-traced argument of the same call (no "k float64 vs q float32" under grad)
    and eager calls never feed a NumPy array to a tracer-only code path.
    """
    return tuple(jnp.asarray(x) if isinstance(x, (np.ndarray, np.generic)) else x
                 for x in xs)


def check_sizes(B, T, n, N, cp_size: int = 1, C: int = 64):
    """Reject sizes whose row offsets would overflow the int32 layout arithmetic.

    The chunk grid of one row has n * T_global steps in chunks of S = n (C // n) steps
    (C for n > C; ``grid.steps_per_chunk``, which this layer-0 module cannot import), each
    C rows, plus up to one partial chunk per sequence; its row indices (and T itself, a
    per-sequence int32 length) must fit int32.
    """
    T_global = T * cp_size
    S = n * (C // n) if n <= C else C
    rows = (n * T_global + N * (S - 1)) // S * C
    if rows > MAX_INT32 or B * T_global > MAX_INT32:
        raise ValueError(f"B={B}, T={T_global} (global), n={n}, N={N} sequences: the chunk "
                         f"grid needs {rows} rows per row of the batch and {B * T_global} "
                         f"tokens; expected both <= 2**31 - 1 (32-bit offsets)")
# The xla backend has no tile limits; this bound only keeps the [K, V] state and the
# per-chunk K x K transition of context parallelism a sensible size. The kernels' own
# limits are their ``can_implement`` (gdp_jax.kernels), applied by backend selection.
MAX_HEAD_DIM = 1024


def _shape(x):
    return tuple(getattr(x, "shape", ()))


def _dtype_name(x):
    return jnp.dtype(x.dtype).name


def _require_array(name, x):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be a jax or numpy array, got {type(x).__name__}")


def _require_float(name, x, allowed):
    if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in allowed]:
        names = ", ".join(jnp.dtype(d).name for d in allowed)
        raise TypeError(f"{name} has dtype {_dtype_name(x)}; expected one of {names}")


def _require_shape(name, x, expected, what):
    if _shape(x) != tuple(expected):
        raise ValueError(f"{name} has shape {_shape(x)}; expected {tuple(expected)} ({what})")


def check_inputs(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None,
                 backend="xla", cp_size: int = 1, use_qk_l2norm: bool = False,
                 recompute_chunk_num=None, batch_invariant: bool = False) -> CallSpec:
    """Validate the op's arguments (docs/API.md) and return the derived :class:`CallSpec`.

    Under context parallelism the shapes are the LOCAL shard's (T = T_global / cp_size)
    while ``cu_seqlens`` holds GLOBAL offsets (ending at T * cp_size).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; expected one of {BACKENDS}")
    for name, x in (("q", q), ("k", k), ("v", v), ("beta", beta)):
        _require_array(name, x)
    if q.ndim != 4:
        raise ValueError(f"q has shape {_shape(q)}; expected rank 4 [B, T, H, K]")
    B, T, H, K = q.shape
    if k.ndim != 5:
        raise ValueError(f"k has shape {_shape(k)}; expected rank 5 [B, T, n, H, K]")
    n = k.shape[2]
    _require_shape("k", k, (B, T, n, H, K), "[B, T, n, H, K] matching q [B, T, H, K]")
    if v.ndim != 5:
        raise ValueError(f"v has shape {_shape(v)}; expected rank 5 [B, T, n, HV, V]")
    if v.shape[:3] != (B, T, n):
        raise ValueError(f"v has shape {_shape(v)}; expected [B, T, n, HV, V] with "
                         f"B, T, n = {(B, T, n)} from q and k")
    HV, V = v.shape[3], v.shape[4]
    _check_dims(q, k, v, dict(B=B, T=T, n=n, H=H, HV=HV, K=K, V=V))
    _require_shape("beta", beta, (B, T, n, HV), "[B, T, n, HV]")
    _require_float("q", q, INPUT_DTYPES)
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {_dtype_name(x)}; expected q's dtype "
                            f"{_dtype_name(q)}")
    _require_float("beta", beta, INPUT_DTYPES)
    if g is not None:
        _require_array("g", g)
        _require_shape("g", g, (B, T, HV), "[B, T, HV]: one log-decay per token and value head")
        _require_float("g", g, STATE_DTYPES)

    packed = cu_seqlens is not None
    if packed:
        _require_array("cu_seqlens", cu_seqlens)
        if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
            raise TypeError(f"cu_seqlens has dtype {_dtype_name(cu_seqlens)}; expected int32")
        if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError(f"cu_seqlens has shape {_shape(cu_seqlens)}; expected [N + 1] "
                             "with N >= 1 sequences")
        if B != 1:
            raise ValueError(f"cu_seqlens needs B == 1 (packed sequences), but q has shape "
                             f"{_shape(q)}")
        N = cu_seqlens.shape[0] - 1
        _check_concrete_offsets(cu_seqlens, T * cp_size)
    else:
        N = B
    check_sizes(B, T, n, N, cp_size)
    if initial_state is not None:
        _require_array("initial_state", initial_state)
        _require_shape("initial_state", initial_state, (N, HV, K, V),
                       "[N, HV, K, V], N = B or the number of packed sequences")
        _require_float("initial_state", initial_state, STATE_DTYPES)

    if not isinstance(batch_invariant, (bool, np.bool_)):
        raise TypeError(f"batch_invariant={batch_invariant!r}; expected a Python bool")
    cdt = "float64" if jnp.dtype(q.dtype) == jnp.float64 else "float32"
    recompute = 0 if recompute_chunk_num is None else check_recompute_chunk_num(
        recompute_chunk_num)
    return CallSpec(B=B, T=T, n=n, H=H, HV=HV, K=K, V=V, N=N, scale=check_scale(scale, K),
                    input_dtype=_dtype_name(q), compute_dtype=cdt, has_gate=g is not None,
                    packed=packed, use_qk_l2norm=bool(use_qk_l2norm),
                    recompute_chunk_num=recompute, batch_invariant=bool(batch_invariant))


def _check_dims(q, k, v, dims: dict) -> None:
    """The dimension checks the op and the step share, their messages quoting the caller's
    own shapes: none empty, whole GVA groups, head dims within the maximum."""
    if min(dims.values()) < 1:
        raise ValueError(f"empty dimension: q {_shape(q)}, k {_shape(k)}, v {_shape(v)}; "
                         f"expected every one of {', '.join(dims)} >= 1")
    H, HV, K, V = dims["H"], dims["HV"], dims["K"], dims["V"]
    if HV % H:
        raise ValueError(f"v has {HV} value heads (shape {_shape(v)}); expected a multiple "
                         f"of the {H} key heads of q")
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise ValueError(f"head dims K={K} (q {_shape(q)}, k {_shape(k)}), V={V} (v "
                         f"{_shape(v)}) exceed the maximum of {MAX_HEAD_DIM} (the xla "
                         f"backend's; the cutedsl kernels take less)")


def require_static(name: str, value) -> None:
    """TypeError when a code-selecting flag is a tracer (``jax.jit`` without static_argnames)."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{name} is a traced value ({value.aval}): it selects code at trace time, so it "
            f"must be a Python value; pass it as a static argument: "
            f"jax.jit(f, static_argnames=({name!r},)), or close over it with "
            f"functools.partial before jitting")


def is_traced_scale(scale) -> bool:
    """A traced ``scale`` (the op and the step then run at scale 1 and scale o after:
    o is linear in it, the states are not touched). TypeError unless it is 0-d."""
    if not isinstance(scale, jax.core.Tracer):
        return False
    if jnp.shape(scale) != ():
        raise TypeError(f"scale has shape {jnp.shape(scale)}; expected a scalar")
    return True


def scale_output(o, scale, dtype):
    """o * scale (a traced 0-d scale), computed in float32 for 16-bit o, as ``dtype``."""
    wide = jnp.promote_types(o.dtype, jnp.float32)
    return (o.astype(wide) * scale.astype(wide)).astype(dtype)


def check_scale(scale, K: int) -> float:
    """``scale``: None (K ** -0.5), a finite real number, or a concrete real 0-d array
    (a traced one is the callers' to handle: the output is linear in it)."""
    if isinstance(scale, (jax.Array, np.ndarray, np.generic)) and not isinstance(
            scale, jax.core.Tracer):
        if (np.shape(scale) != () or not (jnp.issubdtype(scale.dtype, jnp.floating)
                                          or jnp.issubdtype(scale.dtype, jnp.integer))):
            raise TypeError(f"scale has shape {np.shape(scale)} and dtype {scale.dtype}; "
                            f"expected a real scalar")
        scale = float(scale)
    if scale is None:
        return K ** -0.5
    if (isinstance(scale, (jax.Array, np.ndarray, bool, np.bool_))
            or not isinstance(scale, numbers.Real)):
        raise TypeError(f"scale must be a Python float, got {type(scale).__name__}")
    if not np.isfinite(scale):
        raise ValueError(f"scale={scale}; expected a finite float")
    return float(scale)


_STEP_RANKS = (("q", 3, "[B, H, K]"), ("k", 4, "[B, n, H, K]"), ("v", 4, "[B, n, HV, V]"),
               ("beta", 3, "[B, n, HV]"), ("state", 4, "[B, HV, K, V]"))


def check_step_inputs(q, k, v, g, beta, state, *, scale=None, backend="xla",
                      use_qk_l2norm: bool = False) -> CallSpec:
    """Validate the arguments of ``gated_delta_product_step`` (docs/API.md, "Decoding"):
    the op's checks on one token (T = 1, N = B), with the step's shapes in every message."""
    for name, x in (("q", q), ("k", k), ("v", v), ("beta", beta), ("state", state)):
        if x is None and name == "state":
            raise TypeError("state must be a [B, HV, K, V] float32 array (zeros for a fresh "
                            "sequence), got None")
        _require_array(name, x)
    for name, rank, what in _STEP_RANKS:
        x = {"q": q, "k": k, "v": v, "beta": beta, "state": state}[name]
        if x.ndim != rank:
            raise ValueError(f"{name} has shape {_shape(x)}; expected rank {rank} {what}")
    B, H, K = q.shape
    n = k.shape[1]
    _require_shape("k", k, (B, n, H, K), "[B, n, H, K] matching q [B, H, K]")
    if v.shape[:2] != (B, n):
        raise ValueError(f"v has shape {_shape(v)}; expected [B, n, HV, V] with B, n = "
                         f"{(B, n)} from q and k")
    HV, V = v.shape[2], v.shape[3]
    _require_shape("beta", beta, (B, n, HV), "[B, n, HV]")
    if g is not None:
        _require_array("g", g)
        _require_shape("g", g, (B, HV), "[B, HV]: one log-decay per row and value head")
    _require_shape("state", state, (B, HV, K, V), "[B, HV, K, V] from q [B, H, K] and v "
                   "[B, n, HV, V]")
    _require_float("state", state, STATE_DTYPES)
    # before the op's checks below, so that the messages quote the step's shapes
    _check_dims(q, k, v, dict(B=B, n=n, H=H, HV=HV, K=K, V=V))
    add_t = lambda x: None if x is None else x[:, None]
    return check_inputs(add_t(q), add_t(k), add_t(v), add_t(g), add_t(beta), scale=scale,
                        initial_state=state, backend=backend, use_qk_l2norm=use_qk_l2norm)


def _check_concrete_offsets(cu_seqlens, T):
    """Check cu_seqlens values when they are known at trace time (not a tracer)."""
    try:
        cu = np.asarray(cu_seqlens)
    except Exception:        # a tracer: values are only known on device
        return
    if cu[0] != 0 or cu[-1] != T or np.any(np.diff(cu.astype(np.int64)) < 0):
        raise ValueError(f"cu_seqlens={cu.tolist()}; expected nondecreasing offsets from 0 "
                         f"to T={T}")


def check_backend_name(backend: Optional[str]):
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; expected one of {BACKENDS}")
