import sys, jax, jax.numpy as jnp
from jax import lax
import gdp_jax
from gdp_jax import testing
from gdp_jax.kernels import emulate
mode = sys.argv[1]
if mode == "barrier":      # the prep kernel opaque, as on the GPU: no CSE with the backward's XLA
    orig = emulate.chunk_prep_call
    emulate.chunk_prep_call = lambda *a, **kw: orig(*lax.optimization_barrier(a), **kw)
B, T, H, n, K = 2, 1024, 4, 2, 64
ks = jax.random.split(jax.random.PRNGKey(0), 5)
bf = jnp.bfloat16
q = jax.random.normal(ks[0], (B, T, H, K), bf); k = jax.random.normal(ks[1], (B, T, n, H, K), bf)
v = jax.random.normal(ks[2], (B, T, n, H, K), bf)
g = -jax.nn.softplus(jax.random.normal(ks[3], (B, T, H), jnp.float32))
beta = 2 * jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, n, H), jnp.float32))
with testing.emulated_kernels():
    if mode == "xla_ops":
        from gdp_jax.kernels.chunk_prep import ChunkPrepKernel
        from gdp_jax.spec import Unsupported
        ChunkPrepKernel.can_implement = staticmethod(lambda **kw: Unsupported("off"))
    f = lambda *a: gdp_jax.gated_delta_product(*a, backend="cutedsl", use_qk_l2norm=True)[0].astype(jnp.float32).sum()
    for name, fn in (("fwd", jax.jit(f)), ("fwdbwd", jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4))))):
        c = fn.lower(q, k, v, g, beta).compile()
        ca = c.cost_analysis(); ca = ca[0] if isinstance(ca, list) else ca
        print(mode, name, "GFLOP %.3f" % (ca.get("flops", 0) / 1e9), "GB %.3f" % (ca.get("bytes accessed", 0) / 1e9))
