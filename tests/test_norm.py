"""The op's batch-invariant L2 norm (gdp_jax.norm): same values as the reference formula, its
hand-written vjp equals autodiff's, and a row's result does not depend on what else is in
the tensor (the batch invariance the op's packed and batched calls rely on); its exact row sums."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdp_jax import norm, reference


def test_exact_row_sum_cancels_exactly():
    # float sums of these lose the small terms in most orders; the limb sums do not
    x = jnp.asarray([[1e16, 1.0, 3.0, -1e16, 1.0, 5.0]], jnp.float64)
    e = norm._exponent_above(jnp.max(jnp.abs(x), axis=-1, keepdims=True))
    got = norm.exact_row_sum(x, e)
    assert got.shape == (1, 1)
    assert float(got[0, 0]) == 10.0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_exact_row_sum_is_order_free_and_within_its_bound(dtype):
    """Any permutation of a row gives the same bits, and the sum is within the documented
    error of the exact (math.fsum) sum, for terms of both signs over 12 decades."""
    import math
    rng = np.random.default_rng(7)
    D = 128
    t = rng.standard_normal((16, D)) * 10.0 ** rng.uniform(-6, 6, (16, D))
    t = np.asarray(jnp.asarray(t, dtype), np.float64)          # the values the sum sees
    bound = norm._exponent_above(jnp.max(jnp.abs(jnp.asarray(t, dtype)), -1, keepdims=True))
    f = jax.jit(norm.exact_row_sum)
    got = np.asarray(f(jnp.asarray(t, dtype), bound), np.float64)[:, 0]
    _, top = norm._limbs(dtype)
    s = top - (D - 1).bit_length()
    for i in range(16):
        err = abs(got[i] - math.fsum(t[i]))
        ulp = abs(got[i]) * float(jnp.finfo(dtype).eps)
        assert err <= D * 2.0 ** (int(bound[i, 0]) - 2 * s - 1) + ulp, i
    perm = rng.permutation(D)
    again = f(jnp.asarray(t[:, perm], dtype), bound)
    assert np.asarray(again).tobytes() == np.asarray(f(jnp.asarray(t, dtype), bound)).tobytes()


def test_non_finite_rows_give_nan_not_garbage():
    x = jnp.asarray([[1.0, jnp.inf, 2.0], [1.0, 2.0, jnp.nan], [0.0, 0.0, 0.0],
                     [3.0, 4.0, 0.0]], jnp.float32)
    y = norm.l2_normalize(x)
    assert bool(jnp.all(jnp.isnan(y[:2])))
    assert bool(jnp.all(y[2] == 0))
    np.testing.assert_allclose(y[3], [0.6, 0.8, 0.0], rtol=1e-6)


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


@pytest.mark.parametrize("group", [1, 3])
def test_repeat_heads_matches_repeat(group):
    """Values equal jnp.repeat's; the transpose equals autodiff's (float64) and a head's
    cotangent sum is the same bits alone and among other rows (float32, jitted)."""
    rng = np.random.default_rng(group)
    x = jnp.asarray(rng.standard_normal((2, 5, 4, 8)), jnp.float64)
    dy = jnp.asarray(rng.standard_normal((2, 5, 4 * group, 8)), jnp.float64)
    y, pull = jax.vjp(lambda x: norm.repeat_heads(x, group, 2), x)
    y_ref, pull_ref = jax.vjp(lambda x: jnp.repeat(x, group, axis=2), x)
    assert np.array_equal(y, y_ref)
    np.testing.assert_allclose(pull(dy)[0], pull_ref(dy)[0], rtol=1e-15)
    f = jax.jit(lambda x, dy: jax.vjp(lambda x: norm.repeat_heads(x, group, -2), x)[1](dy)[0])
    one = jnp.asarray(rng.standard_normal((1, 4 * group, 128)), jnp.float32)
    alone = f(jnp.zeros((1, 4, 128), jnp.float32), one)
    for rows in (5, 777):
        dys = jnp.asarray(rng.standard_normal((rows, 4 * group, 128)), jnp.float32)
        got = f(jnp.zeros((rows, 4, 128), jnp.float32), dys.at[rows // 2].set(one[0]))
        assert np.asarray(got[rows // 2]).tobytes() == np.asarray(alone[0]).tobytes()


@pytest.mark.parametrize("H,HV", [(2, 2), (1, 3)])
def test_batch_invariant_op_matches(H, HV):
    """The op with ``batch_invariant=True`` (xla backend, float64, packed with an empty
    sequence; GVA; and the one-token path) gives the default's outputs and gradients."""
    from gdp_jax import gated_delta_product
    rng = np.random.default_rng(3)
    T, n, K, V = 70, 2, 16, 8
    f64 = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float64)
    q, k, v = f64(1, T, H, K) * 3, f64(1, T, n, H, K), f64(1, T, n, HV, V)
    g = -jnp.asarray(rng.uniform(0.01, 0.3, (1, T, HV)), jnp.float64)
    beta = jnp.asarray(rng.uniform(0.1, 1.9, (1, T, n, HV)), jnp.float64)
    cu = np.array([0, 30, 30, T], np.int32)
    w = f64(1, T, HV, V)

    def loss(inv, q, k, v, g, beta, cu):
        o = gated_delta_product(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm=True,
                                backend="xla", batch_invariant=inv)
        return jnp.sum(o * w[:, :q.shape[1]])

    for args in ((q, k, v, g, beta, cu), (q[:, :1], k[:, :1], v[:, :1], g[:, :1],
                                          beta[:, :1], None)):
        # jit: one compile a case instead of hundreds of eager dispatches (75 s -> few s)
        vg = lambda inv: jax.jit(jax.value_and_grad(loss, argnums=(1, 2, 3, 4, 5)),
                                 static_argnums=0)(inv, *args)
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
