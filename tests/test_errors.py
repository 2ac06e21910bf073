"""Every malformed call raises ValueError/TypeError at trace time, naming the argument.

(docs/API.md, "Errors".) Calls go through ``jax.eval_shape`` so nothing is ever computed: a
check that fails to fire makes the test fail, never run a kernel. The CP-specific
errors (T not divisible by the CP size, cp_axis outside shard_map) live in the CP tests.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdp_jax
from gdp_jax import backends

OP = gdp_jax.gated_delta_product
REF = gdp_jax.gated_delta_product_reference

B, T, n, H, HV, K, V = 2, 8, 2, 2, 4, 4, 6


def _args(B=B, T=T, n=n, H=H, HV=HV, K=K, V=V, dtype=np.float32):
    """Valid arguments (numpy, zeros: only shapes and dtypes matter here)."""
    dt = jnp.dtype(dtype)
    return dict(q=np.zeros((B, T, H, K), dt), k=np.zeros((B, T, n, H, K), dt),
                v=np.zeros((B, T, n, HV, V), dt), g=np.zeros((B, T, HV), np.float32),
                beta=np.zeros((B, T, n, HV), dt))


def _call(fn=OP, args=None, **kw):
    """Trace fn(**args, **kw) abstractly; concrete kwargs (cu_seqlens) stay concrete."""
    a = _args() if args is None else args
    names = ("q", "k", "v", "g", "beta")
    return jax.eval_shape(lambda *xs: fn(*xs, **kw), *(a[nm] for nm in names))


def _raises(exc, *patterns, fn=OP, args=None, **kw):
    """Assert ``exc`` is raised and its message contains every pattern (regex)."""
    with pytest.raises(exc) as info:
        _call(fn, args, **kw)
    msg = str(info.value)
    for p in patterns:
        assert re.search(p, msg), f"message {msg!r} does not match {p!r}"
    return msg


def _with(**over):
    a = _args()
    a.update(over)
    return a


def test_valid_baseline():
    """The defaults used below are valid (so every error comes from the one change)."""
    o, s = _call(output_final_state=True, initial_state=np.zeros((B, HV, K, V), np.float32))
    assert o.shape == (B, T, HV, V) and s.shape == (B, HV, K, V)
    a = _args(B=1)
    o = _call(args=a, cu_seqlens=np.array([0, 3, 8], np.int32),
              initial_state=np.zeros((2, HV, K, V), np.float32))
    assert o.shape == (1, T, HV, V)


# --- wrong rank / shape ------------------------------------------------------------------

@pytest.mark.parametrize("name,bad,exc", [
    ("q", np.zeros((B, T, H * K), np.float32), ValueError),           # rank 3
    ("q", np.zeros((B, T, H, K, 1), np.float32), ValueError),         # rank 5
    ("k", np.zeros((B, T * n, H, K), np.float32), ValueError),        # FLA's rank 4
    ("k", np.zeros((B, T, n, H, K + 1), np.float32), ValueError),     # K != q's K
    ("k", np.zeros((B, T, n, H + 1, K), np.float32), ValueError),     # H != q's H
    ("k", np.zeros((B, T + 1, n, H, K), np.float32), ValueError),     # T != q's T
    ("k", np.zeros((B + 1, T, n, H, K), np.float32), ValueError),     # B != q's B
    ("v", np.zeros((B, T * n, HV, V), np.float32), ValueError),       # rank 4
    ("v", np.zeros((B, T - 1, n, HV, V), np.float32), ValueError),    # T mismatch
    ("v", np.zeros((B + 1, T, n, HV, V), np.float32), ValueError),    # B mismatch
    ("beta", np.zeros((B, T, HV), np.float32), ValueError),           # rank 3
    ("beta", np.zeros((B, T, n, HV + 1), np.float32), ValueError),    # HV mismatch
    ("beta", np.zeros((B, T - 1, n, HV), np.float32), ValueError),    # T mismatch
    ("g", np.zeros((B, T), np.float32), ValueError),                  # rank 2
    ("g", np.zeros((B, T, H), np.float32), ValueError),               # key heads, not HV
    ("g", np.zeros((B, T, n, HV), np.float32), ValueError),           # per sub-step
])
def test_wrong_shape(name, bad, exc):
    msg = _raises(exc, rf"\b{name}\b", re.escape(str(tuple(bad.shape))), args=_with(**{name: bad}))
    assert "expected" in msg


@pytest.mark.parametrize("name", ["q", "k", "v", "beta", "g"])
def test_not_an_array(name):
    bad = _args()[name].tolist()
    _raises(TypeError, rf"\b{name}\b", args=_with(**{name: bad}))


def test_empty_dimension():
    _raises(ValueError, r"\bq\b", r"empty", args=_args(T=0))
    _raises(ValueError, r"\bk\b|\bq\b", r"empty", args=_args(K=0))


# --- n mismatch, heads ------------------------------------------------------------------

def test_n_mismatch_k_v():
    bad = np.zeros((B, T, n + 1, HV, V), np.float32)
    _raises(ValueError, r"\bv\b", r"\bn\b", args=_with(v=bad))


def test_n_mismatch_k_beta():
    _raises(ValueError, r"\bbeta\b", args=_with(beta=np.zeros((B, T, n + 1, HV), np.float32)))


@pytest.mark.parametrize("H_,HV_", [(2, 3), (3, 4), (4, 2)])
def test_hv_not_multiple_of_h(H_, HV_):
    _raises(ValueError, r"\bv\b", rf"\b{HV_}\b", r"multiple", args=_args(H=H_, HV=HV_))


# --- head dims over the backend maximum ----------------------------------------------------

@pytest.mark.parametrize("K_,V_,culprit,arg", [(1025, 4, "K", "q"), (4, 1025, "V", "v")])
def test_head_dim_over_xla_maximum(K_, V_, culprit, arg):
    a = _args(B=1, T=1, n=1, H=1, HV=1, K=K_, V=V_)
    shape = re.escape(str(a[arg].shape))
    _raises(ValueError, rf"\b{culprit}={max(K_, V_)}", rf"\b{arg} {shape}", r"1024", r"xla",
            args=a, backend="xla")
    _raises(ValueError, rf"\b{culprit}={max(K_, V_)}", args=a)         # auto on CPU = xla


def test_head_dim_over_cutedsl_maximum():
    """The cutedsl kernels' head-dim limit is checked even where cutedsl cannot run."""
    a = _args(B=1, T=2, n=1, H=1, HV=1, K=256, V=64)
    _raises(ValueError, r"\bK=256", r"\(64, 128\)", r"cutedsl", args=a, backend="cutedsl")


# --- dtypes ------------------------------------------------------------------------------

@pytest.mark.parametrize("gdt", [np.int32, jnp.bfloat16, np.float16, np.bool_])
def test_g_dtype(gdt):
    _raises(TypeError, r"\bg\b", jnp.dtype(gdt).name, args=_with(g=np.zeros((B, T, HV), gdt)))


@pytest.mark.parametrize("qdt", [np.int32, np.int8, np.complex64, np.bool_])
def test_q_dtype(qdt):
    a = _args()
    for nm in ("q", "k", "v"):
        a[nm] = a[nm].astype(qdt)
    _raises(TypeError, r"\bq\b", jnp.dtype(qdt).name, args=a)


@pytest.mark.parametrize("name", ["k", "v"])
@pytest.mark.parametrize("qdt,other", [(np.float32, jnp.bfloat16), (jnp.bfloat16, np.float32),
                                       (np.float16, np.float32)])
def test_k_v_dtype_differs_from_q(name, qdt, other):
    a = _args(dtype=qdt)
    a[name] = a[name].astype(other)
    _raises(TypeError, rf"\b{name}\b", jnp.dtype(other).name, args=a)


def test_beta_dtype():
    _raises(TypeError, r"\bbeta\b", "int32", args=_with(beta=np.zeros((B, T, n, HV), np.int32)))


def test_float64_with_cutedsl():
    a = _args(dtype=np.float64)
    _raises(TypeError, r"\bq\b", r"float64", args=a, backend="cutedsl")
    _call(args=a, backend="xla")                      # fine on the xla backend


# --- cu_seqlens --------------------------------------------------------------------------

def test_cu_seqlens_needs_b1():
    _raises(ValueError, r"\bcu_seqlens\b", r"B == 1", cu_seqlens=np.array([0, 8], np.int32))


@pytest.mark.parametrize("cdt", [np.float32, np.float64, np.bool_])
def test_cu_seqlens_not_int(cdt):
    _raises(TypeError, r"\bcu_seqlens\b", jnp.dtype(cdt).name, args=_args(B=1),
            cu_seqlens=np.array([0, 8], cdt))


def test_cu_seqlens_not_an_array():
    _raises(TypeError, r"\bcu_seqlens\b", args=_args(B=1), cu_seqlens=[0, 3, 8])


@pytest.mark.parametrize("cu", [np.array([8], np.int32), np.array([], np.int32),
                                np.array([[0, 8]], np.int32), np.int32(8)])
def test_cu_seqlens_wrong_length_or_rank(cu):
    _raises(ValueError, r"\bcu_seqlens\b", args=_args(B=1), cu_seqlens=cu)


@pytest.mark.parametrize("cu", [[0, 5, 3, 8], [1, 3, 8], [0, 3, 7], [0, 3, 9], [0, -1, 8]])
def test_cu_seqlens_bad_concrete_values(cu):
    _raises(ValueError, r"\bcu_seqlens\b", re.escape(str(cu)), args=_args(B=1),
            cu_seqlens=np.array(cu, np.int32))


def test_cu_seqlens_length_vs_initial_state():
    _raises(ValueError, r"\binitial_state\b", r"\(3, 4, 4, 6\)", args=_args(B=1),
            cu_seqlens=np.array([0, 3, 8], np.int32),
            initial_state=np.zeros((3, HV, K, V), np.float32))


# --- initial_state -----------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(B + 1, HV, K, V), (B, H, K, V), (B, HV, V, K),
                                   (HV, K, V), (1, B, HV, K, V)])
def test_initial_state_shape(shape):
    _raises(ValueError, r"\binitial_state\b", re.escape(str(shape)),
            initial_state=np.zeros(shape, np.float32))


@pytest.mark.parametrize("sdt", [jnp.bfloat16, np.float16, np.int32])
def test_initial_state_dtype(sdt):
    _raises(TypeError, r"\binitial_state\b", jnp.dtype(sdt).name,
            initial_state=np.zeros((B, HV, K, V), sdt))


# --- backend -----------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["triton", "XLA", "", None, "gpu"])
def test_unknown_backend(backend):
    _raises(ValueError, r"\bbackend\b", backend=backend)


@pytest.mark.skipif(backends.cutedsl_available()[0],
                    reason="an sm_90 GPU with the CuTe DSL kernels is present: cutedsl runs")
def test_cutedsl_on_cpu_raises_never_falls_back():
    _raises(ValueError, r"\bbackend\b", r"cutedsl", backend="cutedsl")
    # also for otherwise perfectly valid half-precision inputs
    _raises(ValueError, r"\bbackend\b", r"cutedsl", args=_args(dtype=jnp.bfloat16),
            backend="cutedsl")


# --- scale -------------------------------------------------------------------------------

@pytest.mark.parametrize("scale,exc", [
    (np.array([0.5]), TypeError),           # not a scalar
    (jnp.ones(2), TypeError),
    (jnp.array(1 + 2j), TypeError),
    (jnp.array(True), TypeError),
    ("0.5", TypeError),
    (1j, TypeError),
    (True, TypeError),
    ([0.5], TypeError),
    (float("inf"), ValueError),
    (float("nan"), ValueError),
])
def test_scale_not_a_float(scale, exc):
    _raises(exc, r"\bscale\b", scale=scale)


@pytest.mark.parametrize("scale", [0.5, 1, np.float32(0.25), np.float64(2.0),
                                   jnp.float32(0.5), np.array(0.5)])   # 0-d arrays too
def test_scale_valid(scale):
    _call(scale=scale)


# --- trace-time, and shared with the reference --------------------------------------------

def test_raises_at_trace_time_under_jit():
    a = _with(beta=np.zeros((B, T, n + 1, HV), np.float32))
    f = jax.jit(lambda q, k, v, g, beta: OP(q, k, v, g, beta))
    with pytest.raises(ValueError, match=r"\bbeta\b"):
        f.trace(a["q"], a["k"], a["v"], a["g"], a["beta"])


@pytest.mark.parametrize("over,exc,pat", [
    (dict(beta=np.zeros((B, T, n + 1, HV), np.float32)), ValueError, r"\bbeta\b"),
    (dict(g=np.zeros((B, T, HV), jnp.bfloat16)), TypeError, r"\bg\b"),
    (dict(v=np.zeros((B, T, n, 3, V), np.float32)), ValueError, r"\bv\b"),
])
def test_reference_raises_the_same(over, exc, pat):
    _raises(exc, pat, fn=REF, args=_with(**over))
