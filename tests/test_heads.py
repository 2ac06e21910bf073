"""Head groups (:mod:`gdp_jax.heads`): a call whose kernel launches overflow the 32-bit
offsets runs as G calls on groups of heads.

On CPU the kernels are emulated (:func:`gdp_jax.testing.emulated_kernels`, float64) and
their offsets limit is replaced by a small one (at most ``LIMIT_HV`` value heads a
launch), so grouping happens at test sizes; every launch is held to that limit (the
engine checks each one), so a group that were too large would fail here.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdp_jax
from gdp_jax import _checks, heads, testing
from gdp_jax.kernels.chunk_forward import ChunkForwardKernel
from gdp_jax.kernels.pipeline import CuTeDSLEngine
from gdp_jax.spec import Unsupported
from gdp_jax.testing import loss_and_grads, make_inputs, rel_max

OP = gdp_jax.gated_delta_product
LIMIT_HV = 2
TOL = 1e-12


def _small_limit(*, HV, **kw):
    if HV > LIMIT_HV:
        return Unsupported(f"{HV} heads are too many for the kernel's 32-bit offsets "
                           f"(test limit: {LIMIT_HV})")
    return None


@pytest.fixture
def small_offsets():
    # the limit is undone before the emulation, which restores the real one
    with testing.emulated_kernels(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(ChunkForwardKernel, "can_implement", staticmethod(_small_limit))
        yield


@pytest.mark.parametrize("H,HV,packed,intra_cp", [
    (4, 4, False, None),          # 2 groups of 2 heads
    (2, 4, True, None),           # GVA: 2 groups of (1 key head, 2 value heads); packed
    (3, 6, False, 2),             # 3 groups (3 is the fewest that fits), each split in 2
])
def test_groups_equal_the_whole_call(small_offsets, H, HV, packed, intra_cp):
    """o, the final states and every gradient of the grouped call equal the xla backend's
    whole call (float64) - GVA, packed sequences (an empty one), initial states, and
    intra_cp inside each group."""
    lens = [30, 0, 1, 65]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32) if packed else None
    B, T = (1, int(cu[-1])) if packed else (2, 64)
    inp = make_inputs(5, B, T, 2, H, HV, 8, 12, N=len(lens) if packed else None)
    spec = _checks.check_inputs(*inp[:5], initial_state=inp.initial_state,
                                cu_seqlens=cu, backend="cutedsl")
    assert CuTeDSLEngine.launch_limits(spec) is not None          # whole: too large
    assert CuTeDSLEngine.can_implement(spec) is None               # grouped: runs
    assert CuTeDSLEngine.head_groups(spec) == HV // LIMIT_HV
    kw = dict(use_qk_l2norm=True, intra_cp=intra_cp)
    o, s, _, g = loss_and_grads(OP, inp, cu_seqlens=cu, backend="cutedsl", **kw)
    o_x, s_x, _, g_x = loss_and_grads(OP, inp, cu_seqlens=cu, backend="xla", **kw)
    assert rel_max(o, o_x) < TOL and rel_max(s, s_x) < TOL
    assert set(g) == set(g_x)
    for name in g:
        assert rel_max(g[name], g_x[name]) < TOL, name


def test_no_group_fits_says_why(small_offsets):
    """One key head of 4 value heads is already above the (test) limit: no grouping, the
    kernels' reason is the error."""
    inp = make_inputs(6, 1, 64, 1, 1, 4, 8, 8)
    with pytest.raises(ValueError, match="32-bit offsets"):
        OP(*inp[:5], backend="cutedsl")


def test_real_limits_group_one_million_tokens():
    """With the kernels' real limits (no GPU needed): one row of T = 1M tokens, n = 2, 16
    heads of 128 overflows the 32-bit offsets whole and runs in 8 groups of 2 heads; a
    row of 262144 tokens with n = 1 runs whole; bfloat16 inputs of any size with K = 256
    cannot run at all (head dims), grouped or not."""
    def spec(T, n, H, K=128, dtype="bfloat16"):
        sd = jax.ShapeDtypeStruct
        return _checks.check_inputs(
            sd((1, T, H, K), dtype), sd((1, T, n, H, K), dtype), sd((1, T, n, H, 128), dtype),
            sd((1, T, H), jnp.float32), sd((1, T, n, H), dtype), backend="cutedsl")

    big = spec(1 << 20, 2, 16)
    assert "32-bit" in CuTeDSLEngine.launch_limits(big)
    assert CuTeDSLEngine.head_groups(big) == 8 and CuTeDSLEngine.can_implement(big) is None
    assert CuTeDSLEngine.head_groups(spec(262144, 1, 16)) == 1
    assert CuTeDSLEngine.head_groups(spec(4096, 1, 4, K=256)) is None
    assert "head dims" in CuTeDSLEngine.can_implement(spec(4096, 1, 4, K=256))


def test_groups_round_trip():
    """heads.in_groups with the identity of each group's heads gives the inputs back."""
    rng = np.random.default_rng(0)
    q, v0 = rng.standard_normal((2, 5, 6, 3)), rng.standard_normal((2, 5, 2, 6, 4))
    s0 = rng.standard_normal((2, 6, 3, 4))
    o, s = heads.in_groups(3, lambda q, k, v, g, b, h: (v[:, :, 0], h), q, q[:, :, None],
                           v0, None, v0[..., 0], s0)
    np.testing.assert_array_equal(o, v0[:, :, 0])
    np.testing.assert_array_equal(s, s0)


def test_groups_under_cp(small_offsets):
    """Head groups inside ``jax.shard_map`` CP (2 ranks, packed, GVA): every group's CP
    pass (its collectives inside the ``lax.map``) gives the single device's loss and
    gradients (float64)."""
    from jax.sharding import Mesh, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()[:2]), ("cp",))
    inp = make_inputs(7, 1, 128, 2, 2, 4, 8, 12, N=3)
    cu = jnp.asarray([0, 40, 40, 128], jnp.int32)
    wo = jnp.asarray(np.random.default_rng(1).standard_normal((1, 128, 4, 12)))

    def loss(q, k, v, g, b, h0, cp):
        def op(q, k, v, g, b, h0, c):
            return OP(q, k, v, g, b, initial_state=h0, cu_seqlens=c, output_final_state=True,
                      backend="cutedsl" if cp else "xla", cp_axis="cp" if cp else None)
        if cp:
            op = jax.shard_map(op, mesh=mesh, in_specs=(P(None, "cp"),) * 5 + (P(), P()),
                               out_specs=(P(None, "cp"), P()))
        o, s = op(q, k, v, g, b, h0, cu)
        return jnp.sum(o * wo) + jnp.sum(s ** 2)

    args = tuple(inp)
    got = jax.jit(jax.value_and_grad(lambda *a: loss(*a, True), argnums=tuple(range(6))))(*args)
    want = jax.jit(jax.value_and_grad(lambda *a: loss(*a, False),
                                      argnums=tuple(range(6))))(*args)
    assert rel_max(got[0], want[0]) < TOL
    for a, b in zip(got[1], want[1]):
        assert rel_max(a, b) < 1e-10


def test_groups_run_one_after_another():
    """The groups' temporaries are not all alive at once: XLA's temporary memory of the
    grouped fwd+bwd (4 groups, emulated kernels on CPU) is below the whole call's (at
    (1, 4096, 8, 2), K = V = 64: 198 vs 492 MB when written)."""
    S = jax.ShapeDtypeStruct
    B, T, n, H, K = 1, 4096, 2, 8, 64
    bf = jnp.bfloat16
    args = (S((B, T, H, K), bf), S((B, T, n, H, K), bf), S((B, T, n, H, K), bf),
            S((B, T, H), jnp.float32), S((B, T, n, H), bf))

    def loss(*a):
        o = OP(*a, backend="cutedsl", use_qk_l2norm=True)
        return jnp.sum(o.astype(jnp.float32))

    def temp_bytes(limit):
        def lim(*, HV, **kw):
            return Unsupported("32-bit offsets (test)") if HV > limit else None
        with testing.emulated_kernels(), pytest.MonkeyPatch.context() as mp:
            mp.setattr(ChunkForwardKernel, "can_implement", staticmethod(lim))
            grad = jax.jit(jax.grad(loss, argnums=tuple(range(5))))
            return grad.lower(*args).compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes(2) < 0.75 * temp_bytes(H)
