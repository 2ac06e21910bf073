"""Decoding on an sm_90 GPU: the cutedsl step kernel, the op at small T on both backends
(T = 1 crashed inside XLA on the H200 before the cumsum rewrite), the layer's cache.

Run on the lent H200 only: ``pytest -m gpu -v -s tests/test_step_gpu.py``; CI has no GPU.
Everything is checked against the float64 token recurrence. Tolerances (FLA-style relative
RMS): 5e-3 for 16-bit outputs, 1e-4 for float32 states / float32 outputs, 1e-2 for
gradients of 16-bit inputs.
Last real run: 2026-12-04, nvidia-h200, code 8560c17 (s20-5; the final tree differs only
in the operands kernel's gate loop, reverted after): 22 small-T cases passed before the
call's time limit, none failed; 58 passed on
3b7b783 (s16-4), all 62 on 713534b (2026-12-01, s2-1; tests/gpu_results/GPU_TESTS.md).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.gpu


from gdp_jax.testing import sm90_gpu_present as _gpu_ok  # noqa: E402


if not _gpu_ok():
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

import gdp_jax  # noqa: E402
from gdp_jax.testing import rel_rms  # noqa: E402

REF = gdp_jax.gated_delta_product_reference
ROWS = 2          # rows compared against the float64 reference (rows are independent)


def make(seed, B, T, n, H, HV, K, V, dtype, gate=True):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    f32 = jnp.float32
    q = jax.random.normal(ks[0], (B, T, H, K), f32).astype(dtype)
    k = jax.random.normal(ks[1], (B, T, n, H, K), f32).astype(dtype)
    v = jax.random.normal(ks[2], (B, T, n, HV, V), f32).astype(dtype)
    beta = jax.random.uniform(ks[3], (B, T, n, HV), f32, 0.05, 1.95).astype(dtype)
    g = jax.nn.log_sigmoid(jax.random.normal(ks[4], (B, T, HV), f32) + 3.0) if gate else None
    s0 = 0.3 * jax.random.normal(ks[5], (B, HV, K, V), f32)
    return q, k, v, g, beta, s0


def _f64(x):
    return None if x is None else jnp.asarray(x, jnp.float64)


def _rows(x):
    return None if x is None else x[:ROWS]


@functools.lru_cache(maxsize=None)
def _op_value_and_grad(backend, has_gate):
    def loss(q, k, v, g, beta, s0, w, ws):
        o, s = gdp_jax.gated_delta_product(q, k, v, g, beta, initial_state=s0,
                                           output_final_state=True, use_qk_l2norm=True,
                                           backend=backend)
        return jnp.sum(o.astype(jnp.float32) * w) + jnp.sum(s * ws), (o, s)
    argnums = (0, 1, 2, 3, 4, 5) if has_gate else (0, 1, 2, 4, 5)
    return jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))


def _ref_value_and_grad(args, w, ws):
    q, k, v, g, beta, s0 = (_f64(_rows(a)) for a in args)

    def loss(q, k, v, g, beta, s0):
        o, s = REF(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                   use_qk_l2norm=True)
        return jnp.sum(o * w[:ROWS]) + jnp.sum(s * ws[:ROWS]), (o, s)
    argnums = (0, 1, 2, 3, 4, 5) if g is not None else (0, 1, 2, 4, 5)
    return jax.value_and_grad(loss, argnums=argnums, has_aux=True)(q, k, v, g, beta, s0)


@pytest.mark.parametrize("backend", ["xla", "cutedsl"])
@pytest.mark.parametrize("B", [1, 2, 16, 64])
@pytest.mark.parametrize("T", [1, 2, 5, 63, 65])
def test_small_T_op_forward_and_grad(T, B, backend):
    """The op at the H200 shapes that crashed (H = 32, K = V = 128, n = 2): forward and
    gradients of every input; the first ROWS rows against the float64 reference."""
    args = make(T + B, B, T, 2, 32, 32, 128, 128, jnp.bfloat16)
    w = jax.random.normal(jax.random.PRNGKey(1), (B, T, 32, 128), jnp.float32)
    ws = jax.random.normal(jax.random.PRNGKey(2), (B, 32, 128, 128), jnp.float32)
    (_, (o, s)), grads = _op_value_and_grad(backend, True)(*args, w, ws)
    (_, (o_r, s_r)), grads_r = _ref_value_and_grad(args, _f64(w), _f64(ws))
    errs = [rel_rms(o[:ROWS], o_r), rel_rms(s[:ROWS], s_r)]
    errs += [rel_rms(a[:ROWS], b) for a, b in zip(grads, grads_r)]
    print(f"[op {backend} B={B} T={T}] o {errs[0]:.2e} S {errs[1]:.2e} grads "
          + " ".join(f"{e:.2e}" for e in errs[2:]))
    assert all(np.isfinite(np.asarray(a, np.float32)).all() for a in (o, s) + tuple(grads))
    assert errs[0] < 5e-3 and errs[1] < 5e-3, errs
    assert max(errs[2:]) < 1e-2, errs


STEP_CASES = [  # dtype, n, H, HV, K, V, gate, l2norm
    ("bfloat16", 2, 32, 32, 128, 128, True, True),
    ("bfloat16", 1, 2, 4, 128, 64, True, False),       # GVA, K != V
    ("bfloat16", 3, 1, 2, 64, 128, False, True),       # no gate
    ("float16", 2, 2, 2, 128, 128, True, True),
    ("float32", 2, 4, 8, 128, 128, True, True),
    ("float32", 3, 2, 2, 96, 32, False, False),        # K not a power of two, V = 32
]


@pytest.mark.parametrize("B", [1, 3, 64])
@pytest.mark.parametrize("dtype,n,H,HV,K,V,gate,l2", STEP_CASES)
def test_step_kernel_matches_reference(dtype, n, H, HV, K, V, gate, l2, B):
    q, k, v, g, beta, s0 = make(B, B, 1, n, H, HV, K, V, jnp.dtype(dtype), gate)
    tok = lambda x: None if x is None else x[:, 0]
    step = jax.jit(lambda *a, b: gdp_jax.gated_delta_product_step(
        *a, use_qk_l2norm=l2, backend=b), static_argnames="b")
    o, s = step(tok(q), tok(k), tok(v), tok(g), tok(beta), s0, b="cutedsl")
    o_x, s_x = step(tok(q), tok(k), tok(v), tok(g), tok(beta), s0, b="xla")
    o_r, s_r = REF(_f64(q), _f64(k), _f64(v), _f64(g), _f64(beta), initial_state=_f64(s0),
                   output_final_state=True, use_qk_l2norm=l2)
    tol_o = 1e-4 if dtype == "float32" else 5e-3
    e = (rel_rms(o, o_r[:, 0]), rel_rms(s, s_r), rel_rms(o_x, o_r[:, 0]), rel_rms(s_x, s_r))
    print(f"[step {dtype} B={B} n={n} H={H} HV={HV} K={K} V={V}] cutedsl o {e[0]:.2e} "
          f"S {e[1]:.2e}; xla o {e[2]:.2e} S {e[3]:.2e}")
    assert o.dtype == q.dtype and s.dtype == jnp.float32
    assert e[0] < tol_o and e[2] < tol_o and e[1] < 1e-4 and e[3] < 1e-4, e


def test_step_donated_in_place_and_many_steps():
    """Donated state (the kernel writes over it), 100 steps in a row == the chunked op."""
    B, T, n, H, K = 4, 100, 2, 4, 128
    q, k, v, g, beta, s0 = make(7, B, T, n, H, H, K, K, jnp.bfloat16)
    step = jax.jit(lambda *a: gdp_jax.gated_delta_product_step(*a, use_qk_l2norm=True,
                                                               backend="cutedsl"),
                   donate_argnums=5)
    S = jnp.array(s0)
    outs = []
    for t in range(T):
        o, S = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], S)
        outs.append(o)
    o_r, s_r = REF(_f64(q), _f64(k), _f64(v), _f64(g), _f64(beta), initial_state=_f64(s0),
                   output_final_state=True, use_qk_l2norm=True)
    e = rel_rms(jnp.stack(outs, 1), o_r), rel_rms(S, s_r)
    print(f"[100 donated steps] o {e[0]:.2e} S {e[1]:.2e}")
    assert e[0] < 5e-3 and e[1] < 1e-4, e


def test_step_grad_and_vmap_on_gpu():
    args = make(3, 3, 1, 2, 2, 4, 128, 128, jnp.bfloat16)
    q, k, v, g, beta = (x[:, 0] for x in args[:5])
    s0 = args[5]

    def loss(b):
        def f(q, k, v, g, beta, s):
            o, s = gdp_jax.gated_delta_product_step(q, k, v, g, beta, s, backend=b)
            return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(s ** 2)
        return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4, 5)))
    got, want = loss("cutedsl")(q, k, v, g, beta, s0), loss("xla")(q, k, v, g, beta, s0)
    for a, b in zip(got, want):
        assert rel_rms(a, b) < 1e-2
    stacked = [jnp.stack([x, x]) for x in (q, k, v, g, beta, s0)]
    o_v, s_v = jax.jit(jax.vmap(lambda *a: gdp_jax.gated_delta_product_step(
        *a, backend="cutedsl")))(*stacked)
    o_1, s_1 = gdp_jax.gated_delta_product_step(q, k, v, g, beta, s0, backend="cutedsl")
    assert rel_rms(o_v[1], o_1) < 1e-6 and rel_rms(s_v[1], s_1) < 1e-6


def test_backend_auto_picks_the_step_kernel():
    from gdp_jax import backends
    q, k, v, g, beta, s0 = make(0, 2, 1, 2, 2, 2, 128, 128, jnp.bfloat16)
    spec = gdp_jax._checks.check_step_inputs(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], s0)
    assert backends.resolve("auto", spec, available=backends.step_available) == "cutedsl"


def test_layer_prefill_and_decode_on_gpu():
    from flax import nnx
    from gdp_jax.nn import GatedDeltaProduct
    layer = GatedDeltaProduct(256, 4, head_k_dim=128, num_householder=2, backend="auto",
                              rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 40, 256), jnp.float32)
    graphdef, state = nnx.split(layer)
    full = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)
    run = jax.jit(lambda s, x, c: nnx.merge(graphdef, s)(x, cache=c))
    y, cache = run(state, x[:, :33], layer.init_cache(2))
    ys = [y]
    for t in range(33, 40):
        y, cache = run(state, x[:, t:t + 1], cache)
        ys.append(y)
    e = rel_rms(jnp.concatenate(ys, 1), full)
    print(f"[layer prefill 33 + 7 decode steps] rel rms vs full forward {e:.2e}")
    assert e < 5e-3
