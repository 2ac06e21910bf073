"""One fwd+bwd of the xla backend at (1, 262144, 16, 2) bf16 on the GPU: does it fit, peak bytes."""
import sys, time, json, jax, jax.numpy as jnp, numpy as np
import gdp_jax
B, T, H, n = [int(x) for x in sys.argv[1].split(",")]
K = V = 128
ks = jax.random.split(jax.random.PRNGKey(0), 5)
bf = jnp.bfloat16
q = jax.random.normal(ks[0], (B, T, H, K), bf); k = jax.random.normal(ks[1], (B, T, n, H, K), bf)
v = jax.random.normal(ks[2], (B, T, n, H, V), bf)
g = -jax.nn.softplus(jax.random.normal(ks[3], (B, T, H), jnp.float32))
beta = 2 * jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, n, H), jnp.float32))
loss = lambda *a: gdp_jax.gated_delta_product(*a, backend="xla", use_qk_l2norm=True)[0].astype(jnp.float32).sum()
f = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
t = time.perf_counter(); c = f.lower(q, k, v, g, beta).compile(); tc = time.perf_counter() - t
m = c.memory_analysis()
t = time.perf_counter(); out = jax.block_until_ready(c(q, k, v, g, beta)); t1 = time.perf_counter() - t
ts = []
for _ in range(3):
    t = time.perf_counter(); jax.block_until_ready(c(q, k, v, g, beta)); ts.append(time.perf_counter() - t)
finite = all(bool(jnp.isfinite(x.astype(jnp.float32)).all()) for x in out)
st = jax.devices()[0].memory_stats() or {}
print(json.dumps(dict(shape=[B, T, H, n], compile_s=tc, first_s=t1, median_ms=1e3 * float(np.median(ts)),
      temp_GB=m.temp_size_in_bytes / 1e9, peak_in_use_GB=st.get("peak_bytes_in_use", 0) / 1e9,
      grads_finite=finite, note="timed while other GPU jobs ran")))
