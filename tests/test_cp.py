"""Context parallelism (``cp_axis``) on 1, 2, 4 and 8 simulated host devices.

The CP op runs inside ``jax.shard_map`` with every [B, T, ...] input split along T and
``initial_state`` / the GLOBAL ``cu_seqlens`` replicated; it must equal the single-device
op and the token-by-token reference: outputs, final states and the gradients of every
input. Also: bf16 parity per rank, a model's gradient with and without CP, the protocol's
pieces (rank metadata, folds, summaries, saved context), the collective count of the
jaxpr, and the CP-specific errors.

Compilation dominates on CPU: each jitted function is built once per static
configuration (``functools.lru_cache``) and ``cu_seqlens`` is a traced argument, so
several packings of one shape share one compilation.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

import gdp_jax
from gdp_jax import cp as gcp
from gdp_jax.testing import make_inputs, random_lengths, rel_max, rel_rms

OP = gdp_jax.gated_delta_product
REF = gdp_jax.gated_delta_product_reference
AXIS = "cp"
F64_TOL = 1e-10
SHARDED = ("q", "k", "v", "g", "beta")        # split along T (axis 1)
ALL_NAMES = ("q", "k", "v", "g", "beta", "initial_state")


@functools.lru_cache(maxsize=None)
def _mesh(n_dev: int) -> Mesh:
    devs = jax.devices()
    assert len(devs) >= n_dev, f"need {n_dev} devices, have {len(devs)} (see conftest.py)"
    return Mesh(np.array(devs[:n_dev]), (AXIS,))


def _spec(name):
    return P(None, AXIS) if name in SHARDED else P()


def _call_op(fn, args: dict, cu, out_final: bool, kw: tuple, **extra):
    """fn(q, k, v, g, beta, ...) with the optional inputs taken from ``args`` if present."""
    res = fn(args["q"], args["k"], args["v"], args.get("g"), args["beta"],
             initial_state=args.get("initial_state"), output_final_state=out_final,
             cu_seqlens=cu, **dict(kw), **extra)
    return res if out_final else (res, None)


def _cp_apply(n_dev: int, args: dict, cu, out_final: bool, kw: tuple):
    """The CP op on ``n_dev`` devices: args split along T, cu and initial_state replicated."""
    def local(a, c):
        return _call_op(OP, a, c, out_final, kw, cp_axis=AXIS)

    in_specs = ({n: _spec(n) for n in args}, P())
    out_specs = (P(None, AXIS), P() if out_final else None)
    if cu is None:
        f = jax.shard_map(lambda a: local(a, None), mesh=_mesh(n_dev),
                          in_specs=in_specs[:1], out_specs=out_specs)
        return f(args)
    f = jax.shard_map(local, mesh=_mesh(n_dev), in_specs=in_specs, out_specs=out_specs)
    return f(args, cu)


@functools.lru_cache(maxsize=None)
def _value_and_grad(kind: str, n_dev: int, out_final: bool, kw: tuple):
    """jit(value_and_grad) of L = sum(o * wo) [+ sum(final * ws)] for one configuration.

    kind: "cp" (n_dev devices), "op" (single device) or "ref" (token-by-token reference).
    Differentiates every array in ``diff``; ``cu`` (or None) is a traced argument.
    """
    def loss(diff, cu, wo, ws):
        if kind == "cp":
            o, s = _cp_apply(n_dev, diff, cu, out_final, kw)
        else:
            fn = OP if kind == "op" else REF
            o, s = _call_op(fn, diff, cu, out_final, kw)
        val = jnp.sum(o.astype(wo.dtype) * wo)
        if out_final:
            val = val + jnp.sum(s.astype(ws.dtype) * ws)
        return val, (o, s)

    return jax.jit(jax.value_and_grad(loss, has_aux=True))


def _run(kind, args: dict, cu, weights, out_final, n_dev=1, kw=()):
    """(o, final or None, grads dict) as numpy arrays."""
    vg = _value_and_grad(kind, n_dev, out_final, tuple(kw))
    cuj = None if cu is None else jnp.asarray(np.asarray(cu, np.int32))
    (_, (o, s)), grads = vg(args, cuj, *weights)
    to_np = lambda x: None if x is None else np.asarray(x)
    return to_np(o), to_np(s), {n: np.asarray(g) for n, g in grads.items()}


def _args(inp) -> dict:
    return {n: getattr(inp, n) for n in ALL_NAMES if getattr(inp, n) is not None}


def _weights(seed, o_shape, s_shape, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal(o_shape).astype(dtype)),
            jnp.asarray(rng.standard_normal(s_shape).astype(dtype)))


# --- float64: CP == single-device op == reference ----------------------------------------

class Case(NamedTuple):
    n_dev: int
    B: int
    T: int                          # global length
    n: int
    H: int
    HV: int
    K: int
    V: int
    gate: str                       # "none" | "normal" | "strong"
    h0: bool                        # pass initial_state
    final: bool                     # output_final_state
    cus: Optional[tuple] = None     # packed layouts (GLOBAL offsets), all with the same N
    kw: tuple = ()                  # static op kwargs (use_qk_l2norm, scale)
    cp_kw: tuple = ()               # static kwargs of the CP call alone (intra_cp)


# Hand-made packings of T = 24. With 2, 4 and 8 ranks (6, 3 tokens each when 4, 8) the
# sequence [0, 7) crosses 1-2 boundaries (spans ranks 0-2 on 8), [7, 7) is empty, [7, 8)
# has length 1, [8, 12) ends exactly on a rank boundary, [12, 13) has length 1 and starts
# exactly on one, [13, 24) spans up to 4 ranks. The second has empty sequences first/last.
CU24_A = (0, 7, 7, 8, 12, 13, 24)
CU24_B = (0, 0, 3, 11, 12, 23, 24)


def _random_cu(seed, T, N):
    return tuple(int(c) for c in random_lengths(np.random.default_rng(seed), T, N))


CASES = {
    # batched rows (every row spans all ranks): GVA, K != V, n = 2, initial and final states
    **{f"batched-P{p}": Case(p, 2, 24, 2, 1, 2, 4, 6, "normal", True, True) for p in (1, 2, 4, 8)},
    # packed sequences crossing / spanning / starting on rank boundaries, empty, length 1;
    # n = 3, two key heads, K != V (plus random packings with empty sequences)
    **{f"packed-P{p}": Case(p, 1, 24, 3, 2, 2, 5, 3, "normal", True, True,
                            (CU24_A, CU24_B, _random_cu(p, 24, 6)))
       for p in (1, 2, 4, 8)},
    # n = 1 (Gated DeltaNet), no gate, no initial state; local length 5 (not a multiple of 64)
    "packed-n1-nogate-noh0-P4": Case(4, 1, 20, 1, 1, 1, 4, 4, "none", False, True,
                                     ((0, 0, 3, 11, 12, 20, 20), _random_cu(11, 20, 6))),
    # GVA 2:4, no gate, initial state but no final state; a sequence spans ranks 1-4 of 8
    "packed-gva-nofinal-P8": Case(8, 1, 40, 2, 2, 4, 3, 5, "none", True, False,
                                  ((0, 5, 6, 23, 40), (0, 17, 17, 39, 40)),
                                  (("use_qk_l2norm", True),)),
    # several chunks per rank: 80 tokens (n = 1) per rank, no states at all
    "batched-long-P2": Case(2, 2, 160, 1, 1, 1, 8, 8, "normal", False, False),
    # several chunks per rank in a packing: 50 tokens x n = 2 per rank, custom scale
    "packed-long-P2": Case(2, 1, 100, 2, 1, 2, 4, 4, "normal", True, True,
                           ((0, 30, 75, 76, 100), (0, 50, 50, 51, 100)),
                           (("scale", 0.37),)),
    # strong gates (exact zeros, -1e4 wipes), n = 3, final state without initial state
    "batched-strong-P4": Case(4, 2, 12, 3, 1, 1, 3, 5, "strong", False, True),
    # CP ranks that split their shard too (intra_cp): the P x S segments fold as one CP;
    # sequences cross segment and rank borders, empty and one-token ones included
    "packed-P2-split2": Case(2, 1, 24, 3, 2, 2, 5, 3, "normal", True, True,
                             (CU24_A, CU24_B), cp_kw=(("intra_cp", 2),)),
    "batched-P4-split3": Case(4, 2, 24, 2, 1, 2, 4, 6, "strong", True, True,
                              cp_kw=(("intra_cp", 3),)),
}


def _check_f64_case(case: Case, seed: int, cu):
    N = case.B if cu is None else len(cu) - 1
    inp = make_inputs(seed, case.B, case.T, case.n, case.H, case.HV, case.K, case.V,
                      jnp.float64, N=N, gate=case.gate, initial_state=case.h0)
    args = _args(inp)
    w = _weights(seed + 1, (case.B, case.T, case.HV, case.V), (N, case.HV, case.K, case.V))
    kw = case.kw
    o, s, dg = _run("cp", args, cu, w, case.final, case.n_dev, kw + case.cp_kw)
    o1, s1, dg1 = _run("op", args, cu, w, case.final, 1, kw)
    o_r, s_r, dg_r = _run("ref", args, cu, w, case.final, 1, kw)

    assert o.shape == o_r.shape == (case.B, case.T, case.HV, case.V)
    assert o.dtype == np.float64
    assert set(dg) == set(dg_r) == set(args)
    errs = {}
    for tag, got in (("op", (o1, s1, dg1)), ("cp", (o, s, dg))):
        errs[f"{tag}:o"] = rel_max(got[0], o_r)
        if case.final:
            assert got[1].shape == (N, case.HV, case.K, case.V) and got[1].dtype == np.float64
            errs[f"{tag}:final"] = rel_max(got[1], s_r)
        for name in dg:
            assert got[2][name].shape == args[name].shape, name
            assert got[2][name].dtype == args[name].dtype, name
            errs[f"{tag}:d{name}"] = rel_max(got[2][name], dg_r[name])
    # CP against the single-device op directly too (both chunkwise).
    errs["cp-op:o"] = rel_max(o, o1)
    for name in dg:
        errs[f"cp-op:d{name}"] = rel_max(dg[name], dg1[name])
    bad = {k: v for k, v in errs.items() if not v <= F64_TOL}
    assert not bad, f"cu={cu}: errors over {F64_TOL}: {bad}"
    # Not vacuous: the reference values are nonzero.
    assert np.abs(o_r).max() > 0
    for name in ("q", "k", "v", "beta"):
        assert np.abs(dg_r[name]).max() > 0, name


@pytest.mark.parametrize("name", list(CASES))
def test_cp_matches_single_device_and_reference_f64(name):
    case = CASES[name]
    for i, cu in enumerate(case.cus or (None,)):
        _check_f64_case(case, 1000 + 10 * i, cu)


# --- bf16: CP vs single device within FLA's tolerances, per rank -------------------------

def test_cp_bf16_matches_single_device_per_rank():
    n_dev, T, n, H, HV, K, V = 4, 128, 2, 1, 2, 8, 8
    cu = (0, 20, 70, 71, 96, 128)              # crossing, spanning, length 1, on a boundary
    N = len(cu) - 1
    inp = make_inputs(5, 1, T, n, H, HV, K, V, jnp.bfloat16, N=N, gate="normal")
    assert inp.q.dtype == jnp.bfloat16 and inp.g.dtype == jnp.float32
    args = _args(inp)
    w = _weights(6, (1, T, HV, V), (N, HV, K, V), np.float32)
    o, s, dg = _run("cp", args, cu, w, True, n_dev)
    o1, s1, dg1 = _run("op", args, cu, w, True, 1)
    assert o.dtype == jnp.bfloat16 and s.dtype == np.float32
    # FLA's tolerances (relative RMS): o 5e-3, gradients 8e-3, dbeta / dg 2e-2.
    tol = {"o": 5e-3, "q": 8e-3, "k": 8e-3, "v": 8e-3, "initial_state": 8e-3,
           "g": 2e-2, "beta": 2e-2}
    Tl = T // n_dev
    errs = {"final": rel_rms(s, s1), "dinitial_state": rel_rms(dg["initial_state"],
                                                                 dg1["initial_state"])}
    for r in range(n_dev):
        sl = slice(r * Tl, (r + 1) * Tl)
        errs[f"o@{r}"] = rel_rms(o[:, sl], o1[:, sl])
        for name in SHARDED:
            a, b = dg[name][:, sl], dg1[name][:, sl]
            assert a.dtype == args[name].dtype
            assert np.abs(b.astype(np.float64)).max() > 0, (name, r)
            errs[f"d{name}@{r}"] = rel_rms(a, b)
    bad = {}
    for key, e in errs.items():
        base = key.split("@")[0]                   # o, final, dq, dk, ...
        lim = tol["o"] if base in ("o", "final") else tol[base[1:]]
        if not e <= lim:
            bad[key] = (e, lim)
    assert not bad, f"bf16 CP vs single device over FLA tolerance: {bad} (all: {errs})"


# --- a model's gradient with and without CP ---------------------------------------------

def _model_loss(params, x, cu, *, dims, cp_axis=None):
    """Linear projections -> GDP -> a nonlinear loss. The same code with and without CP."""
    n, H, HV, K, V = dims
    B, T, _ = x.shape
    q = (x @ params["wq"]).reshape(B, T, H, K)
    k = (x @ params["wk"]).reshape(B, T, n, H, K)
    v = (x @ params["wv"]).reshape(B, T, n, HV, V)
    beta = 2.0 * jax.nn.sigmoid(x @ params["wb"]).reshape(B, T, n, HV)
    g = -jax.nn.softplus(x @ params["wa"] + 0.5)
    o = OP(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm=True, cp_axis=cp_axis)
    loss = jnp.sum(jnp.tanh(o) * x[..., :1, None])
    return lax.psum(loss, cp_axis) if cp_axis is not None else loss


@pytest.mark.parametrize("packed", [False, True], ids=["batched", "packed"])
def test_model_grad_with_cp_equals_without(packed):
    n_dev, T, D = 4, 24, 6
    dims = (n, H, HV, K, V) = (2, 1, 2, 4, 3)
    B = 1 if packed else 2
    cu = jnp.asarray(np.array(CU24_A, np.int32)) if packed else None
    rng = np.random.default_rng(3)
    shapes = {"wq": H * K, "wk": n * H * K, "wv": n * HV * V, "wb": n * HV, "wa": HV}
    params = {k_: jnp.asarray(rng.standard_normal((D, m)) / np.sqrt(D))
              for k_, m in shapes.items()}
    x = jnp.asarray(rng.standard_normal((B, T, D)))

    plain = functools.partial(_model_loss, dims=dims)
    sharded = jax.shard_map(functools.partial(_model_loss, dims=dims, cp_axis=AXIS),
                            mesh=_mesh(n_dev), in_specs=(P(), P(None, AXIS), P()),
                            out_specs=P())
    if cu is None:
        plain_f = lambda p, x_: plain(p, x_, None)
        cp_f = jax.shard_map(
            lambda p, x_: _model_loss(p, x_, None, dims=dims, cp_axis=AXIS),
            mesh=_mesh(n_dev), in_specs=(P(), P(None, AXIS)), out_specs=P())
    else:
        plain_f = lambda p, x_: plain(p, x_, cu)
        cp_f = lambda p, x_: sharded(p, x_, cu)
    l0, (gp0, gx0) = jax.jit(jax.value_and_grad(plain_f, argnums=(0, 1)))(params, x)
    l1, (gp1, gx1) = jax.jit(jax.value_and_grad(cp_f, argnums=(0, 1)))(params, x)
    errs = {"loss": rel_max(l1, l0), "dx": rel_max(gx1, gx0)}
    errs.update({f"d{k_}": rel_max(gp1[k_], gp0[k_]) for k_ in params})
    bad = {k_: e for k_, e in errs.items() if not e <= F64_TOL}
    assert not bad, f"model grads with CP differ: {bad}"
    assert all(np.abs(np.asarray(gp0[k_])).max() > 0 for k_ in params)


# --- the protocol's pieces ---------------------------------------------------------------

def _md(cu, rank, P_, Tl, batch=1):
    m = gcp.rank_metadata(None if cu is None else np.array(cu, np.int32), rank, P_, Tl, batch)
    return {f: (None if getattr(m, f) is None else np.asarray(getattr(m, f)).tolist())
            for f in m._fields}


T_, F_ = True, False
# lengths [5, 4, 7] on 4 ranks of 4 tokens (Megatron's worked example), hand-computed
EXAMPLE_5_4_7 = [
    # rank: (a, f-1, cu_local, first, last, cin, cout, fwd_mask, bwd_mask, owns_start, owns_end)
    (0, 1, [0, 4, 4, 4], 0, 0, F_, T_, [F_, F_, F_, F_], [F_, T_, F_, F_], [T_, F_, F_],
     [F_, F_, F_]),
    (0, 2, [0, 1, 4, 4], 0, 1, T_, T_, [T_, F_, F_, F_], [F_, F_, T_, F_], [F_, T_, F_],
     [T_, F_, F_]),
    (1, 3, [0, 0, 1, 4], 1, 2, T_, T_, [F_, T_, F_, F_], [F_, F_, F_, T_], [F_, F_, T_],
     [F_, T_, F_]),
    (2, 3, [0, 0, 0, 4], 2, 2, T_, F_, [F_, F_, T_, F_], [F_, F_, F_, F_], [F_, F_, F_],
     [F_, F_, T_]),
]


@pytest.mark.parametrize("rank", range(4))
def test_rank_metadata_megatron_example(rank):
    a, f1, cu_local, first, last, cin, cout, fm, bm, os_, oe = EXAMPLE_5_4_7[rank]
    m = _md([0, 5, 9, 16], rank, 4, 4)
    assert (m["preceding_rank_start"], m["following_rank_stop"] - 1) == (a, f1)
    assert m["cu_local"] == cu_local
    assert (m["first_seq"], m["last_seq"]) == ([first], [last])
    assert (m["continues_in"], m["continues_out"]) == (cin, cout)
    assert (m["fwd_mask"], m["bwd_mask"]) == (fm, bm)
    assert (m["owns_start"], m["owns_end"]) == (os_, oe)


def test_rank_metadata_empty_sequences_and_exact_boundaries():
    # 2 ranks of 4: [] [0,4) [] [4,8): sequences end / start exactly on the boundary.
    # Empty sequences are "owned" (initial-state gradient, final state) by rank 0.
    cu = [0, 0, 4, 4, 8]
    m0, m1 = _md(cu, 0, 2, 4), _md(cu, 1, 2, 4)
    assert m0["cu_local"] == [0, 0, 4, 4, 4] and m1["cu_local"] == [0, 0, 0, 0, 4]
    assert (m0["first_seq"], m0["last_seq"], m1["first_seq"], m1["last_seq"]) == \
        ([1], [1], [3], [3])
    assert (m0["continues_in"], m0["continues_out"]) == (F_, F_)
    assert (m1["continues_in"], m1["continues_out"]) == (F_, F_)
    assert (m0["preceding_rank_start"], m0["following_rank_stop"]) == (0, 1)
    assert (m1["preceding_rank_start"], m1["following_rank_stop"]) == (1, 2)
    assert m0["fwd_mask"] == m0["bwd_mask"] == m1["fwd_mask"] == m1["bwd_mask"] == [F_, F_]
    assert m0["owns_start"] == [T_, T_, T_, F_] and m1["owns_start"] == [F_, F_, F_, T_]
    assert m0["owns_end"] == [T_, T_, T_, F_] and m1["owns_end"] == [F_, F_, F_, T_]
    # One sequence over 3 ranks of 2 tokens: the middle rank folds rank 0 forward and
    # rank 2 backward.
    m = _md([0, 6], 1, 3, 2)
    assert (m["preceding_rank_start"], m["following_rank_stop"]) == (0, 3)
    assert (m["fwd_mask"], m["bwd_mask"]) == ([T_, F_, F_], [F_, F_, T_])
    assert (m["continues_in"], m["continues_out"]) == (T_, T_)


@pytest.mark.parametrize("rank", range(4))
def test_rank_metadata_batched(rank):
    m = _md(None, rank, 4, 8, batch=2)
    assert m["cu_local"] is None
    assert m["first_seq"] == m["last_seq"] == [0, 1]
    assert (m["continues_in"], m["continues_out"]) == (rank > 0, rank < 3)
    assert (m["preceding_rank_start"], m["following_rank_stop"]) == (0, 4)
    assert m["fwd_mask"] == [j < rank for j in range(4)]
    assert m["bwd_mask"] == [j > rank for j in range(4)]
    assert m["owns_start"] == [rank == 0] * 2 and m["owns_end"] == [rank == 3] * 2


def _random_summaries(seed, P_, F, HV, K, V, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((P_, F, HV, K, V + K)).astype(dtype)


@pytest.mark.parametrize("mask", [[1, 1, 1, 1], [0, 1, 1, 0], [0, 0, 0, 0], [1, 0, 1, 0]])
def test_fold_forward_matches_numpy(mask):
    P_, F, HV, K, V = 4, 2, 3, 4, 5
    packed = _random_summaries(1, P_, F, HV, K, V)
    start = np.random.default_rng(2).standard_normal((F, HV, K, V))
    got = gcp.fold_forward(gcp.SummarySlice(jnp.asarray(packed),
                                            jnp.asarray(np.array(mask, bool))),
                           jnp.asarray(start))
    S = start.copy()
    for j in range(P_):                                       # causal order
        if mask[j]:
            E, M = packed[j, ..., :V], packed[j, ..., V:]
            S = M @ S + E
    assert got.shape == (F, HV, K, V) and got.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(got), S, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mask", [[1, 1, 1, 1], [0, 1, 1, 0], [0, 0, 0, 0], [0, 1, 0, 1]])
def test_fold_backward_matches_numpy(mask):
    P_, F, HV, K, V = 4, 1, 2, 3, 4
    packed = _random_summaries(3, P_, F, HV, K, V)
    got = gcp.fold_backward(gcp.SummarySlice(jnp.asarray(packed),
                                             jnp.asarray(np.array(mask, bool))), V)
    dS = np.zeros((F, HV, K, V))
    for j in reversed(range(P_)):                             # farthest rank first
        if mask[j]:
            gamma, Mt = packed[j, ..., :V], packed[j, ..., V:]
            dS = Mt @ dS + gamma
    assert got.shape == (F, HV, K, V) and got.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(got), dS, rtol=1e-12, atol=1e-12)


def test_fold_forward_float32_and_order_matters():
    # Non-commuting maps: the fold must apply rank 0 first. float32 summaries stay float32.
    V = 1
    M0, M1 = np.array([[0.0, 1.0], [0.0, 0.0]]), np.array([[0.0, 0.0], [1.0, 0.0]])
    E0, E1 = np.array([[1.0], [2.0]]), np.array([[0.0], [0.0]])
    packed = np.stack([np.concatenate([E0, M0], -1), np.concatenate([E1, M1], -1)])
    packed = packed[:, None, None].astype(np.float32)          # [P=2, F=1, HV=1, K=2, V+K]
    got = gcp.fold_forward(gcp.SummarySlice(jnp.asarray(packed), jnp.array([True, True])),
                           jnp.zeros((1, 1, 2, V), jnp.float32))
    assert got.dtype == jnp.float32
    # S = M1 (M0 0 + E0) + E1 = [[0], [1]]  (the other order would give [[2], [2]])
    np.testing.assert_array_equal(np.asarray(got)[0, 0], [[0.0], [1.0]])


def test_pack_unpack_summaries():
    rng = np.random.default_rng(0)
    E = jnp.asarray(rng.standard_normal((3, 4, 5)).astype(np.float32))
    M = jnp.asarray(rng.standard_normal((3, 4, 4)).astype(np.float32))
    p = gcp.pack_forward_summary(E, M)
    assert p.shape == (3, 4, 9) and p.dtype == jnp.float32
    e2, m2 = gcp.unpack_summary(p, 5)
    np.testing.assert_array_equal(np.asarray(e2), np.asarray(E))
    np.testing.assert_array_equal(np.asarray(m2), np.asarray(M))
    pb = gcp.pack_backward_summary(E.astype(jnp.bfloat16), M.astype(jnp.bfloat16))
    assert pb.dtype == jnp.float32 and pb.shape == (3, 4, 9)      # never 16-bit on the wire
    p64 = gcp.pack_forward_summary(E.astype(jnp.float64), M.astype(jnp.float64))
    assert p64.dtype == jnp.float64
    gcp.validate_summary(p, V=5, K=4)
    gcp.validate_summary(p64[None], V=5)                          # batched [B, HV, K, V+K]


def test_validate_summary_errors():
    good = jnp.zeros((2, 4, 9), jnp.float32)
    with pytest.raises(TypeError, match="dtype"):
        gcp.validate_summary(good.astype(jnp.float16), V=5)
    with pytest.raises(TypeError, match="dtype"):
        gcp.validate_summary(good.astype(jnp.bfloat16), V=5)
    with pytest.raises(TypeError, match="dtype"):
        gcp.validate_summary(good.astype(jnp.int32), V=5)
    with pytest.raises(TypeError):
        gcp.validate_summary([[1.0]], V=5)
    with pytest.raises(ValueError, match="V \\+ K"):
        gcp.validate_summary(good, V=4)
    with pytest.raises(ValueError, match="V \\+ K"):
        gcp.unpack_summary(good, 6)
    with pytest.raises(ValueError, match="K=3"):
        gcp.validate_summary(good, V=5, K=3)
    with pytest.raises(ValueError, match="shape"):
        gcp.validate_summary(jnp.zeros((4, 9), jnp.float32), V=5)
    with pytest.raises(TypeError):
        gcp.unpack_summary(good.astype(jnp.float16), 5)


def _metadata(has_gate=False, has_cu=False, has_states=False):
    return gcp.GDPSavedMetadata(scale=0.5, num_householder=2, use_qk_l2norm_in_kernel=False,
                                recompute_chunk_num=0, has_initial_states=True,
                                has_cu_seqlens=has_cu, has_gate=has_gate,
                                has_chunk_states=has_states)


def _saved_inputs(has_gate, has_cu):
    z = lambda *s: jnp.zeros(s)
    return gcp.GDPInputs(z(1, 4, 1, 8), z(1, 4, 2, 1, 8), z(1, 4, 2, 1, 8),
                         z(1, 4, 1) if has_gate else None, z(1, 4, 2, 1), z(1, 1, 8, 8),
                         jnp.array([0, 4]) if has_cu else None, jnp.array([0]),
                         jnp.array([0]), jnp.array(False), jnp.array(False))


def test_restore_saved_context_errors():
    class OtherMetadata:
        pass

    inputs = _saved_inputs(False, False)
    with pytest.raises(TypeError, match="metadata"):
        gcp.restore_saved_context(gcp.SavedContext(inputs, None, OtherMetadata()))
    with pytest.raises(TypeError, match="GDPSavedMetadata"):
        gcp.restore_saved_context(gcp.SavedContext(inputs, None, _metadata()),
                                  metadata_type=OtherMetadata)
    for has_gate, has_cu, has_states in itertools.product((False, True), repeat=3):
        md = _metadata(has_gate, has_cu, has_states)
        states = jnp.zeros((1, 1, 1, 8, 8)) if has_states else None
        good = _saved_inputs(has_gate, has_cu)
        for bad_inputs, bad_states in ((_saved_inputs(not has_gate, has_cu), states),
                                       (_saved_inputs(has_gate, not has_cu), states),
                                       (good, None if has_states else jnp.zeros(3))):
            with pytest.raises(ValueError, match="saved CP context"):
                gcp.restore_saved_context(gcp.SavedContext(bad_inputs, bad_states, md))
        inputs, md2 = gcp.restore_saved_context(gcp.SavedContext(good, states, md))
        assert md2 is md and inputs is good
        spec = md.spec(inputs)         # the backward's spec, from metadata + shapes
        assert (spec.scale, spec.n, spec.packed, spec.has_gate) == (0.5, 2, has_cu, has_gate)
    with pytest.raises(ValueError, match="num_householder"):
        dataclasses.replace(_metadata(), num_householder=3).spec(_saved_inputs(False, False))


def test_forward_only_backend():
    """``for_inference()``: the same outputs and final states as the backend itself (one
    rank, float64, the xla engine), no chunk states kept, and a SavedContext that refuses
    a backward with a ValueError; the flag is part of the backend's identity (it is a
    custom_vjp static argument)."""
    from gdp_jax._checks import check_inputs
    from gdp_jax.cp import driver
    inp = make_inputs(7, 2, 100, 2, 1, 2, 8, 6, jnp.float64, gate="strong")
    spec = check_inputs(*inp[:5], scale=None, initial_state=inp.initial_state)
    meta = driver.rank_metadata(None, 0, 1, 100, 2)
    x = gcp.GDPInputs(*inp[:5], inp.initial_state, meta.cu_local, meta.first_seq,
                      meta.last_seq, meta.continues_in, meta.continues_out)
    be = driver.backend_for(spec, "xla")
    inf = be.for_inference()
    assert inf != be and inf == be.for_inference() and hash(inf) == hash(be.for_inference())
    got = {}
    for name, b in (("full", be), ("inference", inf)):
        summary, ctx = b.cp_forward_prepare(x)
        got[name] = b.cp_forward_apply(ctx, gcp.SummarySlice(summary[None], meta.fwd_mask))
    (o, final, saved), (o2, final2, saved2) = got["full"], got["inference"]
    assert saved.chunk_states is not None and not saved.metadata.forward_only
    assert saved2.chunk_states is None and saved2.metadata.forward_only
    assert rel_max(o2, o) < 1e-14 and rel_max(final2, final) < 1e-14
    ref_o, ref_s = gdp_jax.gated_delta_product_reference(
        *inp[:5], initial_state=inp.initial_state, output_final_state=True)
    assert rel_max(o2, ref_o) < 1e-10 and rel_max(final2, ref_s) < 1e-10
    do = jnp.ones_like(o)
    be.cp_backward_prepare((do, jnp.zeros_like(final)), saved)        # runs
    with pytest.raises(ValueError, match="forward-only"):
        inf.cp_backward_prepare((do, jnp.zeros_like(final)), saved2)


def test_protocol_by_hand_with_a_bare_backend():
    """The four functions called by hand as docs/API.md lists them: a backend built
    without a spec takes the op's defaults from the inputs, and cp_backward_prepare takes
    a bare do (no final-state gradient) as well as the pair (do, dfinal); one rank,
    float64, against the op's own vjp."""
    from gdp_jax.cp import driver
    inp = make_inputs(8, 1, 70, 2, 1, 2, 8, 4, jnp.float64, gate="normal")
    meta = driver.rank_metadata(None, 0, 1, 70, 1)
    x = gcp.GDPInputs(*inp[:5], inp.initial_state, None, meta.first_seq, meta.last_seq,
                      meta.continues_in, meta.continues_out)
    be = gcp.XlaGatedDeltaProductCPBackend()
    summary, ctx = be.cp_forward_prepare(x)
    o, final, saved = be.cp_forward_apply(ctx, gcp.SummarySlice(summary[None], meta.fwd_mask))
    o1, vjp = jax.vjp(lambda *a: OP(*a[:5], initial_state=a[5]), *inp[:5], inp.initial_state)
    assert rel_max(o, o1) < 1e-12 and isinstance(saved.metadata, gcp.SavedMetadata)
    do = jax.random.normal(jax.random.PRNGKey(2), o.shape, o.dtype)
    want = vjp(do)
    for output_grad in (do, (do, jnp.zeros_like(final))):
        bsum, bctx = be.cp_backward_prepare(output_grad, saved)
        got = be.cp_backward_apply(bctx, gcp.SummarySlice(bsum[None], meta.bwd_mask))
        for a, b in zip(got, want):
            assert rel_max(a, b) < 1e-10
    with pytest.raises(ValueError, match=r"do has shape \(1, 70, 2\)"):
        be.cp_backward_prepare(do[..., 0], saved)
    with pytest.raises(TypeError, match="output_grad"):
        be.cp_backward_prepare((do,), saved)


def test_saved_metadata_is_hashable_and_frozen():
    md = _metadata()
    assert hash(md) == hash(_metadata()) and md == _metadata()
    with pytest.raises(Exception):
        md.scale = 1.0                                            # frozen
    ctx = gcp.SavedContext(_saved_inputs(True, True), jnp.zeros(3), md)
    leaves, tree = jax.tree_util.tree_flatten(ctx)
    assert len(leaves) == 12
    assert jax.tree_util.tree_unflatten(tree, leaves).metadata == md


def test_cutedsl_cp_backend_arguments():
    with pytest.raises(ValueError, match="cannot run"):            # CPU: no sm_90 GPU
        gcp.CuTeDSLGatedDeltaProductCPBackend(recompute_chunk_num=0)
    with pytest.raises(ValueError, match="cannot run"):
        gcp.CuTeDSLGatedDeltaProductCPBackend(recompute_chunk_num=64)
    for bad in (-1, 65, 2.0, True, "2", None):
        with pytest.raises(ValueError, match="recompute_chunk_num"):
            gcp.CuTeDSLGatedDeltaProductCPBackend(recompute_chunk_num=bad)


# --- one all_gather per direction --------------------------------------------------------

def _count_primitive(jaxpr, name: str) -> int:
    """Occurrences of primitive ``name`` in a (Closed)Jaxpr, through every sub-jaxpr."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == name
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    count += _count_primitive(sub, name)
    return count


@pytest.mark.parametrize("packed", [False, True], ids=["batched", "packed"])
def test_jaxpr_has_one_all_gather_per_direction(packed):
    n_dev = 4
    cu = CU24_A if packed else None
    B = 1 if packed else 2
    N = B if cu is None else len(cu) - 1
    inp = make_inputs(0, B, 24, 2, 1, 2, 4, 3, jnp.float64, N=N)
    args = _args(inp)
    cuj = None if cu is None else jnp.asarray(np.array(cu, np.int32))

    def fwd(a):
        return _cp_apply(n_dev, a, cuj, True, ())

    def loss(a):
        o, s = fwd(a)
        return jnp.sum(o * o) + jnp.sum(s)

    assert _count_primitive(jax.make_jaxpr(fwd)(args), "all_gather") == 1
    vg = jax.make_jaxpr(jax.value_and_grad(loss))(args)
    assert _count_primitive(vg, "all_gather") == 2
    # No point-to-point traffic either.
    assert _count_primitive(vg, "ppermute") == 0


# --- errors -------------------------------------------------------------------------------

def test_cp_axis_outside_shard_map():
    inp = make_inputs(0, 1, 8, 1, 1, 1, 4, 4, jnp.float64)
    with pytest.raises(ValueError, match="cp_axis"):
        OP(inp.q, inp.k, inp.v, inp.g, inp.beta, cp_axis=AXIS)
    with pytest.raises(ValueError, match="cp_axis"):                # under jit too
        jax.jit(lambda q: OP(q, inp.k, inp.v, inp.g, inp.beta, cp_axis=AXIS))(inp.q)


def test_cp_axis_not_a_mesh_axis():
    inp = make_inputs(0, 1, 8, 1, 1, 1, 4, 4, jnp.float64)
    f = jax.shard_map(lambda q, k, v, g, b: OP(q, k, v, g, b, cp_axis="nope"),
                      mesh=_mesh(2), in_specs=(P(None, AXIS),) * 5, out_specs=P(None, AXIS))
    with pytest.raises(ValueError, match="cp_axis"):
        f(inp.q, inp.k, inp.v, inp.g, inp.beta)


@pytest.mark.parametrize("cu", [(0, 3, 4), (0, 3, 9), (0, 5, 3, 8)],
                         ids=["local-offsets", "past-end", "decreasing"])
def test_cp_concrete_cu_seqlens_must_be_global(cu):
    """Concrete offsets must end at the GLOBAL length (8 = 2 ranks x 4), not the local 4."""
    inp = make_inputs(0, 1, 8, 1, 1, 1, 4, 4, jnp.float64, N=len(cu) - 1)
    cu_arr = np.array(cu, np.int32)
    f = jax.shard_map(
        lambda q, k, v, g, b: OP(q, k, v, g, b, cu_seqlens=cu_arr, cp_axis=AXIS),
        mesh=_mesh(2), in_specs=(P(None, AXIS),) * 5, out_specs=P(None, AXIS))
    with pytest.raises(ValueError, match="cu_seqlens"):
        f(inp.q, inp.k, inp.v, inp.g, inp.beta)
