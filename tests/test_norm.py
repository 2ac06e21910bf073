"""The op's fixed-order L2 norm (gdp_jax.norm): same values as the reference formula, its
hand-written vjp equals autodiff's, and a row's result does not depend on what else is in
the tensor (the batch invariance the op's packed and batched calls rely on)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdp_jax import norm, reference


def test_row_sum_is_the_written_tree():
    # association matters for these values: the tree adds halves, then carries the odd one
    x = jnp.asarray([1e16, 1.0, 3.0, -1e16, 1.0, 5.0], jnp.float64)
    p = [x[0] + x[3], x[1] + x[4], x[2] + x[5]]
    want = (p[0] + p[1]) + p[2]
    got = norm.row_sum(x)
    assert got.shape == (1,)
    assert float(got[0]) == float(want)


@pytest.mark.parametrize("D", [1, 7, 16, 128])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e30])
def test_matches_reference_float64(D, scale):
    rng = np.random.default_rng(D)
    x = jnp.asarray(rng.standard_normal((4, 3, D)) * scale, jnp.float64)
    dy = jnp.asarray(rng.standard_normal((4, 3, D)), jnp.float64)
    y, pull = jax.vjp(norm.l2_normalize, x)
    y_ref, pull_ref = jax.vjp(reference.l2_normalize, x)
    np.testing.assert_allclose(y, y_ref, rtol=1e-14, atol=1e-15)
    dx, dx_ref = pull(dy)[0], pull_ref(dy)[0]
    # D = 1 normalises to +-1 whatever x is: its gradient is rounding noise around 0
    tol = 1e-13 * float(jnp.max(jnp.abs(dy))) / max(scale, 1.0) if D == 1 else 0
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-12, atol=tol)
    assert bool(jnp.all(jnp.isfinite(dx)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_row_alone_equals_row_in_company(dtype):
    """One row's value and gradient are the same bits alone and inside tensors of other
    sizes (jitted: what XLA compiles depends on the shape)."""
    rng = np.random.default_rng(0)
    K = 128
    row = jnp.asarray(rng.standard_normal((1, K)), dtype)
    drow = jnp.asarray(rng.standard_normal((1, K)), dtype)

    def value_and_grad(x, dy):
        y, pull = jax.vjp(norm.l2_normalize, x)
        return y, pull(dy)[0]

    f = jax.jit(value_and_grad)
    y1, g1 = f(row, drow)
    for rows in (3, 640, 4099):
        others = jnp.asarray(rng.standard_normal((rows, K)), dtype)
        d_others = jnp.asarray(rng.standard_normal((rows, K)), dtype)
        at = rows // 2
        x = others.at[at].set(row[0])
        dy = d_others.at[at].set(drow[0])
        y, g = f(x, dy)
        assert np.asarray(y[at]).tobytes() == np.asarray(y1[0]).tobytes(), rows
        assert np.asarray(g[at]).tobytes() == np.asarray(g1[0]).tobytes(), rows


def test_batch_invariant_op_matches():
    """The op with ``batch_invariant=True`` (xla backend, float64, packed with an empty
    sequence; and the one-token path) gives the default's outputs and gradients."""
    from gdp_jax import gated_delta_product
    rng = np.random.default_rng(3)
    T, n, H, K, V = 70, 2, 2, 16, 8
    f64 = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float64)
    q, k, v = f64(1, T, H, K) * 3, f64(1, T, n, H, K), f64(1, T, n, H, V)
    g = -jnp.asarray(rng.uniform(0.01, 0.3, (1, T, H)), jnp.float64)
    beta = jnp.asarray(rng.uniform(0.1, 1.9, (1, T, n, H)), jnp.float64)
    cu = np.array([0, 30, 30, T], np.int32)
    w = f64(1, T, H, V)

    def loss(inv, q, k, v, g, beta, cu):
        o = gated_delta_product(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm=True,
                                backend="xla", batch_invariant=inv)
        return jnp.sum(o * w[:, :q.shape[1]])

    for args in ((q, k, v, g, beta, cu), (q[:, :1], k[:, :1], v[:, :1], g[:, :1],
                                          beta[:, :1], None)):
        vg = lambda inv: jax.value_and_grad(loss, argnums=(1, 2, 3, 4, 5))(inv, *args)
        (l0, g0), (l1, g1) = vg(False), vg(True)
        np.testing.assert_allclose(l1, l0, rtol=1e-13)
        for a, b in zip(g1, g0):
            np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-13)


def test_batch_invariant_checks():
    """``batch_invariant``: a Python bool, static under jit, not with intra_cp / cp_axis."""
    from gdp_jax import gated_delta_product
    q = jnp.ones((1, 8, 1, 16))
    k = jnp.ones((1, 8, 2, 1, 16))
    v = jnp.ones((1, 8, 2, 1, 8))
    beta = jnp.full((1, 8, 2, 1), 0.5)
    with pytest.raises(TypeError, match="batch_invariant"):
        gated_delta_product(q, k, v, None, beta, backend="xla", batch_invariant="yes")
    with pytest.raises(TypeError, match="batch_invariant"):
        jax.jit(lambda b: gated_delta_product(q, k, v, None, beta, backend="xla",
                                              batch_invariant=b))(True)
    with pytest.raises(ValueError, match="batch_invariant=True with cp_axis=None, "
                                         "intra_cp=2"):
        gated_delta_product(q, k, v, None, beta, backend="xla", batch_invariant=True,
                            intra_cp=2)
