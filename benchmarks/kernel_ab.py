"""A/B of the recursion kernels' two tuning choices: the hi + lo split and the value tile.

    python -m benchmarks.kernel_ab [--shape B,T,H,n] [--configs "split=1,bv=32;split=0,bv=64"]

The forward and reverse recursion kernels (``ChunkForwardKernel``, ``StateGradKernel``)
take ``split`` (S and Delta as hi + lo 16-bit parts: every product with them done twice,
which removes their bf16 rounding) and the value tile BV (columns of the state per CTA:
smaller = more CTAs, but every CTA reads the whole [C, K] operands). The engine picks them
with ``ChunkForwardKernel.default_split`` and ``pick_bv``; this script replaces those two
for each config in turn (in this process only) and runs the public op through the
benchmark runner's check and timing (:func:`benchmarks.op.one`): error vs float64 of o and
the five gradients, fwd and fwd+bwd medians, peak memory. Prints one line per config and
a table.
"""
from __future__ import annotations

import argparse
import json
import types


def parse_configs(text: str):
    """"split=1,bv=32;split=0,bv=64" -> [{"split": True, "bv": 32}, ...]."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        kv = dict(item.split("=") for item in part.split(","))
        if set(kv) != {"split", "bv"}:
            raise ValueError(f"config {part!r}: expected split=0|1,bv=32|64|128")
        out.append({"split": kv["split"] == "1", "bv": int(kv["bv"])})
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="8,4096,16,2")
    p.add_argument("--configs", default="split=1,bv=32;split=0,bv=32;split=1,bv=64;"
                                        "split=0,bv=64")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)

    from benchmarks import op, registry
    from benchmarks.measure import log
    from gdp_jax.kernels.chunk_forward import ChunkForwardKernel

    shape = registry.shapes("op", a.shape)[0]
    x = registry.make_inputs(shape, 0)
    ref = op.reference(x, min(4, shape.H), True)
    args = types.SimpleNamespace(check_heads=4, iters=a.iters, reps=a.reps)
    rows = []
    for cfg in parse_configs(a.configs):
        ChunkForwardKernel.default_split = staticmethod(lambda dtype, s=cfg["split"]: s)
        ChunkForwardKernel.pick_bv = staticmethod(lambda rows, HV, V, b=cfg["bv"]: b)
        row = {"shape": shape.label(), **cfg}
        try:
            op.one(registry.impl("cutedsl", "fwdbwd"), x, shape, "fwdbwd", ref, args, row)
        except Exception as e:          # one config failing must not hide the others
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        log("config", json.dumps(row))
        rows.append(row)
    print(f"\nkernel A/B at {shape.label()} (cutedsl backend; check = max rel RMS vs float64)")
    print("| split | BV | fwd ms | fwd+bwd ms | peak GB | check o | check max |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['split']} | {r['bv']} | error: {r['error']} | | | | |")
            continue
        print(f"| {r['split']} | {r['bv']} | {r['fwd_ms']:.2f} | {r['fwdbwd_ms']:.2f} | "
              f"{r['peak_gb']:.2f} | {r['check']['o']:.2e} | {r['check_max']:.2e} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
