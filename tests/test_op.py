"""The xla op against the token-by-token reference: outputs, final states, all gradients.

Compilation dominates the run time on CPU, so each shape case compiles the op and the
reference once (``gdp_jax.testing.loss_and_grads`` caches the jitted functions) and then reuses
them for several value sets (normal and strong gates, the no-NaN extremes).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdp_jax
from gdp_jax.testing import (Inputs, default_weights, loss_and_grads, make_inputs, rel_max,
                             rel_rms, upcast)

OP = gdp_jax.gated_delta_product
REF = gdp_jax.gated_delta_product_reference

F64_TOL = 1e-10


def _check_f64(inp, tol=F64_TOL, cu_seqlens=None, key=None, floor=1e-300, **kw):
    """Op (xla) vs reference in float64: o, final state and every gradient."""
    w = default_weights(inp, cu_seqlens, key)
    o, s, _, dg = loss_and_grads(OP, inp, w, cu_seqlens=cu_seqlens, backend="xla", **kw)
    o_r, s_r, _, dg_r = loss_and_grads(REF, inp, w, cu_seqlens=cu_seqlens, **kw)
    assert o.shape == o_r.shape == inp.v.shape[:2] + inp.v.shape[3:]
    assert o.dtype == jnp.float64 and s.dtype == jnp.float64
    errs = {"o": rel_max(o, o_r), "final_state": rel_max(s, s_r)}
    assert set(dg) == set(dg_r)
    expected = {"q", "k", "v", "beta"} | {n for n in ("g", "initial_state")
                                          if getattr(inp, n) is not None}
    assert set(dg) == expected
    for name in dg:
        assert dg[name].shape == getattr(inp, name).shape, name
        assert dg[name].dtype == getattr(inp, name).dtype, name
        errs["d" + name] = rel_max(dg[name], dg_r[name], floor)
    bad = {k: v for k, v in errs.items() if not v <= tol}
    assert not bad, f"errors over {tol}: {bad} (all: {errs})"
    # The comparison must not be vacuous: the reference produces nonzero values.
    assert np.max(np.abs(np.asarray(o_r))) > 0
    for name in ("q", "k", "v", "beta"):
        assert np.max(np.abs(np.asarray(dg_r[name]))) > 0, name
    return o, s, dg, w


# (B, T, n, H, HV, K, V, gate, initial_state, use_qk_l2norm, scale). Not the full product
# (each case costs a compilation, ~5 s on CPU): every value of every axis appears, the
# T values put the n*T interleaved steps just below / on / just above chunk (64)
# boundaries for each n, and gate "normal" cases also run the "strong" gate values.
MATRIX = [
    (2, 1, 3, 2, 4, 16, 8, "none", False, True, None),
    (2, 63, 1, 1, 2, 8, 16, "none", True, False, None),     # L = 63
    (1, 64, 1, 2, 4, 16, 8, "normal", False, True, None),   # L = 64
    (2, 65, 1, 1, 1, 16, 32, "normal", True, True, None),   # L = 65
    (2, 64, 2, 2, 2, 8, 16, "none", False, False, None),    # L = 128
    (1, 65, 2, 2, 4, 8, 16, "normal", True, True, None),    # L = 130
    (2, 130, 2, 1, 2, 8, 4, "normal", False, False, 0.37),  # L = 260
    (2, 64, 3, 1, 2, 16, 8, "normal", True, True, None),    # L = 192
    (1, 65, 3, 2, 4, 8, 16, "normal", False, False, None),  # L = 195
    (1, 130, 3, 2, 4, 16, 8, "none", True, True, None),     # L = 390
]


def _case_id(c):
    B, T, n, H, HV, K, V, gate, h0, l2, scale = c
    return (f"B{B}-T{T}-n{n}-H{H}-HV{HV}-K{K}-V{V}-{gate}-{'h0' if h0 else 'noh0'}-"
            f"{'l2' if l2 else 'nol2'}" + (f"-scale{scale}" if scale else ""))


@pytest.mark.parametrize("case", MATRIX, ids=[_case_id(c) for c in MATRIX])
def test_matches_reference_f64(case):
    B, T, n, H, HV, K, V, gate, h0, l2, scale = case
    gates = ["normal", "strong"] if gate == "normal" else [gate]
    for i, gk in enumerate(gates):
        inp = make_inputs(100 + i, B, T, n, H, HV, K, V, jnp.float64,
                          gate=gk, initial_state=h0)
        _check_f64(inp, use_qk_l2norm=l2, scale=scale)


def test_fully_covered_axes():
    """The matrix above really covers each requested value (guards against edits)."""
    cols = list(zip(*MATRIX))
    assert set(cols[2]) == {1, 2, 3}
    assert {1, 63, 64, 65, 130} <= set(cols[1])
    assert set(cols[0]) == {1, 2}
    assert {(1, 2), (2, 4)} <= set(zip(cols[3], cols[4]))
    assert all(K != V for K, V in zip(cols[5], cols[6]))
    assert set(cols[7]) == {"none", "normal"} and set(cols[8]) == set(cols[9]) == {True, False}
    assert {n * T % 64 for n, T in zip(cols[2], cols[1])} >= {63, 0, 1}
    assert any(c is not None for c in cols[10])


# --- packed sequences --------------------------------------------------------------------

def _pad_packed(inp: Inputs, cu):
    """Packed row -> one row per sequence, right-padded with identity tokens.

    A token with k = v = beta = g = 0 leaves the state unchanged, so the padded batch has
    the same outputs at the real positions and the same final states as the packed row.
    """
    cu = np.asarray(cu)
    N = len(cu) - 1
    lens = np.diff(cu)
    Tm = max(int(lens.max()), 1)

    def pad(x):
        if x is None:
            return None
        x = np.asarray(x)
        out = np.zeros((N, Tm) + x.shape[2:], x.dtype)
        for i in range(N):
            out[i, :lens[i]] = x[0, cu[i]:cu[i + 1]]
        return jnp.asarray(out)

    return inp._replace(q=pad(inp.q), k=pad(inp.k), v=pad(inp.v), g=pad(inp.g),
                        beta=pad(inp.beta)), Tm


def _unpad(o_b, cu):
    cu, o_b = np.asarray(cu), np.asarray(o_b)
    return np.concatenate([o_b[i, :cu[i + 1] - cu[i]] for i in range(len(cu) - 1)])[None]


PACKED = [
    # (cu_seqlens, n, H, HV, K, V, gate, initial_state, use_qk_l2norm)
    # lengths 1, 49, 0, 70, 30: 2, 98, 0, 140, 60 steps (crossing chunk boundaries)
    ([0, 1, 50, 50, 120, 150], 2, 1, 2, 8, 16, "normal", True, False),
    # empty first / middle sequences, length-1 sequences, one of exactly 3 chunks (192
    # steps), no initial state, GVA 2 -> 4, l2 norm
    ([0, 0, 1, 2, 66, 67, 67, 100], 3, 2, 4, 16, 8, "none", False, True),
]


@pytest.mark.parametrize("case", PACKED, ids=[f"cu{c[0]}-n{c[1]}" for c in PACKED])
def test_packed_matches_reference_f64(case):
    cu, n, H, HV, K, V, gate, h0, l2 = case
    cu = np.array(cu, np.int32)
    T, N = int(cu[-1]), len(cu) - 1
    gates = ["normal", "strong"] if gate == "normal" else [gate]
    for i, gk in enumerate(gates):
        inp = make_inputs(200 + i, 1, T, n, H, HV, K, V, jnp.float64,
                          N=N, gate=gk, initial_state=h0)
        o, s, dg, (wo, ws) = _check_f64(inp, cu_seqlens=cu, use_qk_l2norm=l2)
    # Independent of the packing logic of both implementations: the same sequences as
    # separate, right-padded batch rows of the reference, outputs and gradients.
    padded, _ = _pad_packed(inp, cu)
    wo_b = _pad_packed(inp._replace(q=wo), cu)[0].q      # zero weight on the padding
    o_b, s_b, _, dg_b = loss_and_grads(REF, padded, (wo_b, ws), use_qk_l2norm=l2)
    assert rel_max(o, _unpad(o_b, cu)) < F64_TOL
    assert rel_max(s, s_b) < F64_TOL
    for name in dg:
        ref = dg_b[name] if name == "initial_state" else _unpad(dg_b[name], cu)
        assert rel_max(dg[name], ref) < F64_TOL, name
    lens = np.diff(cu)
    s = np.asarray(s)
    for i in np.flatnonzero(lens == 0):
        # A zero-length sequence passes its initial state through unchanged, and the
        # final-state cotangent straight back to it.
        want = np.asarray(inp.initial_state)[i] if h0 else 0.0
        np.testing.assert_array_equal(s[i], want)
        if h0:
            np.testing.assert_array_equal(np.asarray(dg["initial_state"])[i],
                                          np.asarray(ws)[i])


def test_packed_sequences_are_independent():
    """Changing one sequence's tokens changes nothing in the other sequences."""
    cu = np.array([0, 1, 50, 50, 120, 150], np.int32)
    inp = make_inputs(5, 1, 150, 2, 1, 2, 8, 16, jnp.float64, N=5)
    run = jax.jit(lambda x: OP(x.q, x.k, x.v, x.g, x.beta, initial_state=x.initial_state,
                               output_final_state=True, cu_seqlens=cu, backend="xla"))
    o1, s1 = map(np.asarray, run(inp))
    v2, h2 = np.array(inp.v), np.array(inp.initial_state)
    v2[:, 50:120] *= -3.0
    h2[3] = 1.0
    inp2 = inp._replace(v=jnp.asarray(v2), initial_state=jnp.asarray(h2))
    o2, s2 = map(np.asarray, run(inp2))
    np.testing.assert_array_equal(o1[:, :50], o2[:, :50])
    np.testing.assert_array_equal(o1[:, 120:], o2[:, 120:])
    np.testing.assert_array_equal(s1[np.array([0, 1, 2, 4])], s2[np.array([0, 1, 2, 4])])
    assert not np.allclose(o1[:, 50:120], o2[:, 50:120])
    assert not np.allclose(s1[3], s2[3])


# --- low precision -----------------------------------------------------------------------

LOWP_SHAPE = dict(B=2, T=100, n=2, H=1, HV=2, K=32, V=16)
LOWP_TOL = {
    # dtype: (o, dq/dk/dv/dh0, dbeta/dg)
    jnp.dtype(jnp.bfloat16): (5e-3, 8e-3, 2e-2),
    jnp.dtype(jnp.float16): (5e-3, 8e-3, 2e-2),
    jnp.dtype(jnp.float32): (1e-5, 1e-5, 1e-5),
}


LOWP_L2 = True       # one shared fp32 reference compilation for every low-precision test


def _lowp_inputs(seed, dtype, gate="normal", **kw):
    s = LOWP_SHAPE
    return make_inputs(seed, s["B"], s["T"], s["n"], s["H"], s["HV"], s["K"], s["V"], dtype,
                       gate=gate, **kw)


def _lowp_errors(inp):
    """Op on ``inp`` vs the float32 reference on the same (upcast) values.

    Returns (errors dict name -> rel_rms, op results). Also checks dtypes and finiteness.
    """
    dtype = inp.q.dtype
    assert inp.g.dtype == jnp.float32 and inp.initial_state.dtype == jnp.float32
    ref_inp = upcast(inp, jnp.float32)
    # Cotangent weights exactly representable in the low dtype: the same do for both.
    wo, ws = default_weights(inp)
    wo = jnp.asarray(np.asarray(wo).astype(dtype).astype(np.float64))
    o, st, _, dg = loss_and_grads(OP, inp, (wo, ws), backend="xla", use_qk_l2norm=LOWP_L2)
    o_r, st_r, _, dg_r = loss_and_grads(REF, ref_inp, (wo, ws), use_qk_l2norm=LOWP_L2)
    assert o.dtype == dtype, o.dtype
    assert st.dtype == jnp.float32, st.dtype
    assert o_r.dtype == jnp.float32
    for name in dg:
        assert dg[name].dtype == getattr(inp, name).dtype, (name, dg[name].dtype)
    for name, x in [("o", o), ("final_state", st)] + [("d" + k, x) for k, x in dg.items()]:
        finite = bool(np.all(np.isfinite(np.asarray(x, np.float64))))
        assert finite, f"{name} has NaN/inf"
    errs = {"o": rel_rms(o, o_r), "final_state": rel_rms(st, st_r)}
    errs.update({"d" + k: rel_rms(dg[k], dg_r[k]) for k in dg})
    return errs, (o, st, dg)


def _assert_lowp(errs, dtype):
    t_o, t_x, t_gb = LOWP_TOL[dtype]
    tol = {"o": t_o, "dbeta": t_gb, "dg": t_gb}
    bad = {k: (e, tol.get(k, t_x)) for k, e in errs.items() if not e < tol.get(k, t_x)}
    assert not bad, f"(error, tolerance) over tolerance: {bad}; all: {errs}"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32],
                         ids=["bf16", "fp16", "fp32"])
def test_low_precision_vs_fp32_reference(dtype):
    dtype = jnp.dtype(dtype)
    errs, _ = _lowp_errors(_lowp_inputs(11, dtype, "normal"))
    _assert_lowp(errs, dtype)
    if dtype != jnp.float32:
        # Strong gates (down to -1e4, exact zeros) within the half-precision tolerances.
        errs, _ = _lowp_errors(_lowp_inputs(12, dtype, "strong"))
        _assert_lowp(errs, dtype)


def test_fp32_strong_gates_accuracy():
    """Decay differences are segment sums, so strong gates cost float32 no accuracy."""
    errs, _ = _lowp_errors(_lowp_inputs(12, jnp.float32, "strong"))
    _assert_lowp(errs, jnp.dtype(jnp.float32))


# --- no NaN from valid finite input ------------------------------------------------------

@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
def test_no_nan_full_decay(dtype):
    """g = -1e4 on every token: the state is wiped every step; finite and correct."""
    dtype = jnp.dtype(dtype)
    inp = _lowp_inputs(13, dtype)
    inp = inp._replace(g=jnp.full(inp.g.shape, -1e4, jnp.float32))
    errs, _ = _lowp_errors(inp)
    _assert_lowp(errs, dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
def test_no_nan_beta_near_two(dtype):
    """beta in [1.999, 2] with unit keys: every update has an eigenvalue near -1."""
    dtype = jnp.dtype(dtype)
    inp = _lowp_inputs(14, dtype, beta_range=(1.999, 2.0), key_norm=(1.0, 1.0))
    beta = np.asarray(inp.beta).copy()
    beta[:, ::3] = 2.0                                   # some exactly 2
    inp = inp._replace(beta=jnp.asarray(beta))
    errs, _ = _lowp_errors(inp)
    _assert_lowp(errs, dtype)


def test_no_nan_full_decay_f64():
    case = MATRIX[7]                                     # reuses that case's compilation
    B, T, n, H, HV, K, V, gate, h0, l2, scale = case
    assert gate == "normal" and h0
    inp = make_inputs(15, B, T, n, H, HV, K, V, jnp.float64, initial_state=h0)
    inp = inp._replace(g=jnp.full(inp.g.shape, -1e4, jnp.float64))
    # exp(-1e4) == 0: dg is exactly 0 in the reference; the op's is O(1e-16) rounding,
    # so dg is compared in absolute terms (floor 1: every other tensor here is O(1)).
    o, s, dg, _ = _check_f64(inp, use_qk_l2norm=l2, scale=scale, floor=1.0)
    for x in [o, s, *dg.values()]:
        finite = bool(np.all(np.isfinite(np.asarray(x))))
        assert finite


def test_no_nan_extreme_finite_gate():
    """g = -3e38 (finite float32): cumsums overflow to -inf, yet no inf - inf arises."""
    inp = _lowp_inputs(16, jnp.dtype(jnp.float32))
    inp = inp._replace(g=jnp.full(inp.g.shape, -3e38, jnp.float32))
    errs, _ = _lowp_errors(inp)
    _assert_lowp(errs, jnp.dtype(jnp.float32))


@pytest.mark.parametrize("T,n", [(1, 1), (31, 2), (32, 2), (100, 3), (30, 5), (12, 11),
                                 (3, 65)])
def test_contiguous_relayout_equals_gather(T, n):
    """Batched layouts relayout by pad/reshape/slice (grid.Contiguous); the general
    gather with explicit row indices must give the same chunk grid and readout, incl. a
    partial last chunk, the identity rows after each chunk's whole tokens (n = 3, 5, 11) and
    tokens across chunks (n > 64), and the same transposes (gradients)."""
    from gdp_jax import grid
    B, HV, X = 2, 3, 5
    C, S = grid.CHUNK, grid.steps_per_chunk(n)
    lay = grid.make_layout(B, T, n, None)
    assert isinstance(lay.src, grid.Contiguous)
    NC = lay.reset.shape[1]
    rows = jnp.arange(NC * C, dtype=jnp.int32)
    step = rows // C * S + rows % C
    last = n * jnp.arange(T, dtype=jnp.int32) + n - 1
    explicit = lay._replace(
        src=jnp.broadcast_to(jnp.where((rows % C < S) & (step < n * T), step, -1),
                             (B, NC * C)),
        out_slot=jnp.broadcast_to(last // S * C + last % S, (B, T)))
    x = jnp.asarray(np.random.default_rng(T).standard_normal((B, n * T, HV, X)))
    y_fast, pull_fast = jax.vjp(lambda a: grid.to_chunks(lay, a), x)
    y_gather, pull_gather = jax.vjp(lambda a: grid.to_chunks(explicit, a), x)
    np.testing.assert_array_equal(y_fast, y_gather)
    ct = jnp.asarray(np.random.default_rng(1).standard_normal(y_fast.shape))
    np.testing.assert_array_equal(pull_fast(ct)[0], pull_gather(ct)[0])
    o_fast, back_fast = jax.vjp(lambda c: grid.from_chunks(lay, c), ct)
    o_gather, back_gather = jax.vjp(lambda c: grid.from_chunks(explicit, c), ct)
    np.testing.assert_array_equal(o_fast, o_gather)
    do = jnp.asarray(np.random.default_rng(2).standard_normal(o_fast.shape))
    np.testing.assert_array_equal(back_fast(do)[0], back_gather(do)[0])
