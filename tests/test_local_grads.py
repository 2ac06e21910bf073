"""The written-out chunk-local backward (chunked.local_grads_direct) against autodiff.

float64, random chunk inputs on the real grid (interleaved steps, zero query rows), random
start states and cotangents: every input cotangent equals jax.vjp through intra_chunk and
the chunk map (chunked.local_grads) to rounding, for normal, strong and no gates, GVA,
and K != V.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdp_jax import chunked, engine
from gdp_jax import gated_delta_product as gdp_op
from gdp_jax._checks import check_inputs
from gdp_jax.testing import make_inputs, rel_max


@jax.jit
def _autodiff(ch, S0, doc, dS, scale):
    it, pull = jax.vjp(chunked.intra_chunk, ch)
    return chunked.local_grads(ch, it, pull, S0, doc, dS, scale)


@jax.jit
def _direct(ch, S0, doc, dS, scale):
    it, X = chunked.wy_factors(ch)
    return chunked.local_grads_direct(ch, it, X, S0, doc, dS, scale)


@pytest.mark.parametrize("gate,n,H,HV,K,V", [("normal", 2, 1, 2, 8, 6), ("strong", 3, 2, 2, 4, 8),
                                              ("none", 1, 1, 1, 16, 16)])
def test_direct_equals_autodiff(gate, n, H, HV, K, V):
    inp = make_inputs(n, 2, 90, n, H, HV, K, V, jnp.float64, gate=gate)
    spec = check_inputs(inp.q, inp.k, inp.v, inp.g, inp.beta, use_qk_l2norm=n == 2)
    ch = engine.forward_problem(spec, inp.q, inp.k, inp.v, inp.g, inp.beta, None).ch
    rng = np.random.default_rng(n)
    S0 = jnp.asarray(rng.standard_normal(ch.k.shape[:3] + (K, V)))
    doc = jnp.asarray(rng.standard_normal(ch.v.shape))
    dS = jnp.asarray(rng.standard_normal(S0.shape))
    want = _autodiff(ch, S0, doc, dS, spec.scale)
    got = _direct(ch, S0, doc, dS, spec.scale)
    for name, a, b in zip(ch._fields, got, want):
        if gate == "none" and name == "g":
            continue
        assert np.max(np.abs(np.asarray(b))) > 0, name
        assert rel_max(a, b) < 1e-12, name


def _direct_segment_sums(g):
    """seg[.., i, j] = g_{j+1} + ... + g_i (j < i) summed term by term in float64."""
    C = g.shape[-1]
    ref = np.zeros(g.shape + (C,))
    for i in range(C):
        for j in range(i):
            ref[..., i, j] = g[..., j + 1:i + 1].sum(-1)
    return ref


def test_segment_sums_float32_strong_gates_and_non_finite():
    """The compensated segment sums in float32 are as accurate as direct sums for strong
    gates (|G| ~ 1e4, where a difference of plain cumsums loses 3 digits); a -inf gate
    gives a decay of exactly 0 across it and no NaN; a NaN gate reaches only its own and
    later rows."""
    rng = np.random.default_rng(0)
    g = -np.abs(rng.standard_normal((64, 64))) * 300
    got = np.asarray(chunked.segment_sums(jnp.asarray(g, jnp.float32)), np.float64)
    ref = _direct_segment_sums(g)
    assert np.max(np.abs(got - ref) / np.maximum(np.abs(ref), 1.0)) < 1e-6
    assert np.all(got[:, np.triu_indices(64)[0], np.triu_indices(64)[1]] == 0)

    gi = g[:2].copy()
    gi[0, 10] = -np.inf
    gi[1, 20] = np.nan
    seg = np.asarray(chunked.segment_sums(jnp.asarray(gi, jnp.float32)), np.float64)
    decay = np.exp(seg) * np.tri(64)
    across = np.tri(64, k=0)[10:, :10]           # rows i >= 10, columns j < 10
    assert np.all(decay[0, 10:, :10][across > 0] == 0)
    assert np.all(np.isfinite(seg[0]))
    assert np.all(np.isfinite(seg[1, :20]))      # rows before the NaN gate are untouched
    ok = np.asarray(_direct_segment_sums(g[1:2, :20])[0])
    assert np.max(np.abs(seg[1, :20, :20] - ok)) < 1e-2


def _op_grads(inp, **kw):
    f = lambda *a: jnp.sum(gdp_op(*a, backend="xla", **kw).astype(jnp.float32) ** 2)
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4)))(
        inp.q, inp.k, inp.v, inp.g, inp.beta)


def test_local_grads_in_blocks_equal_all_at_once(monkeypatch):
    """The backward's local gradients on blocks of chunks (engine.LOCAL_GRAD_PROBLEMS)
    give the all-at-once values bitwise (float64), GVA and K != V included."""
    inp = make_inputs(3, 2, 300, 2, 1, 2, 16, 24, jnp.float64)
    jax.clear_caches()          # the op's jit cache would hide the switch
    want = _op_grads(inp)
    monkeypatch.setattr(engine, "LOCAL_GRAD_PROBLEMS", 8)
    assert engine._block_count(10, 4, 8) == 5       # 10 chunks of 2 rows x 2 heads: 5 blocks
    jax.clear_caches()
    got = _op_grads(inp)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    jax.clear_caches()


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.bfloat16])
def test_optimistic_factors_equal_causal_ones_when_finite(monkeypatch, dtype):
    """recurrence.OPTIMISTIC_FACTORS (plain products, the causal ones only for a call
    with a non-finite value): bitwise the always-causal outputs and gradients on finite
    inputs (the non-finite fallback: the test below)."""
    from gdp_jax import recurrence
    inp = make_inputs(4, 2, 200, 2, 1, 2, 16, 8, dtype)
    out = {}
    for flag in (False, True):
        monkeypatch.setattr(recurrence, "OPTIMISTIC_FACTORS", {jax.default_backend(): flag})
        jax.clear_caches()
        out[flag] = jax.tree_util.tree_leaves(_op_grads(inp))
    for a, b in zip(out[True], out[False]):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    jax.clear_caches()


@pytest.mark.parametrize("name,t0", [("k", 70), ("v", 5), ("beta", 130)])
def test_optimistic_factors_fall_back_to_causal_ones(monkeypatch, name, t0):
    """A non-finite input: the optimistic path takes its causal branch, so the outputs are
    bitwise the always-causal ones (NaN where those are NaN, exact before t0)."""
    from gdp_jax import recurrence
    inp = make_inputs(5, 1, 150, 2, 1, 2, 8, 8, jnp.float64)
    x = np.array(getattr(inp, name))
    x[0, t0] = np.inf
    inp = inp._replace(**{name: jnp.asarray(x)})
    out = {}
    for flag in (False, True):
        monkeypatch.setattr(recurrence, "OPTIMISTIC_FACTORS", {jax.default_backend(): flag})
        jax.clear_caches()
        out[flag] = np.asarray(jax.jit(lambda *a: gdp_op(*a, backend="xla"))(
            inp.q, inp.k, inp.v, inp.g, inp.beta))
    assert np.array_equal(out[True], out[False], equal_nan=True)
    assert np.isfinite(out[True][:, :t0]).all() and not np.isfinite(out[True]).all()
    jax.clear_caches()
