"""Testing helpers for gdp_jax: random inputs, error metrics, gradients, emulated kernels.

Public so that tests (this repo's and a user's) share one definition of each:

- :func:`make_inputs` -> :class:`Inputs`: the op's arguments for (B, T, n, H, HV, K, V),
  a gate kind ("none" / "normal" / "strong"), an initial state; :func:`random_lengths`:
  packed ``cu_seqlens`` offsets (empty and length-1 sequences included).
- :func:`rel_rms` (FLA's metric) and :func:`rel_max`: errors against a reference.
- :func:`loss_and_grads`: value and gradients of a random linear loss of (o, final_state).
- :func:`emulated_kernels` / :func:`emulated_step_kernel`: run the ``cutedsl`` pipeline on
  any device with its CuTe DSL kernels replaced by XLA emulations
  (:mod:`gdp_jax.kernels.emulate`), explicitly and only inside a ``with`` block.

Seeds are plain ints (numpy RNG on the host: no per-shape XLA compilation for inputs).
"""
from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["DIFF_NAMES", "Inputs", "make_inputs", "upcast", "random_lengths", "rel_rms",
           "rel_max", "call", "cotangents", "default_weights", "loss_and_grads",
           "emulated_kernels", "emulated_step_kernel"]

DIFF_NAMES = ("q", "k", "v", "g", "beta", "initial_state")


class Inputs(NamedTuple):
    q: jax.Array                 # [B, T, H, K]
    k: jax.Array                 # [B, T, n, H, K]
    v: jax.Array                 # [B, T, n, HV, V]
    g: Optional[jax.Array]       # [B, T, HV] or None
    beta: jax.Array              # [B, T, n, HV]
    initial_state: Optional[jax.Array]  # [N, HV, K, V] or None


def sm90_gpu_present() -> bool:
    """Is JAX's default device an sm_90 (Hopper) GPU? (The GPU test files skip otherwise.)"""
    try:
        d = jax.devices()[0]
    except RuntimeError:
        return False
    return d.platform == "gpu" and str(getattr(d, "compute_capability", "")) == "9.0"


def _rng(key) -> np.random.Generator:
    """Seeds are plain ints (numpy RNG: no per-shape XLA compilation for the inputs)."""
    if isinstance(key, np.random.Generator):
        return key
    return np.random.default_rng(int(key))


def _gate(rng, shape, gate, dtype):
    """Log-decay g <= 0. "normal": moderate decays; "strong": spans 0 .. -1e4."""
    if gate == "none":
        return None
    if gate == "normal":
        # exp(g) in ~(0.37, 1): like a softplus-parametrised decay; never exactly 0.
        g = -rng.uniform(1e-3, 1.0, shape)
    elif gate == "strong":
        # log-uniform magnitudes 1e-4 .. 1e4, plus some exact zeros (no decay) and
        # some tokens that wipe the state out completely (-1e4).
        g = -(10.0 ** rng.uniform(-4.0, 4.0, shape))
        u = rng.uniform(size=shape)
        g = np.where(u < 0.15, 0.0, g)
        g = np.where((u >= 0.15) & (u < 0.25), -1e4, g)
    else:
        raise ValueError(f"unknown gate kind {gate!r}")
    return jnp.asarray(g.astype(jnp.dtype(dtype)))


def make_inputs(key, B, T, n, H, HV, K, V, dtype=jnp.float64, *, N=None, gate="normal",
                beta_range=(0.0, 2.0), initial_state=True, g_dtype=None,
                state_dtype=None, key_norm=(0.5, 1.0)) -> Inputs:
    """Random GDP inputs (never all zero). ``key``: an int seed (or a numpy Generator).

    Shapes: q [B, T, H, K], k [B, T, n, H, K], v [B, T, n, HV, V], g [B, T, HV] (None
    for ``gate="none"``), beta [B, T, n, HV] uniform in ``beta_range``, initial_state
    [N, HV, K, V] (None when ``initial_state=False``).

    Keys are random directions with norms in ``key_norm`` (default [0.5, 1]), so
    beta * |k|^2 < 2 and the recurrence is stable (eigenvalues of every update in
    (-1, 1)) for beta in (0, 2). ``N``: number of initial states (B, or the number of
    packed sequences). ``g_dtype`` / ``state_dtype`` default to float64 for float64
    inputs and float32 otherwise.
    """
    rng = _rng(key)
    N = B if N is None else N
    q = rng.standard_normal((B, T, H, K))
    kd = rng.standard_normal((B, T, n, H, K))
    kd = kd / np.linalg.norm(kd, axis=-1, keepdims=True)
    kd = kd * rng.uniform(key_norm[0], key_norm[1], (B, T, n, H, 1))
    v = rng.standard_normal((B, T, n, HV, V))
    lo, hi = beta_range
    beta = rng.uniform(lo, hi, (B, T, n, HV))
    f64 = jnp.float64
    if g_dtype is None:
        g_dtype = f64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32
    g = _gate(rng, (B, T, HV), gate, g_dtype)
    if state_dtype is None:
        state_dtype = f64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32
    h0 = (jnp.asarray((0.5 * rng.standard_normal((N, HV, K, V))).astype(
        jnp.dtype(state_dtype))) if initial_state else None)
    # Cast on the host (ml_dtypes), so no XLA computation runs here.
    cast = lambda x: jnp.asarray(x.astype(jnp.dtype(dtype)))
    return Inputs(cast(q), cast(kd), cast(v), g, cast(beta), h0)


def gpu_case_inputs(seed, B, T, n, H, HV, K, V, dtype, *, gate=True, N=None, h0=True):
    """The GPU tests' inputs (tests/test_cutedsl_gpu.py, benchmarks.peer_precision), a tuple
    (q [B, T, H, K], k [B, T, n, H, K], v [B, T, n, HV, V], g [B, T, HV] or None,
    beta [B, T, n, HV], initial states [N, HV, K, V] or None): q, k, v standard normal in
    ``dtype``, beta uniform in (0.05, 1.95), g = log_sigmoid(N(0, 1) + 3) in float32 (or
    None: ungated), initial states 0.3 N(0, 1) in float32 (or None)."""
    N = B if N is None else N
    ks = jax.random.split(jax.random.PRNGKey(seed), 7)
    f32, dtype = jnp.float32, jnp.dtype(dtype)
    q = jax.random.normal(ks[0], (B, T, H, K), f32).astype(dtype)
    k = jax.random.normal(ks[1], (B, T, n, H, K), f32).astype(dtype)
    v = jax.random.normal(ks[2], (B, T, n, HV, V), f32).astype(dtype)
    beta = jax.random.uniform(ks[3], (B, T, n, HV), f32, 0.05, 1.95).astype(dtype)
    g = (jax.nn.log_sigmoid(jax.random.normal(ks[4], (B, T, HV), f32) + 3.0)
         if gate else None)
    s0 = 0.3 * jax.random.normal(ks[5], (N, HV, K, V), f32) if h0 else None
    return q, k, v, g, beta, s0


def upcast(inp: Inputs, dtype=jnp.float32) -> Inputs:
    """The same values in a wider dtype (g and initial_state are left alone)."""
    up = lambda x: jnp.asarray(np.asarray(x).astype(jnp.dtype(dtype)))
    return inp._replace(q=up(inp.q), k=up(inp.k), v=up(inp.v), beta=up(inp.beta))


def random_lengths(rng: np.random.Generator, T: int, N: int, *, allow_empty=True):
    """N nonnegative lengths summing to T (as cu_seqlens int32 offsets, [N + 1])."""
    if N == 1:
        return np.array([0, T], np.int32)
    if allow_empty:
        cuts = np.sort(rng.integers(0, T + 1, size=N - 1))
    else:
        assert N <= T, (N, T)
        cuts = np.sort(rng.choice(np.arange(1, T), size=N - 1, replace=False))
    return np.concatenate([[0], cuts, [T]]).astype(np.int32)


def _f64(x):
    return np.asarray(x).astype(np.float64)        # on the host: no XLA convert per shape


def rel_rms(a, b):
    """FLA's metric: RMS(a - b) / RMS(b), computed in float64."""
    a, b = _f64(a), _f64(b)
    den = np.sqrt(np.mean(b * b))
    num = np.sqrt(np.mean((a - b) ** 2))
    if den == 0.0:
        return float(num)
    return float(num / den)


def rel_max(a, b, floor=1e-300):
    """max |a - b| / max(max |b|, floor): max abs error relative to the reference's scale.

    ``floor`` makes it an absolute error where the reference is (near) zero everywhere.
    """
    a, b = _f64(a), _f64(b)
    den = max(float(np.max(np.abs(b))) if b.size else 0.0, floor)
    return float(np.max(np.abs(a - b))) / den if b.size else 0.0


def call(fn, inp: Inputs, **kw):
    """fn(q, k, v, g, beta, initial_state=..., output_final_state=True, **kw)."""
    return fn(inp.q, inp.k, inp.v, inp.g, inp.beta, initial_state=inp.initial_state,
              output_final_state=True, **kw)


def cotangents(key, o_shape, s_shape, dtype=jnp.float64):
    """Random weights for the scalar loss sum(o * wo) + sum(final_state * ws)."""
    rng = _rng(key)
    d = jnp.dtype(dtype)
    return (jnp.asarray(rng.standard_normal(o_shape).astype(d)),
            jnp.asarray(rng.standard_normal(s_shape).astype(d)))


@functools.lru_cache(maxsize=None)
def _value_and_grad_fn(fn, names, static_kw, jit):
    """jit(value_and_grad(loss)) for one (fn, differentiated inputs, static kwargs).

    Cached so that calls with the same shapes reuse one compilation (jit caches per
    function object); cu_seqlens and the loss weights are traced arguments.
    """
    kw = dict(static_kw)

    def loss(diff, rest, cu_seqlens, wo, ws):
        full = Inputs(**{**rest, **diff})
        o, s = call(fn, full, cu_seqlens=cu_seqlens, **kw)
        val = jnp.sum(o.astype(wo.dtype) * wo) + jnp.sum(s.astype(ws.dtype) * ws)
        return val, (o, s)

    vg = jax.value_and_grad(loss, has_aux=True)
    return jax.jit(vg) if jit else vg


def default_weights(inp: Inputs, cu_seqlens=None, key=None, dtype=jnp.float64):
    B, T, HV, V = inp.q.shape[0], inp.q.shape[1], inp.v.shape[3], inp.v.shape[4]
    K = inp.q.shape[3]
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    return cotangents(7 if key is None else key,
                      (B, T, HV, V), (N, HV, K, V), dtype)


def loss_and_grads(fn, inp: Inputs, weights=None, *, key=None, jit=True, cu_seqlens=None,
                   **kw):
    """Value and gradients of L = sum(o * wo) + sum(final_state * ws).

    Differentiates w.r.t. q, k, v, g, beta, initial_state (those that are not None); the
    random cotangents wo, ws make every output element and every final-state element
    matter. ``weights``: (wo, ws) arrays, drawn from ``key`` when not given.
    ``cu_seqlens`` is passed as a traced (jit) argument; ``kw`` (scale, use_qk_l2norm,
    backend, ...) must be hashable and is static.
    Returns (o, final_state, loss, grads) with grads a dict name -> array.
    """
    names = tuple(n for n in DIFF_NAMES if getattr(inp, n) is not None)
    if weights is None:
        weights = default_weights(inp, cu_seqlens, key)
    vg = _value_and_grad_fn(fn, names, tuple(sorted(kw.items())), jit)
    diff = {n: getattr(inp, n) for n in names}
    rest = {n: getattr(inp, n) for n in DIFF_NAMES if n not in names}
    cu = None if cu_seqlens is None else jnp.asarray(cu_seqlens, jnp.int32)
    (val, (o, s)), grads = vg(diff, rest, cu, *weights)
    return o, s, val, grads


@contextlib.contextmanager
def _patched(patches):
    """Set ``(module, attribute, value)`` for the block; restore the old values after."""
    # vars(), not getattr(): a class's staticmethod must be restored as a staticmethod
    saved = [(mod, name, vars(mod)[name]) for mod, name, _ in patches]
    try:
        for mod, name, value in patches:
            setattr(mod, name, value)
        yield
    finally:
        for mod, name, old in reversed(saved):
            setattr(mod, name, old)


def _emulated_available(*args, **kwargs):
    return True, "emulated"


def _no_limits(**kwargs):
    return None


def emulated_kernels():
    """Context manager: the chunked ``cutedsl`` pipeline with emulated kernels.

    Inside the block ``backend="cutedsl"`` runs on any device (CPU included) and for any
    dtype and head dim the XLA path takes: the five custom calls (chunk forward
    [num, 64, ...], reverse dh, WY inverse [num, 64, 64], chunk-local gradients, forward
    operands - the last only for 16-bit inputs, its own limits stay) are replaced by their contracts
    in :mod:`gdp_jax.kernels.emulate` (plain matmuls, like the kernels' MMAs), the kernels'
    shape/dtype limits and the device check are lifted. The glue around the calls (vmap
    rule, layouts, vma typing) is the real one. Not thread-safe (class attributes).

        with gdp_jax.testing.emulated_kernels():
            o, s = gdp_jax.gated_delta_product(..., backend="cutedsl")
    """
    from gdp_jax import backends
    from gdp_jax.kernels import emulate
    from gdp_jax.kernels.chunk_forward import ChunkForwardKernel
    from gdp_jax.kernels.chunk_prep import ChunkPrepKernel
    from gdp_jax.kernels.local_grad import LocalGradKernel
    from gdp_jax.kernels.state_grad import StateGradKernel
    from gdp_jax.kernels.wy_inverse import WYInverseKernel
    return _patched([
        (LocalGradKernel, "raw_call", staticmethod(emulate.local_grad_call)),
        (LocalGradKernel, "raw_call_tokens", staticmethod(emulate.local_grad_tokens_call)),
        (LocalGradKernel, "can_implement", staticmethod(_no_limits)),
        (ChunkPrepKernel, "raw_call", staticmethod(emulate.chunk_prep_call)),
        (ChunkPrepKernel, "raw_call_tokens", staticmethod(emulate.chunk_prep_tokens_call)),
        (ChunkForwardKernel, "raw_call", staticmethod(emulate.chunk_kernel_call)),
        (StateGradKernel, "raw_call", staticmethod(emulate.dh_kernel_call)),
        (WYInverseKernel, "raw_call", staticmethod(emulate.inverse_kernel_call)),
        (ChunkForwardKernel, "can_implement", staticmethod(_no_limits)),
        (backends, "_device_reason", _emulated_available),
    ])


def emulated_step_kernel():
    """Context manager: the ``cutedsl`` decoding step (:func:`gdp_jax.gated_delta_product_step`
    and the op's T = 1 path) with its kernel emulated
    (:func:`gdp_jax.kernels.emulate.step_kernel_call`), its limits and the device check
    lifted (any dtype and head dims, float64 included: exact CPU tests)."""
    from gdp_jax import backends
    from gdp_jax.kernels import emulate
    from gdp_jax.kernels.step import StepKernel
    return _patched([
        (StepKernel, "raw_call", staticmethod(emulate.step_kernel_call)),
        (StepKernel, "can_implement", staticmethod(_no_limits)),
        (backends, "_device_reason", _emulated_available),
    ])
