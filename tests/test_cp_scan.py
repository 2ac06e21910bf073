"""The log-depth CP fold (gdp_jax.cp.fold): a segmented prefix scan over ppermute.

1. The fold algebra at 64, 256 and 1024 SIMULATED ranks (a leading axis, no devices): the
   scan with an emulated shift against the sequential all_gather fold (protocol.fold_forward
   / fold_backward with the rank masks), random float64 maps, packings with sequences
   crossing many ranks, shorter than a rank, ranks inside one sequence, empty sequences.
2. The op under shard_map on 8 CPU devices with the scan fold forced: forward, final
   states and every input's gradient equal the single-device op and the all_gather fold.
3. The choice: cost model, override, recorded fold, collectives in the jaxpr.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import gdp_jax
from gdp_jax.cp import driver, fold, protocol
from gdp_jax.testing import make_inputs, rel_max

AXIS = "cp"
F64_TOL = 1e-10


# --- 1. the algebra at scale ----------------------------------------------------------------

def _packing(rng, n_ranks, local_len):
    """GLOBAL offsets over n_ranks * local_len tokens: empty sequences, sequences shorter
    than a rank, and long ones spanning many ranks (so ranks lie inside one sequence)."""
    T = n_ranks * local_len
    lens = []
    while sum(lens) < T:
        kind = rng.integers(4)
        lens.append(0 if kind == 0 else int(rng.integers(1, local_len)) if kind == 1
                    else int(rng.integers(local_len, 4 * local_len)) if kind == 2
                    else int(rng.integers(10 * local_len, 40 * local_len)))
    cu = np.minimum(np.concatenate([[0], np.cumsum(lens)]), T)
    cu = np.concatenate([cu[cu < T], [T, T]])        # ends with an empty sequence
    return jnp.asarray(cu, jnp.int32)


@functools.lru_cache(maxsize=None)
def _algebra_check(n_ranks: int, local_len: int, batch: int):
    """jit: (cu or None, maps [P, F, HV, K, V + K], S0) -> max |scan - sequential| per
    direction and the sequential fold's magnitudes."""
    V = 2

    def run(cu, maps, S0):
        metas = jax.vmap(lambda r: driver.rank_metadata(cu, r, n_ranks, local_len, batch))(
            jnp.arange(n_ranks))
        rf, rb = fold.fold_resets(metas.continues_in, metas.continues_out,
                                  metas.first_seq, metas.last_seq)
        pos = jnp.arange(n_ranks)
        fwd = fold.exclusive_segmented_scan(maps, rf, pos, n_ranks, fold.emulated_shift)
        bwd = fold.exclusive_segmented_scan(maps[::-1], rb[::-1], pos, n_ranks,
                                            fold.emulated_shift)[::-1]
        one = lambda c, on: protocol.SummarySlice(c[None], on[None])
        got_f = jax.vmap(lambda c, on: protocol.fold_forward(one(c, on), S0))(
            fwd, metas.continues_in)
        got_b = jax.vmap(lambda c, on: protocol.fold_backward(one(c, on), V))(
            bwd, metas.continues_out)
        ref_f = jax.vmap(lambda m: protocol.fold_forward(protocol.SummarySlice(maps, m), S0))(
            metas.fwd_mask)
        ref_b = jax.vmap(lambda m: protocol.fold_backward(protocol.SummarySlice(maps, m), V))(
            metas.bwd_mask)
        err = lambda a, b: jnp.max(jnp.abs(a - b)) / jnp.maximum(1.0, jnp.max(jnp.abs(b)))
        return (err(got_f, ref_f), err(got_b, ref_b), metas.fwd_mask.sum(1).max(),
                jnp.abs(ref_b).max())

    return jax.jit(run)


@pytest.mark.parametrize("n_ranks", [64, 256, 1024])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "batched"])
def test_scan_equals_sequential_fold(n_ranks, packed):
    rng = np.random.default_rng(n_ranks + packed)
    local_len, HV, K, V = 4, 2, 3, 2
    F = 1 if packed else 2
    cu = _packing(rng, n_ranks, local_len) if packed else None
    # Maps near the identity's scale so long runs neither vanish nor blow up.
    A = np.eye(K) + 0.3 * rng.standard_normal((n_ranks, F, HV, K, K)) / np.sqrt(K)
    maps = jnp.asarray(np.concatenate(
        [rng.standard_normal((n_ranks, F, HV, K, V)), 0.95 * A / np.linalg.norm(
            A, ord=2, axis=(-2, -1), keepdims=True)], -1))
    S0 = jnp.asarray(rng.standard_normal((F, HV, K, V)))
    ef, eb, longest, scale = _algebra_check(n_ranks, local_len, F)(cu, maps, S0)
    assert float(ef) <= F64_TOL and float(eb) <= F64_TOL, (float(ef), float(eb))
    assert float(scale) > 0.1                          # not vacuous
    if packed:
        assert int(longest) >= 10, "the packing should cross many ranks"
    else:
        assert int(longest) == n_ranks - 1


def test_rounds_are_logarithmic():
    assert [fold.num_rounds(p) for p in (1, 2, 3, 4, 5, 8, 9, 1024)] == [0, 1, 2, 3, 3, 4, 4, 11]
    # The doubling covers the P - 1 positions before the last one.
    for p in range(2, 70):
        assert 1 + sum(fold.doubling_shifts(p)) >= p - 1


def test_compose_is_affine_composition():
    rng = np.random.default_rng(3)
    x, y = (jnp.asarray(rng.standard_normal((2, 3, 5))) for _ in range(2))
    X = jnp.asarray(rng.standard_normal((2, 3, 2)))
    ap = lambda m, s: m[..., 2:] @ s + m[..., :2]
    np.testing.assert_allclose(ap(fold.compose(x, y), X), ap(y, ap(x, X)), rtol=1e-12)
    np.testing.assert_array_equal(ap(fold.identity_map(x), X), X)


# --- 2. the op on 8 CPU devices with the scan fold forced -------------------------------------

SHARDED = ("q", "k", "v", "g", "beta")


@functools.lru_cache(maxsize=None)
def _grad_fn(kind: str, n_dev: int, packed: bool):
    """jit(value_and_grad) of sum(o wo) + sum(final ws): 'scan' / 'gather' CP or 'op'."""
    mesh = Mesh(np.array(jax.devices()[:n_dev]), (AXIS,))

    def call(a, cu, **kw):
        return gdp_jax.gated_delta_product(a["q"], a["k"], a["v"], a["g"], a["beta"],
                                           initial_state=a["initial_state"],
                                           output_final_state=True, cu_seqlens=cu, **kw)

    def loss(a, cu, wo, ws):
        if kind == "op":
            o, s = call(a, cu)
        else:
            local = lambda a_, c_: call(a_, c_, cp_axis=AXIS)
            spec = {n: P(None, AXIS) if n in SHARDED else P() for n in a}
            o, s = jax.shard_map(local, mesh=mesh, in_specs=(spec, P()),
                                 out_specs=(P(None, AXIS), P()))(a, cu)
        return jnp.sum(o * wo) + jnp.sum(s * ws), (o, s)

    return jax.jit(jax.value_and_grad(loss, has_aux=True))


def _run(kind, args, cu, w, monkeypatch):
    monkeypatch.setenv(fold.FOLD_ENV, kind if kind != "op" else "auto")
    (_, (o, s)), g = _grad_fn(kind, 8, cu is not None)(args, cu, *w)
    return np.asarray(o), np.asarray(s), {n: np.asarray(x) for n, x in g.items()}


@pytest.mark.parametrize("layout", ["batched", "packed"])
def test_cp_scan_equals_single_device(layout, monkeypatch):
    T, n, H, HV, K, V = 40, 2, 1, 2, 4, 3           # 5 tokens per rank (not a chunk multiple)
    if layout == "batched":
        B, cus = 2, (None,)
    else:       # crossing many ranks, empty, length 1, shorter than a rank, on boundaries
        B, cus = 1, ((0, 0, 23, 24, 26, 30, 40), (0, 1, 1, 4, 35, 40, 40))
    for i, cu in enumerate(cus):
        N = B if cu is None else len(cu) - 1
        inp = make_inputs(10 + i, B, T, n, H, HV, K, V, jnp.float64, N=N, initial_state=True)
        args = {nm: getattr(inp, nm) for nm in SHARDED + ("initial_state",)}
        rng = np.random.default_rng(i)
        w = (jnp.asarray(rng.standard_normal((B, T, HV, V))),
             jnp.asarray(rng.standard_normal((N, HV, K, V))))
        cuj = None if cu is None else jnp.asarray(cu, jnp.int32)
        o, s, g = _run("scan", args, cuj, w, monkeypatch)
        o1, s1, g1 = _run("op", args, cuj, w, monkeypatch)
        og, sg, gg = _run("gather", args, cuj, w, monkeypatch)
        errs = {"o": rel_max(o, o1), "final": rel_max(s, s1),
                **{f"d{nm}": rel_max(g[nm], g1[nm]) for nm in g},
                "o-vs-gather": rel_max(o, og),
                **{f"d{nm}-vs-gather": rel_max(g[nm], gg[nm]) for nm in g}}
        # Every rank's slice of every sharded gradient, not only the global maximum.
        for nm in SHARDED:
            for r in range(8):
                sl = (slice(None), slice(5 * r, 5 * r + 5))
                errs[f"d{nm}@rank{r}"] = rel_max(g[nm][sl], g1[nm][sl])
        bad = {k: v for k, v in errs.items() if not v <= F64_TOL}
        assert not bad, f"cu={cu}: {bad}"
        assert np.abs(g1["initial_state"]).max() > 0 and np.abs(o1).max() > 0


def test_scan_fold_collectives_and_record(monkeypatch):
    """Forced scan: only ppermutes (num_rounds per direction), no all_gather; the saved
    metadata says 'scan'; the default at 8 ranks and tiny summaries is the all_gather."""
    monkeypatch.setenv(fold.FOLD_ENV, "scan")
    inp = make_inputs(0, 1, 16, 1, 1, 1, 4, 4, jnp.float64, initial_state=True)
    args = {nm: getattr(inp, nm) for nm in SHARDED + ("initial_state",)}
    w = (jnp.ones((1, 16, 1, 4)), jnp.ones((1, 1, 4, 4)))
    text = str(jax.make_jaxpr(_grad_fn("scan", 8, False))(args, None, *w))
    assert text.count("ppermute") >= 2 * fold.num_rounds(8) and "all_gather" not in text
    monkeypatch.setenv(fold.FOLD_ENV, "auto")
    assert fold.choose_fold(8, 4 * 4 * 8 * 8) == "gather"

    seen = []       # the fold recorded in the saved context the backward receives
    real = protocol.XlaGatedDeltaProductCPBackend.cp_backward_prepare

    def spy(self, grads, saved):
        seen.append(saved.metadata.fold)
        return real(self, grads, saved)

    monkeypatch.setattr(protocol.XlaGatedDeltaProductCPBackend, "cp_backward_prepare", spy)
    monkeypatch.setenv(fold.FOLD_ENV, "scan")
    mesh = Mesh(np.array(jax.devices()[:4]), (AXIS,))
    f = jax.shard_map(lambda q, k, v, b: gdp_jax.gated_delta_product(
        q, k, v, None, b, cp_axis=AXIS), mesh=mesh, in_specs=(P(None, AXIS),) * 4,
        out_specs=P(None, AXIS))
    jax.eval_shape(jax.grad(lambda *x: f(*x).sum()), inp.q, inp.k, inp.v, inp.beta)
    assert seen == ["scan"]


def test_choose_fold_cost_model(monkeypatch):
    monkeypatch.delenv(fold.FOLD_ENV, raising=False)
    s = fold.MEASURED_SUMMARY_BYTES
    # The model reproduces the measured 2-GPU all_gather it was fitted to.
    assert abs(fold.gather_seconds(2, s) - fold.MEASURED_GATHER_S) < 1e-9
    assert fold.choose_fold(1, s) == fold.choose_fold(2, s) == "gather"
    assert fold.choose_fold(1024, s) == "scan"
    assert fold.choose_fold(1024, 64) == "gather"        # latency-bound: one round wins
    assert fold.choose_fold(1024, s, "gather") == "gather"
    monkeypatch.setenv(fold.FOLD_ENV, "scan")
    assert fold.choose_fold(2, s) == "scan"
    monkeypatch.setenv(fold.FOLD_ENV, "ring")
    with pytest.raises(ValueError, match="GDP_CP_FOLD='ring'"):
        fold.choose_fold(2, s)
    with pytest.raises(ValueError, match="fold='ring'"):
        fold.choose_fold(2, s, "ring")
