"""The whole ``cutedsl`` pipeline on CPU, with the kernels replaced by pure-JAX stand-ins.

:mod:`gdp_jax.kernels.emulate` implements the forward, reverse and WY-inverse kernels'
exact contracts (unwritten rows are NaN). Swapping them in tests everything around the
kernels in float64: operand preparation, the chunk-state checkpoints of ``recompute_chunk_num`` and their
recompute, the reverse recursion's wiring, the XLA chunk-local backward, the custom_vjp
residuals, the CP backend's saved context and its kernel summaries - against the
reference and the xla backend.
The kernels themselves are checked on the GPU (tests/test_cutedsl_gpu.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdp_jax
from gdp_jax import _checks, chunked, grid, testing
from gdp_jax.engine import XLA
from gdp_jax.kernels import wy_inverse
from gdp_jax.kernels.pipeline import CUTEDSL
from gdp_jax.testing import loss_and_grads, make_inputs, rel_max
import test_cp as tcp

OP = gdp_jax.gated_delta_product
REF = gdp_jax.gated_delta_product_reference
TOL = 1e-10


@pytest.fixture(autouse=True)
def emulated_kernels():
    # the raw custom calls: the vmap rule around them stays in the test
    with testing.emulated_kernels():
        yield


# grid.chunks_of(spec, layout, q, k, v, g, beta) under jit (eagerly: op by op)
_chunks = jax.jit(grid.chunks_of, static_argnums=0)


def _compare(inp, cu=None, **kw):
    got = loss_and_grads(OP, inp, cu_seqlens=cu, backend="cutedsl", **kw)
    kw.pop("recompute_chunk_num", None)
    want = loss_and_grads(REF, inp, cu_seqlens=cu, **kw)
    o, s, _, g = got
    o_r, s_r, _, g_r = want
    assert rel_max(o, o_r) < TOL
    assert rel_max(s, s_r) < TOL
    assert set(g) == set(g_r)
    for name in g:
        assert np.all(np.isfinite(np.asarray(g[name]))), name
        assert rel_max(g[name], g_r[name]) < TOL, name


@pytest.mark.parametrize("N", [0, 1, 2, 3, 64])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_batched_every_recompute_chunk_num(n, N):
    # T = 70 tokens: n*T = 70/140/210 steps -> 2, 3, 4 chunks (the last one partial).
    inp = make_inputs(10 + n, 2, 70, n, 1, 2, 8, 12, gate="normal")
    _compare(inp, recompute_chunk_num=N)


@pytest.mark.parametrize("N", [0, 2])
def test_packed_gva_strong_gates(N):
    # sequences of 0, 45, 1, 0, 84 tokens (n = 2): chunks reset inside checkpoint groups
    inp = make_inputs(21, 1, 130, 2, 2, 4, 8, 6, N=5, gate="strong", beta_range=(0.05, 1.95))
    _compare(inp, cu=np.array([0, 0, 45, 46, 46, 130], np.int32), recompute_chunk_num=N,
             use_qk_l2norm=True)


def test_no_gate_no_initial_state():
    inp = make_inputs(3, 1, 100, 2, 1, 1, 16, 16, gate="none", initial_state=False)
    _compare(inp, recompute_chunk_num=1)


def test_recompute_chunk_num_checked():
    inp = make_inputs(3, 1, 8, 1, 1, 1, 4, 4)
    for bad in (-1, 65, 2.0, True):
        with pytest.raises(ValueError, match="recompute_chunk_num"):
            OP(inp.q, inp.k, inp.v, inp.g, inp.beta, backend="cutedsl",
               recompute_chunk_num=bad)


@pytest.fixture(scope="module")
def scan_problem():
    """The four strides' common problem and its state scan, once, under jit (eagerly it
    dispatched op by op: ~16 s in the first case)."""
    inp = make_inputs(5, 1, 150, 2, 1, 2, 4, 4, N=4, gate="normal")
    cu = jnp.array([0, 30, 31, 31, 150], jnp.int32)
    layout = grid.make_layout(1, 150, 2, cu)

    @jax.jit
    def scan(layout, q, k, v, g, beta, h0):
        ch = grid.chunk_inputs(layout, q, k, v, g, beta, H=1, HV=2,
                               compute_dtype=jnp.float64, use_qk_l2norm=False)
        it = chunked.intra_chunk(ch)
        return it, chunked.state_scan(it, layout, h0)

    it, S0 = scan(layout, *inp[:5], inp.initial_state)
    return inp, layout, it, S0


@pytest.mark.parametrize("stride", [1, 2, 3, 5])
def test_states_from_checkpoints_equals_state_scan(scan_problem, stride):
    inp, layout, it, S0 = scan_problem
    got = jax.jit(chunked.states_from_checkpoints, static_argnums=4)(
        it, layout, inp.initial_state, S0[:, ::stride], stride)
    assert got.shape == S0.shape
    assert rel_max(got, S0) < 1e-13


def test_checkpoints_kept_per_recompute_chunk_num():
    """The residuals hold ceil(NC / (N + 1)) chunk states: 1 / (N + 1) of them."""
    inp = make_inputs(4, 1, 300, 2, 1, 2, 8, 8)           # 600 steps -> NC = 10 chunks
    for N, NG in [(0, 10), (1, 5), (2, 4), (9, 1), (64, 1)]:
        f = lambda q: OP(q, inp.k, inp.v, inp.g, inp.beta, backend="cutedsl",
                         recompute_chunk_num=N)
        # the residuals' shapes, traced (as test_bytes_kept_beyond_inputs): the eager
        # vjp ran the op's forward op by op (~5 s per N) for shapes only
        vjp = jax.eval_shape(lambda q: jax.vjp(f, q)[1], inp.q)
        shapes = [x.shape for x in jax.tree_util.tree_leaves(vjp)
                  if getattr(x, "ndim", 0) == 5 and x.shape[-2:] == (8, 8)]
        assert shapes == [(1, NG, 2, 8, 8)], (N, shapes)


@pytest.mark.parametrize("backend,N,want", [("xla", 0, 10), ("xla", 2, 4),
                                             ("cutedsl", 0, 10), ("cutedsl", 2, 4)])
def test_bytes_kept_beyond_inputs(backend, N, want):
    """Without an initial state nothing but the inputs and the bf16 checkpoints is kept
    for the backward (no zero initial state, no float32 copy): exactly NG chunk states."""
    inp = make_inputs(4, 1, 300, 2, 1, 2, 8, 8, jnp.bfloat16)   # NC = 10 chunks
    args = (inp.q, inp.k, inp.v, inp.g, inp.beta)
    f = lambda *a: OP(*a, backend=backend, recompute_chunk_num=N)
    res = jax.eval_shape(lambda *a: jax.vjp(f, *a)[1], *args)
    kept = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(res))
    inputs = sum(x.size * x.dtype.itemsize for x in args)
    assert kept - inputs == want * 2 * 8 * 8 * 2            # NG x HV x K x V x bf16


@pytest.mark.parametrize("dtype,want", [(jnp.bfloat16, jnp.bfloat16),
                                         (jnp.float16, jnp.float32)])
def test_checkpoint_dtype(dtype, want):
    """bf16 inputs keep bf16 checkpoints (half the memory, like FLA's h); fp16 inputs keep
    float32 ones (fp16's range is too small for states)."""
    inp = make_inputs(4, 1, 100, 2, 1, 2, 8, 8, dtype)
    f = lambda q: OP(q, inp.k, inp.v, inp.g, inp.beta, backend="cutedsl")
    res = jax.eval_shape(lambda q: jax.vjp(f, q)[1], inp.q)
    ck = [x for x in jax.tree_util.tree_leaves(res)
          if len(x.shape) == 5 and x.shape[-2:] == (8, 8)]
    assert [x.dtype for x in ck] == [want]


# --- CP with the CuTe DSL backend (emulated kernels) on 4 CPU devices ----------------------

@pytest.mark.parametrize("N", [0, 2])
@pytest.mark.parametrize("packed", [False, True])
def test_cp_equals_single_device(packed, N):
    B, T, n, H, HV, K, V = (1, 24, 2, 1, 2, 4, 6) if packed else (2, 80, 2, 1, 2, 4, 6)
    cu = tcp.CU24_A if packed else None
    Nseq = len(cu) - 1 if packed else B
    inp = make_inputs(31, B, T, n, H, HV, K, V, N=Nseq, gate="normal")
    args = tcp._args(inp)
    w = tcp._weights(2, (B, T, HV, V), (Nseq, HV, K, V))
    kw = (("backend", "cutedsl"), ("recompute_chunk_num", N))
    o_cp, s_cp, g_cp = tcp._run("cp", args, cu, w, True, n_dev=4, kw=kw)
    o_1, s_1, g_1 = tcp._run("op", args, cu, w, True, kw=(("backend", "xla"),))
    assert rel_max(o_cp, o_1) < TOL and rel_max(s_cp, s_1) < TOL
    for name in g_1:
        assert rel_max(g_cp[name], g_1[name]) < TOL, name


# 4 ranks of 100 tokens (n = 2: 200 steps, 4 chunks each), so a rank's fragments span
# several chunks and the checkpoints land inside them. A: [31, 380) starts mid-rank 0 and
# crosses out (its own h0 corrects it), spans ranks 1-2 as their first AND last sequence
# (continues in and out) and ends mid-rank 3; [30, 30) is empty, [30, 31) one token.
# B: [31, 400) is rank 3's first and last sequence, continuing in only. C: [100, 400)
# starts exactly at rank 1's start and crosses out (first = last, its own h0), after an
# empty sequence on the boundary.
CU400 = {"A": (0, 30, 30, 31, 380, 400), "B": (0, 30, 30, 31, 31, 400),
         "C": (0, 100, 100, 400)}


@pytest.mark.parametrize("cu,N,backend",
                         [(cu, N, "cutedsl") for cu in ("A", "B", "C", None) for N in (0, 2)]
                         + [("A", 2, "xla"), ("C", 0, "xla"), (None, 2, "xla")])
def test_cp_multichunk_fragments_equal_single_device(cu, N, backend):
    """CP == one device when apply adds the folded state's response to the prepare pass's
    rows, checkpoints and dS_end over several chunks per fragment (one recursion pass per
    direction per rank, both engines), every gradient incl. the initial states'."""
    cu = None if cu is None else CU400[cu]
    B, T, n, H, HV, K, V = (1, 400, 2, 1, 2, 4, 3) if cu else (2, 400, 2, 1, 2, 4, 3)
    Nseq = len(cu) - 1 if cu else B
    inp = make_inputs(33, B, T, n, H, HV, K, V, N=Nseq, gate="normal")
    args = tcp._args(inp)
    w = tcp._weights(5, (B, T, HV, V), (Nseq, HV, K, V))
    kw = (("backend", backend), ("recompute_chunk_num", N))
    o_cp, s_cp, g_cp = tcp._run("cp", args, cu, w, True, n_dev=4, kw=kw)
    o_1, s_1, g_1 = tcp._run("op", args, cu, w, True, kw=(("backend", "xla"),))
    assert rel_max(o_cp, o_1) < 1e-13 and rel_max(s_cp, s_1) < 1e-13
    assert set(g_cp) == set(g_1) and "initial_state" in g_1
    for name in g_1:
        assert rel_max(g_cp[name], g_1[name]) < 1e-13, name


@pytest.mark.parametrize("fuse_ddo", [False, True])
def test_cp_16bit_error_is_the_single_device_error(monkeypatch, fuse_ddo):
    """bf16 inputs: apply's corrections read 16-bit output rows and checkpoints of the
    response columns (as the kernels write them), and still add no error beyond the
    single-device op's (both against float64); also with the reverse kernel forming
    ddo itself (``pipeline.FUSED_DDO``: the CP rank's V + K columns of dO, P as it is)."""
    from gdp_jax.kernels import pipeline
    from gdp_jax.kernels.state_grad import StateGradKernel
    from gdp_jax.testing import rel_rms
    monkeypatch.setattr(pipeline, "FUSED_DDO", fuse_ddo)
    fused = []
    raw = StateGradKernel.raw_call
    monkeypatch.setattr(StateGradKernel, "raw_call", staticmethod(
        lambda *a, **kw: fused.append(kw.get("fuse_ddo", False)) or raw(*a, **kw)))
    jax.clear_caches()
    cu = CU400["A"]
    inp = make_inputs(33, 1, 400, 2, 1, 2, 64, 64, jnp.bfloat16, N=len(cu) - 1, gate="normal")
    args = tcp._args(inp)
    w = tcp._weights(5, (1, 400, 2, 64), (len(cu) - 1, 2, 64, 64), np.float32)
    kw = (("backend", "cutedsl"), ("recompute_chunk_num", 1))
    cp = tcp._run("cp", args, cu, w, True, n_dev=4, kw=kw)
    one = tcp._run("op", args, cu, w, True, kw=kw)
    up = lambda x: np.asarray(x, np.float64)
    ref = tcp._run("op", {n: up(a) for n, a in args.items()}, cu, tuple(map(up, w)), True,
                   kw=(("backend", "xla"),))
    pairs = [(cp[0], one[0], ref[0]), (cp[1], one[1], ref[1])]
    pairs += [(cp[2][n], one[2][n], ref[2][n]) for n in ref[2]]
    for got, single, want in pairs:
        assert rel_rms(up(got), want) < 1.2 * rel_rms(up(single), want) + 1e-4
    assert fused and set(fused) == {fuse_ddo}


def test_cp_saved_context_holds_checkpoints():
    from gdp_jax import cp as gcp
    inp = make_inputs(8, 1, 100, 2, 1, 2, 8, 8)           # 200 steps -> 4 chunks
    spec = _checks.check_inputs(*inp[:5])
    be = gcp.CuTeDSLGatedDeltaProductCPBackend(spec, 1)
    layout_inputs = gcp.GDPInputs(*inp[:5], inp.initial_state, None,
                                  jnp.array([0]), jnp.array([0]), jnp.array(False),
                                  jnp.array(False))
    none = gcp.SummarySlice(jnp.zeros((1, 1, 2, 8, 16)), jnp.zeros((1,), bool))
    # prepare and apply under jax.jit (eagerly: op-by-op dispatch, ~18 s); the saved
    # context is a pytree whose metadata is its static aux data
    saved = jax.jit(lambda li, none: be.cp_forward_apply(be.cp_forward_prepare(li)[1],
                                                          none)[2])(layout_inputs, none)
    assert saved.metadata.has_chunk_states and saved.metadata.recompute_chunk_num == 1
    assert saved.chunk_states.shape == (1, 2, 2, 8, 8)
    assert len(jax.tree_util.tree_leaves(saved)) == 11    # 9 tensors + g + checkpoints
    inputs, md = gcp.restore_saved_context(saved)
    assert md.spec(inputs) == spec.replace(recompute_chunk_num=1)   # rebuilt, not stored


# --- jax.vmap: the kernels' batching rule folds the mapped axis into the batch rows ------

def _stacked_inputs(M, packed):
    B, T, N = (1, 90, 3) if packed else (2, 70, 2)
    per = [make_inputs(50 + i, B, T, 2, 1, 2, 8, 6, N=N) for i in range(M)]
    return [jnp.stack([getattr(p, f) for p in per]) for f in
            ("q", "k", "v", "g", "beta", "initial_state")]


@pytest.mark.parametrize("packed", [False, True])
def test_vmap_forward_and_grad(packed):
    M = 3
    stacked = _stacked_inputs(M, packed)
    cu = jnp.array([0, 40, 41, 90], jnp.int32) if packed else None

    def loss(q, k, v, g, beta, h0):
        o, s = OP(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                  backend="cutedsl", recompute_chunk_num=1)
        return jnp.sum(jnp.sin(o)) + jnp.sum(s * s), (o, s)

    vg = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5), has_aux=True)
    # h0 shared (in_axes None) for the packed case: the rule broadcasts unmapped operands
    h_axis = None if packed else 0
    args = stacked[:5] + [stacked[5][0] if packed else stacked[5]]
    (_, (o, s)), grads = jax.jit(jax.vmap(vg, in_axes=(0, 0, 0, 0, 0, h_axis)))(*args)
    for i in range(M):
        one = [a[i] for a in stacked[:5]] + [args[5] if packed else args[5][i]]
        (_, (o1, s1)), g1 = jax.jit(vg)(*one)
        assert rel_max(o[i], o1) < TOL and rel_max(s[i], s1) < TOL
        for j, (a, b) in enumerate(zip(grads, g1)):
            assert rel_max(a[i], b) < TOL, j   # a shared h0 still gets one gradient per map


def test_kernel_inverse_wrapper_matches_xla():
    """kernels.wy_inverse (emulated kernel): value, closed-form vjp and vmap equal the XLA
    inverse's, and both equal LAPACK's inverse and the analytic vjp (independent of the
    blocked inverse that the emulation and chunked share); junk above the diagonal is
    ignored."""
    key = jax.random.PRNGKey(3)
    A = jnp.tril(jax.random.uniform(key, (2, 3, 64, 64), jnp.float64, -1.0, 1.0), -1)
    junk = A + jnp.triu(jnp.ones((64, 64)), 0) * 7.0
    # every transform of the two inverses under jax.jit (eagerly: op-by-op dispatch)
    xla_inv = jax.jit(chunked.unit_lower_inverse)
    kernel_inv = jax.jit(wy_inverse.unit_lower_inverse)
    X = xla_inv(A)
    eye = np.eye(64)
    X_np = np.linalg.inv(eye + np.asarray(A))                 # LAPACK, on the host
    np.testing.assert_allclose(X, X_np, rtol=1e-9, atol=1e-9)
    X_kernel = kernel_inv(junk)
    np.testing.assert_allclose(X_kernel, X_np, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(X_kernel, X, rtol=1e-12, atol=1e-12)
    W = jax.random.normal(jax.random.PRNGKey(4), A.shape, jnp.float64)
    loss = lambda inv: lambda a: jnp.sum(jnp.sin(inv(a)) * W)
    # d/dA of sum(sin(X) W) with X = (I + A)^-1: -X^T G X^T, G = cos(X) W, kept strictly
    # lower (A's upper part is not an input of the inverse).
    G = np.cos(X_np) * np.asarray(W)
    Xt = np.swapaxes(X_np, -1, -2)
    dA = np.tril(-(Xt @ G @ Xt), -1)
    grad_kernel = jax.jit(jax.grad(loss(wy_inverse.unit_lower_inverse)))(A)
    np.testing.assert_allclose(np.tril(grad_kernel, -1), dA, rtol=1e-8, atol=1e-8)
    np.testing.assert_allclose(grad_kernel,
                               jax.jit(jax.grad(loss(chunked.unit_lower_inverse)))(A),
                               rtol=1e-10, atol=1e-10)
    vm = jax.jit(jax.vmap(wy_inverse.unit_lower_inverse, in_axes=1, out_axes=1))(A)
    np.testing.assert_allclose(vm, X, rtol=1e-12, atol=1e-12)
    # vmap of a function where only another argument is mapped (the inverse is unbatched)
    f = jax.vmap(lambda a, s: wy_inverse.unit_lower_inverse(a) * s, in_axes=(None, 0))
    np.testing.assert_allclose(jax.jit(f)(A[0], jnp.arange(2.0)),
                               X[0][None] * jnp.arange(2.0)[:, None, None, None], atol=1e-12)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_16bit_inputs_match_reference(dtype):
    """bf16/fp16 inputs through the whole cutedsl pipeline (emulated kernels): bf16/float32
    checkpoints and the kernel inverse's glue, vs the float64 reference at FLA's 16-bit
    tolerance."""
    from gdp_jax.testing import DIFF_NAMES, rel_rms, upcast
    inp = make_inputs(12, 2, 150, 2, 2, 4, 32, 16, dtype, gate="normal")
    cu = None
    got = loss_and_grads(OP, inp, cu_seqlens=cu, backend="cutedsl", use_qk_l2norm=True)
    ref = loss_and_grads(REF, upcast(inp, jnp.float64)._replace(
        g=inp.g.astype(jnp.float64), initial_state=inp.initial_state.astype(jnp.float64)),
        cu_seqlens=cu, use_qk_l2norm=True)
    errs = {"o": rel_rms(got[0], ref[0]), "final": rel_rms(got[1], ref[1])}
    errs.update({n: rel_rms(got[3][n], ref[3][n]) for n in DIFF_NAMES})
    print(jnp.dtype(dtype).name, {k: f"{e:.1e}" for k, e in errs.items()})
    assert max(errs.values()) < 1e-2, errs


@pytest.mark.parametrize("packed", [False, True])
def test_kernel_summaries_equal_xla_summaries(packed):
    """The CP summaries from one kernel pass over V + K columns ([E | M] forward,
    [gamma | M^T] reverse) equal the XLA engine's parallel composition, per sequence,
    incl. an empty and a one-token sequence."""
    n, H, HV, K, V = 2, 1, 2, 8, 6
    if packed:
        cu = jnp.asarray([0, 37, 37, 38, 100], jnp.int32)
        B, T, N = 1, 100, 4
    else:
        cu, B, T, N = None, 2, 70, 2
    inp = make_inputs(21, B, T, n, H, HV, K, V, N=N, gate="normal")
    spec = _checks.check_inputs(*inp[:5], scale=0.3, cu_seqlens=cu)
    layout = grid.layout_of(spec, cu)
    # the relayout and each engine's summaries under jax.jit (eagerly: op-by-op dispatch,
    # ~30-50 s per case)
    ch = _chunks(spec, layout, inp.q, inp.k, inp.v, inp.g, inp.beta)
    fwd = lambda eng: jax.jit(lambda ch, layout: eng.forward_summaries(spec, ch, layout)[0])(
        ch, layout)
    for got, want in zip(fwd(CUTEDSL), fwd(XLA)):
        assert got.shape == want.shape
        assert rel_max(got, want) < TOL
    rng = np.random.default_rng(3)
    doc = jnp.asarray(rng.standard_normal(ch.v.shape))
    dfinal = jnp.asarray(rng.standard_normal((N, HV, K, V)))
    bwd = lambda eng: jax.jit(lambda ch, layout, doc, dfinal: eng.backward_summaries(
        spec, ch, layout, doc, dfinal)[0])(ch, layout, doc, dfinal)
    for got, want in zip(bwd(CUTEDSL), bwd(XLA)):
        assert got.shape == want.shape
        assert rel_max(got, want) < TOL


def _bf16_chunks(seed, nonfinite=False):
    """bf16 op inputs on a packed grid (empty and one-token sequences) -> float32 chunks."""
    cu = jnp.asarray([0, 0, 1, 70, 70, 150], jnp.int32)
    inp = make_inputs(seed, 1, 150, 2, 1, 2, 64, 64, jnp.bfloat16, N=5, gate="strong")
    spec = _checks.check_inputs(*inp[:5], cu_seqlens=cu, use_qk_l2norm=True)
    layout = grid.layout_of(spec, cu)
    ch = _chunks(spec, layout, *inp[:5])
    if nonfinite:
        ch = ch._replace(k=ch.k.at[0, 1, 0, 10, 5].set(jnp.nan),
                         v=ch.v.at[0, 2, 1, 30].set(jnp.inf),
                         q=ch.q.at[0, 3, 0, 40, 7].set(jnp.nan),
                         g=ch.g.at[0, 4, 1, 20].set(jnp.nan))
    return spec, ch


@pytest.mark.parametrize("nonfinite", [False, True])
def test_operands_kernel_contract_is_the_xla_pipeline(nonfinite):
    """The operands kernel's emulation (its contract) equals causal_operands(
    forward_operands(..)), bad rows and NaN rows included."""
    from gdp_jax.kernels import emulate, pipeline
    from gdp_jax.kernels.chunk_prep import as_read
    spec, ch = _bf16_chunks(4, nonfinite)
    B = ch.k.shape[0]
    # each side under jax.jit (eagerly: op-by-op dispatch, ~45 s)
    prep = lambda inverse: lambda ch: emulate.chunk_prep_call(
        *ch, jnp.full((B,), spec.scale, jnp.float32), ab_dtype=spec.ab_dtype,
        inverse=inverse)
    got = jax.jit(prep(True))(ch)
    want, bad = jax.jit(lambda ch: pipeline.causal_operands(pipeline.forward_operands(
        as_read(ch, spec.ab_dtype), spec.scale, spec.ab_dtype)))(ch)
    np.testing.assert_array_equal(got[6] != 0, bad)
    # X = (I + A)^-1, in the chunks without a non-finite input (elsewhere unspecified)
    X = np.asarray(jax.jit(lambda ch: chunked.wy_factors(as_read(ch, spec.ab_dtype))[1])(ch),
                   np.float64)
    clean = np.isfinite(X).all(axis=(-1, -2))
    assert got[7].dtype == jnp.float32 and got[7].shape == X.shape and clean.any()
    np.testing.assert_allclose(np.asarray(got[7], np.float64)[clean], X[clean], rtol=1e-5,
                               atol=1e-6)
    assert jax.eval_shape(prep(False), ch)[7].shape == (1,)   # a shape: traced, not run
    assert np.any(bad) == nonfinite
    for a, b in zip(got[:6], want):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                                   rtol=1e-2, atol=1e-6)      # bf16 rounding of w, P


@pytest.mark.parametrize("scale", [None, 0.3])
def test_engine_forward_runs_the_operands_kernel(monkeypatch, scale):
    """bf16, K = V = 64: CuTeDSLEngine.forward (and the CP summaries) take their operands
    from ChunkPrepKernel (the scale a run-time input), and the op's outputs equal those of
    the XLA operands path, at the default and another scale."""
    from gdp_jax.kernels.chunk_prep import ChunkPrepKernel
    from gdp_jax.spec import Unsupported
    calls = []
    for name in ("raw_call", "raw_call_tokens"):      # chunk-major or token-major inputs
        raw = getattr(ChunkPrepKernel, name)
        monkeypatch.setattr(ChunkPrepKernel, name, staticmethod(
            lambda *a, raw=raw, **kw: calls.append(1) or raw(*a, **kw)))
    inp = make_inputs(6, 2, 100, 2, 1, 2, 64, 64, jnp.bfloat16, gate="normal")
    # The op and the summaries under jax.jit (eagerly: op-by-op dispatch, ~50 s), a new
    # jitted function per call, so each traces (where raw_call is counted) anew.
    run = lambda: jax.jit(lambda *a: OP(*a[:5], scale=scale, initial_state=a[5],
                                        output_final_state=True, use_qk_l2norm=True,
                                        backend="cutedsl"))(*inp[:5], inp.initial_state)
    o, s = run()
    assert calls
    spec, ch = _bf16_chunks(7)
    layout = grid.layout_of(spec, jnp.asarray([0, 0, 1, 70, 70, 150], jnp.int32))
    summaries = lambda: jax.jit(lambda ch, layout: CUTEDSL.forward_summaries(
        spec, ch, layout)[0])(ch, layout)
    summ = summaries()
    n = len(calls)
    assert n >= 2
    monkeypatch.setattr(ChunkPrepKernel, "can_implement",
                        staticmethod(lambda **kw: Unsupported("off")))
    o2, s2 = run()
    summ2 = summaries()
    assert len(calls) == n
    np.testing.assert_allclose(np.asarray(o, np.float64), np.asarray(o2, np.float64),
                               rtol=2e-2, atol=2e-2)
    assert rel_max(s, s2) < 1e-2
    for a, b in zip(summ, summ2):
        assert rel_max(a, b) < 1e-2


def test_differentiated_call_runs_the_operands_kernel_both_ways(monkeypatch):
    """Under jax.grad, where the kernels take the backward, the forward takes its operands
    from the operands kernel (no X; on the chunk-major inputs the backward lays out too)
    and the backward runs it once more with X for the local-gradient kernel; the
    gradients equal those with XLA's factors (``KERNEL_FACTORS = False``: XLA's factors,
    float32 dS_end) to bf16 rounding. (Chunk tiles: ``TOKEN_BACKWARD`` off; on, see
    test_token_backward_equals_chunk_tiles.)"""
    from gdp_jax.kernels import emulate, pipeline
    from gdp_jax.kernels.chunk_prep import ChunkPrepKernel
    monkeypatch.setattr(pipeline, "TOKEN_BACKWARD", False)
    monkeypatch.setattr(pipeline, "SAVE_OPERANDS", False)      # whatever the environment says
    calls = []
    raw = emulate.chunk_prep_call
    monkeypatch.setattr(ChunkPrepKernel, "raw_call", staticmethod(
        lambda *a, **kw: calls.append(kw.get("inverse", False)) or raw(*a, **kw)))
    raw_tokens = emulate.chunk_prep_tokens_call
    monkeypatch.setattr(ChunkPrepKernel, "raw_call_tokens", staticmethod(
        lambda *a, **kw: calls.append("tokens") or raw_tokens(*a, **kw)))
    inp = make_inputs(8, 2, 200, 2, 1, 2, 64, 64, jnp.bfloat16, gate="normal")
    loss = lambda *x: OP(*x, use_qk_l2norm=True, backend="cutedsl").astype(
        jnp.float32).sum()
    # under jax.jit (eagerly: op-by-op dispatch, ~30 s each); a new jitted function per
    # setting, so each traces (where raw_call is counted) with its own KERNEL_FACTORS
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*inp[:5])
    assert sorted(calls, key=str) == [False, True]   # not the token-major kernel
    calls.clear()
    monkeypatch.setattr(pipeline, "KERNEL_FACTORS", False)
    want = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*inp[:5])
    assert not calls
    for a, b in zip(grads, want):
        assert a.shape == b.shape and rel_max(a, b) < 1e-2


def test_saved_operands_give_the_recomputed_gradients(monkeypatch):
    """``SAVE_OPERANDS``: the differentiated forward runs the operands kernel once, with X,
    and the backward reuses its outputs (no second pass); outputs and gradients equal
    those of the recomputing backward bitwise (the same kernel on the same inputs: the
    token-major one, raw q, k normalised inside, qg and P on the read-out rows)."""
    from gdp_jax.kernels import emulate, pipeline
    from gdp_jax.kernels.chunk_prep import ChunkPrepKernel
    calls = []
    for name, raw in (("raw_call", emulate.chunk_prep_call),
                      ("raw_call_tokens", emulate.chunk_prep_tokens_call)):
        monkeypatch.setattr(ChunkPrepKernel, name, staticmethod(
            lambda *a, _raw=raw, _name=name, **kw: calls.append(
                (_name, kw.get("inverse", False), kw.get("readout_rows", False),
                 kw.get("l2norm", False))) or _raw(*a, **kw)))
    inp = make_inputs(8, 2, 200, 2, 1, 2, 64, 64, jnp.bfloat16, gate="normal")
    loss = lambda *x: OP(*x[:5], initial_state=x[5], output_final_state=True,
                         use_qk_l2norm=True, backend="cutedsl")
    # the forward and its pullback in one jax.jit (eagerly: op-by-op dispatch, ~78 s); a
    # new jitted function per setting, so each traces (where raw_call is counted) with its
    # own SAVE_OPERANDS
    def vg():
        def f(*a):
            (o, s), pull = jax.vjp(loss, *a)
            return (o, s), pull((jnp.ones_like(o), jnp.ones_like(s)))
        return jax.jit(f)(*inp[:5], inp.initial_state)
    (o, s), want = vg()
    assert sorted(calls) == [("raw_call_tokens", False, True, True),
                             ("raw_call_tokens", True, True, True)]
    calls.clear()
    monkeypatch.setattr(pipeline, "SAVE_OPERANDS", True)
    (o2, s2), got = vg()
    assert calls == [("raw_call_tokens", True, True, True)]
    for a, b in zip((o, s) + tuple(want), (o2, s2) + tuple(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_save_operands_follows_the_environment(monkeypatch):
    """``GDP_JAX_SAVE_OPERANDS`` turns the saved operands on for a user ("1"), off ("0" or
    unset), is read when the op is traced, loses to a set ``SAVE_OPERANDS``, and a bad
    value names the variable."""
    from gdp_jax.kernels import pipeline
    monkeypatch.setattr(pipeline, "SAVE_OPERANDS", None)
    monkeypatch.delenv("GDP_JAX_SAVE_OPERANDS", raising=False)
    assert pipeline.save_operands() is False
    monkeypatch.setenv("GDP_JAX_SAVE_OPERANDS", "1")
    assert pipeline.save_operands() is True
    monkeypatch.setenv("GDP_JAX_SAVE_OPERANDS", "0")
    assert pipeline.save_operands() is False
    monkeypatch.setenv("GDP_JAX_SAVE_OPERANDS", "yes")
    with pytest.raises(ValueError, match="GDP_JAX_SAVE_OPERANDS='yes'; expected '0' or '1'"):
        pipeline.save_operands()
    monkeypatch.setattr(pipeline, "SAVE_OPERANDS", False)
    assert pipeline.save_operands() is False
    # read at trace time: the op's forward keeps (operands, X) beside its checkpoints
    monkeypatch.setattr(pipeline, "SAVE_OPERANDS", None)
    monkeypatch.setenv("GDP_JAX_SAVE_OPERANDS", "1")
    inp = make_inputs(9, 1, 70, 2, 1, 1, 64, 64, jnp.bfloat16)
    loss = lambda *x: OP(*x, use_qk_l2norm=True, backend="cutedsl")[0].astype(
        jnp.float32).sum()
    from gdp_jax.kernels.chunk_prep import ChunkPrepKernel
    calls = []
    raw = ChunkPrepKernel.raw_call_tokens
    monkeypatch.setattr(ChunkPrepKernel, "raw_call_tokens", staticmethod(
        lambda *a, **kw: calls.append(kw.get("inverse", False)) or raw(*a, **kw)))
    jax.jit(jax.grad(loss)).trace(*inp[:5])
    assert calls == [True]


def test_differentiated_forward_shares_its_operands_with_an_xla_backward(monkeypatch):
    """Where the backward's factors are XLA's (here: ``KERNEL_FACTORS = False``) the
    differentiated forward builds its operands in XLA, not on the (opaque) operands
    kernel: XLA then computes the intra-chunk factors once for the forward and the
    backward. With the kernel made opaque (an optimization barrier on its inputs, as a
    custom call is on the GPU) the fwd+bwd program costs what it costs without it."""
    from jax import lax
    from gdp_jax.kernels import emulate, pipeline
    from gdp_jax.kernels.chunk_prep import ChunkPrepKernel
    monkeypatch.setattr(pipeline, "KERNEL_FACTORS", False)
    inp = make_inputs(8, 2, 200, 2, 1, 2, 64, 64, jnp.bfloat16, gate="normal")
    loss = lambda q, k, v: OP(q, k, v, inp.g, inp.beta, use_qk_l2norm=True,
                              backend="cutedsl")[0].astype(jnp.float32).sum()
    cost = lambda: jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(
        *inp[:3]).compile().cost_analysis()
    flops = lambda ca: (ca[0] if isinstance(ca, list) else ca)["flops"]
    shared = flops(cost())
    opaque = emulate.chunk_prep_call
    monkeypatch.setattr(ChunkPrepKernel, "raw_call", staticmethod(
        lambda *a, **kw: opaque(*lax.optimization_barrier(a), **kw)))
    jax.clear_caches()
    assert flops(cost()) == pytest.approx(shared, rel=1e-3)
    calls = []
    monkeypatch.setattr(ChunkPrepKernel, "raw_call",
                        staticmethod(lambda *a, **kw: calls.append(1) or opaque(*a, **kw)))
    tokens = emulate.chunk_prep_tokens_call
    monkeypatch.setattr(ChunkPrepKernel, "raw_call_tokens",
                        staticmethod(lambda *a, **kw: calls.append(1) or tokens(*a, **kw)))
    jax.clear_caches()
    # traced only (raw_call is counted as it traces; nothing here needs the values, and
    # compiling and running both took ~25 s on a 2-core CPU)
    jax.jit(jax.grad(loss)).trace(*inp[:3])
    assert not calls                    # not in the differentiated forward
    jax.jit(lambda *a: OP(*a, use_qk_l2norm=True, backend="cutedsl")).trace(*inp[:5])
    assert calls                        # but in the plain forward (token-major)


@pytest.mark.parametrize("kernel_backward", [True, False])
def test_cp_differentiated_call_operands(monkeypatch, kernel_backward):
    """Under CP (the driver's custom_vjp and intra_cp's) a differentiated call takes its
    operands as the single-device one does: from the operands kernel, forward and backward
    (once each per rank), where the kernels take the backward, else from XLA (shared with
    the backward's factors); the plain CP forward always runs the kernel, reading q, k, v
    token-major as the plain single-device forward does; gradients agree with the plain
    forward's outputs either way."""
    from gdp_jax.kernels import emulate, pipeline
    from gdp_jax.kernels.chunk_prep import ChunkPrepKernel
    monkeypatch.setattr(pipeline, "KERNEL_FACTORS", kernel_backward)
    # tcp._run's jitted function is shared (lru_cache) across the two cases: without this
    # the second case hit the first's trace (made with the other KERNEL_FACTORS), so it
    # counted no calls whatever its setting
    jax.clear_caches()
    calls = []
    opaque = emulate.chunk_prep_call
    monkeypatch.setattr(ChunkPrepKernel, "raw_call", staticmethod(
        lambda *a, **kw: calls.append(kw.get("inverse", False)) or opaque(*a, **kw)))
    opaque_tokens = emulate.chunk_prep_tokens_call
    monkeypatch.setattr(ChunkPrepKernel, "raw_call_tokens", staticmethod(
        lambda *a, **kw: calls.append("tokens") or opaque_tokens(*a, **kw)))
    inp = make_inputs(9, 2, 200, 2, 1, 2, 64, 64, jnp.bfloat16, gate="normal")
    args = tcp._args(inp)
    w = tcp._weights(3, (2, 200, 2, 64), (2, 2, 64, 64), np.float32)
    kw = (("backend", "cutedsl"),)
    got = tcp._run("cp", args, None, w, True, n_dev=2, kw=kw)
    assert sorted(set(calls)) == ([False, True] if kernel_backward else [])
    calls.clear()
    o = jax.jit(lambda a: tcp._cp_apply(2, a, None, True, kw)[0])(args)
    assert set(calls) == {"tokens"} and rel_max(o, got[0]) < 1e-2
    calls.clear()
    split = jax.grad(lambda q: OP(q, *inp[1:5], use_qk_l2norm=True, backend="cutedsl",
                                  intra_cp=2).astype(jnp.float32).sum())
    jax.jit(split)(inp.q)
    assert sorted(set(calls)) == ([False, True] if kernel_backward else [])


def test_cp_local_gradients_come_out_token_major(monkeypatch):
    """A CP rank's backward (here intra_cp's) runs the local-gradient kernel that writes
    dq, dk, dv token-major, as the single-device backward does (no chunk-major float32
    tiles relaid by XLA), with the gradients of the unsplit op."""
    from gdp_jax.kernels import emulate
    from gdp_jax.kernels.local_grad import LocalGradKernel
    calls = []
    tokens = emulate.local_grad_tokens_call
    monkeypatch.setattr(LocalGradKernel, "raw_call_tokens", staticmethod(
        lambda *a, **kw: calls.append(1) or tokens(*a, **kw)))
    inp = make_inputs(12, 1, 256, 2, 1, 2, 64, 64, jnp.bfloat16, gate="normal")
    loss = lambda S: jax.jit(jax.grad(lambda q, k: OP(
        q, k, *inp[2:5], use_qk_l2norm=True, backend="cutedsl",
        intra_cp=S).astype(jnp.float32).sum(), argnums=(0, 1)))
    split = loss(4)(inp.q, inp.k)
    assert calls
    plain = loss(None)(inp.q, inp.k)
    for a, b in zip(split, plain):
        assert rel_max(a, b) < 2e-2


def test_cp_xla_segmented_ranks_take_the_two_pass_path(monkeypatch):
    """An xla rank long enough to run in segments does not make the one-level V + K pass:
    prepare falls back to the summaries by parallel composition and apply to a second
    pass (segmented), with the same results."""
    from gdp_jax import recurrence
    from gdp_jax.engine import XLA
    cu = (0, 30, 30, 31, 180, 200)        # crosses the rank boundary at 100 tokens
    inp = make_inputs(34, 1, 200, 2, 1, 2, 4, 3, N=len(cu) - 1, gate="normal")
    args = tcp._args(inp)
    w = tcp._weights(6, (1, 200, 2, 3), (len(cu) - 1, 2, 4, 3))
    kw = (("backend", "xla"), ("recompute_chunk_num", 1))
    want = tcp._run("op", args, cu, w, True, kw=(("backend", "xla"),))
    monkeypatch.setattr(recurrence, "MAX_PROBLEMS", 0)
    monkeypatch.setattr(recurrence, "SEGMENT_PROBLEMS", 2)
    spec = _checks.check_inputs(*inp[:5])
    layout = grid.layout_of(spec, None)
    ch = _chunks(spec, layout, *inp[:5])
    h0p = jnp.zeros((spec.N, spec.HV, spec.K, spec.V), spec.cdt)
    # traced, not run eagerly op by op: whether there is work is decided at trace time
    assert jax.eval_shape(lambda ch, layout, h0p: XLA.forward_prepare(
        spec, ch, layout, h0p)[1], ch, layout, h0p) is None              # no one-pass work
    jax.clear_caches()
    got = tcp._run("cp", args, cu, w, True, n_dev=2, kw=kw)
    assert rel_max(got[0], want[0]) < 1e-13 and rel_max(got[1], want[1]) < 1e-13
    for name in want[2]:
        assert rel_max(got[2][name], want[2][name]) < 1e-13, name


@pytest.mark.parametrize("cu", [None, [0, 0, 1, 70, 70, 150]])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_token_rows_name_the_layout_rows(n, cu):
    """``chunk_prep.token_rows`` (where the token-major operands kernel reads each chunk's
    rows) names exactly the rows of the chunk grid: step base + i for i < count, -1
    (padding) after; the read-out token of row i = n - 1 (mod n) is (base + i) // n."""
    from gdp_jax.kernels.chunk_prep import token_rows
    T, B = (150, 1) if cu is not None else (70, 2)
    layout = grid.make_layout(B, T, n, None if cu is None else jnp.asarray(cu, jnp.int32))
    rows = np.asarray(token_rows(layout, n, T))
    NC = layout.reset.shape[1]
    if cu is None:
        S = grid.steps_per_chunk(n)
        src = np.full((B, NC, grid.CHUNK), -1)
        for c in range(NC):
            m = min(S, max(0, n * T - c * S))
            src[:, c, :m] = c * S + np.arange(m)
    else:
        src = np.asarray(layout.src).reshape(B, NC, grid.CHUNK)
    i = np.arange(grid.CHUNK)
    base, count, tok, nn = (rows[..., j, None] for j in range(4))
    want = np.where(i < count, base + i, -1)
    np.testing.assert_array_equal(want, src)
    assert np.all(nn == n) and np.all(tok * n == base)
    assert np.all((base + i) // n == tok + i // n)


# the token-major tests' cases: (B, T, n, H, HV, cu_seqlens) - T not a multiple of 64,
# T = 2, n = 1..3, GVA, packed with empty and one-token sequences
TOKEN_CASES = {"n1": (2, 100, 1, 1, 1, None), "n2-gva": (1, 130, 2, 1, 2, None),
               "n3-T2": (2, 2, 3, 2, 2, None),
               "packed": (1, 150, 2, 1, 2, [0, 0, 1, 70, 70, 150])}


@pytest.mark.parametrize("case", list(TOKEN_CASES))
@pytest.mark.parametrize("l2norm", [False, True])
def test_token_major_operands_equal_chunk_major(monkeypatch, case, l2norm):
    """bf16 inputs: the forward with the operands kernel reading the token-major q, k, v
    itself (L2 norm in the kernel) equals the forward on XLA's chunk-major copies
    (``chunk_prep.TOKEN_LAYOUT = False``), outputs and final states: T not a multiple
    of 64, T = 2 (T = 1 runs the decoding step), n = 1..3, GVA, packed with empty and
    one-token sequences. (The plain forward's byte levers are pinned off: the
    chunk-major path has none, and each has its own test against this path.)"""
    from gdp_jax.kernels import chunk_forward, chunk_prep
    from gdp_jax.kernels.chunk_prep import ChunkPrepKernel
    monkeypatch.setattr(chunk_forward, "O_TOKENS", False)
    monkeypatch.setattr(chunk_prep, "U16", False)
    calls = []
    raw = ChunkPrepKernel.raw_call_tokens
    monkeypatch.setattr(ChunkPrepKernel, "raw_call_tokens", staticmethod(
        lambda *a, **kw: calls.append(kw["l2norm"]) or raw(*a, **kw)))
    B, T, n, H, HV, cu = TOKEN_CASES[case]
    N = B if cu is None else len(cu) - 1
    inp = make_inputs(31, B, T, n, H, HV, 64, 64, jnp.bfloat16, N=N, gate="strong")
    cu = None if cu is None else jnp.asarray(cu, jnp.int32)
    run = lambda: jax.jit(lambda *a: OP(*a[:5], initial_state=a[5], cu_seqlens=cu,
                                        output_final_state=True, use_qk_l2norm=l2norm,
                                        backend="cutedsl"))(*inp[:5], inp.initial_state)
    o, s = run()
    assert calls == [l2norm]
    monkeypatch.setattr(chunk_prep, "TOKEN_LAYOUT", False)
    o2, s2 = run()
    assert calls == [l2norm]
    assert np.all(np.isfinite(np.asarray(o, np.float32)))
    assert rel_max(o, o2) < 1e-5 and rel_max(s, s2) < 1e-5


def _token_case_forward(seed, case, l2norm):
    """(run, inputs, k with one inf entry) for :data:`TOKEN_CASES`' ``case`` (bf16, strong
    gates): run(k) is a fresh jit of the plain cutedsl forward (o, final) on those inputs
    with ``k`` - the switches are read at trace time."""
    B, T, n, H, HV, cu = TOKEN_CASES[case]
    N = B if cu is None else len(cu) - 1
    inp = make_inputs(seed, B, T, n, H, HV, 64, 64, jnp.bfloat16, N=N, gate="strong")
    cu = None if cu is None else jnp.asarray(cu, jnp.int32)
    k_bad = inp.k.at[0, T // 2, 0, 0, 3].set(jnp.inf)
    run = lambda k: jax.jit(lambda *a: OP(*a[:5], initial_state=a[5], cu_seqlens=cu,
                                          output_final_state=True, use_qk_l2norm=l2norm,
                                          backend="cutedsl"))(
        inp.q, k, *inp[2:5], inp.initial_state)
    return run, inp, k_bad


@pytest.mark.parametrize("case", list(TOKEN_CASES))
def test_walk_writes_o_token_major(monkeypatch, case):
    """``chunk_forward.O_TOKENS``: the plain forward whose walk writes o token-major (its
    read-out rows at their tokens by the row table, NaN on the operands kernel's bad rows)
    gives the same o and final state as the walk's chunk rows laid out by XLA - T not a
    multiple of 64, T = 2, n = 1..3, GVA, packed with empty and one-token sequences; a k
    token of inf makes the same outputs NaN; every token is written (the emulation leaves
    unwritten ones NaN)."""
    from gdp_jax.kernels import chunk_forward
    from gdp_jax.kernels.chunk_forward import ChunkForwardKernel
    seen = []
    walk = ChunkForwardKernel.raw_call
    monkeypatch.setattr(ChunkForwardKernel, "raw_call", staticmethod(
        lambda *a, **kw: seen.append(kw.get("o_tokens") is not None) or walk(*a, **kw)))
    monkeypatch.setattr(chunk_forward, "O_TOKENS", False)
    run, inp, k_bad = _token_case_forward(42, case, True)
    ref, ref_bad = run(inp.k), run(k_bad)
    assert seen == [False, False]
    seen.clear()
    monkeypatch.setattr(chunk_forward, "O_TOKENS", True)
    got, got_bad = run(inp.k), run(k_bad)
    assert seen == [True, True]
    assert np.all(np.isfinite(np.asarray(got[0], np.float32)))
    for x, y in zip(got + got_bad, ref + ref_bad):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    assert np.isnan(np.asarray(got_bad[0], np.float32)).any()
    monkeypatch.setattr(chunk_forward, "O_TOKENS", "on")
    with pytest.raises(ValueError, match="chunk_forward.O_TOKENS=.on.; expected True"):
        run(inp.k)


def test_walk_o_tokens_auto_follows_the_value_tile(monkeypatch):
    """``chunk_forward.O_TOKENS = "auto"``: the plain forward's walk writes o token-major
    exactly where it walks 64-column value tiles (``pick_bv``: rows x heads x V / 64
    fill the GPU's SMs; emulated with the SM count patched), with the same outputs as the
    XLA relayout."""
    from gdp_jax.kernels import chunk_forward
    from gdp_jax.kernels.chunk_forward import ChunkForwardKernel
    seen = []
    walk = ChunkForwardKernel.raw_call
    monkeypatch.setattr(ChunkForwardKernel, "raw_call", staticmethod(
        lambda *a, **kw: seen.append((kw["BV"], kw.get("o_tokens") is not None))
        or walk(*a, **kw)))
    monkeypatch.setattr(chunk_forward, "O_TOKENS", "auto")
    run, inp, _ = _token_case_forward(43, "n2-gva", True)
    outs = {}
    for sms in (1, 10 ** 6):                 # 64-column tiles; then 32 (and 16)
        monkeypatch.setattr(ChunkForwardKernel, "SMS", sms)
        seen.clear()
        outs[sms] = run(inp.k)
        assert seen == [(64, True)] if sms == 1 else (len(seen) == 1
                                                      and seen[0][0] < 64 and not seen[0][1])
    for x, y in zip(outs[1], outs[10 ** 6]):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def test_walk_token_modes_under_vmap(monkeypatch):
    """``chunk_forward.O_TOKENS`` under jax.vmap: the mapped axis folds into the rows of
    the row table, the bad rows and the token-major o alike, and each mapped problem
    equals its own call."""
    from gdp_jax.kernels import chunk_forward
    from gdp_jax.kernels.chunk_forward import ChunkForwardKernel
    monkeypatch.setattr(chunk_forward, "O_TOKENS", True)
    shapes = []
    walk = ChunkForwardKernel.raw_call
    monkeypatch.setattr(ChunkForwardKernel, "raw_call", staticmethod(
        lambda *a, **kw: shapes.append(tuple(x.shape for x in kw["o_tokens"][:2])
                                       + (kw["o_tokens"][2],)) or walk(*a, **kw)))
    inp = make_inputs(39, 1, 90, 2, 1, 2, 64, 64, jnp.bfloat16, gate="strong")
    other = make_inputs(40, 1, 90, 2, 1, 2, 64, 64, jnp.bfloat16, gate="normal")
    stack = lambda i: jnp.stack([inp[i], other[i]])
    f = lambda *a: OP(*a, use_qk_l2norm=True, backend="cutedsl")
    o = jax.jit(jax.vmap(f))(*(stack(i) for i in range(5)))
    assert shapes[-1] == ((2, 3, 4), (2, 3, 2, 64), 90)    # folded: 2 rows of 90 tokens
    assert o.shape == (2, 1, 90, 2, 64)
    for m, x in enumerate((inp, other)):
        assert rel_max(o[m], jax.jit(f)(*x[:5])) < 1e-6


@pytest.mark.parametrize("packed", [False, True])
def test_split_forward_takes_the_plain_forward_operands(monkeypatch, packed):
    """``intra_cp`` (a forward nothing differentiates): with ``chunk_prep.U16 = "forward"``
    the segments' summary walk (V + K columns) and the apply walk both read u in bfloat16,
    and the split's outputs stay within 1e-2 of the default split's (packed sequences
    across the segment borders)."""
    from gdp_jax.kernels import chunk_prep
    from gdp_jax.kernels.chunk_forward import ChunkForwardKernel
    seen = []
    walk = ChunkForwardKernel.raw_call
    monkeypatch.setattr(ChunkForwardKernel, "raw_call", staticmethod(
        lambda *a, **kw: seen.append((kw.get("readout", True), jnp.dtype(a[4].dtype).name))
        or walk(*a, **kw)))
    T = 256
    cu = jnp.asarray([0, 30, 30, 31, 200, T], jnp.int32) if packed else None
    inp = make_inputs(38, 1, T, 2, 1, 2, 64, 64, jnp.bfloat16, gate="normal",
                      N=5 if packed else None)
    run = lambda: jax.jit(lambda *a: OP(*a, initial_state=inp.initial_state,
                                        output_final_state=True, cu_seqlens=cu,
                                        use_qk_l2norm=True, backend="cutedsl",
                                        intra_cp=4))(*inp[:5])
    monkeypatch.setattr(chunk_prep, "U16", False)
    ref = run()
    assert set(seen) == {(False, "float32"), (True, "float32")}
    seen.clear()
    monkeypatch.setattr(chunk_prep, "U16", "forward")
    got = run()
    assert set(seen) == {(False, "bfloat16"), (True, "bfloat16")}
    assert rel_max(got[0], ref[0]) < 1e-2 and rel_max(got[1], ref[1]) < 1e-2


@pytest.mark.parametrize("n", [1, 2])
def test_u16_forward_only_in_the_plain_forward(monkeypatch, n):
    """``chunk_prep.U16 = "forward"``: the plain forward's walk reads u in bfloat16 (its o
    within 1e-2 of the float32 u's), the differentiated call keeps u in float32 - its
    outputs and gradients the same bits as with U16 off; a value other than True, False,
    "forward" is refused."""
    from gdp_jax.kernels import chunk_prep
    from gdp_jax.kernels.chunk_forward import ChunkForwardKernel
    u_seen = []
    walk = ChunkForwardKernel.raw_call
    monkeypatch.setattr(ChunkForwardKernel, "raw_call", staticmethod(
        lambda *a, **kw: u_seen.append(jnp.dtype(a[4].dtype).name) or walk(*a, **kw)))
    inp = make_inputs(36, 2, 100, n, 1, 2, 64, 64, jnp.bfloat16, gate="normal")
    kw = dict(initial_state=inp.initial_state, output_final_state=True, use_qk_l2norm=True,
              backend="cutedsl")
    fwd = lambda: jax.jit(lambda *a: OP(*a, **kw))(*inp[:5])
    def both():           # a fresh trace each: the switch is read at trace time
        testing._value_and_grad_fn.cache_clear()
        jax.clear_caches()
        return loss_and_grads(OP, inp, use_qk_l2norm=True, backend="cutedsl")
    monkeypatch.setattr(chunk_prep, "U16", False)
    ref_o, ref_g = fwd(), both()
    monkeypatch.setattr(chunk_prep, "U16", "forward")
    u_seen.clear()
    o = fwd()
    assert u_seen == ["bfloat16"]
    assert 0 < rel_max(o[0], ref_o[0]) < 1e-2 and rel_max(o[1], ref_o[1]) < 1e-2
    u_seen.clear()
    g = both()
    assert u_seen and set(u_seen) == {"float32"}
    for x, y in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    monkeypatch.setattr(chunk_prep, "U16", "fwd")
    with pytest.raises(ValueError, match="chunk_prep.U16='fwd'; expected True, False or"):
        fwd()


def test_token_major_limits_and_vmap(monkeypatch):
    """Where the token-major operands kernel does not take the call (inputs not in the
    16-bit operand dtype, n > C) the forward reads
    the chunk-major copies; under jax.vmap it takes the call, and each mapped problem
    equals its own call."""
    from gdp_jax.kernels.chunk_prep import ChunkPrepKernel
    inp = make_inputs(33, 1, 90, 2, 1, 2, 64, 64, jnp.bfloat16, gate="normal")
    spec = _checks.check_inputs(*inp[:5])
    q, k, v = inp[:3]
    assert ChunkPrepKernel.can_read_tokens(spec, q, k, v)
    assert not ChunkPrepKernel.can_read_tokens(spec, q.astype(jnp.float32), k, v)
    k65 = jnp.zeros((1, 2, 65, 1, 64), jnp.bfloat16)
    assert not ChunkPrepKernel.can_read_tokens(spec, q[:, :2], k65, v[:, :2])
    calls = []
    raw = ChunkPrepKernel.raw_call_tokens
    monkeypatch.setattr(ChunkPrepKernel, "raw_call_tokens", staticmethod(
        lambda *a, **kw: calls.append(a[0].shape) or raw(*a, **kw)))
    other = make_inputs(34, 1, 90, 2, 1, 2, 64, 64, jnp.bfloat16, gate="normal")
    stack = lambda i: jnp.stack([inp[i], other[i]])
    f = lambda *a: OP(*a, use_qk_l2norm=True, backend="cutedsl")
    o = jax.jit(jax.vmap(f))(*(stack(i) for i in range(5)))
    assert calls[-1] == (2, 90, 1, 64)        # the mapped axis folded into the rows
    for m, x in enumerate((inp, other)):
        assert rel_max(o[m], jax.jit(f)(*x[:5])) < 1e-6


@pytest.mark.parametrize("case", list(TOKEN_CASES))
@pytest.mark.parametrize("l2norm", [False, True])
def test_token_major_gradients_equal_chunk_major(monkeypatch, case, l2norm):
    """bf16 inputs: the backward with the local-gradient kernel writing dq, dk, dv in the
    op's token-major layout (16-bit) equals the one relaying its chunk-major float32
    results in XLA (``local_grad.TOKEN_GRADS = False``) to the 16-bit rounding: every
    gradient, T not a multiple of 64, T = 2, n = 1..3, GVA, packed with empty and
    one-token sequences."""
    from gdp_jax.kernels import local_grad
    from gdp_jax.kernels.local_grad import LocalGradKernel
    calls = []
    raw = LocalGradKernel.raw_call_tokens
    monkeypatch.setattr(LocalGradKernel, "raw_call_tokens", staticmethod(
        lambda *a, **kw: calls.append((kw["n"], kw["T"])) or raw(*a, **kw)))
    B, T, n, H, HV, cu = TOKEN_CASES[case]
    N = B if cu is None else len(cu) - 1
    inp = make_inputs(35, B, T, n, H, HV, 64, 64, jnp.bfloat16, N=N, gate="strong")
    run = lambda: loss_and_grads(OP, inp, cu_seqlens=cu, backend="cutedsl",
                                 use_qk_l2norm=l2norm)
    _, _, _, g = run()
    assert calls == [(n, T)]
    monkeypatch.setattr(local_grad, "TOKEN_GRADS", False)
    jax.clear_caches()
    _, _, _, g2 = run()
    assert calls == [(n, T)]
    assert set(g) == set(g2) == {"q", "k", "v", "g", "beta", "initial_state"}
    for name in g:
        assert np.all(np.isfinite(np.asarray(g[name], np.float32))), name
        assert rel_max(g[name], g2[name]) < 1e-2, name


def test_token_major_gradients_limits_and_vmap(monkeypatch):
    """The token-major local gradients only where every chunk holds whole tokens (not
    n > C) and not for float16 (its range may not hold dk before the L2-norm backward);
    under jax.vmap of the gradient each mapped problem equals its own call."""
    from gdp_jax.kernels.local_grad import LocalGradKernel
    calls = []
    raw = LocalGradKernel.raw_call_tokens
    monkeypatch.setattr(LocalGradKernel, "raw_call_tokens", staticmethod(
        lambda *a, **kw: calls.append(a[0].shape) or raw(*a, **kw)))
    inp = make_inputs(36, 1, 90, 2, 1, 2, 64, 64, jnp.bfloat16, gate="normal")
    other = make_inputs(37, 1, 90, 2, 1, 2, 64, 64, jnp.bfloat16, gate="normal")
    loss = lambda *a: jnp.sum(OP(*a, use_qk_l2norm=True, backend="cutedsl")
                              .astype(jnp.float32) ** 2)
    grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4))
    stack = lambda i: jnp.stack([inp[i], other[i]])
    got = jax.jit(jax.vmap(grad))(*(stack(i) for i in range(5)))
    assert calls and calls[-1][0] == 2        # the mapped axis folded into the rows
    for m, x in enumerate((inp, other)):
        want = jax.jit(grad)(*x[:5])
        for a, b in zip(got, want):
            assert rel_max(a[m], b) < 1e-6
    calls.clear()
    h = lambda x: x.astype(jnp.float16)
    jax.jit(grad)(h(inp.q), h(inp.k), h(inp.v), inp.g, h(inp.beta))
    assert not calls                          # float16: the float32 chunk tiles
    n65 = make_inputs(38, 1, 3, 65, 1, 1, 64, 64, jnp.bfloat16, gate="normal")
    jax.jit(jax.grad(loss))(*n65[:5])
    assert not calls                          # n > C: tokens run across chunks


def test_token_major_gradients_inside_shard_map():
    """The single-device op inside ``jax.shard_map`` (data parallel: the batch split over 2
    devices, no cp_axis), differentiated through the token-major local gradients: each
    shard's gradients equal the unsharded call's rows, and a replicated ``beta`` gets the
    sum over shards (the cotangents carry the primals' varying axes)."""
    from jax.sharding import Mesh, PartitionSpec as P
    from gdp_jax.kernels.local_grad import LocalGradKernel
    calls = []
    raw = LocalGradKernel.raw_call_tokens
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LocalGradKernel, "raw_call_tokens", staticmethod(
            lambda *a, **kw: calls.append(1) or raw(*a, **kw)))
        inp = make_inputs(39, 2, 70, 2, 1, 2, 64, 64, jnp.bfloat16, gate="normal")
        q, k, v, g, beta = inp[:5]
        beta1 = beta[:1]                                        # one beta for both rows
        loss = lambda q, k, v, g, b: jnp.sum(
            OP(q, k, v, g, jnp.broadcast_to(b, k.shape[:2] + b.shape[2:]),
               use_qk_l2norm=True, backend="cutedsl").astype(jnp.float32) ** 2)
        grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4))
        mesh = Mesh(np.array(jax.devices()[:2]), ("dp",))
        d = P("dp")

        # (a replicated input's gradient is summed over the shards by the transpose of
        # its implicit broadcast: invariant, out_specs P())
        got = jax.jit(jax.shard_map(grad, mesh=mesh, in_specs=(d, d, d, d, P()),
                                    out_specs=(d, d, d, d, P())))(q, k, v, g, beta1)
        want = jax.jit(grad)(q, k, v, g, beta1)
    assert calls
    for i, (a, b) in enumerate(zip(got, want)):
        assert np.all(np.isfinite(np.asarray(a, np.float32)))
        # beta's: the sum of two bf16 shard gradients (one rounding more)
        assert rel_max(a, b) < (1e-2 if i == 4 else 1e-5), i


@pytest.mark.parametrize("packed", [False, True])
def test_fused_ddo_gradients_equal_xla_ddo(monkeypatch, packed):
    """``pipeline.FUSED_DDO``: the reverse kernel forming ddo = P^T dO from the readout
    matrix gives the gradients of XLA's ddo: bf16, n = 2, GVA, packed with empty and
    one-token sequences (CP: test_cp_16bit_error_is_the_single_device_error)."""
    from gdp_jax.kernels import pipeline
    from gdp_jax.kernels.state_grad import StateGradKernel
    calls = []
    raw = StateGradKernel.raw_call
    monkeypatch.setattr(StateGradKernel, "raw_call", staticmethod(
        lambda *a, **kw: calls.append(kw.get("fuse_ddo", False)) or raw(*a, **kw)))
    cu = [0, 0, 1, 70, 70, 150] if packed else None
    B, T = (1, 150) if packed else (2, 100)
    inp = make_inputs(40, B, T, 2, 1, 2, 64, 64, jnp.bfloat16,
                      N=len(cu) - 1 if packed else B, gate="strong")
    run = lambda: loss_and_grads(OP, inp, cu_seqlens=cu, backend="cutedsl",
                                 use_qk_l2norm=True)
    monkeypatch.setattr(pipeline, "FUSED_DDO", False)
    _, _, _, want = run()
    assert calls == [False]
    monkeypatch.setattr(pipeline, "FUSED_DDO", True)
    jax.clear_caches()
    _, _, _, got = run()
    assert calls == [False, True]
    for name in want:
        assert rel_max(got[name], want[name]) < 1e-6, name


@pytest.mark.parametrize("case", list(TOKEN_CASES))
@pytest.mark.parametrize("l2norm", [False, True])
def test_token_backward_equals_chunk_tiles(monkeypatch, case, l2norm):
    """``pipeline.TOKEN_BACKWARD``: the differentiated op's operands kernels (forward, and
    backward with X) and the local-gradient kernel read q, k, v token-major (the
    normalised per-token operands, through the row table) instead of the chunk tiles XLA
    lays out: the same values reach the kernels (qg, P on the read-out rows in both), so
    outputs and every gradient but dg are the same bits, dg to float32 rounding (bf16, T not a multiple of 64, T = 2, n = 1..3, GVA, packed with empty and
    one-token sequences); the plain forward keeps its raw-token path."""
    from gdp_jax.kernels import pipeline
    from gdp_jax.kernels.chunk_prep import ChunkPrepKernel
    from gdp_jax.kernels.local_grad import LocalGradKernel
    calls = []
    prep, lg = ChunkPrepKernel.raw_call_tokens, LocalGradKernel.raw_call_tokens
    monkeypatch.setattr(ChunkPrepKernel, "raw_call_tokens", staticmethod(
        lambda *a, **kw: calls.append(("prep", kw["l2norm"], kw.get("inverse", False)))
        or compact.append(kw.get("readout_rows", False)) or prep(*a, **kw)))
    monkeypatch.setattr(LocalGradKernel, "raw_call_tokens", staticmethod(
        lambda *a, **kw: calls.append(("grad", kw.get("tokens_in", False))) or lg(*a, **kw)))
    compact = []
    B, T, n, H, HV, cu = TOKEN_CASES[case]
    N = B if cu is None else len(cu) - 1
    inp = make_inputs(41, B, T, n, H, HV, 64, 64, jnp.bfloat16, N=N, gate="strong")
    run = lambda: loss_and_grads(OP, inp, cu_seqlens=cu, backend="cutedsl",
                                 use_qk_l2norm=l2norm)
    monkeypatch.setattr(pipeline, "NORM_IN_KERNELS", False)    # XLA's norm both ways
    monkeypatch.setattr(pipeline, "TOKEN_BACKWARD", False)
    want = run()
    assert calls == [("grad", False)]
    monkeypatch.setattr(pipeline, "TOKEN_BACKWARD", True)
    jax.clear_caches()
    calls.clear()
    got = run()
    assert sorted(calls) == [("grad", True), ("prep", False, False), ("prep", False, True)]
    # qg, P on the read-out rows where n >= 2 (READOUT_ONLY_GRAD, READOUT_ONLY_BWD on): both
    # operands kernels, the backward's with X as well
    assert compact == [n >= 2] * 2
    o, s, _, g = got
    o2, s2, _, g2 = want
    assert np.asarray(o).tobytes() == np.asarray(o2).tobytes()
    assert np.asarray(s).tobytes() == np.asarray(s2).tobytes()
    assert set(g) == set(g2)
    for name in g:
        if name == "g":     # summed in XLA around the kernels: another graph may reassociate
            assert rel_max(g[name], g2[name]) < 1e-6
            continue
        assert np.asarray(g[name]).tobytes() == np.asarray(g2[name]).tobytes(), name
    calls.clear()
    jax.jit(lambda *a: OP(*a, use_qk_l2norm=l2norm, backend="cutedsl"))(*inp[:5])
    assert calls == [("prep", l2norm, False)]       # the plain forward: raw tokens


@pytest.mark.parametrize("case", list(TOKEN_CASES))
def test_norm_in_kernels(monkeypatch, case):
    """``pipeline.NORM_IN_KERNELS`` (with TOKEN_BACKWARD): the differentiated op's operands
    kernels (forward; backward with X) and the local-gradient kernel read the raw q, k and
    L2-normalise them themselves, the local-gradient kernel applying the norm's backward
    with its own factors: no normalised copy or row norms from XLA. The same values up to
    float32 rounding of the norm (XLA's sums over token rows vs the kernels' over chunk
    rows) as XLA's norm; within the 16-bit tolerance of float64 (bf16, T not a multiple of
    64, T = 2, n = 2, 3, GVA, packed with empty and one-token sequences); n = 1 keeps XLA's
    norm."""
    from gdp_jax.kernels import pipeline
    from gdp_jax.kernels.chunk_prep import ChunkPrepKernel
    from gdp_jax.kernels.local_grad import LocalGradKernel
    from gdp_jax.testing import DIFF_NAMES, rel_rms, upcast
    calls = []
    prep, lg = ChunkPrepKernel.raw_call_tokens, LocalGradKernel.raw_call_tokens
    monkeypatch.setattr(ChunkPrepKernel, "raw_call_tokens", staticmethod(
        lambda *a, **kw: calls.append(("prep", kw["l2norm"], kw.get("inverse", False)))
        or prep(*a, **kw)))
    monkeypatch.setattr(LocalGradKernel, "raw_call_tokens", staticmethod(
        lambda *a, **kw: calls.append(("grad", kw.get("l2norm", False), kw["rho"] is None))
        or lg(*a, **kw)))
    B, T, n, H, HV, cu = TOKEN_CASES[case]
    N = B if cu is None else len(cu) - 1
    inp = make_inputs(43, B, T, n, H, HV, 64, 64, jnp.bfloat16, N=N, gate="strong")
    run = lambda: loss_and_grads(OP, inp, cu_seqlens=cu, backend="cutedsl",
                                 use_qk_l2norm=True)
    monkeypatch.setattr(pipeline, "TOKEN_BACKWARD", True)
    monkeypatch.setattr(pipeline, "NORM_IN_KERNELS", False)
    jax.clear_caches()
    want = run()
    assert sorted(calls) == [("grad", False, False), ("prep", False, False),
                             ("prep", False, True)]
    monkeypatch.setattr(pipeline, "NORM_IN_KERNELS", True)
    jax.clear_caches()
    calls.clear()
    got = run()
    if n == 1:       # operands on all rows: XLA's norm (pipeline.norm_in_kernels)
        assert sorted(calls) == [("grad", False, False), ("prep", False, False),
                                 ("prep", False, True)]
    else:
        assert sorted(calls) == [("grad", True, True), ("prep", True, False),
                                 ("prep", True, True)]
    ref = loss_and_grads(REF, upcast(inp, jnp.float64)._replace(
        g=inp.g.astype(jnp.float64), initial_state=inp.initial_state.astype(jnp.float64)),
        cu_seqlens=cu, use_qk_l2norm=True)
    pairs = {"o": (got[0], want[0], ref[0]), "final": (got[1], want[1], ref[1])}
    pairs.update({m: (got[3][m], want[3][m], ref[3][m]) for m in DIFF_NAMES})
    for name, (x, y, r) in pairs.items():
        assert rel_rms(x, y) < 2e-3, name               # a few 16-bit roundings apart
        e_got, e_want = rel_rms(x, r), rel_rms(y, r)
        assert e_got < 1e-2 and e_got < 1.25 * e_want + 1e-4, (name, e_got, e_want)


def test_value_tile_is_picked_for_the_launch(monkeypatch):
    """The recursion kernels pick their value tile for the rows a launch has after
    ``jax.vmap`` or ``intra_cp`` folded into them (the trace shows fewer). One sequence,
    16 heads, V = 128: unsplit 64 walks of 32 columns -> 16-column tiles; split in 4
    (256 walks of 32) -> 32: the V + K summary walks -> 64, apply's plain walks 32
    (forward and reverse); a user's vmap of 4 problems the same as the split."""
    from gdp_jax.kernels import emulate
    seen = []
    fwd, rev = emulate.chunk_kernel_call, emulate.dh_kernel_call
    monkeypatch.setattr(emulate, "chunk_kernel_call", lambda *a, **k: seen.append(
        ("fwd", a[0].shape[0], a[9].shape[-1], k["BV"])) or fwd(*a, **k))
    monkeypatch.setattr(emulate, "dh_kernel_call", lambda *a, **k: seen.append(
        ("rev", a[0].shape[0], a[9].shape[-1], k["BV"])) or rev(*a, **k))
    inp = make_inputs(7, 1, 256, 1, 16, 16, 128, 128, jnp.bfloat16, gate="normal")
    loss = lambda *a, **kw: jnp.sum(gdp_jax.gated_delta_product(
        *a, backend="cutedsl", **kw).astype(jnp.float32))
    with testing.emulated_kernels():
        jax.jit(jax.grad(loss))(*inp[:5])
        assert set(seen) == {("fwd", 1, 128, 16), ("rev", 1, 128, 16)}
        seen.clear()
        # (custom_vmap also traces the unmapped call once, at 1 row: not a launch)
        launched = lambda: {c for c in seen if c[1] == 4}
        jax.jit(jax.grad(lambda *a: loss(*a, intra_cp=4)))(*inp[:5])
        assert launched() == {("fwd", 4, 256, 64), ("rev", 4, 256, 64), ("fwd", 4, 128, 32),
                              ("rev", 4, 128, 32)}
        seen.clear()
        four = [x.reshape((4, 1, 64) + x.shape[2:]) for x in inp[:5]]
        jax.jit(jax.vmap(lambda *a: gdp_jax.gated_delta_product(*a, backend="cutedsl")))(*four)
        assert launched() == {("fwd", 4, 128, 32)}


@pytest.mark.parametrize("case", ["packed"])
def test_u16_operand(monkeypatch, case):
    """``chunk_prep.U16`` (off by default): u, the forward walk's and the local-gradient
    kernel's [C, V] operand, in bfloat16 for bfloat16 operands - the operands (kernel and
    XLA's) come out so, float16 operands keep a float32 u, and the op's output and
    gradients stay within the 16-bit tolerance of float64, a few roundings from the float32
    u's (bf16, GVA, packed with empty and one-token sequences, strong gates). Not free:
    with strong gates dg's error vs float64 grew ~3x in s35's run of the "n2-gva" case
    (0.0019 -> 0.0058), one reason U16 is off."""
    from gdp_jax.kernels import chunk_prep, pipeline
    from gdp_jax.testing import DIFF_NAMES, rel_rms, upcast
    B, T, n, H, HV, cu = TOKEN_CASES[case]
    N = B if cu is None else len(cu) - 1
    inp = make_inputs(47, B, T, n, H, HV, 64, 64, jnp.bfloat16, N=N, gate="strong")
    run = lambda: loss_and_grads(OP, inp, cu_seqlens=cu, backend="cutedsl",
                                 use_qk_l2norm=True)
    cu_arr = None if cu is None else jnp.asarray(cu, jnp.int32)
    spec = _checks.check_inputs(inp.q, inp.k, inp.v, inp.g, inp.beta, cu_seqlens=cu_arr)
    ch = _chunks(spec, grid.layout_of(spec, cu_arr), inp.q, inp.k, inp.v, inp.g, inp.beta)
    results = {}
    for on in (False, True):
        monkeypatch.setattr(chunk_prep, "U16", on)
        jax.clear_caches()
        u_xla = pipeline.forward_operands(ch, spec.scale, jnp.bfloat16)[4]
        assert u_xla.dtype == (jnp.bfloat16 if on else jnp.float32)
        assert chunk_prep.u_dtype(jnp.float16) == jnp.float32
        results[on] = run()
    ref = loss_and_grads(REF, upcast(inp, jnp.float64)._replace(
        g=inp.g.astype(jnp.float64), initial_state=inp.initial_state.astype(jnp.float64)),
        cu_seqlens=cu, use_qk_l2norm=True)
    got, want = results[True], results[False]
    pairs = {"o": (got[0], want[0], ref[0]), "final": (got[1], want[1], ref[1])}
    pairs.update({m: (got[3][m], want[3][m], ref[3][m]) for m in DIFF_NAMES})
    for name, (x, y, r) in pairs.items():
        assert np.all(np.isfinite(np.asarray(x, np.float64))), name
        assert rel_rms(x, y) < 1e-2, name
        e_got, e_want = rel_rms(x, r), rel_rms(y, r)
        worse = 4.0 if name == "g" else 1.5
        assert e_got < 1e-2 and e_got < worse * e_want + 1e-4, (name, e_got, e_want)
