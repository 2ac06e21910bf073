"""A/B forward and fwd+bwd timing of the cutedsl op across code versions (public API only)."""
import sys, time, json
import jax, jax.numpy as jnp
import gdp_jax
B, T, H, n, K = 8, 4096, 16, 2, 128
ks = jax.random.split(jax.random.PRNGKey(0), 6)
bf = jnp.bfloat16
q = jax.random.normal(ks[0], (B, T, H, K), bf)
k = jax.random.normal(ks[1], (B, T, n, H, K), bf)
v = jax.random.normal(ks[2], (B, T, n, H, K), bf)
g = -jax.nn.softplus(jax.random.normal(ks[3], (B, T, H), jnp.float32))
beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, n, H), jnp.float32)).astype(bf) * 1.9
w = jax.random.normal(ks[5], (B, T, H, K), bf)
op = lambda q, k, v, g, beta: gdp_jax.gated_delta_product(q, k, v, g, beta, use_qk_l2norm=True, backend="cutedsl")
fwd = jax.jit(op)
loss = lambda *a: jnp.sum(op(*a).astype(jnp.float32) * w)
fb = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
def med(f, reps=30):
    jax.block_until_ready(f(q, k, v, g, beta)); jax.block_until_ready(f(q, k, v, g, beta))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); jax.block_until_ready(f(q, k, v, g, beta)); ts.append(time.perf_counter() - t0)
    ts.sort(); return 1e3 * ts[len(ts) // 2]
print(json.dumps({"version": sys.argv[1], "fwd_ms": med(fwd), "fwdbwd_ms": med(fb)}), flush=True)
