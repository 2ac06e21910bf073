"""Never silently wrong (issue 17, docs/ERRORS.md): what trace-time checks cannot see.

- CP under ``shard_map(check_vma=False)``: right outputs AND gradients (initial state and
  final-state cotangents included); replicated inputs raise where shard_map tracks axes
  and give the one-device answer (outputs and gradients) where it does not.
- ``cu_seqlens`` as a traced value: invalid offsets poison every output, final state and
  gradient with NaN, and ``checkify`` reports them (hypothesis draws invalid ones).
- Non-finite inputs are causal: outputs before the bad token (and other sequences) equal
  the clean run's (hypothesis injects inf/NaN at a random token), on the xla backend and on
  the cutedsl pipeline with emulated kernels.
- NumPy arrays anywhere, the overflow-safe L2 norm, and the remaining clear errors.
"""
from __future__ import annotations

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.experimental import checkify
from jax.sharding import PartitionSpec as P

import gdp_jax
from gdp_jax import testing
from gdp_jax.kernels import wy_inverse
from gdp_jax.testing import make_inputs, rel_max
import test_cp as tcp

OP = gdp_jax.gated_delta_product
REF = gdp_jax.gated_delta_product_reference
AXIS = tcp.AXIS
FIELDS = ("q", "k", "v", "g", "beta")


def _call(fn, inp, **kw):
    return fn(inp.q, inp.k, inp.v, inp.g, inp.beta, initial_state=inp.initial_state, **kw)


# --- CP without varying-axis checks ------------------------------------------------------

CU_CP = (0, 5, 13, 13, 32)        # 4 ranks of 8 tokens: crossings, an empty sequence


@functools.lru_cache(maxsize=None)
def _cp_grad(check_vma: bool, packed: bool):
    def local(a, cu):
        return OP(a["q"], a["k"], a["v"], a["g"], a["beta"], initial_state=a["h0"],
                  output_final_state=True, cu_seqlens=cu, cp_axis=AXIS)

    def loss(a, cu, wo, ws):
        specs = {n: (P() if n == "h0" else P(None, AXIS)) for n in a}
        if packed:
            f = jax.shard_map(local, mesh=tcp._mesh(4), in_specs=(specs, P()),
                              out_specs=(P(None, AXIS), P()), check_vma=check_vma)
            o, s = f(a, cu)
        else:
            f = jax.shard_map(lambda a: local(a, None), mesh=tcp._mesh(4), in_specs=(specs,),
                              out_specs=(P(None, AXIS), P()), check_vma=check_vma)
            o, s = f(a)
        return jnp.sum(o * wo) + jnp.sum(s * ws)

    return jax.jit(jax.value_and_grad(loss))


@jax.jit
@jax.value_and_grad
def _single_grad(a, cu, wo, ws):
    """The one-device reference, under jit (eagerly its value_and_grad dispatched op by op:
    ~35 s of the first case); one jitted function for all four cases."""
    o, s = OP(a["q"], a["k"], a["v"], a["g"], a["beta"], initial_state=a["h0"],
              output_final_state=True, cu_seqlens=cu)
    return jnp.sum(o * wo) + jnp.sum(s * ws)


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("check_vma", [False, True])
def test_cp_gradients_with_and_without_check_vma(check_vma, packed):
    # Before: check_vma=False gave the initial-state gradient 4x and the final state's
    # share of dk/dv/dg/dbeta 0.25x, silently.
    B, N = (1, len(CU_CP) - 1) if packed else (2, 2)
    inp = make_inputs(0, B, 32, 2, 1, 2, 8, 8, N=N)
    args = dict(q=inp.q, k=inp.k, v=inp.v, g=inp.g, beta=inp.beta, h0=inp.initial_state)
    wo, ws = tcp._weights(1, (B, 32, 2, 8), (N, 2, 8, 8))
    cu = jnp.asarray(CU_CP, jnp.int32) if packed else None

    want_val, want = _single_grad(args, cu, wo, ws)
    val, got = _cp_grad(check_vma, packed)(args, cu, wo, ws)
    assert abs(float(val) - float(want_val)) < 1e-10 * abs(float(want_val))
    for name in args:
        assert rel_max(got[name], want[name]) < 1e-10, name


@pytest.mark.parametrize("name", FIELDS)
def test_cp_replicated_input_raises_under_check_vma(name):
    """The replicated one has the local shard's shape, so only its varying axes tell."""
    inp = make_inputs(0, 1, 16, 1, 1, 1, 4, 4, initial_state=False)
    args = {n: getattr(inp, n) for n in FIELDS}
    args[name] = args[name][:, :8]
    specs = {n: (P() if n == name else P(None, AXIS)) for n in FIELDS}
    f = jax.shard_map(lambda a: OP(*(a[n] for n in FIELDS), cp_axis=AXIS),
                      mesh=tcp._mesh(2), in_specs=(specs,), out_specs=P(None, AXIS))
    with pytest.raises(ValueError, match=rf"^{name} \(shape .*\) does not vary over cp_axis"):
        jax.eval_shape(f, args)


def _replicated_grad(bad_rank=None):
    """value_and_grad over CP on 4 ranks under check_vma=False with every input passed
    replicated (in_specs=P()); ``bad_rank``: that rank's copy of q differs in one element
    (the inputs are then shards, not replicas)."""
    def local(a):
        q = a["q"]
        if bad_rank is not None:
            q = jnp.where(lax.axis_index(AXIS) == bad_rank, q.at[0, 0, 0, 0].add(1.0), q)
        return OP(q, a["k"], a["v"], a["g"], a["beta"], initial_state=a["h0"],
                  output_final_state=True, cp_axis=AXIS)

    def loss(a, wo, ws):
        f = jax.shard_map(local, mesh=tcp._mesh(4), in_specs=(P(),),
                          out_specs=(P(), P()), check_vma=False)
        o, s = f(a)
        return jnp.sum(o * wo) + jnp.sum(s * ws), (o, s)

    return jax.jit(jax.value_and_grad(loss, has_aux=True))


def test_cp_replicated_inputs_without_check_vma_give_the_one_device_answer():
    """API.md: inputs not split along cp_axis, where shard_map(check_vma=False) cannot
    tell, give the right answer and gradients (or raise) - never wrong numbers. The ranks
    compare fingerprints of their inputs; replicas compute alone, as one device. Before:
    the final state was off by ~1e-3 and every gradient by ~1 (each rank took the whole
    sequence as its quarter of a 4x longer one)."""
    B, T = 2, 32
    inp = make_inputs(5, B, T, 2, 1, 2, 8, 4, gate="strong")
    args = dict(q=inp.q, k=inp.k, v=inp.v, g=inp.g, beta=inp.beta, h0=inp.initial_state)
    wo, ws = tcp._weights(2, (B, T, 2, 4), (B, 2, 8, 4))
    (want_val, want_out), want = _single_grad_aux(args, wo, ws)
    (val, out), got = _replicated_grad()(args, wo, ws)
    for a, b in zip(out, want_out):
        assert rel_max(a, b) < 1e-10
    for name in args:
        assert rel_max(got[name], want[name]) < 1e-10, name
    # one element of q different on one rank: not replicas, so the ranks run as the CP
    # shards of a 4x longer sequence (shard_map returns rank 0's o; the gradients, summed
    # over the ranks, show it)
    _, got2 = _replicated_grad(bad_rank=3)(args, wo, ws)
    assert rel_max(got2["k"], want["k"]) > 1e-3


@jax.jit
@functools.partial(jax.value_and_grad, has_aux=True)
def _single_grad_aux(a, wo, ws):
    o, s = OP(a["q"], a["k"], a["v"], a["g"], a["beta"], initial_state=a["h0"],
              output_final_state=True)
    return jnp.sum(o * wo) + jnp.sum(s * ws), (o, s)


# --- traced cu_seqlens -------------------------------------------------------------------

T_OFF = 20


@functools.lru_cache(maxsize=None)
def _packed_grad(N: int):
    def loss(diff, cu):
        o, s = OP(*(diff[n] for n in FIELDS), initial_state=diff["initial_state"],
                  output_final_state=True, cu_seqlens=cu)
        return jnp.sum(o) + jnp.sum(s), (o, s)

    return jax.jit(jax.value_and_grad(loss, has_aux=True))


def _packed_args(N):
    inp = make_inputs(3, 1, T_OFF, 2, 1, 2, 4, 4, N=N)
    return {n: getattr(inp, n) for n in FIELDS + ("initial_state",)}


def _all_nan(tree):
    return all(bool(np.all(np.isnan(np.asarray(x)))) for x in jax.tree_util.tree_leaves(tree))


def _assert_poisoned(cu):
    cu = np.asarray(cu, np.int32)
    (val, (o, s)), grads = _packed_grad(len(cu) - 1)(_packed_args(len(cu) - 1), cu)
    assert np.isnan(float(val))
    assert _all_nan((o, s)), "outputs / final states not all NaN"
    assert _all_nan(grads), "gradients not all NaN"


@pytest.mark.parametrize("cu", [(1, 7, 20), (0, 7, 19), (0, 12, 7, 20), (0, 7, 21),
                                (-2, 7, 20), (0, 0, 0)])
def test_invalid_traced_offsets_poison_everything(cu):
    _assert_poisoned(cu)


def test_valid_traced_offsets_are_untouched():
    cu = np.asarray((0, 0, 7, 20), np.int32)
    (val, (o, s)), grads = _packed_grad(3)(_packed_args(3), cu)
    args = _packed_args(3)
    o_r, s_r = REF(*(args[n] for n in FIELDS), initial_state=args["initial_state"],
                   output_final_state=True, cu_seqlens=cu)
    assert rel_max(o, o_r) < 1e-10 and rel_max(s, s_r) < 1e-10
    assert all(np.all(np.isfinite(np.asarray(g))) for g in grads.values())


@st.composite
def invalid_offsets(draw):
    """[N + 1] offsets for T_OFF tokens that break exactly one rule, N = 3."""
    cuts = sorted(draw(st.lists(st.integers(0, T_OFF), min_size=2, max_size=2)))
    cu = [0, *cuts, T_OFF]
    kind = draw(st.sampled_from(["start", "end", "decrease"]))
    if kind == "start":
        cu[0] = draw(st.integers(-T_OFF, T_OFF).filter(lambda x: x != 0))
    elif kind == "end":
        cu[-1] = draw(st.integers(-T_OFF, 3 * T_OFF).filter(lambda x: x != T_OFF))
    else:
        i = draw(st.integers(1, 2))
        cu[i] = cu[i + 1] + draw(st.integers(1, T_OFF))        # cu[i] > cu[i + 1]
    return tuple(cu)


@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(invalid_offsets())
def test_random_invalid_traced_offsets_poison_everything(cu):
    _assert_poisoned(cu)


def test_checkify_reports_invalid_offsets():
    args = _packed_args(2)

    def f(cu):
        return OP(*(args[n] for n in FIELDS), initial_state=args["initial_state"],
                  cu_seqlens=cu)

    checked = jax.jit(checkify.checkify(f))
    err, o = checked(jnp.asarray([0, 9, 19], jnp.int32))
    assert np.all(np.isnan(np.asarray(o)))
    with pytest.raises(checkify.JaxRuntimeError, match=r"invalid traced cu_seqlens.*T=20"):
        err.throw()
    err, o = checked(jnp.asarray([0, 9, 20], jnp.int32))
    assert err.get() is None and np.all(np.isfinite(np.asarray(o)))


@pytest.mark.parametrize("bad", ["local", "per_rank", "sharded"])
def test_invalid_offsets_under_cp_poison_everything(bad):
    """GLOBAL offsets are required, the same on every rank: local ones (ending at the
    shard length), different ones per rank, or a sharded array give NaN everywhere."""
    inp = make_inputs(5, 1, 32, 1, 1, 2, 4, 4, N=4)
    args = {n: getattr(inp, n) for n in FIELDS + ("initial_state",)}
    if bad == "local":
        cu, cu_spec = jnp.asarray([0, 3, 5, 7, 8], jnp.int32), P()
    elif bad == "per_rank":          # rank r sees [0, 5 + r, ..] (sharded rows, squeezed)
        cu = jnp.asarray([[0, 5 + r, 13, 20, 32] for r in range(4)], jnp.int32)
        cu_spec = P(AXIS)
    else:                            # the [8] global offsets split over 4 ranks
        cu, cu_spec = jnp.asarray([0, 1, 4, 9, 13, 20, 25, 32], jnp.int32), P(AXIS)
    if bad == "sharded":             # each rank sees 2 offsets: N = 1 sequence
        args["initial_state"] = args["initial_state"][:1]
    specs = {n: (P() if n == "initial_state" else P(None, AXIS)) for n in args}

    def local(a, c):
        return OP(*(a[n] for n in FIELDS), initial_state=a["initial_state"],
                  output_final_state=True, cu_seqlens=c.reshape(-1), cp_axis=AXIS)

    def loss(a, c):
        f = jax.shard_map(local, mesh=tcp._mesh(4), in_specs=(specs, cu_spec),
                          out_specs=(P(None, AXIS), P()), check_vma=False)
        o, s = f(a, c)
        return jnp.sum(o) + jnp.sum(s), (o, s)

    (val, outs), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(args, cu)
    assert _all_nan(outs) and _all_nan(grads)


# --- non-finite inputs are causal --------------------------------------------------------

CU_NF = (0, 37, 37, 38, 150)     # packed: the bad token sits in the last sequence


def _inject(inp, name, t0, value):
    x = np.array(getattr(inp, name))
    x[0, t0] = value
    return inp._replace(**{name: jnp.asarray(x)})


@functools.lru_cache(maxsize=None)
def _jit_call(fn, cu, kw):
    """_call(fn, inp, cu_seqlens=cu, **kw) under jit, one compile per configuration
    (eagerly each call dispatched op by op: ~2 s per call, 3 per hypothesis example). cu
    is closed over, so the op sees concrete NumPy offsets as it did eagerly (the reference,
    which indexes them with traced values, a jax constant of the same values)."""
    cu = None if cu is None else (jnp if fn is REF else np).asarray(cu, np.int32)
    return jax.jit(lambda inp: _call(fn, inp, cu_seqlens=cu, **dict(kw)))


def _check_causal(inp, name, t0, value, cu=None, **kw):
    bad = _inject(inp, name, t0, value)
    kw = tuple(sorted(kw.items()))
    cu = None if cu is None else tuple(cu)
    o_c = np.asarray(_jit_call(OP, cu, kw)(inp))
    o_b = np.asarray(_jit_call(OP, cu, kw)(bad))
    o_r = np.asarray(_jit_call(REF, cu, ())(bad))
    # before t0 (and, packed, every other sequence): exactly the clean run, = recurrence
    keep = np.r_[0:t0] if cu is None else np.r_[0:t0, (min(c for c in cu if c > t0)):150]
    assert np.array_equal(o_b[:, keep], o_c[:, keep]), (name, t0)
    assert rel_max(o_b[:, keep], o_r[:, keep]) < 1e-10
    # the bad token itself is not silently finite where the recurrence is not
    assert np.isfinite(o_b[:, t0]).all() == np.isfinite(o_r[:, t0]).all()


@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(FIELDS), st.integers(0, 149), st.sampled_from([np.inf, -np.inf, np.nan]),
       st.booleans())
def test_nonfinite_input_is_causal(name, t0, value, packed):
    inp = make_inputs(7, 1, 150, 2, 1, 2, 8, 8, N=len(CU_NF) - 1 if packed else 1)
    _check_causal(inp, name, t0, value, cu=CU_NF if packed else None)


@pytest.fixture
def emulated_kernels():
    """The cutedsl pipeline on CPU with its kernels emulated (plain matmuls, like the
    kernels' MMAs: a non-finite later row would reach earlier ones without the glue)."""
    with testing.emulated_kernels():
        yield


@pytest.mark.parametrize("name", FIELDS)
def test_nonfinite_input_is_causal_cutedsl_emulated(emulated_kernels, name):
    inp = make_inputs(8, 1, 150, 2, 1, 2, 8, 8, N=len(CU_NF) - 1)
    for t0, value, cu in ((100, np.inf, None), (70, np.nan, CU_NF), (37, -np.inf, CU_NF)):
        _check_causal(inp if cu else inp._replace(initial_state=inp.initial_state[:1]),
                      name, t0, value, cu=cu, backend="cutedsl")


def test_inverse_kernel_wrapper_is_row_causal(emulated_kernels):
    rng = np.random.default_rng(0)
    A = np.tril(rng.standard_normal((2, 64, 64)) * 0.1, -1)
    A[1, 40, 3] = np.inf
    X = np.asarray(wy_inverse.unit_lower_inverse(jnp.asarray(A, jnp.float32)))
    want = np.linalg.inv(np.eye(64) + A[0])
    assert np.abs(X[0] - want).max() < 1e-4
    assert np.isfinite(X[1, :40]).all() and np.isnan(X[1, 40:]).all()
    assert np.abs(X[1, :40] - np.linalg.inv(np.eye(64) + np.where(np.isinf(A[1]), 0, A[1]))
                  [:40]).max() < 1e-4


@pytest.mark.parametrize("block", [2, 4, 16])
@pytest.mark.parametrize("plain", [False, True])
def test_xla_inverse_any_block_and_size(monkeypatch, block, plain):
    """The XLA blocked inverse for every substitution block and sizes that do not halve
    evenly: (I + A)^-1 in float64 to 1e-12, and (row-causal path) a non-finite row of A
    leaves the rows before it finite and puts a NaN into it and every later row."""
    from gdp_jax import chunked
    monkeypatch.setattr(chunked, "SUBSTITUTION_BLOCK", block)
    rng = np.random.default_rng(block)
    with jax.enable_x64(True):
        for m in (1, 3, 5, 24, 40, 63, 64):
            A = np.tril(rng.standard_normal((2, m, m)) * 0.3, -1)
            X = np.asarray(chunked._blocked_inverse(jnp.asarray(A), plain=plain))
            want = np.linalg.inv(np.eye(m) + A)
            assert np.abs(X - want).max() < 1e-12 * np.abs(want).max(), (m, block)
        if not plain:
            A = np.tril(rng.standard_normal((40, 40)) * 0.3, -1)
            A[17, 5] = np.inf
            X = np.asarray(chunked._blocked_inverse(jnp.asarray(A)))
            assert np.isfinite(X[:17]).all() and np.isnan(X[17:]).any(axis=-1).all()


def test_masked_loss_over_inf_padding_is_finite():
    """Inf garbage in padding after the real tokens: a loss masked to the real tokens is
    finite and equals the recurrence's (it was NaN: one inf poisoned its 64-step chunk)."""
    inp = make_inputs(9, 1, 90, 2, 1, 2, 8, 8)
    x = np.array(inp.v)
    x[0, 60:] = np.inf
    bad = inp._replace(v=jnp.asarray(x))
    mask = (jnp.arange(90) < 60)[None, :, None, None]
    # each loss under jax.jit (eagerly: op-by-op dispatch)
    loss = lambda fn: float(jax.jit(lambda b: jnp.sum(jnp.where(mask, _call(fn, b), 0.0)))(
        bad))
    got, want = loss(OP), loss(REF)
    assert np.isfinite(got) and abs(got - want) < 1e-10 * abs(want)


def test_unnormalised_keys_stay_finite_as_long_as_the_recurrence():
    """Keys x10 (|beta k^2| >> 2): the float32 recurrence blows up after a couple dozen
    tokens; the op stays finite and right up to the same token (it was NaN everywhere)."""
    inp = make_inputs(0, 1, 128, 2, 1, 2, 32, 32, dtype=jnp.float32)
    inp = inp._replace(k=inp.k * 10)
    # each side under jax.jit (eagerly: op-by-op dispatch)
    o, r = (np.asarray(jax.jit(lambda x: _call(fn, x))(inp)) for fn in (OP, REF))
    fo, fr = np.isfinite(o).all(axis=(0, 2, 3)), np.isfinite(r).all(axis=(0, 2, 3))
    n_r = int(np.argmin(fr))
    assert 5 < n_r < 128 and fo[:n_r].all()
    assert rel_max(o[:, :10], r[:, :10]) < 1e-3


# --- L2 norm, NumPy inputs, errors -------------------------------------------------------

@pytest.mark.parametrize("fn", [OP, REF])
def test_l2norm_of_huge_keys(fn):
    """|k| ~ 1e30: the sum of squares overflows float32 (it returned all zeros)."""
    inp = make_inputs(11, 1, 40, 2, 1, 2, 8, 8, dtype=jnp.float32)
    big = inp._replace(k=inp.k * 1e30, q=inp.q * 1e25)
    # one jitted function for both calls (eagerly: op-by-op dispatch, twice)
    run = jax.jit(lambda x: _call(fn, x, use_qk_l2norm=True))
    o_big = np.asarray(run(big))
    o = np.asarray(run(inp))
    assert np.isfinite(o_big).all() and np.abs(o_big).max() > 0
    assert rel_max(o_big, o) < 1e-4


def test_l2norm_unchanged_for_ordinary_vectors():
    from gdp_jax.reference import L2_EPS, l2_normalize
    x = np.random.default_rng(0).standard_normal((5, 16)) * np.array([[1e-3], [0.1], [1.], [3.], [100.]])
    want = x / np.sqrt(np.sum(x * x, -1, keepdims=True) + L2_EPS)
    assert np.abs(np.asarray(l2_normalize(jnp.asarray(x))) - want).max() < 1e-14
    g = jax.grad(lambda y: jnp.sum(l2_normalize(y) * jnp.arange(16.)))(jnp.asarray(x))
    g_plain = jax.grad(lambda y: jnp.sum(y * jax.lax.rsqrt(jnp.sum(y * y, -1, keepdims=True)
                                                           + L2_EPS) * jnp.arange(16.)))(x)
    assert np.abs(np.asarray(g) - np.asarray(g_plain)).max() < 1e-12


@pytest.mark.parametrize("fn", [OP, REF])
def test_numpy_inputs_eager(fn):
    """Every argument as a NumPy array, called eagerly (TracerArrayConversionError before)."""
    inp = make_inputs(12, 1, 20, 2, 1, 2, 4, 4, N=2)
    cu = np.asarray([0, 8, 20], np.int32)
    as_np = {n: np.asarray(getattr(inp, n)) for n in FIELDS + ("initial_state",)}
    o, s = fn(*(as_np[n] for n in FIELDS), initial_state=as_np["initial_state"],
              output_final_state=True, cu_seqlens=cu)
    o_j, s_j = _call(fn, inp, output_final_state=True, cu_seqlens=jnp.asarray(cu))
    assert rel_max(o, o_j) < 1e-12 and rel_max(s, s_j) < 1e-12


def test_float64_numpy_without_x64_then_grad():
    """All-float64 NumPy inputs with x64 off become float32 like the argument jax.grad
    traces (it blamed "k float64 vs q float32")."""
    inp = make_inputs(13, 1, 12, 1, 1, 1, 4, 4)
    as_np = {n: np.asarray(getattr(inp, n), np.float64) for n in FIELDS + ("initial_state",)}
    with jax.enable_x64(False), warnings.catch_warnings():
        warnings.simplefilter("ignore")     # jax's "float64 requested, float32 given"
        # under jax.jit (eagerly the grad dispatched op by op); the other inputs stay NumPy
        # float64 arrays closed over, q the float32 argument that jax.grad traces
        dq = jax.jit(jax.grad(lambda q: jnp.sum(OP(q, *(as_np[n] for n in FIELDS[1:]),
                                                   initial_state=as_np["initial_state"]))))(
            as_np["q"])
        assert dq.dtype == jnp.float32 and np.isfinite(np.asarray(dq)).all()


def test_recompute_chunk_num_numpy_int():
    inp = make_inputs(14, 1, 12, 1, 1, 1, 4, 4)
    # the two runs under jit (eagerly: op-by-op dispatch, ~30 s); the flag is closed over
    # as the np.int64 itself
    run = lambda **kw: jax.jit(lambda inp: _call(OP, inp, **kw))(inp)
    o = run(recompute_chunk_num=np.int64(3))
    assert rel_max(o, run()) == 0
    for bad in (np.float64(3.0), True, np.int64(65), -1):
        with pytest.raises(ValueError, match="recompute_chunk_num"):
            _call(OP, inp, recompute_chunk_num=bad)


@pytest.mark.parametrize("B, T, n, cu", [(1, 2 ** 30, 2, None), (1, 2 ** 30, 2, 4),
                                         (2, 2 ** 31, 1, None), (3, 2 ** 30, 1, None)])
def test_sizes_that_overflow_int32_offsets_raise(B, T, n, cu):
    """Rejected up front with the sizes (a raw OverflowError, or an int32 length wrapping
    negative, before). Shapes only: jax.eval_shape allocates nothing."""
    s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    H = HV = K = V = 1
    args = (s(B, T, H, K), s(B, T, n, H, K), s(B, T, n, HV, V), None, s(B, T, n, HV))
    kw = {} if cu is None else {"cu_seqlens": jax.ShapeDtypeStruct((cu + 1,), jnp.int32)}
    with pytest.raises(ValueError, match=r"B=.*T=.*n=.*2\*\*31 - 1"):
        jax.eval_shape(lambda q, k, v, b, **c: OP(q, k, v, None, b, **c), *args[:3],
                       args[4], **kw)


def _layer(**kw):
    from flax import nnx
    from gdp_jax.nn import GatedDeltaProduct
    return GatedDeltaProduct(16, 2, head_k_dim=4, rngs=nnx.Rngs(0), **kw)


def test_layer_cp_axis_outside_shard_map():
    layer = _layer(cp_axis="cp")
    with pytest.raises(ValueError, match=r"cp_axis='cp' is not a mesh axis bound here"):
        layer(jnp.ones((1, 8, 16)))


def test_layer_cu_seqlens_error_names_x():
    layer = _layer()
    with pytest.raises(ValueError, match=re.escape("x has shape (2, 8, 16)")):
        layer(jnp.ones((2, 8, 16)), cu_seqlens=np.asarray([0, 8], np.int32))
