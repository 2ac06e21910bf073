"""Property test: op == reference (float64) over random shapes, packings and options.

Hypothesis draws B, T (1..100), n (1..3), H, the GVA group, K, V, gate kind, initial
state, l2 norm, scale and (for B == 1) a random packing of T into sequences, zero-length
ones included. Outputs and final states are compared for every example, gradients of
every input for every GRAD_EVERY-th example (each example compiles anew: ~1 s forward,
~5 s with gradients on CPU). derandomize=True and no database: CI sees the same examples
on every run.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gdp_jax
from gdp_jax.testing import call, default_weights, loss_and_grads, make_inputs, rel_max

OP = gdp_jax.gated_delta_product
REF = gdp_jax.gated_delta_product_reference
TOL = 1e-10
GRAD_EVERY = 8
_count = {"examples": 0, "grads": 0}


@st.composite
def cases(draw):
    packed = draw(st.booleans())
    B = 1 if packed else draw(st.integers(1, 2))
    T = draw(st.integers(1, 100))
    cu = None
    if packed:
        N = draw(st.integers(1, 5))
        # cuts at 0 / T and repeated cuts give zero-length sequences
        cut = st.one_of(st.integers(0, T), st.sampled_from([0, T]))
        cuts = sorted(draw(st.lists(cut, min_size=N - 1, max_size=N - 1)))
        cu = np.array([0, *cuts, T], np.int32)
    return dict(
        B=B, T=T, n=draw(st.integers(1, 3)), H=draw(st.integers(1, 2)),
        group=draw(st.sampled_from([1, 2, 3])), K=draw(st.sampled_from([4, 8, 16])),
        V=draw(st.sampled_from([4, 8, 12])), cu=cu,
        gate=draw(st.sampled_from(["normal", "strong", "none"])),
        h0=draw(st.booleans()), l2=draw(st.booleans()),
        scale=draw(st.sampled_from([None, 0.3])), seed=draw(st.integers(0, 2**31 - 1)))


@functools.lru_cache(maxsize=None)
def _forward_pair(static_kw):
    """One jit (one compilation) computing the op and the reference forward."""
    kw = dict(static_kw)

    @jax.jit
    def f(x, cu):
        return (call(OP, x, cu_seqlens=cu, backend="xla", **kw),
                call(REF, x, cu_seqlens=cu, **kw))
    return f


@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(c=cases())
def test_op_matches_reference(c):
    N = c["B"] if c["cu"] is None else len(c["cu"]) - 1
    x = make_inputs(c["seed"], c["B"], c["T"], c["n"], c["H"], c["H"] * c["group"], c["K"],
                    c["V"], jnp.float64, N=N, gate=c["gate"], initial_state=c["h0"])
    kw = dict(use_qk_l2norm=c["l2"], scale=c["scale"])
    cu = None if c["cu"] is None else jnp.asarray(c["cu"])
    _count["examples"] += 1
    if _count["examples"] % GRAD_EVERY == 1:
        _count["grads"] += 1
        w = default_weights(x, c["cu"], key=c["seed"])
        o, s, _, g = loss_and_grads(OP, x, w, cu_seqlens=cu, backend="xla", **kw)
        o_r, s_r, _, g_r = loss_and_grads(REF, x, w, cu_seqlens=cu, **kw)
        assert set(g) == set(g_r)
        for name in g:
            assert g[name].shape == getattr(x, name).shape
            err = rel_max(g[name], g_r[name])
            assert err < TOL, (name, err)
    else:
        (o, s), (o_r, s_r) = _forward_pair(tuple(sorted(kw.items())))(x, cu)
    assert o.shape == (c["B"], c["T"], c["H"] * c["group"], c["V"]) and o.dtype == jnp.float64
    assert s.shape == (N, c["H"] * c["group"], c["K"], c["V"])
    assert rel_max(o, o_r) < TOL, rel_max(o, o_r)
    assert rel_max(s, s_r) < TOL, rel_max(s, s_r)
    assert np.all(np.isfinite(np.asarray(o))) and np.all(np.isfinite(np.asarray(s)))


def test_properties_ran_with_gradients():
    """Guard: the property test above really ran its examples and checked gradients on
    some of them. pytest keeps file order, so in a full run it has run already; selected
    on its own (-k) this test runs it first, so the counts are never vacuous."""
    if _count["examples"] == 0:
        test_op_matches_reference()
    assert _count["examples"] >= 20
    assert _count["grads"] >= 3
