"""A stack of GDP layers under jax.grad: what keeping the forward's operands
(``GDP_JAX_SAVE_OPERANDS``, ``pipeline.SAVE_OPERANDS``) costs and saves in a model, with
and without ``jax.checkpoint`` around each layer.

    python -m benchmarks.layers --shape 2,4096,16,2 --layers 4 [--impl cutedsl] [--reps 5]

Each of ``--layers`` layers maps x [B, T, H, K] (K = V = 128, bf16) to x + o, o the op on
q = x, k = x * a_l, v = x * b_l (the n sub-steps scaled apart), its own gates and betas
(in-op L2 norm); the loss is sum(x^2) at the top. For each of (operands recomputed,
operands kept) x (plain, jax.checkpoint per layer): the median ms of the jitted gradient
(w.r.t. x and every layer's a, b, g, beta), XLA's temporary bytes of that program (what
the layers keep for the backward is in there), and whether the gradients equal those of
the recomputing configuration with the same checkpointing bit for bit. One JSON line per
configuration, then a markdown table.
"""
from __future__ import annotations

import argparse
import json
import time


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", required=True, help="B,T,H,n")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--impl", default="cutedsl")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args(argv)
    if a.layers < 1:
        ap.error(f"--layers must be >= 1, got {a.layers}")

    import jax
    import jax.numpy as jnp
    import numpy as np

    import gdp_jax
    from gdp_jax.kernels import pipeline

    B, T, H, n = (int(x) for x in a.shape.split(","))
    K = 128
    bf = jnp.bfloat16
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 1 + 4 * a.layers))
    x0 = jax.random.normal(next(keys), (B, T, H, K), bf)
    params = []
    for _ in range(a.layers):
        params.append(dict(
            a=(1 + 0.1 * jax.random.normal(next(keys), (n, H, K))).astype(bf),
            b=(1 + 0.1 * jax.random.normal(next(keys), (n, H, K))).astype(bf),
            g=-jax.nn.softplus(jax.random.normal(next(keys), (B, T, H), jnp.float32)),
            beta=2 * jax.nn.sigmoid(jax.random.normal(next(keys), (B, T, n, H),
                                                      jnp.float32))))

    def layer(x, p):
        k = x[:, :, None] * p["a"]                      # [B, T, n, H, K]
        v = x[:, :, None] * p["b"]
        o = gdp_jax.gated_delta_product(x, k, v, p["g"], p["beta"], backend=a.impl,
                                        use_qk_l2norm=True)[0]
        return x + o.astype(x.dtype)

    def loss(x, ps, remat):
        f = jax.checkpoint(layer) if remat else layer
        for p in ps:
            x = f(x, p)
        return jnp.sum(x.astype(jnp.float32) ** 2)

    rows, recomputed = [], {}
    for save in (False, True):
        for remat in (False, True):
            pipeline.SAVE_OPERANDS = save          # read when the op is traced
            try:
                c = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2).lower(
                    x0, params, remat).compile()
            finally:
                pipeline.SAVE_OPERANDS = None
            mem = c.memory_analysis()
            out = jax.block_until_ready(c(x0, params))
            times = []
            for _ in range(a.reps):
                t = time.perf_counter()
                jax.block_until_ready(c(x0, params))
                times.append(time.perf_counter() - t)
            leaves = [np.asarray(v) for v in jax.tree_util.tree_leaves(out)]
            first = recomputed.setdefault(remat, leaves)
            row = dict(shape=[B, T, H, n], layers=a.layers, impl=a.impl, save_operands=save,
                       remat=remat, device=str(jax.devices()[0].device_kind),
                       median_ms=round(1e3 * float(np.median(times)), 2),
                       temp_GB=round(mem.temp_size_in_bytes / 1e9, 3) if mem else None,
                       same_bits=all(x.tobytes() == y.tobytes()
                                     for x, y in zip(leaves, first)),
                       finite=all(bool(np.isfinite(x.astype(np.float32)).all())
                                  for x in leaves))
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{a.layers} layers at (B, T, H, n) = {a.shape}, {a.impl}, "
          "jax.grad of the stack:\n")
    print("| operands | jax.checkpoint | ms | XLA temp GB | same bits as recomputed |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {'kept' if r['save_operands'] else 'recomputed'} | "
              f"{'per layer' if r['remat'] else 'no'} | {r['median_ms']} | {r['temp_GB']} | "
              f"{r['same_bits']} |")


if __name__ == "__main__":
    main()
