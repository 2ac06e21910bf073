"""Readout terms on the read-out rows only (issue 22).

Every chunk holds whole tokens (grid.steps_per_chunk: 21 tokens and one identity row for
n = 3), so only rows n - 1, 2n - 1, .. of every chunk are read out (grid.readout_every); the
readout side (qg, P, o, dO, dq, the dP terms) runs on those C // n rows. float64, random inputs (no zero rows among the read-out ones):
1. the layouts put every read-out row at a stride position and q is zero elsewhere, for
   batched and packed rows (empty and one-token sequences, T not a multiple of 64, T = 1);
2. every stride-aware function equals its all-rows form on the read-out rows, n = 1..4;
3. the op's outputs and all gradients equal those of the all-rows path (readout_every
   forced to 1) for n = 2, 3, 4: xla (one level and segmented), emulated cutedsl, and CP
   on the xla engine;
4. n with identity rows or all-rows readout (5, 11) and tokens across chunks (65) equal
   the float64 token recurrence.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdp_jax
from gdp_jax import chunked, engine, grid, recurrence, testing
from gdp_jax._checks import check_inputs
from gdp_jax.kernels import pipeline
from gdp_jax.testing import loss_and_grads, make_inputs, rel_max

TOL = 1e-12
C = grid.CHUNK

# (T, cu_seqlens or None): batched rows; packed with empty and one-token sequences and T
# not a multiple of 64; one token.
LAYOUTS = [(150, None), (150, [0, 0, 1, 70, 70, 150]), (1, None), (1, [0, 0, 1])]


def _problem(n, T, cu, seed=0):
    N = 2 if cu is None else len(cu) - 1
    inp = make_inputs(seed + n, 2 if cu is None else 1, T, n, 1, 2, 8, 6, jnp.float64, N=N)
    cu = None if cu is None else np.asarray(cu, np.int32)
    spec = check_inputs(inp.q, inp.k, inp.v, inp.g, inp.beta,
                        initial_state=inp.initial_state, cu_seqlens=cu)
    prob = engine.forward_problem(spec, inp.q, inp.k, inp.v, inp.g, inp.beta,
                                  None if cu is None else jnp.asarray(cu))
    return spec, prob.layout, prob.ch, inp


def _rand(rng, shape):
    return jnp.asarray(rng.uniform(0.5, 1.5, shape) * rng.choice([-1.0, 1.0], shape))


def test_readout_every():
    ns = (1, 2, 3, 4, 5, 8, 11, 12, 21, 22, 64, 65)
    assert [grid.readout_every(n) for n in ns] == [1, 2, 3, 4, 5, 8, 1, 12, 21, 1, 64, 1]
    assert [grid.steps_per_chunk(n) for n in ns] == [64, 64, 63, 64, 60, 64, 55, 60, 63,
                                                     44, 64, 64]
    assert grid.every_of(C) == 1 and grid.every_of(C // 4) == 4 and grid.every_of(21) == 3
    for n in range(1, 70):               # the stride is read back off the row count
        every = grid.readout_every(n)
        assert grid.every_of(C // every) == every
    for rows in (0, 11, 65):
        with pytest.raises(ValueError):
            grid.every_of(rows)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("T, cu", LAYOUTS)
def test_layout_reads_out_on_the_stride(n, T, cu):
    """Every token's readout row is a stride row of its chunk, and the chunked q is zero
    on all the other rows: skipping them drops zeros only."""
    spec, layout, ch, _ = _problem(n, T, cu)
    every, S = grid.readout_every(n), grid.steps_per_chunk(n)
    assert every == n
    last = np.arange(T) * n + n - 1
    rows = last // S * C + last % S if cu is None else np.asarray(layout.out_slot)[0]
    assert np.all(rows % C % every == every - 1) and np.all(rows % C < S)
    # the rows after the whole tokens are identity steps
    for a in (ch.k, ch.v, ch.g[..., None], ch.beta[..., None]):
        assert np.all(np.asarray(a)[..., S:, :] == 0)
    q = np.asarray(ch.q)
    q_off = q.copy()
    q_off[..., every - 1::every, :] = 0
    assert np.all(q_off == 0)
    assert np.any(np.asarray(grid.readout_rows(ch.q, every)) != 0)


@pytest.mark.parametrize("every", [1, 2, 3, 4, 5])
def test_rows_and_their_transpose(every):
    rng = np.random.default_rng(every)
    x = _rand(rng, (2, 3, C, 5))
    r = grid.readout_rows(x, every)
    assert r.shape == (2, 3, C // every, 5)
    np.testing.assert_array_equal(np.asarray(r), np.asarray(x)[:, :, every - 1::every])
    back = np.asarray(grid.from_readout_rows(r, every))
    want = np.zeros(x.shape)
    want[:, :, every - 1::every] = np.asarray(r)
    np.testing.assert_array_equal(back, want)
    # the transpose: <rows(x), y> = <x, from_rows(y)>
    y = _rand(rng, r.shape)
    assert abs(float(jnp.sum(r * y) - jnp.sum(x * grid.from_readout_rows(y, every)))) < 1e-12
    v = _rand(rng, (4, C))
    np.testing.assert_array_equal(np.asarray(grid.readout_rows(v, every, axis=-1)),
                                  np.asarray(v)[:, every - 1::every])
    for strict in (False, True):
        full = np.tril(np.ones((C, C), bool), -1 if strict else 0)
        np.testing.assert_array_equal(np.asarray(grid.readout_lower(C // every, C, strict)),
                                      full[every - 1::every])


@pytest.mark.parametrize("every", [1, 2, 3, 4])
def test_causal_products_on_readout_rows(every):
    """causal_mm / causal_scores on the read-out rows = those rows of the all-rows forms,
    non-finite rows of the right operand included (NaN from the first such row on)."""
    rng = np.random.default_rng(10 + every)
    rows = lambda x: grid.readout_rows(x, every)
    X = jnp.tril(_rand(rng, (3, C, C)))
    R = np.array(_rand(rng, (3, C, 4)))
    R[1, 17, 2] = np.inf
    R[2, 40, 0] = np.nan
    R = jnp.asarray(R)
    for strict in (False, True):
        Xs = jnp.tril(X, -1) if strict else X
        want = rows(chunked.causal_mm(Xs, R, strict))
        got = chunked.causal_mm(rows(Xs), R, strict)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        assert rel_max(jnp.nan_to_num(got), jnp.nan_to_num(want)) < TOL
    q, k = _rand(rng, (3, C, 8)), _rand(rng, (3, C, 8))
    Gam = jnp.tril(jnp.exp(-_rand(rng, (3, C, C)) ** 2))
    got = chunked.causal_scores(rows(q), k, rows(Gam))
    assert rel_max(got, rows(chunked.causal_scores(q, k, Gam))) < TOL


@pytest.mark.parametrize("every", [1, 2, 3, 4])
def test_mask_nonfinite_rows_on_readout_rows(every):
    rng = np.random.default_rng(20 + every)
    rows = lambda x, axis=-2: grid.readout_rows(x, every, axis)
    w, u, Kt = (np.array(_rand(rng, (3, C, d))) for d in (8, 6, 8))
    qg, P = np.array(_rand(rng, (3, C, 8))), np.array(_rand(rng, (3, C, C)))
    w[1, 30, 0] = np.inf                       # a state row: NaN from row 30 on
    qg[2, 47, 1] = np.nan                      # a read-out row for every stride 1..4
    P[0, 63, 5] = -np.inf
    ops = [jnp.asarray(a) for a in (w, u, Kt, qg, P)]
    (fw, fu, fK, fqg, fP), fbad = chunked.mask_nonfinite_rows(*ops)
    (gw, gu, gK, gqg, gP), gbad = chunked.mask_nonfinite_rows(*ops[:3], rows(ops[3]),
                                                              rows(ops[4]))
    np.testing.assert_array_equal(np.asarray(gbad), np.asarray(rows(fbad, -1)))
    for a, b in ((gw, fw), (gu, fu), (gqg, rows(fqg)), (gP, rows(fP))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(gK), np.asarray(fK))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("T, cu", LAYOUTS)
def test_engine_functions_on_readout_rows(n, T, cu):
    """On the real grid: forward operands, the readout of a walk, from_chunks, the readout
    cotangent, the reverse pass, the CP backward summaries, the cutedsl backward operands
    and the chunk-local backward, each on the read-out rows vs all rows."""
    spec, layout, ch, inp = _problem(n, T, cu, seed=30)
    every = grid.readout_every(n)
    rows = lambda x, axis=-2: grid.readout_rows(x, every, axis)
    rng = np.random.default_rng(n + T)
    B, NC, HV = ch.k.shape[:3]
    K, V = ch.k.shape[-1], ch.v.shape[-1]

    # Each engine function runs under jax.jit (CPU time: eager dispatch compiled every
    # primitive of them on its own, ~80 s per case); the comparisons are unchanged.
    it, X = jax.jit(chunked.wy_factors)(ch)
    x1, bad1 = jax.jit(lambda ch, it: recurrence.forward_operands(ch, it, spec.scale))(ch, it)
    xr, badr = jax.jit(lambda ch, it: recurrence.forward_operands(ch, it, spec.scale, every))(
        ch, it)
    assert xr.qg.shape[-2] == C // every
    assert rel_max(xr.qg, rows(x1.qg)) < TOL and rel_max(xr.P, rows(x1.P)) < TOL
    np.testing.assert_array_equal(np.asarray(badr), np.asarray(rows(bad1, -1)))
    S0 = _rand(rng, (B, NC, HV, K, V))
    readout = jax.jit(recurrence.readout)
    o1 = readout(x1, S0)
    orr = readout(xr, S0)
    assert rel_max(orr, rows(o1)) < TOL
    from_chunks = jax.jit(lambda o: grid.from_chunks(layout, o))
    assert rel_max(from_chunks(orr), from_chunks(o1)) < TOL

    do = _rand(rng, (B, T, HV, V))
    doc1 = jax.jit(lambda do: grid.readout_cotangent(layout, do))(do)
    docr = jax.jit(lambda do: grid.readout_cotangent(layout, do, every))(do)
    np.testing.assert_array_equal(np.asarray(docr), np.asarray(rows(doc1)))
    np.testing.assert_array_equal(np.asarray(grid.from_readout_rows(docr, every)),
                                  np.asarray(doc1))
    docr = _rand(rng, docr.shape)            # random on every read-out row (the padding too)
    doc1 = grid.from_readout_rows(docr, every)

    dS_end = _rand(rng, S0.shape)
    local = jax.jit(lambda ch, it, X, S0, doc, dS_end: chunked.local_grads_direct(
        ch, it, X, S0, doc, dS_end, spec.scale))
    want = local(ch, it, X, S0, doc1, dS_end)
    got = local(ch, it, X, S0, docr, dS_end)
    for name, a, b in zip(ch._fields, got, want):
        assert rel_max(a, b) < TOL, name

    dfinal = _rand(rng, inp.initial_state.shape)
    summaries = jax.jit(lambda ch, doc, dfinal: chunked.backward_summaries(
        ch, layout, doc, dfinal, spec.scale))
    for a, b in zip(summaries(ch, docr, dfinal), summaries(ch, doc1, dfinal)):
        assert rel_max(a, b) < TOL
    blk = recurrence.Blocking(B, NC, NC)
    f = recurrence.flags(blk, layout)
    revs = [recurrence.Reverse(it.w, it.Kt, it.G_last, x.qg, x.P, d)
            for x, d in ((x1, doc1), (xr, docr))]
    reverse = jax.jit(lambda r, dfinal: recurrence.reverse(blk, jax.tree_util.tree_map(
        lambda a: jnp.moveaxis(a, 1, 0), r), f, dfinal, spec.N))
    (dS1, first1), (dSr, firstr) = (reverse(r, dfinal) for r in revs)
    assert rel_max(dSr, dS1) < TOL and rel_max(firstr, first1) < TOL

    with testing.emulated_kernels():          # its WY inverse is a kernel
        work = jax.jit(lambda ch, doc: pipeline.BackwardWork(ch, doc, spec.scale,
                                                          jnp.float64).operands)
        w1 = work(ch, doc1)
        wr = work(ch, docr)
    for a, b in zip(wr, w1):
        assert a.shape == b.shape and rel_max(a, b) < TOL


# ------------------------------------------------------------------ the op, end to end

def _all_rows(n, C=C):
    return 1


def _op_runs(monkeypatch, inp, cu, **kw):
    """(the op on the read-out rows, the op on all rows): (o, final, grads) each."""
    runs = []
    for patch in (False, True):
        if patch:
            monkeypatch.setattr(grid, "readout_every", _all_rows)
        jax.clear_caches()
        o, s, _, g = loss_and_grads(gdp_jax.gated_delta_product, inp, cu_seqlens=cu, **kw)
        runs.append((o, s, g))
    monkeypatch.undo()
    jax.clear_caches()
    return runs


def _assert_same(runs):
    (o, s, g), (o1, s1, g1) = runs
    assert rel_max(o, o1) < TOL and rel_max(s, s1) < TOL
    assert set(g) == set(g1) and {"q", "k", "v", "g", "beta", "initial_state"} <= set(g)
    for name in g:
        assert rel_max(g[name], g1[name]) < TOL, name


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("T, cu", [(150, None), (150, [0, 0, 1, 70, 70, 150])])
@pytest.mark.parametrize("segmented", [False, True])
def test_op_equals_all_rows_path_xla(monkeypatch, n, T, cu, segmented):
    inp = make_inputs(40 + n, 2 if cu is None else 1, T, n, 1, 2, 8, 6, jnp.float64,
                      N=2 if cu is None else len(cu) - 1, gate="strong")
    cu = None if cu is None else np.asarray(cu, np.int32)
    kw = dict(backend="xla", recompute_chunk_num=1)
    if segmented:
        with monkeypatch.context() as m:
            m.setattr(recurrence, "MAX_PROBLEMS", 0)
            m.setattr(recurrence, "SEGMENT_PROBLEMS", 4)
            runs = _op_runs(m, inp, cu, **kw)
    else:
        runs = _op_runs(monkeypatch, inp, cu, **kw)
    _assert_same(runs)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_op_equals_all_rows_path_cutedsl_emulated(monkeypatch, n):
    inp = make_inputs(50 + n, 1, 150, n, 1, 2, 8, 6, jnp.float64, N=5)
    cu = np.asarray([0, 0, 1, 70, 70, 150], np.int32)
    with testing.emulated_kernels():
        runs = _op_runs(monkeypatch, inp, cu, backend="cutedsl", recompute_chunk_num=1,
                        use_qk_l2norm=True)
    _assert_same(runs)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_cp_equals_all_rows_path_xla(monkeypatch, n):
    """CP on 2 simulated devices (xla engine: its one-pass ranks), packed sequences
    crossing the rank boundary: outputs, final states and every gradient."""
    from jax.sharding import Mesh, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()[:2]), ("cp",))
    T = 160
    inp = make_inputs(60 + n, 1, T, n, 1, 2, 8, 6, jnp.float64, N=4)
    cu = jnp.asarray([0, 1, 1, 100, T], jnp.int32)
    rng = np.random.default_rng(n)
    wo = _rand(rng, (1, T, 2, 6))
    ws = _rand(rng, inp.initial_state.shape)

    def loss(q, k, v, g, beta, h0):
        f = jax.shard_map(
            lambda q, k, v, g, beta, h0, cu: gdp_jax.gated_delta_product(
                q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                cp_axis="cp", backend="xla"),
            mesh=mesh, in_specs=(P(None, "cp"),) * 5 + (P(), P()),
            out_specs=(P(None, "cp"), P()))
        o, s = f(q, k, v, g, beta, h0, cu)
        return jnp.sum(o * wo) + jnp.sum(s * ws), (o, s)

    args = (inp.q, inp.k, inp.v, inp.g, inp.beta, inp.initial_state)
    runs = []
    for patch in (False, True):
        if patch:
            monkeypatch.setattr(grid, "readout_every", _all_rows)
        jax.clear_caches()
        (_, (o, s)), g = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)),
                                                    has_aux=True))(*args)
        runs.append((o, s, dict(zip(("q", "k", "v", "g", "beta", "initial_state"), g))))
    monkeypatch.undo()
    jax.clear_caches()
    _assert_same(runs)


@pytest.mark.parametrize("n, T, cu", [(5, 30, None), (5, 30, [0, 0, 1, 13, 30]),
                                      (11, 7, [0, 6, 6, 7]), (65, 3, None)])
def test_uncommon_n_equals_the_token_recurrence(n, T, cu):
    """Chunks with identity rows after their whole tokens (n = 5: 12 tokens + 4 rows;
    n = 11: 5 tokens + 9 rows, read out on all rows) and tokens across chunks (n = 65):
    outputs, final states and every gradient equal the float64 token recurrence."""
    ref, tol = gdp_jax.gated_delta_product_reference, 1e-10     # test_op's bound
    N = 2 if cu is None else len(cu) - 1
    inp = make_inputs(70 + n, 2 if cu is None else 1, T, n, 1, 2, 4, 3, jnp.float64, N=N,
                      gate="strong")
    cu = None if cu is None else np.asarray(cu, np.int32)
    got = loss_and_grads(gdp_jax.gated_delta_product, inp, cu_seqlens=cu, backend="xla")
    want = loss_and_grads(ref, inp, cu_seqlens=cu)
    (o, s, _, g), (o1, s1, _, g1) = got, want
    assert rel_max(o, o1) < tol and rel_max(s, s1) < tol
    assert set(g) == set(g1)
    for name in g:
        assert rel_max(g[name], g1[name]) < tol, name


# --- 5. the kernels' read-out rows (pipeline.READOUT_ONLY), on the emulated kernels -------

@pytest.mark.parametrize("n,T,cu,H,HV,l2norm,S", [
    (2, 150, None, 2, 2, True, None),
    (3, 150, [0, 0, 1, 70, 70, 150], 1, 2, False, None),   # GVA, packed
    (4, 150, None, 2, 4, True, None),
    (5, 150, None, 1, 1, True, 3),                         # 12 rows; intra_cp
    (12, 70, [0, 1, 70], 1, 1, True, None),                # 5 rows; packed
    (2, 3, None, 1, 1, True, None),                        # one chunk, 3 tokens
])
def test_kernel_readout_rows_equal_all_rows(monkeypatch, n, T, cu, H, HV, l2norm, S):
    """With ``READOUT_ONLY`` the token-major operands contract gives qg, P on the read-out
    rows ([.., READOUT_ROWS, *]: row m = chunk row n m + n - 1, zeros after C // n), the
    walk o on them, and the op the same o and final state (bitwise) as with all rows -
    batched, packed with empty and one-token sequences, GVA, with and without the in-op
    norm, and under intra_cp (the CP pass's summary and apply walks)."""
    from gdp_jax.kernels import emulate
    N = 2 if cu is None else len(cu) - 1
    inp = make_inputs(n, 2 if cu is None else 1, T, n, H, HV, 64, 128, jnp.bfloat16, N=N)
    cuj = None if cu is None else jnp.asarray(cu, jnp.int32)
    seen = []
    of = emulate._readout_rows_of
    monkeypatch.setattr(emulate, "_readout_rows_of",
                        lambda x, nn: seen.append(x.shape) or of(x, nn))
    out = {}
    for on in (False, True):
        monkeypatch.setattr(pipeline, "READOUT_ONLY", on)
        with testing.emulated_kernels():
            out[on] = jax.jit(lambda *a: gdp_jax.gated_delta_product(
                *a[:5], initial_state=a[5], output_final_state=True, cu_seqlens=cuj,
                use_qk_l2norm=l2norm, backend="cutedsl", intra_cp=S))(
                    inp.q, inp.k, inp.v, inp.g, inp.beta, inp.initial_state)
    assert seen                                    # the read-out rows were taken
    for a, b in zip(out[True], out[False]):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert np.isfinite(np.asarray(out[True][0], np.float32)).all()


def _emulated_loss_and_grads(monkeypatch, switches, inp, cu, seed, intra_cp=None):
    """{False: (loss, grads), True: (loss, grads)}: ``jax.value_and_grad`` of a random
    weighting of o plus the final state's sum, on the emulated cutedsl kernels,
    with the ``pipeline`` switches named in ``switches`` all off, then all on."""
    cuj = None if cu is None else jnp.asarray(cu, jnp.int32)
    wo = jax.random.normal(jax.random.PRNGKey(seed), inp.q.shape[:2] + inp.v.shape[-2:],
                           jnp.float32)                 # [B, T, HV, V], as o

    def loss(q, k, v, g, beta, h0):
        o, s = gdp_jax.gated_delta_product(q, k, v, g, beta, initial_state=h0,
                                           output_final_state=True, cu_seqlens=cuj,
                                           use_qk_l2norm=True, backend="cutedsl",
                                           intra_cp=intra_cp)
        return jnp.sum(o.astype(jnp.float32) * wo) + jnp.sum(s)

    out = {}
    for on in (False, True):
        for name in switches:
            monkeypatch.setattr(pipeline, name, on)
        with testing.emulated_kernels():
            out[on] = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6))))(
                inp.q, inp.k, inp.v, inp.g, inp.beta, inp.initial_state)
    return out


def _assert_same_bits_but_dg(out, dg_too=False):
    """The loss and every gradient of ``out[True]`` the same bits as ``out[False]``'s; dg
    (unless ``dg_too``) within float32 rounding: it is summed in XLA around the kernels,
    and a changed forward graph may let XLA reassociate those sums (seen once in 3.8e-8;
    the emulated kernels' results are exact)."""
    (l1, g1), (l0, g0) = out[True], out[False]
    for i, (a, b) in enumerate(zip((l1,) + g1, (l0,) + g0)):
        assert np.isfinite(np.asarray(a, np.float32)).all(), i
        if i == 4 and not dg_too:
            assert rel_max(a, b) < 1e-6
        else:
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), i


@pytest.mark.parametrize("n,T,cu,H,HV", [
    (2, 150, None, 2, 2),
    (3, 150, [0, 0, 1, 70, 70, 150], 1, 2),                # GVA, packed
    (5, 150, None, 1, 1),                                  # 12 rows
])
def test_differentiated_readout_rows_equal_all_rows(monkeypatch, n, T, cu, H, HV):
    """With ``READOUT_ONLY_GRAD`` the differentiated forward's chunk-major operands
    contract reads q's read-out rows compact and gives qg, P on them, its walk (with the
    checkpoints) o on them: the loss and every gradient but dg are the same bits as with
    all rows, dg to float32 rounding (batched, packed with empty and one-token sequences,
    GVA)."""
    from gdp_jax.kernels import emulate
    # the chunk-major contract (TOKEN_BACKWARD, on since s33, reads tokens instead: its
    # read-out rows are test_cutedsl_emulated.py::test_token_backward_equals_chunk_tiles')
    monkeypatch.setattr(pipeline, "TOKEN_BACKWARD", False)
    N = 2 if cu is None else len(cu) - 1
    inp = make_inputs(n, 2 if cu is None else 1, T, n, H, HV, 64, 128, jnp.bfloat16, N=N)
    seen = []
    to_rows = emulate._to_chunk_rows
    monkeypatch.setattr(emulate, "_to_chunk_rows",
                        lambda x, nn, c: seen.append(x.shape) or to_rows(x, nn, c))
    out = _emulated_loss_and_grads(monkeypatch, ["READOUT_ONLY_GRAD"], inp, cu, seed=1)
    assert seen and all(x[-2] == grid.READOUT_ROWS for x in seen)
    _assert_same_bits_but_dg(out)


@pytest.mark.parametrize("n,T,cu,H,HV,S", [
    (2, 150, None, 2, 2, None),
    (3, 150, [0, 0, 1, 70, 70, 150], 1, 2, None),          # GVA, packed
    (5, 150, None, 1, 1, None),                            # 12 rows
    (3, 150, None, 1, 1, 3),                               # intra_cp: the CP summary walk
])
def test_backward_readout_rows_equal_all_rows(monkeypatch, n, T, cu, H, HV, S):
    """With ``READOUT_ONLY_BWD`` the backward's operands (with X) hold qg, P on the
    read-out rows and the reverse walk takes qg, P, dO on them; the chunk-local backward
    still gets dO on all rows. On the emulated kernels (plain matmuls: zero rows add
    nothing) every gradient is the same bits as with all rows, dg to float32 rounding."""
    from gdp_jax.kernels import emulate
    N = 2 if cu is None else len(cu) - 1
    inp = make_inputs(n, 2 if cu is None else 1, T, n, H, HV, 64, 128, jnp.bfloat16, N=N)
    rows = []                           # qg's rows at each reverse-walk call
    raw = emulate.dh_kernel_call        # (emulated_kernels binds it on entry)
    monkeypatch.setattr(emulate, "dh_kernel_call",
                        lambda *a, **k: rows.append(a[2].shape[-2]) or raw(*a, **k))
    out = _emulated_loss_and_grads(monkeypatch, ["READOUT_ONLY_BWD"], inp, cu, seed=2,
                                   intra_cp=S)
    half = len(rows) // 2
    assert rows and set(rows[:half]) == {C} and set(rows[half:]) == {grid.READOUT_ROWS}, rows
    # dg to float32 rounding: with TOKEN_BACKWARD (on since s33) the packed GVA case's
    # sums around the kernels reassociated
    _assert_same_bits_but_dg(out)


def test_emulated_chunk_rows_invert_the_row_pick():
    """``_to_chunk_rows`` puts row m back at chunk row n m + n - 1 (zeros elsewhere): the
    chunk-major operands kernel's compact q read back, the inverse of ``_readout_rows_of``
    on rows that hold q."""
    from gdp_jax.kernels.emulate import _readout_rows_of, _to_chunk_rows
    rng = np.random.default_rng(1)
    n = jnp.asarray([[2, 3, 5], [4, 12, 2]], jnp.int32)
    x = np.asarray(rng.normal(size=(2, 3, 2, C, 5)), np.float32)
    for b in range(2):                  # keep the read-out rows only, as a chunk's q
        for c in range(3):
            nn = int(n[b, c])
            keep = (np.arange(C) % nn == nn - 1)
            x[b, c, :, ~keep] = 0
    x = jnp.asarray(x)
    np.testing.assert_array_equal(np.asarray(_to_chunk_rows(_readout_rows_of(x, n), n, C)),
                                  np.asarray(x))


@pytest.mark.parametrize("n", [1, 11, 65])
def test_kernel_readout_rows_only_where_rows_repeat(monkeypatch, n):
    """n = 1 (every row read out), 11 (C // n rows do not name n back) and 65 (tokens
    across chunks): the kernels keep all C rows."""
    spec = check_inputs(*make_inputs(0, 1, 4, n, 1, 1, 8, 8, jnp.bfloat16)[:5])
    monkeypatch.setattr(pipeline, "READOUT_ONLY", True)
    assert not pipeline.readout_rows_only(spec)
    spec2 = check_inputs(*make_inputs(0, 1, 4, 2, 1, 1, 8, 8, jnp.bfloat16)[:5])
    assert pipeline.readout_rows_only(spec2)
    monkeypatch.setattr(pipeline, "READOUT_ONLY", False)
    assert not pipeline.readout_rows_only(spec2)


def test_emulated_readout_rows_pick_the_read_out_rows():
    """The contract's row pick: row m of [.., READOUT_ROWS, X] is chunk row n m + n - 1
    for m < C // n, zero after (n from the row table, per chunk)."""
    from gdp_jax.kernels.emulate import _readout_rows_of
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 3, 2, C, 5)), jnp.float32)
    n = jnp.asarray([[2, 3, 5], [4, 12, 2]], jnp.int32)
    y = np.asarray(_readout_rows_of(x, n))
    assert y.shape == (2, 3, 2, grid.READOUT_ROWS, 5)
    for b in range(2):
        for c in range(3):
            nn = int(n[b, c])
            rows = np.asarray(x)[b, c, :, nn - 1::nn][:, :C // nn]
            np.testing.assert_array_equal(y[b, c, :, :C // nn], rows)
            assert not y[b, c, :, C // nn:].any()


@pytest.mark.parametrize("save", [False, True], ids=["recompute", "save_operands"])
def test_readout_rows_forward_and_backward_together(monkeypatch, save):
    """``READOUT_ONLY_GRAD`` and ``READOUT_ONLY_BWD`` on together (with the backward's
    operands recomputed, or kept by the forward: ``SAVE_OPERANDS``, whose all-rows
    operands then serve both walks) give the loss and every gradient of both off: the
    same bits but dg (float32 rounding: XLA's sums around the kernels), packed with GVA
    and empty / one-token sequences, n = 3, on the emulated kernels."""
    n, T, cu, H, HV = 3, 150, [0, 0, 1, 70, 70, 150], 1, 2
    inp = make_inputs(7, 1, T, n, H, HV, 64, 128, jnp.bfloat16, N=len(cu) - 1)
    monkeypatch.setattr(pipeline, "SAVE_OPERANDS", save)
    out = _emulated_loss_and_grads(
        monkeypatch, ["READOUT_ONLY_GRAD", "READOUT_ONLY_BWD"], inp, cu, seed=3)
    _assert_same_bits_but_dg(out)
