"""``gated_delta_product_step`` (one decoding token) on CPU, float64, against the reference
recurrence and the chunked op; the cutedsl step with its kernel emulated
(:func:`gdp_jax.kernels.emulate.step_kernel_call`); the op's T = 1 path."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdp_jax
from gdp_jax import backends, testing
from gdp_jax.testing import make_inputs, rel_max

STEP = gdp_jax.gated_delta_product_step
OP = gdp_jax.gated_delta_product
REF = gdp_jax.gated_delta_product_reference
TOL = 1e-10


@pytest.fixture
def emulated_step():
    with testing.emulated_step_kernel():
        yield


def _token(inp, t):
    """Token t of [B, T, ...] inputs in the step's layout."""
    g = None if inp.g is None else inp.g[:, t]
    return inp.q[:, t], inp.k[:, t], inp.v[:, t], g, inp.beta[:, t]


CASES = [  # n, H, HV, K, V, gate, l2norm
    (1, 1, 1, 8, 8, "normal", False),
    (2, 2, 4, 8, 6, "strong", False),      # GVA, K != V
    (3, 1, 3, 6, 10, "none", True),        # n = 3, no gate, L2 norm
    (2, 2, 2, 16, 16, "normal", True),
]


@pytest.mark.parametrize("backend", ["xla", "cutedsl"])
@pytest.mark.parametrize("n,H,HV,K,V,gate,l2", CASES)
def test_one_step_equals_reference(n, H, HV, K, V, gate, l2, backend, request):
    if backend == "cutedsl":
        request.getfixturevalue("emulated_step")
    inp = make_inputs(n + 10 * HV, 3, 1, n, H, HV, K, V, gate=gate)
    # One jit for both (CPU time: eager dispatch compiles every primitive on its own).
    (o, S), (o_r, S_r) = jax.jit(lambda inp: (
        STEP(*_token(inp, 0), inp.initial_state, use_qk_l2norm=l2, backend=backend,
             scale=0.7),
        REF(inp.q, inp.k, inp.v, inp.g, inp.beta, initial_state=inp.initial_state,
            output_final_state=True, use_qk_l2norm=l2, scale=0.7)))(inp)
    assert o.shape == (3, HV, V) and o.dtype == inp.q.dtype
    assert S.shape == inp.initial_state.shape and S.dtype == inp.initial_state.dtype
    assert rel_max(o, o_r[:, 0]) < TOL
    assert rel_max(S, S_r) < TOL


def _decode_loop(inp, S, l2, backend="xla", start=0):
    step = jax.jit(lambda *a: STEP(*a, use_qk_l2norm=l2, backend=backend))
    outs = []
    for t in range(start, inp.q.shape[1]):
        o, S = step(*_token(inp, t), S)
        outs.append(o)
    return jnp.stack(outs, 1), S


@pytest.mark.parametrize("n,H,HV,K,V,gate,l2", CASES)
def test_loop_of_steps_equals_chunked_op(n, H, HV, K, V, gate, l2):
    inp = make_inputs(3 + n, 2, 37, n, H, HV, K, V, gate=gate)
    o, S = _decode_loop(inp, inp.initial_state, l2)
    o_c, S_c = jax.jit(lambda inp: OP(inp.q, inp.k, inp.v, inp.g, inp.beta,
                                      initial_state=inp.initial_state,
                                      output_final_state=True, use_qk_l2norm=l2,
                                      backend="xla"))(inp)
    assert rel_max(o, o_c) < TOL
    assert rel_max(S, S_c) < TOL


def test_prefill_then_steps_equals_op_from_zero():
    inp = make_inputs(5, 2, 40, 2, 1, 2, 8, 8, gate="strong", initial_state=False)
    P = 29                                             # prompt: 29 tokens, then 11 steps
    o_p, S = jax.jit(lambda q, k, v, g, beta: OP(
        q[:, :P], k[:, :P], v[:, :P], g[:, :P], beta[:, :P], output_final_state=True,
        backend="xla"))(inp.q, inp.k, inp.v, inp.g, inp.beta)
    o_d, S = _decode_loop(inp, S, False, start=P)
    o_r, S_r = jax.jit(lambda q, k, v, g, beta: REF(q, k, v, g, beta, output_final_state=True))(
        inp.q, inp.k, inp.v, inp.g, inp.beta)
    assert rel_max(jnp.concatenate([o_p, o_d], 1), o_r) < TOL
    assert rel_max(S, S_r) < TOL


def _loss(step, w_o, w_s):
    def f(q, k, v, g, beta, S):
        o, S = step(q, k, v, g, beta, S)
        return jnp.sum(o * w_o) + jnp.sum(S * w_s)
    return f


@pytest.mark.parametrize("backend", ["xla", "cutedsl"])
def test_grad_jit_vmap(backend, request):
    if backend == "cutedsl":
        request.getfixturevalue("emulated_step")
    inp = make_inputs(9, 2, 1, 2, 1, 2, 8, 4, gate="normal")
    args = _token(inp, 0) + (inp.initial_state,)
    rng = np.random.default_rng(0)
    w_o = jnp.asarray(rng.standard_normal((2, 2, 4)))
    w_s = jnp.asarray(rng.standard_normal(inp.initial_state.shape))
    step = lambda *a: STEP(*a, use_qk_l2norm=True, backend=backend)

    def ref_step(q, k, v, g, beta, S):
        o, S = REF(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
                   initial_state=S, output_final_state=True, use_qk_l2norm=True)
        return o[:, 0], S

    got = jax.jit(jax.grad(_loss(step, w_o, w_s), argnums=range(6)))(*args)
    want = jax.jit(jax.grad(_loss(ref_step, w_o, w_s), argnums=range(6)))(*args)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "state"), got, want):
        assert rel_max(a, b) < TOL, name
    # vmap over a leading axis of 3 problems == each problem on its own
    stacked = [jnp.stack([x, 1.1 * x, 0.9 * x]) for x in args]
    o_v, S_v = jax.jit(jax.vmap(step))(*stacked)
    step1 = jax.jit(step)                             # one compilation for the 3 problems
    for m in range(3):
        o_m, S_m = step1(*[x[m] for x in stacked])
        assert rel_max(o_v[m], o_m) < TOL and rel_max(S_v[m], S_m) < TOL


@pytest.mark.parametrize("backend", ["xla", "cutedsl"])
def test_donated_state(backend, request):
    if backend == "cutedsl":
        request.getfixturevalue("emulated_step")
    inp = make_inputs(4, 2, 1, 2, 2, 2, 8, 8)
    args = _token(inp, 0)
    want = STEP(*args, inp.initial_state, backend=backend)
    step = jax.jit(lambda *a: STEP(*a, backend=backend), donate_argnums=5)
    S = jnp.array(inp.initial_state)                   # a copy we may give away
    got = step(*args, S)
    assert rel_max(got[0], want[0]) < TOL and rel_max(got[1], want[1]) < TOL
    got2 = step(*args, got[1])                         # the output feeds the next step
    assert got2[1].shape == S.shape


def test_float32_state_and_bf16_inputs():
    inp = make_inputs(6, 2, 1, 2, 1, 2, 16, 16, dtype=jnp.bfloat16)
    o, S = jax.jit(lambda inp: STEP(*_token(inp, 0), inp.initial_state, backend="xla"))(inp)
    assert o.dtype == jnp.bfloat16 and S.dtype == jnp.float32
    o_r, S_r = jax.jit(lambda inp: REF(inp.q, inp.k, inp.v, inp.g, inp.beta,
                                       initial_state=inp.initial_state,
                                       output_final_state=True))(inp)
    assert rel_max(o.astype(jnp.float32), o_r[:, 0].astype(jnp.float32)) < 2e-2
    assert rel_max(S, S_r) < 1e-5


def _args(B=2, n=2, H=1, HV=2, K=8, V=4):
    r = np.random.default_rng(0).standard_normal
    return dict(q=jnp.asarray(r((B, H, K))), k=jnp.asarray(r((B, n, H, K))),
                v=jnp.asarray(r((B, n, HV, V))), g=-jnp.abs(jnp.asarray(r((B, HV)))),
                beta=jnp.asarray(r((B, n, HV))), state=jnp.asarray(r((B, HV, K, V))))


BAD = [
    ("q", lambda a: a["q"][:, None], ValueError, r"q has shape \(2, 1, 1, 8\); expected rank 3"),
    ("k", lambda a: a["k"][:, :, :, :4], ValueError, r"k has shape .*\[B, n, H, K\]"),
    ("v", lambda a: a["v"][:1], ValueError, r"v has shape \(1, 2, 2, 4\)"),
    ("v", lambda a: a["v"][:, :, :1], ValueError, "value heads"),   # HV = 1, H = 2
    ("beta", lambda a: a["beta"][:, :1], ValueError, r"beta has shape \(2, 1, 2\)"),
    ("g", lambda a: a["g"][:, None], ValueError, r"g has shape \(2, 1, 2\); expected"),
    ("g", lambda a: a["g"].astype(jnp.float16), TypeError, "g has dtype float16"),
    ("state", lambda a: a["state"][..., :3], ValueError, r"state has shape \(2, 2, 8, 3\)"),
    ("state", lambda a: a["state"].astype(jnp.bfloat16), TypeError, "state has dtype bfloat16"),
    ("state", lambda a: None, TypeError, "state must be"),
    ("k", lambda a: a["k"].astype(jnp.float32), TypeError, "k has dtype float32"),
    ("q", lambda a: a["q"].astype(jnp.int32), TypeError, "q has dtype int32"),
]


@pytest.mark.parametrize("name,bad,exc,msg", BAD)
def test_argument_errors(name, bad, exc, msg):
    a = _args(H=2, HV=2) if msg == "value heads" else _args()
    if msg == "value heads":          # 2 key heads, 1 value head: not a multiple
        a["beta"], a["state"], a["g"] = a["beta"][:, :, :1], a["state"][:, :1], a["g"][:, :1]
    a[name] = bad(a)
    with pytest.raises(exc, match=msg):
        STEP(a["q"], a["k"], a["v"], a["g"], a["beta"], a["state"], backend="xla")


def test_scale_as_array_or_traced():
    """scale as the op takes it: a float, a 0-d array, or traced (o is linear in it; the
    state does not depend on it), with jax.grad reaching it."""
    a = _args()
    o, S = STEP(*a.values(), scale=0.37)
    for sc in (jnp.float64(0.37), np.array(0.37)):
        o2, S2 = STEP(*a.values(), scale=sc)
        assert float(jnp.max(jnp.abs(o2 - o))) == 0.0 and float(jnp.max(jnp.abs(S2 - S))) == 0
    o3, S3 = jax.jit(lambda s: STEP(*a.values(), scale=s))(jnp.float64(0.37))
    assert float(jnp.max(jnp.abs(o3 - o))) < 1e-15 * float(jnp.max(jnp.abs(o)))
    d = jax.grad(lambda s: jnp.sum(STEP(*a.values(), scale=s)[0]))(0.37)
    assert abs(float(d) - float(jnp.sum(o)) / 0.37) < 1e-12 * abs(float(d))


def test_messages_quote_the_steps_shapes():
    """The checks shared with the op name the step's own shapes (no T axis)."""
    a = _args()
    B, _, K = a["q"].shape
    n, V = a["k"].shape[1], a["v"].shape[-1]
    q2 = jnp.ones((B, 2, K), a["q"].dtype)                       # H = 2 key heads
    k2 = jnp.ones((B, n, 2, K), a["k"].dtype)
    with pytest.raises(ValueError, match=rf"v has 3 value heads \(shape \({B}, {n}, 3, {V}\)\)"):
        STEP(q2, k2, jnp.ones((B, n, 3, V), a["v"].dtype), None,
             jnp.ones((B, n, 3), a["beta"].dtype), jnp.zeros((B, 3, K, V), a["state"].dtype))


def test_scale_and_backend_errors():
    a = _args()
    with pytest.raises(TypeError, match="scale"):
        STEP(*a.values(), scale=jnp.ones(2))
    with pytest.raises(TypeError, match="scale"):                  # traced, not a scalar
        jax.jit(lambda s: STEP(*a.values(), scale=s))(jnp.ones(2))
    with pytest.raises(TypeError, match="use_qk_l2norm is a traced value"):
        jax.jit(STEP)(*a.values(), use_qk_l2norm=True)
    with pytest.raises(ValueError, match="backend"):
        STEP(*a.values(), backend="triton")
    if not backends.cutedsl_available()[0]:          # no sm_90 GPU on this host
        a32 = [x.astype(jnp.float32) for x in a.values()]
        with pytest.raises(ValueError, match="backend='cutedsl' cannot run here"):
            STEP(*a32, backend="cutedsl")
    with pytest.raises(TypeError, match="q has dtype float64"):   # as the op: no f64 kernels
        STEP(*a.values(), backend="cutedsl")


# --- the op's T = 1 path (through the step) and its GPU lowering -------------------------

@pytest.mark.parametrize("backend", ["xla", "cutedsl"])
def test_op_one_token_equals_reference_with_grads(backend, request):
    from gdp_jax.testing import loss_and_grads
    if backend == "cutedsl":
        request.getfixturevalue("emulated_step")
    for init in (True, False):
        inp = make_inputs(8, 3, 1, 2, 1, 2, 8, 6, gate="strong", initial_state=init)
        o, s, _, g = loss_and_grads(OP, inp, backend=backend, use_qk_l2norm=True)
        o_r, s_r, _, g_r = loss_and_grads(REF, inp, use_qk_l2norm=True)
        assert rel_max(o, o_r) < TOL and rel_max(s, s_r) < TOL
        assert set(g) == set(g_r)
        for name in g:
            assert rel_max(g[name], g_r[name]) < TOL, name


def _cuda_hlo(fn, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("T,packed", [(1, False), (2, False), (5, False), (65, False),
                                      (5, True)])
def test_op_gpu_lowering_has_no_reduce_window(T, packed):
    """XLA's GPU emitter crashed on the reduce_window of jnp.cumsum (T = 1, H200): the
    op's forward and backward lower for cuda without one (B = 1 / 64 as on the H200)."""
    for B in ((1,) if packed else (1, 64)):
        inp = make_inputs(1, B, T, 2, 2, 2, 16, 16, dtype=jnp.bfloat16, N=2 if packed else B)
        cu = jnp.asarray([0, 2, T], jnp.int32) if packed else None
        h0 = inp.initial_state

        def loss(q, k, v, g, beta, h0):
            o, s = OP(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu,
                      output_final_state=True, backend="xla")
            return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(s)

        txt = _cuda_hlo(jax.grad(loss, argnums=range(6)), inp.q, inp.k, inp.v, inp.g,
                        inp.beta, h0)
        assert not re.search("reduce_window", txt), (B, T)


@pytest.mark.parametrize("backend", ["xla", "cutedsl"])
def test_step_under_shard_map_over_rows(backend, request):
    """Data-parallel decode: rows split over a mesh axis (check_vma on); gradients too."""
    if backend == "cutedsl":
        request.getfixturevalue("emulated_step")
    from jax.sharding import Mesh, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()[:2]), ("dp",))
    inp = make_inputs(12, 4, 1, 2, 1, 2, 8, 8)
    args = _token(inp, 0) + (inp.initial_state,)
    step = lambda *a: STEP(*a, backend=backend)
    sharded = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("dp"), out_specs=P("dp")))
    o, S = sharded(*args)
    o_1, S_1 = jax.jit(step)(*args)
    assert rel_max(o, o_1) < TOL and rel_max(S, S_1) < TOL
    loss = lambda *a: jnp.sum(jax.shard_map(step, mesh=mesh, in_specs=P("dp"),
                                            out_specs=P("dp"))(*a)[1] ** 2)
    g = jax.jit(jax.grad(loss, argnums=range(6)))(*args)
    g_1 = jax.jit(jax.grad(lambda *a: jnp.sum(step(*a)[1] ** 2), argnums=range(6)))(*args)
    for a, b in zip(g, g_1):
        assert rel_max(a, b) < TOL
