"""Context parallelism inside one device (``intra_cp``, gdp_jax.cp.split): T cut into S
segments run as CP ranks along a vmap axis (and under shard_map CP, each rank's shard).

float64, random inputs, against the unsplit op and the token recurrence: outputs, final
states and every input's gradient (initial_state included), dense rows and packed
sequences crossing segments (empty and length-1 sequences), GVA, gates strong and off,
recompute_chunk_num; the emulated cutedsl kernels under the split; how "auto" picks S;
bad values.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdp_jax
from gdp_jax._checks import check_inputs
from gdp_jax.cp import split
from gdp_jax.testing import (default_weights, emulated_kernels, loss_and_grads, make_inputs,
                             rel_max)

OP = gdp_jax.gated_delta_product
REF = gdp_jax.gated_delta_product_reference


def _compare(inp, cu, S, tol, **kw):
    w = default_weights(inp, cu, None)
    got = loss_and_grads(OP, inp, w, cu_seqlens=cu, intra_cp=S, **kw)
    plain = loss_and_grads(OP, inp, w, cu_seqlens=cu, **kw)
    ref = loss_and_grads(REF, inp, w, cu_seqlens=cu)
    for a, b, c in ((got[0], plain[0], ref[0]), (got[1], plain[1], ref[1])):
        assert rel_max(a, b) < tol and rel_max(a, c) < tol
    assert set(got[3]) >= {"q", "k", "v", "beta", "initial_state"}
    for name in got[3]:
        assert rel_max(got[3][name], plain[3][name]) < tol, name
        assert rel_max(got[3][name], ref[3][name]) < tol, name


@pytest.mark.parametrize("S", [2, 4])
def test_dense_rows_gva(S):
    inp = make_inputs(0, 2, 256, 2, 1, 2, 8, 6, jnp.float64, gate="strong")
    _compare(inp, None, S, 1e-10, backend="xla")


def test_packed_sequences_cross_segments():
    """Sequences longer than a segment, inside one, empty and of one token."""
    T = 320
    cu = jnp.asarray([0, 0, 1, 150, 151, 230, T], jnp.int32)
    inp = make_inputs(1, 1, T, 3, 1, 1, 8, 8, jnp.float64, N=6, gate="normal")
    _compare(inp, cu, 4, 1e-10, backend="xla", recompute_chunk_num=1)


@pytest.mark.parametrize("S,packed", [(5, True), (8, False)])
def test_many_segments(S, packed):
    """S = 5 (packed: sequences crossing several segments) and 8 (dense rows): outputs and
    every gradient equal the unsplit op and the reference."""
    T = 320 if packed else 256
    cu = jnp.asarray([0, 0, 1, 150, 151, 230, T], jnp.int32) if packed else None
    inp = make_inputs(7, 1 if packed else 2, T, 2, 1, 2, 8, 6, jnp.float64,
                      N=6 if packed else None, gate="strong")
    _compare(inp, cu, S, 1e-10, backend="xla")


def test_cp_ranks_split_their_shards(monkeypatch):
    """``intra_cp`` under ``cp_axis``: each rank cuts its shard (the P x S segments fold
    as one CP; tests/test_cp.py checks the numbers), with the fold's one all_gather over
    cp_axis outside the segment vmaps; the same call as the plain CP op's but for
    rounding. Under shard_map(check_vma=False), where inputs passed replicated cannot be
    told from shards, it is a ValueError."""
    from jax.sharding import Mesh, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()[:2]), ("cp",))
    inp = make_inputs(3, 1, 64, 2, 1, 2, 8, 8, jnp.float64, N=4, gate="normal")
    cu = jnp.asarray([0, 5, 5, 40, 64], jnp.int32)
    calls = []
    real = split.split_gated_delta_product
    monkeypatch.setattr(split, "split_gated_delta_product",
                        lambda *a, **k: calls.append((k["segments"], k["cp_axis"]))
                        or real(*a, **k))

    def run(check_vma=True, **kw):
        f = jax.shard_map(lambda q, k, v, g, b, h0, c: OP(
            q, k, v, g, b, initial_state=h0, cu_seqlens=c, cp_axis="cp",
            output_final_state=True, **kw),
            mesh=mesh, in_specs=(P(None, "cp"),) * 5 + (P(), P()),
            out_specs=(P(None, "cp"), P()), check_vma=check_vma)
        return jax.jit(f)(*inp[:5], inp.initial_state, cu)

    o, s = run(intra_cp=4)
    assert calls == [(4, "cp")]
    o1, s1 = run()
    assert rel_max(o, o1) < 1e-10 and rel_max(s, s1) < 1e-10
    with pytest.raises(ValueError, match="check_vma=True"):
        run(check_vma=False, intra_cp=4)
    # "auto" on each rank's spec: the forward alone split, its gradient the plain CP op's
    monkeypatch.setattr(split, "MIN_SEGMENT_TOKENS", 8)
    calls.clear()
    o2, _ = run(intra_cp="auto")
    assert calls == [(4, "cp")] and rel_max(o2, o1) < 1e-10
    grad = lambda **kw: jax.jit(jax.grad(lambda q: jnp.sum(jax.shard_map(
        lambda q, k, v, g, b, c: OP(q, k, v, g, b, cu_seqlens=c, cp_axis="cp", **kw),
        mesh=mesh, in_specs=(P(None, "cp"),) * 5 + (P(),), out_specs=P(None, "cp"))(
            q, *inp[1:5], cu) ** 2)))(inp.q)
    calls.clear()
    np.testing.assert_array_equal(np.asarray(grad(intra_cp="auto")), np.asarray(grad()))


def test_split_folds_by_gather_by_default(monkeypatch):
    """The split folds its stacked summaries (no collective): never the scan, even where
    the cross-device cost model (and GDP_CP_FOLD) would pick it."""
    from gdp_jax.cp import driver
    monkeypatch.setenv("GDP_CP_FOLD", "scan")
    monkeypatch.setattr(driver, "_scanned_slice", lambda *a, **k: pytest.fail("scan fold"))
    inp = make_inputs(8, 1, 256, 1, 1, 1, 8, 8, jnp.float64)
    assert rel_max(OP(*inp[:5], intra_cp=8), OP(*inp[:5])) < 1e-10


def test_no_gate_no_initial_state():
    inp = make_inputs(2, 1, 192, 1, 2, 2, 8, 8, jnp.float64, gate="none")
    inp = inp._replace(initial_state=None)
    # under jax.jit (eagerly: op-by-op dispatch)
    o1 = jax.jit(lambda *a: OP(*a, intra_cp=3))(*inp[:5])
    o2 = jax.jit(REF)(*inp[:5])
    assert rel_max(o1, o2) < 1e-10


@pytest.mark.parametrize("packed", [False, True])
def test_emulated_cutedsl_split_matches_xla(packed):
    """The cutedsl engine's kernels (emulated) under the split: the segment axis folds
    into the kernels' rows (and their per-sequence tables, packed)."""
    T = 256
    cu = jnp.asarray([0, 30, 30, 31, 200, T], jnp.int32) if packed else None
    inp = make_inputs(3, 1, T, 2, 1, 2, 64, 64, jnp.bfloat16, gate="normal",
                      N=5 if packed else None)
    kw = dict(initial_state=inp.initial_state, output_final_state=True, cu_seqlens=cu,
              use_qk_l2norm=True)
    # under jax.jit (eagerly: op-by-op dispatch, most of the ~45 s), traced inside the
    # emulation; a fresh function per call, so neither reuses the other's trace
    with emulated_kernels():
        o, s = jax.jit(lambda *a: OP(*a, backend="cutedsl", intra_cp=4, **kw))(*inp[:5])
    o2, s2 = jax.jit(lambda *a: OP(*a, backend="xla", **kw))(*inp[:5])
    assert rel_max(o, o2) < 2e-2 and rel_max(s, s2) < 2e-2


def test_forward_only_split_keeps_no_checkpoints(monkeypatch):
    """A split call that nothing differentiates runs the driver's primal: its kernel walks
    write no chunk-state checkpoints (ckpt = 0) and its operands come from the
    token-major kernel; its outputs still equal the differentiated call's forward and the
    float64 reference, packed with empty and length-1 sequences. Under jax.grad the same
    call keeps its checkpoints (on the walk with the readout; the summary walk before it
    keeps none)."""
    from gdp_jax.kernels import emulate
    T = 256
    cu = jnp.asarray([0, 30, 30, 31, 200, T], jnp.int32)
    inp = make_inputs(5, 1, T, 2, 1, 2, 64, 64, jnp.bfloat16, gate="strong", N=5)
    kw = dict(initial_state=inp.initial_state, output_final_state=True, cu_seqlens=cu,
              use_qk_l2norm=True, backend="cutedsl", intra_cp=4)
    ckpts, prep = [], []
    # the emulations recorded (emulated_kernels installs what emulate holds on entry)
    walk, tokens = emulate.chunk_kernel_call, emulate.chunk_prep_tokens_call
    monkeypatch.setattr(emulate, "chunk_kernel_call",
                        lambda *a, **k: ckpts.append((k["ckpt"], k.get("readout", True)))
                        or walk(*a, **k))
    monkeypatch.setattr(emulate, "chunk_prep_tokens_call",
                        lambda *a, **k: prep.append("tokens") or tokens(*a, **k))
    with emulated_kernels():
        o, s = jax.jit(lambda *a: OP(*a, **kw))(*inp[:5])
        assert ckpts and {c for c, _ in ckpts} == {0} and prep
        ckpts.clear()
        (o2, s2), _ = jax.jit(lambda *a: jax.vjp(lambda *x: OP(*x, **kw), *a))(*inp[:5])
        assert ckpts and min(c for c, readout in ckpts if readout) > 0
        assert all(c == 0 for c, readout in ckpts if not readout)
    f64 = lambda x: x.astype(jnp.float64)
    ref_o, ref_s = REF(*map(f64, inp[:5]), initial_state=f64(inp.initial_state),
                       output_final_state=True, cu_seqlens=cu, use_qk_l2norm=True)
    assert rel_max(o, o2) < 1e-2 and rel_max(s, s2) < 1e-2
    assert rel_max(o, ref_o) < 2e-2 and rel_max(s, ref_s) < 2e-2


@pytest.mark.parametrize("packed", [False, True])
def test_emulated_cutedsl_cp_pass(monkeypatch, packed):
    """The cutedsl CP pass, emulated kernels under the split: prepare's V + K walks write
    no output rows, checkpoints or dS_end (readout=False, ckpt=0 / write_ds=False) and
    apply walks the V columns with them. Outputs, final states and every gradient agree
    with the xla backend (bfloat16 inputs, packed with empty and length-1 sequences,
    recompute_chunk_num=1)."""
    from gdp_jax.kernels import emulate
    T = 256
    cu = jnp.asarray([0, 30, 30, 31, 200, T], jnp.int32) if packed else None
    inp = make_inputs(11, 1, T, 2, 1, 2, 64, 64, jnp.bfloat16, gate="strong",
                      N=5 if packed else None)
    kw = dict(initial_state=inp.initial_state, output_final_state=True, cu_seqlens=cu,
              use_qk_l2norm=True, recompute_chunk_num=1)
    wo, ws = default_weights(inp, cu, None)
    f32 = lambda x: x.astype(jnp.float32)

    def run(backend, **more):        # a fresh function per call: no trace is reused
        def loss(q, k, v, g, beta):
            o, s = OP(q, k, v, g, beta, backend=backend, **kw, **more)
            return jnp.sum(f32(o) * wo) + jnp.sum(f32(s) * ws), (o, s)
        (_, (o, s)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4),
                                                        has_aux=True))(*inp[:5])
        return (o, s) + tuple(grads)

    calls = []
    fwd, rev = emulate.chunk_kernel_call, emulate.dh_kernel_call
    monkeypatch.setattr(emulate, "chunk_kernel_call", lambda *a, **k: calls.append(
        ("fwd", a[9].shape[-1], k.get("readout", True), k["ckpt"])) or fwd(*a, **k))
    monkeypatch.setattr(emulate, "dh_kernel_call", lambda *a, **k: calls.append(
        ("rev", a[9].shape[-1], k.get("write_ds", True))) or rev(*a, **k))
    with emulated_kernels():
        got = run("cutedsl", intra_cp=4)
    assert {c for c in calls if c[1] == 128} == {("fwd", 128, False, 0), ("rev", 128, False)}
    assert {c for c in calls if c[1] == 64} == {("fwd", 64, True, 2), ("rev", 64, True)}
    ref = run("xla")
    names = ("o", "final", "dq", "dk", "dv", "dg", "dbeta")
    for name, a, c in zip(names, got, ref):
        assert rel_max(a, c) < 2e-2, name


def test_under_vmap():
    inp = make_inputs(4, 2, 128, 1, 1, 1, 8, 8, jnp.float64)
    # under jax.jit (eagerly: op-by-op dispatch of the batched op)
    vm = jax.jit(jax.vmap(lambda q, k, v, g, b: OP(q[None], k[None], v[None], g[None],
                                                   b[None], intra_cp=2)[0]))(*inp[:5])
    assert rel_max(vm, jax.jit(OP)(*inp[:5])) < 1e-12


def _spec(B, T, HV):
    z = jnp.zeros
    return check_inputs(z((B, T, 1, 64)), z((B, T, 1, 1, 64)), z((B, T, 1, HV, 64)), None,
                        z((B, T, 1, HV)))


def test_auto_segments():
    # _spec's V = 64: B x HV x 4 CTAs of 16 columns; split where they are <= 132, into
    # more than 264
    assert split.num_segments(_spec(1, 65536, 16), "auto") == 8     # 64 CTAs -> 512
    assert split.num_segments(_spec(1, 65536, 33), "auto") == 4     # 132 -> 528
    assert split.num_segments(_spec(1, 65536, 34), "auto") == 1     # 136: every SM busy
    assert split.num_segments(_spec(8, 4096, 16), "auto") == 1      # 512 CTAs
    assert split.num_segments(_spec(1, 262144, 1), "auto") == 64    # 4 CTAs -> 256
    assert split.num_segments(_spec(1, 4096, 2), "auto") == 1       # segments too short
    assert split.num_segments(_spec(1, 8193, 1), "auto") == 1       # 2 does not divide T
    assert split.num_segments(_spec(1, 12288, 1), "auto") == 2      # 4 segments too short
    assert split.num_segments(_spec(1, 8192, 1), None) == 1
    assert split.num_segments(_spec(1, 8192, 1), 4) == 4
    assert split.num_segments(_spec(1, 8192, 1), np.int64(2)) == 2


def test_auto_splits_only_a_call_nothing_differentiates(monkeypatch):
    """intra_cp="auto": the forward alone runs split (the same bits as intra_cp=S);
    under differentiation the unsplit op's forward and backward run (the same bits as
    intra_cp=None: o, final state, every gradient), under jax.jit and jax.vmap too."""
    monkeypatch.setattr(split, "MIN_SEGMENT_TOKENS", 64)
    T = 256
    cu = jnp.asarray([0, 0, 1, 150, 151, T], jnp.int32)
    inp = make_inputs(2, 1, T, 2, 1, 2, 8, 8, jnp.float64, gate="strong", N=5)
    assert split.num_segments(_spec(1, T, 2), "auto") == 4
    calls = []
    real = split.split_gated_delta_product
    monkeypatch.setattr(split, "split_gated_delta_product",
                        lambda *a, **k: calls.append(k["segments"]) or real(*a, **k))
    kw = dict(initial_state=inp.initial_state, output_final_state=True, cu_seqlens=cu)
    o, s = jax.jit(lambda *a: OP(*a, intra_cp="auto", **kw))(*inp[:5])
    o4, s4 = jax.jit(lambda *a: OP(*a, intra_cp=4, **kw))(*inp[:5])
    assert calls == [4, 4]
    assert np.array_equal(o, o4) and np.array_equal(s, s4)
    calls.clear()
    w = default_weights(inp, cu, None)
    got = loss_and_grads(OP, inp, w, cu_seqlens=cu, intra_cp="auto")
    plain = loss_and_grads(OP, inp, w, cu_seqlens=cu)
    assert calls == []
    assert np.array_equal(got[0], plain[0]) and np.array_equal(got[1], plain[1])
    assert set(got[3]) >= {"q", "k", "v", "g", "beta", "initial_state"}
    for name in got[3]:
        assert np.array_equal(got[3][name], plain[3][name]), name
    ref = loss_and_grads(REF, inp, w, cu_seqlens=cu)
    assert rel_max(o, ref[0]) < 1e-10 and rel_max(got[3]["q"], ref[3]["q"]) < 1e-10
    # a user's vmap of the differentiated call: each problem as its own call
    two = make_inputs(4, 2, T, 1, 1, 1, 8, 8, jnp.float64)
    f = lambda q, k, v, g, b, intra: jnp.sum(OP(q[None], k[None], v[None], g[None], b[None],
                                                intra_cp=intra) ** 2)
    gv = jax.jit(jax.vmap(jax.grad(lambda *a: f(*a, "auto"))))(*two[:5])
    gp = jax.jit(jax.vmap(jax.grad(lambda *a: f(*a, None))))(*two[:5])
    assert np.array_equal(gv, gp)


@pytest.mark.parametrize("bad", [0, -2, 2.0, True, "yes"])
def test_bad_intra_cp(bad):
    with pytest.raises(ValueError, match="intra_cp"):
        split.num_segments(_spec(1, 128, 1), bad)


def test_intra_cp_must_divide_T():
    inp = make_inputs(5, 1, 100, 1, 1, 1, 8, 8, jnp.float64)
    with pytest.raises(ValueError, match=r"intra_cp=3 does not divide T=100"):
        OP(*inp[:5], intra_cp=3)


def test_one_token_checks_intra_cp_then_runs_unsplit():
    """T = 1 (the decoding path): a bad value is still an error; a valid S that cannot
    divide T = 1 is not (a layer configured with intra_cp keeps decoding)."""
    inp = make_inputs(6, 2, 1, 2, 1, 2, 8, 8, jnp.float64)
    with pytest.raises(ValueError, match="intra_cp"):
        OP(*inp[:5], intra_cp="yes")
    np.testing.assert_array_equal(np.asarray(OP(*inp[:5], intra_cp=4)),
                                  np.asarray(OP(*inp[:5])))


def test_cp_ranks_split_on_emulated_kernels():
    """cp_axis + intra_cp on the cutedsl engine (emulated kernels): the two vmaps carry its
    contexts (the forward's operands, the backward's work) and the P x S summaries fold
    as one CP; loss and gradients (q, k, v, initial state) equal the plain CP op's to
    bfloat16 rounding, packed with an empty sequence."""
    from jax.sharding import Mesh, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()[:2]), ("cp",))
    inp = make_inputs(3, 1, 256, 2, 1, 2, 64, 64, jnp.bfloat16, N=4, gate="normal")
    cu = jnp.asarray([0, 30, 30, 200, 256], jnp.int32)

    def loss(q, k, v, g, b, h0, **kw):
        o, s = jax.shard_map(lambda q, k, v, g, b, h0, c: OP(
            q, k, v, g, b, initial_state=h0, cu_seqlens=c, cp_axis="cp",
            output_final_state=True, backend="cutedsl", **kw),
            mesh=mesh, in_specs=(P(None, "cp"),) * 5 + (P(), P()),
            out_specs=(P(None, "cp"), P()))(q, k, v, g, b, h0, cu)
        return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(s ** 2)

    args = (*inp[:5], inp.initial_state)
    with emulated_kernels():
        split_ = jax.jit(jax.value_and_grad(lambda *a: loss(*a, intra_cp=2),
                                            argnums=(0, 1, 2, 5)))(*args)
        plain = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 5)))(*args)
    assert rel_max(split_[0], plain[0]) < 1e-4
    for a, b in zip(split_[1], plain[1]):
        assert rel_max(a, b) < 1e-2
