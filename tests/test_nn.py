"""The Flax NNX GatedDeltaProduct layer: shapes, packing, GVA, gradients, CP == one device."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

nnx = pytest.importorskip("flax.nnx", reason="install the 'nn' extra (flax)")

import gdp_jax  # noqa: E402
from gdp_jax.nn import GatedDeltaProduct, causal_conv1d  # noqa: E402
from gdp_jax.testing import rel_max  # noqa: E402

F64 = jnp.float64
D = 16


def make(cp_axis=None, **kw):
    """H = num_heads query/key heads (default 1), HV = num_v_heads value heads (default 2)."""
    args = dict(num_v_heads=2, head_k_dim=8, head_v_dim=8, num_householder=2,
                param_dtype=F64, backend="xla")
    args.update(kw)
    return GatedDeltaProduct(D, args.pop("num_heads", 1), cp_axis=cp_axis, rngs=nnx.Rngs(0),
                             **args)


def rand_x(B, T, seed=1):
    return jax.random.normal(jax.random.key(seed), (B, T, D), F64)


@functools.partial(jax.jit, static_argnums=0)
def _apply(graphdef, state, x, cu):
    return nnx.merge(graphdef, state)(x, cu)


def fwd(layer, x, cu=None):
    """layer(x, cu) under jit (eager layers dispatch op by op: slow). One jitted function
    with the graphdef static: calls of equal layers (equal graphdefs: the same structure
    and static attributes) at equal shapes share one compile; the parameters are traced."""
    graphdef, state = nnx.split(layer)
    return _apply(graphdef, state, x, cu)


@functools.partial(jax.jit, static_argnums=0)
def _project(graphdef, state, x):
    """layer.project(x) under jit (eagerly: op-by-op dispatch)."""
    return nnx.merge(graphdef, state).project(x)


rel = rel_max      # max |a - b| / max |b|


@pytest.mark.parametrize("kw", [dict(), dict(use_forget_gate=False, allow_neg_eigval=False),
                                dict(conv_size=0, num_householder=3),
                                dict(learn_initial_state=True, qkv_activation=False)])
def test_shapes_and_projection(kw):
    layer = make(num_heads=2, num_v_heads=4, **kw)
    x = rand_x(2, 23)
    y = fwd(layer, x)
    assert y.shape == x.shape and y.dtype == x.dtype
    n = layer.num_householder
    p = _project(*nnx.split(layer), x)
    assert p["q"].shape == (2, 23, 2, 8)
    assert p["k"].shape == (2, 23, n, 2, 8)
    assert p["v"].shape == (2, 23, n, 4, 8)
    assert p["beta"].shape == (2, 23, n, 4)
    assert p["z"].shape == (2, 23, 4, 8)
    hi = 2.0 if layer.allow_neg_eigval else 1.0
    assert 0 < float(p["beta"].min()) and float(p["beta"].max()) < hi
    if layer.use_forget_gate:
        assert p["g"].shape == (2, 23, 4) and float(p["g"].max()) <= 0
    else:
        assert p["g"] is None


def test_bfloat16_compute():
    layer = GatedDeltaProduct(D, 2, head_k_dim=8, dtype=jnp.bfloat16, backend="xla",
                              rngs=nnx.Rngs(0))    # float32 parameters, bf16 compute
    y = fwd(layer, rand_x(1, 17).astype(jnp.bfloat16))
    assert y.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(y.astype(jnp.float32))))


def test_matches_the_reference_pipeline_with_gva():
    """Layer == its own projections fed to the token-recurrence reference (GVA: H < HV)."""
    from gdp_jax.nn import gated_rms_norm
    layer = make(num_heads=2, num_v_heads=4)
    x = rand_x(2, 19)
    graphdef, state = nnx.split(layer)

    @jax.jit                    # the reference pipeline (eagerly: op-by-op dispatch)
    def pipeline(state, x):
        layer = nnx.merge(graphdef, state)
        p = layer.project(x)
        o = gdp_jax.gated_delta_product_reference(p["q"], p["k"], p["v"], p["g"], p["beta"],
                                                  use_qk_l2norm=True)
        o = gated_rms_norm(o, p["z"], layer.norm_weight[...], layer.norm_eps)
        return layer.out_proj(o.reshape(2, 19, -1))

    want = pipeline(state, x)
    assert rel(fwd(layer, x), want) < 1e-10


def test_packed_equals_separate_sequences():
    layer = make(learn_initial_state=True)
    # a non-zero learned start state must be used by every packed sequence
    layer.initial_state[...] = 0.1 * jax.random.normal(jax.random.key(5),
                                                       layer.initial_state.shape, F64)
    cu = np.array([0, 5, 17, 17, 30, 41])
    x = rand_x(1, 41)
    packed = fwd(layer, x, jnp.asarray(cu, jnp.int32))
    parts = [fwd(layer, x[:, a:b]) for a, b in zip(cu[:-1], cu[1:]) if b > a]
    assert rel(packed, jnp.concatenate(parts, axis=1)) < 1e-10


def test_causal():
    layer = make()
    x = rand_x(1, 30)
    y = fwd(layer, x)
    y2 = fwd(layer, x.at[:, 20].add(1.0))
    assert rel(y2[:, :20], y[:, :20]) == 0.0
    assert rel(y2[:, 20:], y[:, 20:]) > 1e-3


@pytest.mark.parametrize("use_forget_gate", [True, False])
def test_grads_finite(use_forget_gate):
    layer = make(use_forget_gate=use_forget_gate, num_heads=2, num_v_heads=4)
    graphdef, params = nnx.split(layer, nnx.Param)
    x = rand_x(1, 33)
    cu = jnp.array([0, 12, 33], jnp.int32)

    def loss(params, x):
        return jnp.sum(nnx.merge(graphdef, params)(x, cu) ** 2)

    gp, gx = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
    leaves = jax.tree.leaves(gp) + [gx]
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
    assert all(float(jnp.abs(g).max()) > 0 for g in leaves)


def test_conv_restarts_and_halo_check():
    x = jax.random.normal(jax.random.key(0), (1, 12, 3), F64)
    w = jax.random.normal(jax.random.key(1), (4, 3), F64)
    cu = jnp.array([0, 5, 12], jnp.int32)
    y = causal_conv1d(x, w, None, cu_seqlens=cu, activation=False)
    y0 = causal_conv1d(x[:, :5], w, None, activation=False)
    y1 = causal_conv1d(x[:, 5:], w, None, activation=False)
    assert rel(y, jnp.concatenate([y0, y1], 1)) < 1e-12
    # tap W-1 multiplies the current token
    assert rel(y[:, 0], x[:, 0] * w[3]) < 1e-12


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_v_heads=3"):
        GatedDeltaProduct(D, 2, num_v_heads=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="expected"):
        make()(jnp.zeros((1, 4, D + 1), F64))


# --- context parallelism -----------------------------------------------------------------

def _mesh(n=8):
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices")
    return Mesh(np.array(jax.devices()[:n]), ("cp",))


@pytest.mark.parametrize("case", ["packed", "batched"])
def test_layer_under_cp_equals_one_device(case):
    """8 ranks of 8 tokens; packed sequences cross (several) rank boundaries."""
    mesh = _mesh()
    kw = dict(num_heads=2, num_v_heads=4, learn_initial_state=True)
    one, cp = make(**kw), make(cp_axis="cp", **kw)
    graphdef1, params = nnx.split(one, nnx.Param)
    graphdef_cp, _ = nnx.split(cp, nnx.Param)
    params = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(
        jax.random.key(3), a.shape, a.dtype), params)          # non-zero start state too
    if case == "packed":
        B, cu = 1, jnp.array([0, 3, 21, 22, 23, 50, 64], jnp.int32)
    else:
        B, cu = 2, None
    x = rand_x(B, 64)
    w = rand_x(B, 64, seed=7)                                  # random output weights

    def loss1(params, x):
        return jnp.sum(w * nnx.merge(graphdef1, params)(x, cu))

    def loss_cp(params, x, w):
        y = nnx.merge(graphdef_cp, params)(x, cu)
        return jax.lax.psum(jnp.sum(w * y), "cp")

    sp = P(None, "cp")
    fwd_cp = jax.jit(jax.shard_map(lambda p, x: nnx.merge(graphdef_cp, p)(x, cu), mesh=mesh,
                                   in_specs=(P(), sp), out_specs=sp))
    grad_cp = jax.jit(jax.shard_map(jax.grad(loss_cp, argnums=(0, 1)), mesh=mesh,
                                    in_specs=(P(), sp, sp), out_specs=(P(), sp)))
    y1 = jax.jit(lambda p, x: nnx.merge(graphdef1, p)(x, cu))(params, x)
    assert rel(fwd_cp(params, x), y1) < 1e-10
    g1 = jax.jit(jax.grad(loss1, argnums=(0, 1)))(params, x)
    gc = grad_cp(params, x, w)
    errs = jax.tree.map(rel, gc, g1)
    assert max(jax.tree.leaves(errs)) < 1e-9, errs


def test_cp_needs_conv_halo_tokens_per_rank():
    mesh = _mesh()
    layer = make(cp_axis="cp", conv_size=4)
    graphdef, params = nnx.split(layer, nnx.Param)
    f = jax.shard_map(lambda p, x: nnx.merge(graphdef, p)(x), mesh=mesh,
                      in_specs=(P(), P(None, "cp")), out_specs=P(None, "cp"))
    with pytest.raises(ValueError, match="conv_size - 1"):
        jax.jit(f)(params, rand_x(1, 16))                      # 2 tokens per rank < 3


# --- generation: the decoding cache --------------------------------------------------------

def _cached(layer):
    """(x, cache, cu) -> (y, cache) under jit."""
    graphdef, state = nnx.split(layer)
    return jax.jit(lambda state, x, cache, cu=None: nnx.merge(graphdef, state)(
        x, cu, cache=cache))


@pytest.mark.parametrize("kw", [dict(), dict(num_heads=2, num_v_heads=4, conv_size=3),
                                dict(use_forget_gate=False, conv_size=0, num_householder=3),
                                dict(learn_initial_state=True, qkv_activation=False,
                                     conv_size=5)])
def test_prefill_then_decode_equals_full_forward(kw):
    from gdp_jax.nn import GDPCache
    layer = make(**kw)
    x = rand_x(2, 19)
    if layer.learn_initial_state:              # a non-zero learned start state
        layer.initial_state[...] = 0.3 * jax.random.normal(
            jax.random.key(3), layer.initial_state.shape, F64)
    want = fwd(layer, x)
    run = _cached(layer)
    graphdef, state = nnx.split(layer)
    cache = layer.init_cache(2, dtype=F64)
    assert isinstance(cache, GDPCache) and cache.state.dtype == F64
    P = 7                                      # prompt 7 tokens (< 2 conv widths), then steps
    y, cache = run(state, x[:, :P], cache)
    ys = [y]
    for t in range(P, x.shape[1]):
        y, cache = run(state, x[:, t:t + 1], cache)
        ys.append(y)
    assert rel(jnp.concatenate(ys, 1), want) < 1e-10
    # a second prefill chunk (T > 1 from a non-fresh cache) also continues exactly
    cache = layer.init_cache(2, dtype=F64)
    y0, cache = run(state, x[:, :2], cache)
    y1, cache = run(state, x[:, 2:], cache)
    assert rel(jnp.concatenate([y0, y1], 1), want) < 1e-10
    # no cache: y only (the same layer call, under jit: eagerly it took ~18 s)
    assert jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))(
        state, x[:, :3]).shape == (2, 3, D)


def test_packed_prefill_gives_one_cache_row_per_sequence():
    layer = make(num_heads=2, conv_size=4)
    _, state = nnx.split(layer)
    run = _cached(layer)
    lens = [5, 0, 1, 9]                         # an empty and a length-1 sequence
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    x = rand_x(1, int(cu[-1]), seed=4)
    y, cache = run(state, x, layer.init_cache(len(lens), dtype=F64), jnp.asarray(cu))
    assert cache.state.shape == (4, 2, 8, 8) and cache.conv.shape == (4, 3, layer.conv_dim)
    # each sequence on its own: prefill, then 3 more tokens decoded per row
    extra = rand_x(len(lens), 3, seed=5)
    for i, L in enumerate(lens):
        full = jnp.concatenate([x[:, cu[i]:cu[i + 1]], extra[i:i + 1]], 1)
        want = fwd(layer, full)
        assert rel(y[:, cu[i]:cu[i + 1]], want[:, :L]) < 1e-10 if L else True
        row = jax.tree_util.tree_map(lambda a: a[i:i + 1], cache)
        for t in range(3):
            y_t, row = run(state, extra[i:i + 1, t:t + 1], row)
            assert rel(y_t, want[:, L + t:L + t + 1]) < 1e-10, (i, t)


def test_cache_errors():
    layer = make()
    x = rand_x(2, 3)
    with pytest.raises(ValueError, match="cache.state has shape"):
        layer(x, cache=layer.init_cache(3))
    with pytest.raises(TypeError, match="GDPCache"):
        layer(x, cache=(1, 2))
    with pytest.raises(ValueError, match="batch_size"):
        layer.init_cache(0)
    with pytest.raises(ValueError, match="cp_axis"):
        make(cp_axis="cp")(x, cache=layer.init_cache(2))


def test_s3_streaming_equals_parallel_forward():
    """gdp_jax.s3.streaming_logits (token by token through the cache) == the parallel
    forward, on an untrained S3 model with a non-zero learned start state."""
    from gdp_jax import s3
    cfg = s3.S3Config(num_householder=2, conv_size=3, qkv_activation=True)
    _, params = nnx.split(s3.S3Model(cfg, rngs=nnx.Rngs(1)), nnx.Param)
    params["mixer"]["initial_state"][...] = 0.5 * jax.random.normal(
        jax.random.key(0), params["mixer"]["initial_state"].shape, jnp.float32)
    x, _ = s3.sample_batch(np.random.default_rng(0), 3, 21)
    par = np.asarray(s3.model_logits(cfg, params, x))
    stream = np.asarray(s3.streaming_logits(cfg, params, x))
    assert stream.shape == par.shape == (3, 21, 6)
    assert rel(stream, par) < 1e-5                      # float32 model


def test_batch_invariant_passes_through(monkeypatch):
    """``batch_invariant=True`` reaches the op (the plain call and the cached prefill) and
    changes no value (float64); a non-bool is a TypeError naming it."""
    from gdp_jax import nn as gnn
    seen = []
    op = gnn.gated_delta_product
    monkeypatch.setattr(gnn, "gated_delta_product",
                        lambda *a, **kw: seen.append(kw["batch_invariant"]) or op(*a, **kw))
    x = rand_x(2, 70)
    base = make()
    _, params = nnx.split(base, nnx.Param)
    inv = make(batch_invariant=True)
    nnx.update(inv, params)
    assert rel(fwd(inv, x), fwd(base, x)) < 1e-10
    y, _ = inv(x, cache=inv.init_cache(2))
    assert rel(y, fwd(base, x)) < 1e-10
    assert seen == [True, False, True]
    with pytest.raises(TypeError, match="batch_invariant"):
        make(batch_invariant=1)


def test_recompute_and_intra_cp_pass_through():
    """The layer hands recompute_chunk_num and intra_cp to the op: the same outputs and
    parameter gradients as without them (float64)."""
    x = rand_x(1, 128)
    base = make()
    graphdef, params = nnx.split(base, nnx.Param)

    def grads(layer):
        g, p = nnx.split(layer, nnx.Param)
        loss = lambda p, x: jnp.sum(nnx.merge(g, p)(x) ** 2)
        return jax.jit(jax.grad(loss))(p, x)

    want = grads(base)
    other = make(recompute_chunk_num=1, intra_cp=2)
    nnx.update(other, params)
    assert other.intra_cp == 2 and other.recompute_chunk_num == 1
    assert rel(fwd(other, x), fwd(base, x)) < 1e-10
    for a, b in zip(jax.tree.leaves(grads(other)), jax.tree.leaves(want)):
        assert rel(a, b) < 1e-10
