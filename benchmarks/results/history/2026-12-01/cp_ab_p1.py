"""Per-rank cost of cutedsl CP on ONE GPU (P = 1 mesh) vs the single-device op; public API only.
usage: python cp_ab.py <label>"""
import sys, time, json, functools
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
import gdp_jax
B, T, H, n, K = 1, 65536, 16, 2, 128
ks = jax.random.split(jax.random.PRNGKey(0), 6)
bf = jnp.bfloat16
q = jax.random.normal(ks[0], (B, T, H, K), bf)
k = jax.random.normal(ks[1], (B, T, n, H, K), bf)
v = jax.random.normal(ks[2], (B, T, n, H, K), bf)
g = -jax.nn.softplus(jax.random.normal(ks[3], (B, T, H), jnp.float32))
beta = (jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, n, H), jnp.float32)) * 1.9).astype(bf)
w = jax.random.normal(ks[5], (B, T, H, K), bf)
cu = jnp.array([0, 20000, 20001, 50000, T], jnp.int32)
mesh = Mesh(np.array(jax.devices()[:1]), ("cp",))
s = P(None, "cp")
def single(q, k, v, g, beta):
    return gdp_jax.gated_delta_product(q, k, v, g, beta, use_qk_l2norm=True, backend="cutedsl", cu_seqlens=cu)
def cp(q, k, v, g, beta):
    f = jax.shard_map(lambda q, k, v, g, beta, c: gdp_jax.gated_delta_product(
        q, k, v, g, beta, use_qk_l2norm=True, backend="cutedsl", cu_seqlens=c, cp_axis="cp"),
        mesh=mesh, in_specs=(s, s, s, s, s, P()), out_specs=s)
    return f(q, k, v, g, beta, cu)
def med(f, reps=20):
    for _ in range(2): jax.block_until_ready(f(q, k, v, g, beta))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); jax.block_until_ready(f(q, k, v, g, beta)); ts.append(time.perf_counter() - t0)
    ts.sort(); return round(1e3 * ts[len(ts) // 2], 3)
out = {"label": sys.argv[1]}
for name, op in (("single", single), ("cp1", cp)):
    fwd = jax.jit(op)
    fb = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(op(*a).astype(jnp.float32) * w), argnums=(0, 1, 2, 3, 4)))
    out[name + "_fwd_ms"] = med(fwd); out[name + "_fwdbwd_ms"] = med(fb)
    if name == "cp1":
        o1, o2 = jax.jit(single)(q, k, v, g, beta), fwd(q, k, v, g, beta)
        d = jnp.asarray(o1, jnp.float32) - jnp.asarray(o2, jnp.float32)
        out["cp_vs_single_relrms"] = float(jnp.sqrt(jnp.mean(d * d) / jnp.mean(jnp.asarray(o1, jnp.float32) ** 2)))
print(json.dumps(out), flush=True)
