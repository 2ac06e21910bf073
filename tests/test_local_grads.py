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
