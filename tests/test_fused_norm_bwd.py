"""The in-op L2 norm's backward inside the local-gradient kernel (``pipeline.FUSED_NORM_BWD``).

On the emulated kernels (CPU): with the switch the kernel contract takes the rows'
1 / |raw row| (``reference.l2_norm_scale``) and returns dq, dk as the raw q, k rows'
cotangents; the op's gradients must then be those of the unfused path (XLA's norm
backward after the 16-bit rounding) up to bf16 rounding, dv, dbeta and dh0 the same bits
(the norm touches only q, k; dg to float32 rounding: XLA's sums around the kernels), and every gradient as close to float64 as the unfused
path's. Batched and packed rows with empty and one-token sequences, T not a multiple of
64, n = 1..3, GVA, K != V, and rows of very different lengths (|k| from 1e-3 to 1e3).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdp_jax
from gdp_jax import testing
from gdp_jax.kernels import emulate, pipeline
from gdp_jax.reference import l2_norm_scale, l2_normalize
from gdp_jax.testing import loss_and_grads, make_inputs, rel_rms

NAMES = ("q", "k", "v", "g", "beta", "initial_state")


@pytest.fixture(autouse=True)
def _fresh_traces():
    """These tests trace the op with switches off their defaults: drop the cached jitted
    loss afterwards, or a later test of the same shapes reuses that trace (s32: the
    packed case of ``test_token_backward_equals_chunk_tiles`` did, in the same worker)."""
    yield
    testing._value_and_grad_fn.cache_clear()


def _grads(inp, cu, backend, fused, monkeypatch, calls=None):
    monkeypatch.setattr(pipeline, "FUSED_NORM_BWD", fused)
    # XLA's norm with the kernel's backward on its rho (NORM_IN_KERNELS has its own tests:
    # test_cutedsl_emulated.py::test_norm_in_kernels)
    monkeypatch.setattr(pipeline, "NORM_IN_KERNELS", False)
    kw = dict(backend=backend, use_qk_l2norm=True)
    if backend == "reference":
        return loss_and_grads(gdp_jax.gated_delta_product_reference, testing.upcast(
            inp, jnp.float64), cu_seqlens=cu, key=7, use_qk_l2norm=True)
    if calls is not None:                    # (emulated_kernels binds it on entry)
        raw = emulate.local_grad_tokens_call
        monkeypatch.setattr(emulate, "local_grad_tokens_call", lambda *a, **k: calls.append(
            k.get("rho") is not None) or raw(*a, **k))
    testing._value_and_grad_fn.cache_clear()       # the switch is read at trace time
    with testing.emulated_kernels():
        out = loss_and_grads(gdp_jax.gated_delta_product, inp, cu_seqlens=cu, key=7, **kw)
    if calls is not None:
        monkeypatch.setattr(emulate, "local_grad_tokens_call", raw)
    return out


def _scale_rows(inp, seed):
    """q, k rows with norms spread over 1e-3 .. 1e3 (the norm's backward scales by 1 / |row|)."""
    rng = np.random.default_rng(seed)
    f = lambda x: (x.astype(jnp.float32) * jnp.asarray(
        10.0 ** rng.uniform(-3, 3, size=x.shape[:-1] + (1,)), jnp.float32)).astype(x.dtype)
    return inp._replace(q=f(inp.q), k=f(inp.k))


@pytest.mark.parametrize("n,T,cu,H,HV,K,V", [
    (1, 150, None, 2, 2, 64, 128),
    (2, 150, [0, 0, 1, 70, 70, 150], 1, 2, 64, 64),        # GVA, packed, empty and 1-token
    (3, 7, None, 1, 3, 128, 64),                           # GVA 3 (T = 1 runs the step kernel)
])
def test_fused_norm_bwd_matches_unfused(monkeypatch, n, T, cu, H, HV, K, V):
    N = 2 if cu is None else len(cu) - 1
    inp = _scale_rows(make_inputs(n + T, 2 if cu is None else 1, T, n, H, HV, K, V,
                                  jnp.bfloat16, N=N), n)
    calls = []
    _, _, _, off = _grads(inp, cu, "cutedsl", False, monkeypatch, calls)
    _, _, _, on = _grads(inp, cu, "cutedsl", True, monkeypatch, calls)
    assert calls == [False, True], calls
    _, _, _, ref = _grads(inp, cu, "reference", False, monkeypatch)
    for name in NAMES:
        a, b = np.asarray(on[name], np.float32), np.asarray(off[name], np.float32)
        assert np.isfinite(a).all(), name
        if name in ("q", "k"):
            assert rel_rms(a, b) < 1e-2, (name, rel_rms(a, b))
            # rounded once after the norm's backward instead of once before it
            e_on, e_off = rel_rms(on[name], ref[name]), rel_rms(off[name], ref[name])
            # y (the normalised rows) enters in 16 bits instead of d: a little worse on
            # some inputs (k of the GVA case: 3.3e-3 vs 2.8e-3), better on others
            assert e_on < 1.25 * e_off + 1e-4, (name, e_on, e_off)
        elif name == "g":   # summed in XLA around the kernels: another graph may reassociate
            assert testing.rel_max(a, b) < 1e-6, name
        else:
            assert a.tobytes() == b.tobytes(), name


@pytest.mark.parametrize("n,T,cu,H,HV,K,V", [
    (2, 150, [0, 0, 1, 70, 70, 150], 1, 2, 64, 64),        # GVA, packed, empty and 1-token
    (3, 90, None, 1, 1, 128, 64),
])
def test_do_tokens_same_bits(monkeypatch, n, T, cu, H, HV, K, V):
    """``pipeline.DO_TOKENS``: the local-gradient kernel reads dO token-major through its
    row table (zeros off the read-out rows) - the same values as XLA's all-rows copy, so
    o, the final state and every gradient but dg are the same bits, dg to float32 rounding
    (emulated kernels)."""
    N = 2 if cu is None else len(cu) - 1
    inp = make_inputs(n + 40, 2 if cu is None else 1, T, n, H, HV, K, V, jnp.bfloat16, N=N)
    seen = []
    raw = emulate.local_grad_tokens_call        # (emulated_kernels binds it on entry)
    monkeypatch.setattr(emulate, "local_grad_tokens_call", lambda *a, **k: seen.append(
        (k.get("do_tokens", False), a[3].ndim)) or raw(*a, **k))
    out = {}
    for on in (False, True):
        monkeypatch.setattr(pipeline, "DO_TOKENS", on)
        testing._value_and_grad_fn.cache_clear()
        with testing.emulated_kernels():
            out[on] = loss_and_grads(gdp_jax.gated_delta_product, inp, cu_seqlens=cu,
                                     key=3, backend="cutedsl", use_qk_l2norm=True)
    assert seen == [(False, 5), (True, 4)], seen
    (o1, s1, l1, g1), (o0, s0, l0, g0) = out[True], out[False]
    pairs = [("o", o1, o0), ("final", s1, s0), ("loss", l1, l0)]
    for name, a, b in pairs + [(k, g1[k], g0[k]) for k in g0]:
        if name == "g":     # summed in XLA around the kernels: another graph may reassociate
            assert testing.rel_max(a, b) < 1e-6
        else:
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), name


def test_l2_norm_scale_is_the_normalise_factor():
    """l2_normalize(x) == x * l2_norm_scale(x) (float64, rows from 1e-30 to 1e30 and a zero
    row), and the norm's backward rho (dy - y (y . dy)) equals jax.vjp of l2_normalize."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 16)) * (10.0 ** np.array([-30, -3, 0, 3, 30, 0]))[:, None]
    x[5] = 0.0
    x = jnp.asarray(x)
    y, pull = jax.vjp(l2_normalize, x)
    rho = l2_norm_scale(x)
    np.testing.assert_allclose(x * rho, y, rtol=1e-14, atol=1e-300)
    dy = jnp.asarray(rng.normal(size=x.shape))
    (dx,) = pull(dy)
    mine = rho * (dy - y * jnp.sum(y * dy, -1, keepdims=True))
    np.testing.assert_allclose(mine, dx, rtol=1e-12, atol=1e-300)


def test_kernel_row_norms_checked():
    """Bad row-norm arrays: a ValueError naming them, their shape and what was expected."""
    from gdp_jax.kernels.local_grad import _checked_row_norms
    ok = (jnp.ones((2, 5, 1), jnp.float32), jnp.ones((2, 10, 1), jnp.float32))
    assert _checked_row_norms(ok, 2, 2, 5, 3) == ok
    with pytest.raises(ValueError, match=r"rho_k: float32 \(2, 10, 1\)"):
        _checked_row_norms((ok[0], jnp.ones((2, 5, 1), jnp.float32)), 2, 2, 5, 3)
    with pytest.raises(ValueError, match="rho_q"):
        _checked_row_norms((ok[0].astype(jnp.bfloat16), ok[1]), 2, 2, 5, 3)
    with pytest.raises(ValueError, match="divisor"):
        _checked_row_norms((jnp.ones((2, 5, 2), jnp.float32),
                            jnp.ones((2, 10, 2), jnp.float32)), 2, 2, 5, 3)
