"""Forward precision beside FLA on the GPU tests' inputs: o and the final state vs float64.

    python -m benchmarks.peer_precision [--impl xla,cutedsl,cutedsl-nosplit,fla] [--cases NAME,...]

Each case is one of tests/test_cutedsl_gpu.py's forward cases (the same inputs,
:func:`gdp_jax.testing.gpu_case_inputs`), run
through each implementation; prints the relative RMS error of o and of the final state
against the float64 token recurrence (the precision bar: no worse than FLA's on the same
inputs). FLA gets g = 0 where the case has no gate, and the interleaved layout of
:mod:`benchmarks.fla`. ``cutedsl-nosplit``: the cutedsl backend with the recursion kernels'
hi + lo split off (``chunk_forward.BF16_SPLIT``; plain 16-bit state operands, as FLA's).
"""
from __future__ import annotations

import argparse
import sys

# name: (seed, B, T, n, H, HV, K, V, dtype, gate, h0)
CASES = {
    "bf16-K64-n2-nogate": (0, 2, 203, 2, 2, 2, 64, 64, "bfloat16", False, True),
    "bf16-K128-V64-n3-nogate": (0, 2, 203, 3, 2, 2, 128, 64, "bfloat16", False, False),
    "bf16-K128-n2-gate": (0, 2, 203, 2, 2, 2, 128, 128, "bfloat16", True, True),
    "bf16-long-T4096-n2": (2, 1, 4096, 2, 2, 2, 128, 128, "bfloat16", True, True),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", default="xla,cutedsl,fla")
    ap.add_argument("--cases", default=",".join(CASES))
    a = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    jax.config.update("jax_enable_x64", True)
    import gdp_jax
    from gdp_jax.testing import gpu_case_inputs, rel_rms

    def ours(backend, args):
        from gdp_jax.kernels import chunk_forward
        if backend == "cutedsl-nosplit":
            saved, chunk_forward.BF16_SPLIT = chunk_forward.BF16_SPLIT, False
            try:
                return ours("cutedsl", args)
            finally:
                chunk_forward.BF16_SPLIT = saved
        q, k, v, g, beta, s0 = args
        f = jax.jit(lambda q, k, v, g, beta, s0: gdp_jax.gated_delta_product(
            q, k, v, g, beta, initial_state=s0, output_final_state=True,
            use_qk_l2norm=True, backend=backend))
        return f(q, k, v, g, beta, s0)

    def reference(args):
        up = lambda x: None if x is None else jnp.asarray(x, jnp.float64)
        q, k, v, g, beta, s0 = args
        return gdp_jax.gated_delta_product_reference(
            up(q), up(k), up(v), up(g), up(beta), initial_state=up(s0),
            output_final_state=True, use_qk_l2norm=True)

    def fla(args):
        import torch
        from fla.ops.gated_delta_product import chunk_gated_delta_product
        q, k, v, g, beta, s0 = args
        B, T, n, H, K = k.shape
        HV, V = v.shape[-2:]
        tt = lambda x: torch.from_numpy(np.array(x, np.float32)).cuda()
        bf = torch.bfloat16
        g = jnp.zeros((B, T, HV), jnp.float32) if g is None else g
        with torch.no_grad():
            o, fin = chunk_gated_delta_product(
                tt(q).to(bf), tt(k.reshape(B, T * n, H, K)).to(bf),
                tt(v.reshape(B, T * n, HV, V)).to(bf), tt(g),
                tt(beta.reshape(B, T * n, HV)).to(bf), num_householder=n,
                initial_state=None if s0 is None else tt(s0),
                output_final_state=True, use_qk_l2norm_in_kernel=True)
        return o.float().cpu().numpy(), fin.float().cpu().numpy()

    for name in a.cases.split(","):
        *shape, gate, h0 = CASES[name]
        args = gpu_case_inputs(*shape, gate=gate, h0=h0)
        o_r, s_r = reference(args)
        for impl in a.impl.split(","):
            try:
                o, s = fla(args) if impl == "fla" else ours(impl, args)
                print(f"{name:26s} {impl:8s} o {rel_rms(o, o_r):.2e} S {rel_rms(s, s_r):.2e}",
                      flush=True)
            except Exception as e:       # report and go on: one peer's failure is a result
                print(f"{name:26s} {impl:8s} ERROR {type(e).__name__}: {str(e)[:200]}",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
