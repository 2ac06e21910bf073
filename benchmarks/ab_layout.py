"""A/B of the batched chunk relayout (one GPU): pad/reshape/slice vs gather/scatter.

Batched (not packed) calls relayout by pad/reshape/slice (``chunked.Contiguous``). On the
H200 the cutedsl fwd+bwd at (8, 4096, 16, n=2) went 23.2 -> 20.8 ms with it, but the
forward alone measured 6.4 ms vs 4.6-4.7 ms before (different runs, 2026-11-29). This
times both relayouts in ONE process (contiguous, gather, contiguous again for drift),
forward and fwd+bwd, cutedsl and xla. Not run yet.

    python benchmarks/ab_layout.py
"""
import os, sys
sys.path.insert(0, "benchmarks")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
from bench_fwd import fwdbwd_step, jax_inputs, time_fn
import jax, jax.numpy as jnp
from gdp_jax import chunked, gated_delta_product
orig = chunked.make_layout
def explicit(B, T, n, cu, C=64):
    lay = orig(B, T, n, cu, C)
    if cu is not None:
        return lay
    NC = lay.reset.shape[1]
    rows = jnp.arange(NC * C, dtype=jnp.int32)
    src = jnp.broadcast_to(jnp.where(rows < n * T, rows, -1), (B, NC * C))
    out = jnp.broadcast_to(n * jnp.arange(T, dtype=jnp.int32) + n - 1, (B, T))
    return lay._replace(src=src, out_slot=out)
B, T, H, n = 8, 4096, 16, 2
q, k, v, g, beta = jax_inputs(B, T, H, n)
w = jax.random.normal(jax.random.PRNGKey(1), (B, T, H, 128), jnp.float32).astype(q.dtype)
sync = jax.block_until_ready
for variant in ("contiguous", "gather", "contiguous"):
    chunked.make_layout = orig if variant == "contiguous" else explicit
    for be in ("cutedsl", "xla"):
        op = lambda *a, be=be: gated_delta_product(*a, use_qk_l2norm=True, backend=be)
        f = jax.jit(op)
        fb = jax.jit(fwdbwd_step(op, w))
        sync(f(q, k, v, g, beta)); sync(fb(q, k, v, g, beta))
        tf = time_fn(lambda: f(q, k, v, g, beta), sync, iters=5)
        tb = time_fn(lambda: fb(q, k, v, g, beta), sync, iters=5)
        print(f"{variant:10s} {be:8s} fwd {tf:7.3f} ms  fwd+bwd {tb:7.3f} ms", flush=True)
