"""The xla engine's two-level passes (gdp_jax.recurrence) against one-level scans.

float64, random inputs: the blocked forward (outputs, final states, checkpoints) and
reverse pass (dS_end, start-state gradients) equal the plain chunk-by-chunk scans of
gdp_jax.chunked for block lengths 1 .. NC, checkpoint strides 1 and 2, batched and packed
rows (empty and one-token sequences, sequences inside one block and across several);
then the op with blocking forced on short rows against the token recurrence, and the
segmented (memory-bounded) passes against the same reference and the unsegmented op.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdp_jax
from gdp_jax import chunked, engine, recurrence
from gdp_jax._checks import check_inputs
from gdp_jax.testing import default_weights, loss_and_grads, make_inputs, rel_max

TOL = 1e-12


def _problem(packed, seed=0, T=300, n=2):
    N = 5 if packed else 2
    inp = make_inputs(seed, 1 if packed else 2, T, n, 1, 2, 8, 6, jnp.float64, N=N,
                      gate="strong" if seed % 2 else "normal")
    cu = np.array([0, 0, 1, 90, 91, T], np.int32) if packed else None
    spec = check_inputs(inp.q, inp.k, inp.v, inp.g, inp.beta, initial_state=inp.initial_state,
                        cu_seqlens=cu)
    # under jit (eagerly the chunk relayout dispatches op by op)
    prob = jax.jit(engine.forward_problem, static_argnums=0)(
        spec, inp.q, inp.k, inp.v, inp.g, inp.beta, None if cu is None else jnp.asarray(cu))
    return spec, prob.layout, prob.ch, inp.initial_state


@jax.jit
def _scan_forward(ch, layout, h0, scale):
    it = chunked.intra_chunk(ch)
    S0 = chunked.state_scan(it, layout, h0)
    return (chunked.chunk_map(ch, it, S0, scale)[0], chunked.final_states(it, layout, S0, h0),
            S0)


@functools.partial(jax.jit, static_argnums=(0, 5, 6))
def _blocked_forward(blk, ch, layout, h0, scale, N, stride):
    chb = blk.tree_block(ch)
    x, bad = recurrence.forward_operands(chb, chunked.intra_chunk(chb), scale)
    f = recurrence.flags(blk, layout)
    o, fin, states = recurrence.forward(blk, x, f, h0, N, stride, jnp.float64)
    fin = jnp.where((layout.seq_len > 0)[:, None, None, None], fin, h0)
    S0 = recurrence.states_from_checkpoints(x, f, h0, states, stride)
    return jnp.any(bad), blk.unblock(o), fin, blk.unblock(S0)


@pytest.mark.parametrize("L, packed", [(2, False), (3, True), (5, True)])
def test_blocked_forward_equals_scan(packed, L):
    spec, layout, ch, h0 = _problem(packed, seed=L)
    B, NC = ch.k.shape[:2]
    o_want, fin_want, S0_want = _scan_forward(ch, layout, h0, spec.scale)
    for stride in (1, 2):
        blk = recurrence.Blocking(B, NC, stride * -(-L // stride))
        bad, o, fin, S0 = _blocked_forward(blk, ch, layout, h0, spec.scale, spec.N, stride)
        assert not bool(bad)
        assert rel_max(o, o_want) < TOL
        assert rel_max(fin, fin_want) < TOL
        assert rel_max(S0, S0_want) < TOL, stride


@functools.partial(jax.jit, static_argnums=(5,))
def _scan_reverse(ch, layout, doc, dfinal, scale, N):
    it = chunked.intra_chunk(ch)
    dS_end, dS_start = chunked.reverse_state_grad_scan(ch, it, layout, doc, dfinal, scale)
    return dS_end, chunked.initial_state_grads(layout, dS_start, dfinal)


@functools.partial(jax.jit, static_argnums=(0, 6))
def _blocked_reverse(blk, ch, layout, doc, dfinal, scale, N):
    chb = blk.tree_block(ch)
    itb = chunked.intra_chunk(chb)
    qg, P = recurrence.readout_operands(chb, itb, scale)
    rev = recurrence.Reverse(itb.w, itb.Kt, itb.G_last, qg, P, blk.block(doc))
    got, first = recurrence.reverse(blk, rev, recurrence.flags(blk, layout), dfinal, N)
    dh0 = jnp.where((layout.seq_len > 0)[:, None, None, None], first, dfinal)
    return blk.unblock(got), dh0


@pytest.mark.parametrize("L, packed", [(1, False), (2, True), (4, True)])
def test_blocked_reverse_equals_scan(packed, L):
    # Both passes under jax.jit (eagerly they dispatched op by op: ~15-30 s per case).
    spec, layout, ch, h0 = _problem(packed, seed=10 + L)
    B, NC = ch.k.shape[:2]
    rng = np.random.default_rng(L)
    doc = jnp.asarray(rng.standard_normal(ch.v.shape))
    dfinal = jnp.asarray(rng.standard_normal(h0.shape))
    dS_end, dh0_want = _scan_reverse(ch, layout, doc, dfinal, spec.scale, spec.N)
    blk = recurrence.Blocking(B, NC, L)
    got, dh0 = _blocked_reverse(blk, ch, layout, doc, dfinal, spec.scale, spec.N)
    assert rel_max(got, dS_end) < TOL
    assert rel_max(dh0, dh0_want) < TOL


def test_block_len(monkeypatch):
    assert recurrence.block_len(2048) == 2048        # one level by default
    monkeypatch.setattr(recurrence, "MIN_BLOCKED_CHUNKS", 8)
    assert recurrence.block_len(1) == 1
    assert recurrence.block_len(8) == 8
    assert recurrence.block_len(128) == 8
    assert recurrence.block_len(2048) == 32
    assert recurrence.block_len(128, stride=3) == 9
    for NC in (9, 50, 513):
        L = recurrence.block_len(NC)
        assert 2 <= L < NC


@pytest.mark.parametrize("packed", [False, True])
def test_op_blocked_matches_reference(monkeypatch, packed):
    """Blocking forced on a short row (NC = 10): the op's outputs and every gradient."""
    monkeypatch.setattr(recurrence, "MIN_BLOCKED_CHUNKS", 1)
    T, n = 300, 2
    N = 4 if packed else 2
    inp = make_inputs(3, 1 if packed else 2, T, n, 1, 2, 8, 6, jnp.float64, N=N)
    cu = jnp.asarray([0, 1, 1, 170, T], jnp.int32) if packed else None
    w = default_weights(inp, cu, None)
    for N_rc in ((0, 2) if packed else (0,)):
        o, s, _, dg = loss_and_grads(gdp_jax.gated_delta_product, inp, w, cu_seqlens=cu,
                                     backend="xla", recompute_chunk_num=N_rc)
        o_r, s_r, _, dg_r = loss_and_grads(gdp_jax.gated_delta_product_reference, inp, w,
                                           cu_seqlens=cu)
        assert rel_max(o, o_r) < 1e-10 and rel_max(s, s_r) < 1e-10
        for name in dg:
            assert rel_max(dg[name], dg_r[name]) < 1e-10, (name, N_rc)


def test_segment_len():
    assert recurrence.segment_len(128, 8 * 16) is None              # (8, 4096, 16, 2)
    assert recurrence.segment_len(512, 2 * 16) is None              # (2, 16384, 16, 2)
    Ls = recurrence.segment_len(8192, 16)                            # (1, 262144, 16, 2)
    assert Ls * 16 <= recurrence.SEGMENT_PROBLEMS and 8192 % Ls == 0
    assert recurrence.segment_len(8192, 16, stride=3) % 3 == 0
    assert recurrence.segment_len(40000, 1) == recurrence.SEGMENT_PROBLEMS


def _op_case(seed, packed, T=300, n=2):
    """A float64 op case with strong gates - 2 rows, or 5 packed sequences (empty and
    one-token ones among them) - its loss weights and the token recurrence's
    (o, final, loss, grads)."""
    N = 5 if packed else 2
    inp = make_inputs(seed, 1 if packed else 2, T, n, 1, 2, 8, 6, jnp.float64, N=N,
                      gate="strong")
    cu = jnp.asarray([0, 0, 1, 90, 91, T], jnp.int32) if packed else None
    w = default_weights(inp, cu, None)
    return inp, cu, w, loss_and_grads(gdp_jax.gated_delta_product_reference, inp, w,
                                      cu_seqlens=cu)


@pytest.mark.parametrize("packed", [False, True])
def test_op_segmented_matches_reference(monkeypatch, packed):
    """Segments forced (3 or 2 chunks per segment, a partial last segment): outputs, final
    states and every gradient equal the token recurrence and the unsegmented op."""
    inp, cu, w, ref = _op_case(5, packed)
    run = lambda N_rc: loss_and_grads(gdp_jax.gated_delta_product, inp, w, cu_seqlens=cu,
                                      backend="xla", recompute_chunk_num=N_rc)
    # loss_and_grads' jitted function is shared (lru_cache): without this, the unbatched
    # case hit the trace test_op_blocked_matches_reference made with blocking forced
    jax.clear_caches()
    plain = run(0)
    monkeypatch.setattr(recurrence, "MAX_PROBLEMS", 0)
    monkeypatch.setattr(recurrence, "SEGMENT_PROBLEMS", 3 if packed else 6)
    for N_rc in ((0, 2) if packed else (0, 1)):
        jax.clear_caches()
        got = run(N_rc)
        for a, b, c in ((got[0], ref[0], plain[0]), (got[1], ref[1], plain[1])):
            assert rel_max(a, b) < 1e-10 and rel_max(a, c) < 1e-12
        for name in got[3]:
            assert rel_max(got[3][name], ref[3][name]) < 1e-10, (name, N_rc)
            assert rel_max(got[3][name], plain[3][name]) < 1e-12, (name, N_rc)


@pytest.mark.parametrize("stride", [1, 2])
def test_batched_walks_equal_flagged(stride):
    """One sequence per row on one level: the walks without per-chunk flags (started
    from h0 / dfinal) equal the flagged ones, outputs, final states, checkpoints,
    recomputed states, dS_end and start-state gradients, to float64 rounding."""
    spec, layout, ch, h0 = _problem(False, seed=3, T=333)
    B, NC = ch.k.shape[:2]
    blk = recurrence.Blocking(B, NC, recurrence.block_len(NC, stride))
    assert recurrence.is_batched(blk, layout)

    # the setup and each walk under jax.jit (eagerly: op-by-op dispatch, ~20 s per case)
    @jax.jit
    def operands(ch, layout):
        chb = blk.tree_block(ch)
        it = chunked.intra_chunk(chb)
        x, _ = recurrence.forward_operands(chb, it, spec.scale)
        return recurrence.flags(blk, layout), it, x

    f, it, x = operands(ch, layout)
    rng = np.random.default_rng(stride)
    do = jnp.asarray(rng.standard_normal(blk.block(ch.v).shape))
    dfinal = jnp.asarray(rng.standard_normal(h0.shape))
    rev = recurrence.Reverse(it.w, it.Kt, it.G_last, x.qg, x.P, do)

    @functools.partial(jax.jit, static_argnums=(0,))
    def walks(batched, x, f, h0, rev, dfinal):
        o, fin, st = recurrence.forward(blk, x, f, h0, spec.N, stride, jnp.float64, batched)
        S0 = recurrence.states_from_checkpoints(x, f, h0, st, stride, batched)
        dS_end, first = recurrence.reverse(blk, rev, f, dfinal, spec.N, batched)
        # padding chunks (after the last real one) are dropped: unblock
        return blk.unblock(o), fin, st, blk.unblock(S0), blk.unblock(dS_end), first

    runs = [walks(batched, x, f, h0, rev, dfinal) for batched in (False, True)]
    for got, want in zip(runs[1], runs[0]):
        assert rel_max(got, want) < TOL



@pytest.mark.parametrize("packed", [False, True])
def test_op_transition_walk_matches_reference(monkeypatch, packed):
    """The walks on each chunk's affine map (recurrence.TRANSITION_WALK, on the GPU for
    rows of few problems per step) forced on here: outputs, final states and every
    gradient equal the token recurrence, with checkpoints kept every chunk and every
    third, and through the CP protocol (intra_cp=2: the prepare's pass on V + K state
    columns, the resume's response)."""
    inp, cu, w, ref = _op_case(7, packed)
    monkeypatch.setattr(recurrence, "TRANSITION_WALK", {jax.default_backend(): 10 ** 9})
    assert recurrence._transition_walk(10 ** 6)
    for kw in (dict(recompute_chunk_num=0), dict(recompute_chunk_num=2),
               dict(intra_cp=2)):
        jax.clear_caches()      # loss_and_grads' jitted function is shared (lru_cache)
        o, s, _, dg = loss_and_grads(gdp_jax.gated_delta_product, inp, w, cu_seqlens=cu,
                                     backend="xla", **kw)
        assert rel_max(o, ref[0]) < 1e-10 and rel_max(s, ref[1]) < 1e-10, kw
        for name in dg:
            assert rel_max(dg[name], ref[3][name]) < 1e-10, (name, kw)
    jax.clear_caches()


def test_transition_walk_is_for_few_problems_per_step(monkeypatch):
    monkeypatch.setattr(recurrence, "TRANSITION_WALK", {"gpu": 64})
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert recurrence._transition_walk(32) and not recurrence._transition_walk(128)
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert not recurrence._transition_walk(1)
