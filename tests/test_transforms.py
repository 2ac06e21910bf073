"""The op under JAX transformations: jit, grad/vjp, vmap, checkpoint, traced cu_seqlens.

Everything runs in float64 against the token-by-token reference (tolerance 1e-10) or
against the op itself outside the transformation.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdp_jax
from gdp_jax.testing import Inputs, make_inputs, random_lengths, rel_max

OP = functools.partial(gdp_jax.gated_delta_product, backend="xla")
REF = gdp_jax.gated_delta_product_reference
TOL = 1e-10

# One small shape for the whole file (K != V, GVA, n = 2, crosses a chunk boundary).
B, T, n, H, HV, K, V = 2, 40, 2, 1, 2, 8, 12


def _inputs(seed, **kw):
    return make_inputs(seed, B, T, n, H, HV, K, V, jnp.float64, **kw)


def _both(fn, x: Inputs, **kw):
    return fn(x.q, x.k, x.v, x.g, x.beta, initial_state=x.initial_state,
              output_final_state=True, **kw)


def test_eval_shape_dtypes():
    """Abstract evaluation only (no compilation): output shapes and dtypes per dtype."""
    for dt in (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64):
        x = _inputs(0, initial_state=False)
        sds = lambda a: jax.ShapeDtypeStruct(a.shape, dt)
        g = jax.ShapeDtypeStruct(x.g.shape, jnp.float32)
        o, s = jax.eval_shape(
            lambda q, k, v, g, b: OP(q, k, v, g, b, output_final_state=True),
            sds(x.q), sds(x.k), sds(x.v), g, sds(x.beta))
        assert o.shape == (B, T, HV, V) and o.dtype == jnp.dtype(dt)
        want_state = jnp.float64 if dt == jnp.float64 else jnp.float32
        assert s.shape == (B, HV, K, V) and s.dtype == jnp.dtype(want_state)
        o = jax.eval_shape(lambda q, k, v, g, b: OP(q, k, v, g, b),
                           sds(x.q), sds(x.k), sds(x.v), g, sds(x.beta))
        assert isinstance(o, jax.ShapeDtypeStruct) and o.shape == (B, T, HV, V)


def test_jit_matches_reference_and_caches():
    traces = []

    @jax.jit
    def f(x):
        traces.append(1)
        return _both(OP, x)

    ref = jax.jit(lambda x: _both(REF, x))
    for seed in (1, 2):
        x = _inputs(seed, gate="strong" if seed == 2 else "normal")
        o, s = f(x)
        o_r, s_r = ref(x)
        assert rel_max(o, o_r) < TOL and rel_max(s, s_r) < TOL
    assert len(traces) == 1, "new values of the same shapes must not retrace"


def test_grad_and_vjp_without_final_state():
    """jax.grad / jax.vjp through the o-only path (output_final_state=False)."""
    x = _inputs(3)
    w = jnp.asarray(np.random.default_rng(0).standard_normal((B, T, HV, V)))

    def loss(fn, q, k, v, g, beta, h0):
        return jnp.sum(fn(q, k, v, g, beta, initial_state=h0) * w)

    args = (x.q, x.k, x.v, x.g, x.beta, x.initial_state)
    grads_r = jax.jit(jax.grad(functools.partial(loss, REF), argnums=tuple(range(6))))(*args)

    # jax.vjp of the op (jax.grad of it is exercised by every other gradient test).
    @jax.jit
    def vjp(*a):
        o, pull = jax.vjp(lambda *a: OP(*a[:5], initial_state=a[5]), *a)
        return o, pull(w)

    o, cts = vjp(*args)
    assert o.shape == (B, T, HV, V)
    for name, a, b, x_ in zip(("q", "k", "v", "g", "beta", "h0"), cts, grads_r, args):
        assert a.shape == x_.shape and a.dtype == x_.dtype, name
        assert rel_max(a, b) < TOL, name


@pytest.mark.parametrize("packed", [False, True], ids=["batched", "packed"])
def test_vmap_over_leading_axis(packed):
    """vmap over a stacked extra axis == one call per element (packed: different
    cu_seqlens per element, batched along with the data)."""
    E = 3
    if packed:
        rng = np.random.default_rng(4)
        N = 4
        cus = np.stack([random_lengths(rng, T, N) for _ in range(E)])
        assert len({tuple(c) for c in cus}) == E
        xs = [make_inputs(10 + e, 1, T, n, H, HV, K, V, jnp.float64, N=N) for e in range(E)]
    else:
        cus = None
        xs = [_inputs(10 + e) for e in range(E)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *xs)
    cu_arg = None if cus is None else jnp.asarray(cus, jnp.int32)

    def one(x, cu):
        return _both(OP, x, cu_seqlens=cu)

    o_v, s_v = jax.jit(jax.vmap(one))(stacked, cu_arg)
    single = jax.jit(one)
    ref = jax.jit(lambda x, cu: _both(REF, x, cu_seqlens=cu))
    for e in range(E):
        cu_e = None if cus is None else cu_arg[e]
        o, s = single(xs[e], cu_e)
        assert rel_max(o_v[e], o) < 1e-12 and rel_max(s_v[e], s) < 1e-12, e
        o_r, s_r = ref(xs[e], cu_e)
        assert rel_max(o, o_r) < TOL and rel_max(s, s_r) < TOL, e


def test_vmap_of_grad():
    E = 2
    xs = [_inputs(20 + e) for e in range(E)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *xs)
    w = jnp.asarray(np.random.default_rng(1).standard_normal((B, T, HV, V)))

    def loss(x):
        o, s = _both(OP, x)
        return jnp.sum(o * w) + jnp.sum(s)

    g_v = jax.jit(jax.vmap(jax.grad(loss)))(stacked)
    g_1 = jax.jit(jax.grad(loss))
    for e in range(E):
        ge = g_1(xs[e])
        for name in Inputs._fields:
            assert rel_max(getattr(g_v, name)[e], getattr(ge, name)) < 1e-12, (e, name)


def test_checkpoint_same_grads():
    """jax.checkpoint (remat) around a block that calls the op: identical gradients."""
    x = _inputs(5)
    rng = np.random.default_rng(2)
    Wq = jnp.asarray(rng.standard_normal((K, K)) / np.sqrt(K))
    w = jnp.asarray(rng.standard_normal((B, T, HV, V)))

    def block(q, k, v, g, beta, h0):
        q = jnp.tanh(q @ Wq)                   # something before and after the op
        o, s = OP(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        return jnp.sin(o), s

    def loss(blk, *a):
        o, s = blk(*a)
        return jnp.sum(o * w) + jnp.sum(s * s)

    args = tuple(x)
    argnums = tuple(range(1, 7))
    plain = jax.jit(jax.value_and_grad(loss, argnums=argnums), static_argnums=0)
    val, grads = plain(block, *args)
    for policy in (jax.checkpoint_policies.nothing_saveable,):
        remat = jax.checkpoint(block, policy=policy)
        val_c, grads_c = plain(remat, *args)
        assert rel_max(val_c, val) < 1e-13
        for name, a, b in zip(Inputs._fields, grads_c, grads):
            assert rel_max(a, b) < 1e-12, (policy, name)
    # and the checkpointed op really is recomputed: the gradient's jaxpr calls the op's
    # forward (its custom_vjp) more often than without remat (once more, in the backward);
    # a policy that saves everything would not recompute, so the counts would be equal.
    def op_calls(blk):
        grad = jax.grad(lambda *a: loss(blk, *a), argnums=tuple(range(6)))
        return str(jax.make_jaxpr(grad)(*args)).count("custom_vjp_call")
    n_plain = op_calls(block)
    n_remat = op_calls(jax.checkpoint(block, policy=jax.checkpoint_policies.nothing_saveable))
    assert n_plain > 0 and n_remat > n_plain, (n_plain, n_remat)


def test_value_and_grad_under_jit_with_traced_cu_seqlens():
    """cu_seqlens as a jit argument (a tracer, not a constant): one compilation serves
    different packings of the same length, each equal to the reference."""
    Tp, N = 90, 4
    x = make_inputs(6, 1, Tp, n, H, HV, K, V, jnp.float64, N=N)
    w = jnp.asarray(np.random.default_rng(3).standard_normal((1, Tp, HV, V)))
    traces = []

    def loss(fn, x, cu):
        o, s = _both(fn, x, cu_seqlens=cu)
        return jnp.sum(o * w) + jnp.sum(s * s)

    @jax.jit
    def vg(x, cu):
        traces.append(1)
        assert isinstance(cu, jax.core.Tracer)
        return jax.value_and_grad(functools.partial(loss, OP))(x, cu)

    vg_ref = jax.jit(jax.value_and_grad(functools.partial(loss, REF)))
    for cu in ([0, 1, 40, 40, 90], [0, 64, 65, 89, 90], [0, 30, 60, 61, 90]):
        cu = jnp.asarray(cu, jnp.int32)
        val, g = vg(x, cu)
        val_r, g_r = vg_ref(x, cu)
        assert rel_max(val, val_r) < TOL
        for name in Inputs._fields:
            assert rel_max(getattr(g, name), getattr(g_r, name)) < TOL, (cu, name)
    assert len(traces) == 1
