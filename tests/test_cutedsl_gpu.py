"""cutedsl forward on an sm_90 GPU vs the xla backend and the float64 reference.

Run on the lent H200 only (``pytest -m gpu tests/test_cutedsl_gpu.py``); CI has no GPU.
Last real result: benchmarks/results/ (fwd_*.md, "GPU tests" section).
Tolerance: FLA-style relative RMS error ||x - ref|| / ||ref|| < 5e-3 for the output and
the final state.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

TOL = 5e-3


def _gpu_ok():
    try:
        d = jax.devices()[0]
    except RuntimeError:
        return False
    return d.platform == "gpu" and str(getattr(d, "compute_capability", "")) == "9.0"


if not _gpu_ok():
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

from gdp_jax import backends, gated_delta_product, gated_delta_product_reference  # noqa: E402


def rel_rms(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / (np.sqrt(np.mean(b ** 2)) + 1e-30))


def make(seed, B, T, n, H, HV, K, V, dtype, *, gate=True, N=None, h0=True):
    N = B if N is None else N
    ks = jax.random.split(jax.random.PRNGKey(seed), 7)
    f32 = jnp.float32
    q = jax.random.normal(ks[0], (B, T, H, K), f32).astype(dtype)
    k = jax.random.normal(ks[1], (B, T, n, H, K), f32).astype(dtype)
    v = jax.random.normal(ks[2], (B, T, n, HV, V), f32).astype(dtype)
    beta = jax.random.uniform(ks[3], (B, T, n, HV), f32, 0.05, 1.95).astype(dtype)
    g = (jax.nn.log_sigmoid(jax.random.normal(ks[4], (B, T, HV), f32) + 3.0)
         if gate else None)
    s0 = 0.3 * jax.random.normal(ks[5], (N, HV, K, V), f32) if h0 else None
    return q, k, v, g, beta, s0


def run(backend, args, cu=None):
    q, k, v, g, beta, s0 = args
    f = jax.jit(lambda q, k, v, g, beta, s0: gated_delta_product(
        q, k, v, g, beta, initial_state=s0, output_final_state=True, cu_seqlens=cu,
        use_qk_l2norm=True, backend=backend))
    return f(q, k, v, g, beta, s0)


def reference(args, cu=None):
    q, k, v, g, beta, s0 = args
    up = lambda x: None if x is None else jnp.asarray(x, jnp.float64)
    return gated_delta_product_reference(up(q), up(k), up(v), up(g), up(beta),
                                         initial_state=up(s0), output_final_state=True,
                                         cu_seqlens=cu, use_qk_l2norm=True)


CASES = [
    # dtype, K, V, n, H, HV, gate, h0
    ("bfloat16", 128, 128, 1, 2, 2, True, True),
    ("bfloat16", 128, 128, 2, 2, 4, True, False),    # GVA
    ("bfloat16", 128, 128, 3, 1, 2, True, True),
    ("bfloat16", 64, 64, 2, 2, 2, False, True),      # no gate
    ("bfloat16", 64, 128, 1, 1, 3, True, True),      # GVA, K != V
    ("bfloat16", 128, 64, 3, 2, 2, False, False),
    ("float16", 128, 128, 2, 2, 2, True, True),
    ("float16", 64, 64, 3, 1, 2, True, True),
    ("float16", 128, 128, 1, 1, 1, False, True),
]


@pytest.mark.parametrize("dtype,K,V,n,H,HV,gate,h0", CASES)
def test_forward_matches(dtype, K, V, n, H, HV, gate, h0):
    args = make(0, 2, 203, n, H, HV, K, V, jnp.dtype(dtype), gate=gate, h0=h0)
    o, s = run("cutedsl", args)
    o_x, s_x = run("xla", args)
    o_r, s_r = reference(args)
    assert o.dtype == args[0].dtype and o.shape == o_x.shape
    assert np.isfinite(np.asarray(o, np.float32)).all()
    e = (rel_rms(o, o_r), rel_rms(s, s_r), rel_rms(o, o_x), rel_rms(s, s_x))
    print(f"[{dtype} K={K} V={V} n={n} H={H} HV={HV} gate={gate}] "
          f"o/ref {e[0]:.2e} S/ref {e[1]:.2e} o/xla {e[2]:.2e} S/xla {e[3]:.2e}")
    assert max(e) < TOL, e


@pytest.mark.parametrize("dtype,n", [("bfloat16", 2), ("float16", 1), ("bfloat16", 3)])
def test_packed_matches(dtype, n):
    lens = [70, 0, 1, 130, 64]                 # an empty and a one-token sequence
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    T = int(cu[-1])
    args = make(1, 1, T, n, 2, 4, 128, 128, jnp.dtype(dtype), N=len(lens))
    o, s = run("cutedsl", args, cu)
    o_r, s_r = reference(args, cu)
    o_x, s_x = run("xla", args, cu)
    e = (rel_rms(o, o_r), rel_rms(s, s_r), rel_rms(o, o_x), rel_rms(s, s_x))
    print(f"[packed {dtype} n={n}] o/ref {e[0]:.2e} S/ref {e[1]:.2e} o/xla {e[2]:.2e} "
          f"S/xla {e[3]:.2e}")
    assert max(e) < TOL, e
    # the empty sequence's final state is its initial state
    np.testing.assert_allclose(np.asarray(s[1]), np.asarray(args[5][1]), rtol=0, atol=0)


def test_long_sequence_state_stays_accurate():
    """Many chunks (T*n = 8192 steps): errors of the 16-bit state operand must not grow."""
    args = make(2, 1, 4096, 2, 2, 2, 128, 128, jnp.bfloat16)
    o, s = run("cutedsl", args)
    o_x, s_x = run("xla", args)
    e = (rel_rms(o, o_x), rel_rms(s, s_x))
    print(f"[long T=4096 n=2] o/xla {e[0]:.2e} S/xla {e[1]:.2e}")
    assert max(e) < TOL, e


def test_grad_uses_xla_backward():
    """A linear loss: its cotangents do not depend on the forward values, so the cutedsl
    op (xla backward) must give the xla op's gradients."""
    args = make(3, 1, 130, 2, 1, 2, 64, 64, jnp.bfloat16)
    wo = jax.random.normal(jax.random.PRNGKey(9), (1, 130, 2, 64), jnp.float32)
    ws = jax.random.normal(jax.random.PRNGKey(8), (1, 2, 64, 64), jnp.float32)

    def loss(backend):
        def f(q, k, v, g, beta, s0):
            o, s = gated_delta_product(q, k, v, g, beta, initial_state=s0,
                                       output_final_state=True, use_qk_l2norm=True,
                                       backend=backend)
            return jnp.sum(o.astype(jnp.float32) * wo) + jnp.sum(s * ws)
        return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4, 5)))

    gc = loss("cutedsl")(*args)
    gx = loss("xla")(*args)
    for a, b in zip(gc, gx):
        assert rel_rms(a, b) < 1e-5


def test_backend_resolution_on_sm90():
    from gdp_jax import _checks
    args = make(0, 1, 64, 1, 1, 1, 128, 128, jnp.bfloat16)
    spec = _checks.check_inputs(*args[:5])
    assert backends.resolve("auto", spec, jnp.bfloat16) == "cutedsl"
    assert backends.resolve("auto", spec, jnp.float32) == "xla"
    with pytest.raises(ValueError, match="bfloat16/float16"):
        backends.resolve("cutedsl", spec, jnp.float32)
    q, k, v, g, beta, _ = make(0, 1, 64, 1, 1, 1, 128, 128, jnp.float32)
    with pytest.raises(ValueError, match="cutedsl"):
        gated_delta_product(q, k, v, g, beta, backend="cutedsl")


# --- context parallelism with the cutedsl backend (forward on the kernel) --------------

@pytest.mark.parametrize("num_gpus", [1, 2])
@pytest.mark.parametrize("packed", [False, True], ids=["batched", "packed"])
def test_cp_cutedsl_equals_single_device(num_gpus, packed):
    """CP over 1 or 2 GPUs with backend='cutedsl' == the single-device xla op (fwd + grads)."""
    from jax.sharding import Mesh, PartitionSpec as P
    if len(jax.devices()) < num_gpus:
        pytest.skip(f"needs {num_gpus} GPUs")       # nvidia-h200-x2 runs the 2-GPU case
    B, T = (1, 1024) if packed else (2, 512)
    args = make(41, B, T, 2, 2, 4, 64, 64, jnp.bfloat16, N=4 if packed else None)
    cu = jnp.array([0, 100, 600, 601, 1024], jnp.int32) if packed else None
    mesh = Mesh(np.array(jax.devices()[:num_gpus]), ("cp",))
    spec = P(None, "cp")

    def cp_op(q, k, v, g, beta, s0, cu_):
        return gated_delta_product(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                   cu_seqlens=cu_, use_qk_l2norm=True, cp_axis="cp",
                                   backend="cutedsl")

    f = jax.shard_map(cp_op, mesh=mesh, in_specs=(spec,) * 5 + (P(), P()),
                      out_specs=(spec, P()))
    o, s = jax.jit(f)(*args, cu)
    o1, s1 = jax.jit(lambda *a: gated_delta_product(
        *a[:5], initial_state=a[5], output_final_state=True, cu_seqlens=cu,
        use_qk_l2norm=True, backend="xla"))(*args)
    assert rel_rms(o, o1) < TOL and rel_rms(s, s1) < TOL
    loss = lambda fn: lambda *a: jnp.sum(fn(*a)[0].astype(jnp.float32) ** 2)
    g_cp = jax.jit(jax.grad(loss(lambda *a: f(*a, cu)), argnums=(0, 1, 2, 4)))(*args)
    g_1 = jax.jit(jax.grad(loss(lambda *a: gated_delta_product(
        *a[:5], initial_state=a[5], output_final_state=True, cu_seqlens=cu,
        use_qk_l2norm=True, backend="xla")),
        argnums=(0, 1, 2, 4)))(*args)
    for a, b in zip(g_cp, g_1):
        assert rel_rms(a, b) < 8e-3
