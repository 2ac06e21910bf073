"""The layer in its ecosystem: FLA's head names and weights, padding masks, segment ids,
dtype following x, optional output gate / conv bias, initializers, backend logging."""
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx", reason="install the 'nn' extra (flax)")

import gdp_jax  # noqa: E402
from gdp_jax import backends  # noqa: E402
from gdp_jax.fla_weights import fla_layer_kwargs, load_fla_weights  # noqa: E402
from gdp_jax.nn import GatedDeltaProduct  # noqa: E402
from gdp_jax.packing import cu_seqlens_from_mask, cu_seqlens_from_segment_ids  # noqa: E402
from gdp_jax.testing import rel_max  # noqa: E402

F64 = jnp.float64
D = 16


def layer(**kw):
    args = dict(num_v_heads=4, head_k_dim=8, head_v_dim=8, param_dtype=F64, backend="xla")
    args.update(kw)
    return GatedDeltaProduct(D, args.pop("num_heads", 2), rngs=nnx.Rngs(0), **args)


rel = rel_max      # max |a - b| / max |b|


def call(m, x, *args, **kw):
    graphdef, state = nnx.split(m)
    return jax.jit(lambda s, x, *a: nnx.merge(graphdef, s)(x, *a, **kw))(state, x, *args)


# --- FLA weights ---------------------------------------------------------------------------

def _fla_state_dict(rng, *, D, H, HV, K, V, n, W, conv_bias, output_gate):
    w = lambda *s: rng.normal(0, 0.3, s)
    sd = {"q_proj.weight": w(H * K, D), "k_proj.weight": w(n * H * K, D),
          "v_proj.weight": w(n * HV * V, D), "b_proj.weight": w(n * HV, D),
          # the layer keeps A_log and dt_bias in float32 (as FLA does): exact in float32
          "a_proj.weight": w(HV, D),
          "A_log": np.log(rng.uniform(1, 16, HV)).astype(np.float32).astype(np.float64),
          "dt_bias": rng.normal(0, 1, HV).astype(np.float32).astype(np.float64), "o_norm.weight": 1 + w(V),
          "o_proj.weight": w(D, HV * V)}
    for name, c in (("q", H * K), ("k", n * H * K), ("v", n * HV * V)):
        sd[f"{name}_conv1d.weight"] = w(c, 1, W)
        if conv_bias:
            sd[f"{name}_conv1d.bias"] = w(c)
    if output_gate:
        sd["g_proj.weight"] = w(HV * V, D)
    return sd


def _fla_forward(sd, x, *, H, HV, K, V, n, W, output_gate, eps=1e-5):
    """FLA's GatedDeltaProduct layer forward, written from its definition: separate
    projections and convolutions, q/k heads repeated for GVA, then the token recurrence."""
    B, T, _ = x.shape
    silu = lambda a: a / (1 + np.exp(-a))
    sp = lambda a: np.log1p(np.exp(a))

    def conv(name, y):
        wt = sd[f"{name}_conv1d.weight"][:, 0]                     # [C, W]
        yp = np.concatenate([np.zeros((B, W - 1, y.shape[-1])), y], 1)
        out = sum(yp[:, i:i + T] * wt[:, i] for i in range(W))
        return silu(out + sd.get(f"{name}_conv1d.bias", 0))

    q = conv("q", x @ sd["q_proj.weight"].T).reshape(B, T, H, K)
    k = conv("k", x @ sd["k_proj.weight"].T).reshape(B, T, n, H, K)
    v = conv("v", x @ sd["v_proj.weight"].T).reshape(B, T, n, HV, V)
    rep = HV // H
    q, k = np.repeat(q, rep, axis=-2), np.repeat(k, rep, axis=-2)
    beta = 2 / (1 + np.exp(-(x @ sd["b_proj.weight"].T))).reshape(B, T, n, HV)
    g = -np.exp(sd["A_log"]) * sp(x @ sd["a_proj.weight"].T + sd["dt_bias"])
    o = np.asarray(gdp_jax.gated_delta_product_reference(
        *(jnp.asarray(a) for a in (q, k, v, g, beta)), use_qk_l2norm=True))
    o = o / np.sqrt(np.mean(o * o, -1, keepdims=True) + eps) * sd["o_norm.weight"]
    if output_gate:
        o = o * silu((x @ sd["g_proj.weight"].T).reshape(B, T, HV, V))
    return o.reshape(B, T, HV * V) @ sd["o_proj.weight"].T


@pytest.mark.parametrize("conv_bias,output_gate,H", [(False, True, 2), (True, False, 4)])
def test_fla_weights_give_fla_outputs(conv_bias, output_gate, H):
    HV, K, n, W, expand_v = 4, 8, 2, 4, 1.5
    V = int(K * expand_v)
    kw = fla_layer_kwargs(hidden_size=D, head_dim=K, num_heads=H, num_v_heads=HV,
                          expand_v=expand_v, num_householder=n, conv_size=W,
                          conv_bias=conv_bias, use_output_gate=output_gate)
    m = GatedDeltaProduct(**kw, param_dtype=F64, backend="xla", rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    sd = _fla_state_dict(rng, D=D, H=H, HV=HV, K=K, V=V, n=n, W=W, conv_bias=conv_bias,
                         output_gate=output_gate)
    load_fla_weights(m, {"model.layers.0.attn." + k: v for k, v in sd.items()},
                     prefix="model.layers.0.attn.")
    x = rng.normal(size=(2, 21, D))
    want = _fla_forward(sd, x, H=H, HV=HV, K=K, V=V, n=n, W=W, output_gate=output_gate)
    assert rel(call(m, jnp.asarray(x)), want) < 1e-10


def test_fla_weights_errors_name_the_key():
    m = layer(conv_bias=False)
    sd = _fla_state_dict(np.random.default_rng(0), D=D, H=2, HV=4, K=8, V=8, n=2, W=4,
                         conv_bias=False, output_gate=True)
    with pytest.raises(ValueError, match="'g_proj.weight' is missing"):
        load_fla_weights(m, {k: v for k, v in sd.items() if k != "g_proj.weight"})
    sd["v_proj.weight"] = sd["v_proj.weight"][:-1]
    with pytest.raises(ValueError, match=r"'v_proj.weight' has shape \(63, 16\)"):
        load_fla_weights(m, sd)


# --- padding masks and segment ids ----------------------------------------------------------

def test_mask_rows_equal_unpadded_rows():
    m = layer(learn_initial_state=True)
    m.initial_state[...] = 0.1 * jax.random.normal(jax.random.key(2), m.initial_state.shape, F64)
    B, T = 3, 19
    x = jax.random.normal(jax.random.key(1), (B, T, D), F64)
    runs = [(0, 19), (0, 7), (5, 19)]                    # full, right- and left-padded
    mask = np.zeros((B, T), bool)
    for b, (s, e) in enumerate(runs):
        mask[b, s:e] = True
    y = call(m, x, mask=jnp.asarray(mask))
    for b, (s, e) in enumerate(runs):
        alone = call(m, x[b:b + 1, s:e])
        assert rel(y[b:b + 1, s:e], alone) < 1e-10
        assert float(jnp.abs(y[b, :s]).max(initial=0)) == 0.0
        assert float(jnp.abs(y[b, e:]).max(initial=0)) == 0.0


def test_mask_helper_offsets_and_errors():
    mask = np.array([[1, 1, 0, 0], [0, 1, 1, 1], [0, 0, 0, 0]])
    np.testing.assert_array_equal(cu_seqlens_from_mask(mask),
                                  [0, 0, 2, 4, 5, 8, 8, 8, 8, 12])
    with pytest.raises(ValueError, match=r"row\(s\) \[0\]"):
        cu_seqlens_from_mask(np.array([[1, 0, 1, 0]]))
    with pytest.raises(ValueError, match=r"mask has shape \(2, 4\); expected \(2, 5\)"):
        cu_seqlens_from_mask(mask[:2], shape=(2, 5))
    with pytest.raises(ValueError, match="mask or cu_seqlens|either cu_seqlens or mask"):
        layer()(jnp.zeros((1, 4, D), F64), jnp.array([0, 4]), mask=jnp.ones((1, 4)))


def test_traced_bad_mask_gives_invalid_offsets():
    cu = jax.jit(cu_seqlens_from_mask)(jnp.array([[1, 0, 1, 0]]))
    assert bool(jnp.any(cu[1:] < cu[:-1]))          # the op's on-device check rejects it
    good = jax.jit(cu_seqlens_from_mask)(jnp.array([[0, 1, 1, 0]]))
    np.testing.assert_array_equal(good, [0, 1, 3, 4])


def test_segment_ids_helper():
    ids = np.array([0, 0, 0, 2, 2, 3])
    np.testing.assert_array_equal(cu_seqlens_from_segment_ids(ids, 5), [0, 3, 3, 5, 6, 6])
    np.testing.assert_array_equal(jax.jit(cu_seqlens_from_segment_ids, static_argnums=1)(
        jnp.asarray(ids), 5), [0, 3, 3, 5, 6, 6])
    with pytest.raises(ValueError, match="decrease"):
        cu_seqlens_from_segment_ids(np.array([0, 1, 0]), 2)
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        cu_seqlens_from_segment_ids(np.array([0, 2]), 2)
    with pytest.raises(TypeError, match="segment_ids has dtype float"):
        cu_seqlens_from_segment_ids(np.array([0.0, 1.0]), 2)
    bad = jax.jit(cu_seqlens_from_segment_ids, static_argnums=1)(jnp.array([1, 0]), 2)
    assert bool(jnp.any(bad[1:] < bad[:-1]))


def test_segment_ids_run_the_op_like_separate_sequences():
    ids = np.array([0] * 5 + [1] * 9 + [3] * 6)
    m = layer()
    x = jax.random.normal(jax.random.key(3), (1, 20, D), F64)
    cu = cu_seqlens_from_segment_ids(ids, 4)
    y = call(m, x, cu)
    for a, b in ((0, 5), (5, 14), (14, 20)):
        assert rel(y[:, a:b], call(m, x[:, a:b])) < 1e-10


# --- dtypes, options, initializers, logging -------------------------------------------------

def test_dtype_none_follows_x():
    m = GatedDeltaProduct(D, 2, head_k_dim=8, backend="xla", rngs=nnx.Rngs(0))   # f32 params
    x = jax.random.normal(jax.random.key(0), (1, 9, D), jnp.bfloat16)
    p = m.project(x)
    assert p["q"].dtype == p["k"].dtype == p["v"].dtype == p["beta"].dtype == jnp.bfloat16
    assert p["g"].dtype == jnp.float32
    assert call(m, x).dtype == jnp.bfloat16
    forced = GatedDeltaProduct(D, 2, head_k_dim=8, dtype=jnp.float32, backend="xla",
                               rngs=nnx.Rngs(0))
    assert forced.project(x)["q"].dtype == jnp.float32


def test_no_output_gate_no_conv_bias():
    m = layer(use_output_gate=False, conv_bias=False)
    assert m.conv_bias is None and m.split_sizes[-1] == 0
    x = jax.random.normal(jax.random.key(0), (2, 9, D), F64)
    p = m.project(x)
    assert p["z"] is None
    o = gdp_jax.gated_delta_product_reference(p["q"], p["k"], p["v"], p["g"], p["beta"],
                                              use_qk_l2norm=True)
    o = o / jnp.sqrt(jnp.mean(o * o, -1, keepdims=True) + m.norm_eps) * m.norm_weight[...]
    want = o.reshape(2, 9, -1) @ m.out_proj.kernel[...]
    assert rel(call(m, x), want) < 1e-10


def test_kernel_init_is_used():
    m = layer(kernel_init=nnx.initializers.constant(0.25))
    assert float(jnp.abs(m.in_proj.kernel[...] - 0.25).max()) == 0.0
    assert float(jnp.abs(m.out_proj.kernel[...] - 0.25).max()) == 0.0


def test_auto_falling_back_on_a_gpu_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(backends, "_default_platform", lambda: "gpu")
    backends._log_choice.cache_clear()
    with caplog.at_level(logging.INFO, logger="gdp_jax"):
        backends._log_choice("xla", "why it fell back")
        backends._log_choice("xla", "why it fell back")
        backends._log_choice("cutedsl", "sm_90 GPU with CuTe DSL")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "why it fell back" in warnings[0].getMessage()
    assert [r.levelno for r in caplog.records].count(logging.INFO) == 1
    backends._log_choice.cache_clear()
