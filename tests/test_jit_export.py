"""The op under a bare ``jax.jit`` (no static_argnames) and through ``jax.export``.

Flags that select code (output_final_state, use_qk_l2norm, recompute_chunk_num) raise a
TypeError that names the flag and says how to make it static; string flags (backend,
cp_axis) are refused by jax.jit itself; a traced ``scale`` works. ``jax.export``: the op
exported for CPU, serialized, deserialized and called equals the op (values and grads).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

import gdp_jax
from gdp_jax.testing import make_inputs, rel_max

OP = gdp_jax.gated_delta_product
B, T, n, H, HV, K, V = 1, 37, 2, 1, 2, 8, 12


@pytest.fixture(scope="module")
def x():
    return make_inputs(3, B, T, n, H, HV, K, V, jnp.float64)


def _args(x):
    return x.q, x.k, x.v, x.g, x.beta


@pytest.mark.parametrize("flag,value", [("output_final_state", True),
                                        ("use_qk_l2norm", True),
                                        ("recompute_chunk_num", 2)])
def test_bare_jit_code_flag_says_make_it_static(x, flag, value):
    with pytest.raises(TypeError, match=rf"{flag} is a traced value.*static_argnames"):
        jax.jit(functools.partial(OP, backend="xla"))(*_args(x), **{flag: value})


@pytest.mark.parametrize("flag,value", [("backend", "xla"), ("cp_axis", "cp")])
def test_bare_jit_string_flag_refused_by_jit(x, flag, value):
    """jax.jit cannot trace a str: its own TypeError names the argument and static_argnames."""
    with pytest.raises(TypeError, match=rf"(?s){flag}.*static_arg"):
        jax.jit(OP)(*_args(x), **{flag: value})


def test_static_argnames_work(x):
    f = jax.jit(OP, static_argnames=("output_final_state", "use_qk_l2norm", "backend"))
    o, s = f(*_args(x), initial_state=x.initial_state, output_final_state=True,
             use_qk_l2norm=True, backend="xla")
    ro, rs = gdp_jax.gated_delta_product_reference(
        *_args(x), initial_state=x.initial_state, output_final_state=True, use_qk_l2norm=True)
    assert rel_max(o, ro) < 1e-10 and rel_max(s, rs) < 1e-10


def test_traced_scale_works_with_gradient(x):
    """scale as a jit argument: the same output as a Python float, and d(loss)/d(scale)."""
    op = functools.partial(OP, backend="xla", use_qk_l2norm=True)
    o_py = op(*_args(x), scale=0.37)
    o_tr = jax.jit(op)(*_args(x), scale=jnp.float64(0.37))
    assert rel_max(o_tr, o_py) < 1e-12
    loss = lambda s: jnp.sum(jax.jit(op)(*_args(x), scale=s) ** 2)
    d = jax.grad(loss)(jnp.float64(0.37))
    # o is linear in scale, so loss = scale^2 * c and dloss/dscale = 2 loss / scale.
    assert abs(float(d) - 2 * float(loss(0.37)) / 0.37) < 1e-8 * abs(float(d))
    with pytest.raises(TypeError, match="scale has shape"):
        jax.jit(op)(*_args(x), scale=jnp.ones(2))


def test_export_serialize_roundtrip(x):
    """jax.export for CPU: serialize -> deserialize -> call == the op; the vjp too."""
    pytest.importorskip("flatbuffers", reason="jax.export serialization needs flatbuffers "
                                              "(in the 'test' extra)")
    from jax import export

    op = jax.jit(functools.partial(OP, backend="xla", use_qk_l2norm=True,
                                   output_final_state=True))
    args = _args(x)
    exp = export.export(op, platforms=["cpu"])(*args, initial_state=x.initial_state)
    blob = exp.serialize(vjp_order=1)
    assert isinstance(blob, (bytes, bytearray)) and len(blob) > 1000
    back = export.deserialize(blob)
    o, s = back.call(*args, initial_state=x.initial_state)
    ro, rs = op(*args, initial_state=x.initial_state)
    assert rel_max(o, ro) < 1e-12 and rel_max(s, rs) < 1e-12

    def loss(call, q):
        o, s = call(q, *args[1:], initial_state=x.initial_state)
        return jnp.sum(o * o) + jnp.sum(s)
    dq_back = jax.grad(functools.partial(loss, back.call))(x.q)
    dq_op = jax.grad(functools.partial(loss, op))(x.q)
    assert rel_max(dq_back, dq_op) < 1e-10
