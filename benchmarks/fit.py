"""Does one fwd+bwd fit on this device? One jitted gradient of the op at one shape.

    python -m benchmarks.fit --shape 1,262144,16,2 --impl xla [--recompute 0] [--reps 3]

Builds bf16 inputs (K = V = 128, in-op L2 norm, gates in (-inf, 0), beta in (0, 2)),
compiles jax.grad of sum(o) w.r.t. q, k, v, g, beta, runs it once and ``--reps`` more
times, and prints one JSON line: compile seconds, first-call seconds, median ms,
XLA's temporary bytes, the device's peak bytes in use, and whether every gradient is
finite. Nothing else should run on the device meanwhile (peak bytes are the process's).
"""
from __future__ import annotations

import argparse
import json
import time


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", required=True, help="B,T,H,n")
    ap.add_argument("--impl", default="xla")
    ap.add_argument("--recompute", type=int, default=0, help="recompute_chunk_num")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    import gdp_jax

    B, T, H, n = (int(x) for x in a.shape.split(","))
    K = V = 128
    ks = jax.random.split(jax.random.PRNGKey(0), 5)
    bf = jnp.bfloat16
    q = jax.random.normal(ks[0], (B, T, H, K), bf)
    k = jax.random.normal(ks[1], (B, T, n, H, K), bf)
    v = jax.random.normal(ks[2], (B, T, n, H, V), bf)
    g = -jax.nn.softplus(jax.random.normal(ks[3], (B, T, H), jnp.float32))
    beta = 2 * jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, n, H), jnp.float32))

    def loss(*args):
        o = gdp_jax.gated_delta_product(*args, backend=a.impl, use_qk_l2norm=True,
                                        recompute_chunk_num=a.recompute)[0]
        return o.astype(jnp.float32).sum()

    f = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
    t = time.perf_counter()
    c = f.lower(q, k, v, g, beta).compile()
    compile_s = time.perf_counter() - t
    mem = c.memory_analysis()
    t = time.perf_counter()
    out = jax.block_until_ready(c(q, k, v, g, beta))
    first_s = time.perf_counter() - t
    times = []
    for _ in range(a.reps):
        t = time.perf_counter()
        jax.block_until_ready(c(q, k, v, g, beta))
        times.append(time.perf_counter() - t)
    finite = all(bool(jnp.isfinite(x.astype(jnp.float32)).all()) for x in out)
    stats = jax.devices()[0].memory_stats() or {}
    print(json.dumps(dict(
        shape=[B, T, H, n], impl=a.impl, recompute_chunk_num=a.recompute,
        device=str(jax.devices()[0].device_kind), compile_s=round(compile_s, 2),
        first_s=round(first_s, 3),
        median_ms=round(1e3 * float(np.median(times)), 2) if times else None,
        temp_GB=round(mem.temp_size_in_bytes / 1e9, 3) if mem else None,
        peak_in_use_GB=round(stats.get("peak_bytes_in_use", 0) / 1e9, 3),
        grads_finite=finite)))


if __name__ == "__main__":
    main()
