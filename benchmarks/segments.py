"""The xla backend's segment size: fwd+bwd time and memory per segment size, one shape.

    python -m benchmarks.segments --shape 8,4096,16,2 --sizes none,8192,4096,2048

For each size (chunk problems per segment, ``recurrence.SEGMENT_PROBLEMS``; ``none`` = no
segments), the xla op's jitted value-and-grad of sum(o * w) w.r.t. q, k, v, g, beta is traced
afresh with segments forced on (``recurrence.MAX_PROBLEMS = 0``) and timed (median after
warm-up), with XLA's compiled temporary bytes and, for sizes after the first, the largest
relative difference of the gradients from the first size's. The inputs are the benchmark
runner's (``benchmarks.registry.make_inputs``), in ``--dtype`` (bf16 by default), K = V =
128 unless the shape gives K, V; ``use_qk_l2norm``, gates on. Prints one line per size and, with
``--json``, writes the rows. The default segmenting threshold is chosen from these rows.
"""
from __future__ import annotations

import argparse
import contextlib
import json


@contextlib.contextmanager
def segments(size):
    """Segments of ``size`` chunk problems forced on (None: off) while tracing."""
    from gdp_jax import recurrence
    saved = recurrence.MAX_PROBLEMS, recurrence.SEGMENT_PROBLEMS
    if size is None:
        recurrence.MAX_PROBLEMS = float("inf")
    else:
        recurrence.MAX_PROBLEMS, recurrence.SEGMENT_PROBLEMS = 0, int(size)
    try:
        yield
    finally:
        recurrence.MAX_PROBLEMS, recurrence.SEGMENT_PROBLEMS = saved


def measure(shape, sizes, dtype="bfloat16", iters=5, reps=5, seed=0):
    import jax
    import jax.numpy as jnp
    from benchmarks import registry
    from benchmarks.measure import median_ms
    from gdp_jax import gated_delta_product

    # the runner's inputs (benchmarks.registry), cast to ``dtype``
    inp = registry.make_inputs(registry.Shape(*shape), seed)
    dt = jnp.dtype(dtype)
    x = (inp.q.astype(dt), inp.k.astype(dt), inp.v.astype(dt), inp.g, inp.beta.astype(dt))
    w = inp.w

    def loss(*a):
        o = gated_delta_product(*a, backend="xla", use_qk_l2norm=True)[0]
        return jnp.sum(o.astype(jnp.float32) * w)

    rows, first = [], None
    for size in sizes:
        with segments(size):
            f = jax.jit(jax.grad(lambda *a: loss(*a), argnums=(0, 1, 2, 3, 4)))
            compiled = f.lower(*x).compile()
        grads = jax.block_until_ready(compiled(*x))
        ms = median_ms(lambda: compiled(*x), jax.block_until_ready, iters, reps)
        mem = compiled.memory_analysis()
        row = {"shape": list(shape), "segment_problems": size, "fwdbwd_ms": ms,
               "temp_GB": mem.temp_size_in_bytes / 1e9 if mem is not None else None,
               "device": jax.devices()[0].device_kind}
        if first is None:
            first = grads
        else:
            rel = lambda a, b: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                                     / (jnp.max(jnp.abs(b.astype(jnp.float32))) + 1e-30))
            row["max_rel_diff_vs_first"] = max(rel(a, b) for a, b in zip(grads, first))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="8,4096,16,2", help="B,T,H,n[,K,V]")
    p.add_argument("--sizes", default="none,8192,4096,2048",
                   help="comma list of chunk problems per segment; none = no segments")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default=None, help="also write the rows to this file")
    a = p.parse_args(argv)
    shape = tuple(int(s) for s in a.shape.split(","))
    sizes = [None if s == "none" else int(s) for s in a.sizes.split(",")]
    rows = measure(shape, sizes, a.dtype, a.iters, a.reps)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
